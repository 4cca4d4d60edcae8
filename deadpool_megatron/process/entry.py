"""The process side of a training script started by deadpool-launch, for our pretrain_gpt.py
and patched Megatron-LM's alike: parse the command line (a bad value ends the process with
status 2 and one message, before anything heavy is imported), answer the launcher's preflight,
then wait as a spare or train as a worker. With --exit-signal-handler, SIGTERM is noted from
here on (before the heavy imports and the set-up), so a Slurm notice that comes early is not a
death. Bad input found later (a checkpoint under --load, the data) ends the process the same
way, and deadpool-launch ends the job on that status rather than hot-swapping the rank."""

from __future__ import annotations

import sys
from collections.abc import Callable

from ..config import JobConfig
from ..errors import CheckpointError, ConfigError
from ..logging_setup import setup_logging
from ..runtime import ROLE_SPARE, ProcessEnv, write_preflight
from .exit_signal import ExitSignal

# train(cfg, env, exit_signal): exit_signal is None without --exit-signal-handler
Train = Callable[[JobConfig, ProcessEnv, ExitSignal | None], int]


def run_process(
    parse: Callable[[ProcessEnv], JobConfig],
    train: Train,
    become: Callable[[JobConfig], Callable] | None = None,
    prog: str = "pretrain_gpt.py",
) -> int:
    """`train(cfg, env, exit_signal)` as a worker; as a spare, idle until claimed, then our
    own worker or `become(cfg)`'s way in. Returns the exit status."""
    env = ProcessEnv.from_environ()
    try:
        cfg = parse(env)
    except ConfigError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return ConfigError.exit_code
    if env.preflight:
        write_preflight(cfg)
        return 0
    exit_signal = ExitSignal() if cfg.training.exit_signal_handler else None
    setup_logging("" if env.under_launcher else f"rank {env.rank}")
    from ..megatron.core_import import import_megatron_core

    import_megatron_core()  # first: whatever imports it next finds it loaded (see there)
    try:
        if env.role == ROLE_SPARE:
            from .spare import run_spare

            way_in = None if become is None else become(cfg)
            return run_spare(env, cfg, become=way_in, exit_signal=exit_signal)
        return train(cfg, env, exit_signal)
    except (ConfigError, CheckpointError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr, flush=True)
        return err.exit_code
