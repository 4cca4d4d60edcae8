"""The hook API: the few calls a Megatron-LM training script makes into DeadPool.

Patched Megatron-LM (`patches/`) calls exactly these, at these points:

- `show_help(provider)`: in the script's `__main__`, before its first parse (in-process
  restart's, which prints Megatron-LM's help without DeadPool's flags and exits); with
  --help and a --deadpool* flag, prints that help with them (`provider`: the script's own
  extra-arguments provider) and exits, else returns at once;
- `wrap_pretrain(pretrain)`: in the script's `__main__`; returns `pretrain` itself unless the
  command line has --deadpool* flags or deadpool-launch started the process, else a wrapper
  that runs it protected, through failures (a spare process waits inside it until it is
  claimed), with the --deadpool* flags added to Megatron-LM's parser through its
  extra-arguments hook (`extra_args_provider`, wrapping the script's own);
- `run_main(main, store)`: the same for core_v0.18 and later, whose script parses its
  command line and builds its configs before pretrain(): `main(store)` does both and calls
  pretrain(), and runs once, or once in each generation of a protected process (its parser
  given `extra_args_provider(...)` by the patch);
- `after_setup(model, optimizer, opt_param_scheduler)`: in pretrain(), right after
  setup_model_and_optimizer: protection starts, or a hot-swap restores the state here;
- `before_loop(iteration, evaluate)`: in train(), before its loop: `evaluate` runs the
  evaluation after `iteration` as the loop does, called where a hot-swap resumed after that
  evaluation was cut short by the failure (megatron/upstream_loop.py);
- `before_step(iteration)` / `after_step(iteration, loss_dict)`: in train(), around each
  train_step; `iteration` counts completed iterations, so before_step gets the number
  completed so far and after_step the one just completed (its snapshot);
- `after_final_save(iteration, save)`: in pretrain(), after its save at the end.

Without a session (no --deadpool) every hook returns at once: patched Megatron-LM then
behaves exactly as unpatched. Importing this module is cheap: no torch, no megatron.

Our own loop (megatron/training.py's Trainer) calls the same methods on the same object,
handed to it (process/session.py's ProtectedLoop). For Megatron-LM the session is process-wide
(process/session.py's `current()`), set for the duration of the run: it calls these from deep
inside its own functions, where nothing can be passed in.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from collections.abc import Callable

_SESSIONS = "deadpool_megatron.process.session"


def _session():
    """The protected run's session; None without one (then that module was never imported)."""
    module = sys.modules.get(_SESSIONS)
    return None if module is None else module.current()


def escaped_help(text: str | None) -> str | None:
    """A help text as argparse formats it: its `%` escaped where it is not a `%(name)s`
    placeholder or a `%%` already (core_v0.18's and later's own texts have a bare one, which
    fails every --help in argparse)."""
    if text is None:
        return None
    return re.sub(r"%%|%\(\w+\)[-#0 +]*\d*(?:\.\d+)?[a-zA-Z]|%",
                  lambda m: "%%" if m.group(0) == "%" else m.group(0), text)  # fmt: skip


def show_help(provider: Callable | None = None) -> None:
    """Megatron-LM's --help with DeadPool's flags, when a --deadpool* flag asks for them: the
    script's first parse (in-process restart's, before pretrain()) would print it without
    them, or fail on a bare `%`. Megatron-LM's own parse prints it and exits."""
    argv = sys.argv[1:]
    if not (_wanted(argv) and ("-h" in argv or "--help" in argv)):
        return
    from megatron.training import arguments

    def with_ours(parser):
        parser = extra_args_provider(provider)(parser)
        for action in parser._actions:  # argparse keeps its actions there, help included
            action.help = escaped_help(action.help)
        return parser

    arguments.parse_args(extra_args_provider=with_ours)
    sys.exit(0)  # parse_args printed the help and exited; never here


def extra_args_provider(inner: Callable | None = None) -> Callable:
    """Megatron-LM's `extra_args_provider`: the script's own flags, then DeadPool's."""

    def provider(parser):
        if inner is not None:
            parser = inner(parser)
        from .megatron.upstream_args import add_arguments

        return add_arguments(parser)

    return provider


def _wanted(argv: list[str]) -> bool:
    from .runtime import ENV_ROLE

    return ENV_ROLE in os.environ or any(a.startswith("--deadpool") for a in argv)


def wrap_pretrain(pretrain: Callable) -> Callable:
    """`pretrain` protected by DeadPool when the job asks for it, else `pretrain` itself."""
    if not _wanted(sys.argv[1:]):
        return pretrain

    @functools.wraps(pretrain)
    def protected(*args, **kwargs):
        from .process.upstream import main
        from .runtime import end_process

        kwargs["extra_args_provider"] = extra_args_provider(kwargs.get("extra_args_provider"))
        code = main(pretrain, args, kwargs, sys.argv[1:])
        # pretrain() is the last call of Megatron-LM's scripts. Everything is written and every
        # group destroyed; the interpreter's teardown of torch and megatron takes seconds per
        # process, during which the agent would see a process that stopped beating.
        end_process(code)

    return protected


def run_main(main: Callable[[object], object], store: object = None) -> None:
    """The `pretrain_gpt.py` of Megatron-LM core_v0.18 and later: `main(store)` parses the
    command line, builds the configs and runs pretrain() (which no longer parses). Without
    DeadPool it runs once; with it, once in each generation of this process (a hot-swap runs
    pretrain() again, and Megatron-LM's globals, the parsed arguments among them, are gone by
    then), and a spare runs it only once claimed, as the rank it replaces."""
    if not _wanted(sys.argv[1:]):
        main(store)
        return
    from .process.upstream import main as protected_main
    from .runtime import end_process

    end_process(protected_main(lambda store=None: main(store), (), {}, sys.argv[1:]))


def after_setup(model, optimizer, opt_param_scheduler) -> None:
    session = _session()
    if session is not None:
        session.after_setup(model, optimizer, opt_param_scheduler)


def before_loop(iteration: int, evaluate: Callable[[], object]) -> None:
    session = _session()
    if session is not None:
        session.before_loop(iteration, evaluate)


def before_step(iteration: int) -> None:
    session = _session()
    if session is not None:
        session.before_step(iteration)


def after_step(iteration: int, loss_dict: dict) -> None:
    session = _session()
    if session is not None:
        session.after_step(iteration, loss_dict)


def after_final_save(iteration: int, save: Callable[[], object]) -> None:
    """pretrain() skips its save at the end when `iteration` is on the save interval; when a
    hot-swap rolled back into that last periodic save, the tracker does not name it: `save`."""
    session = _session()
    if session is not None:
        session.after_final_save(iteration, save)
