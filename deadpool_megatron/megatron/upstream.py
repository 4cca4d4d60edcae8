"""Megatron-LM's own training code (`megatron.training`, from a Megatron-LM checkout) as DeadPool
sees it: its global state and the functions of its loop a hot-swap changes (its counts and
where its loop goes on: upstream_counts.py; its command line as DeadPool reads it:
upstream_args.py).

With upstream_counts.py, the only module that touches `megatron.training`'s functions;
imported only by a patched Megatron-LM (`patches/`), so the project itself never needs a
Megatron-LM checkout.
"""

from __future__ import annotations

import inspect
import logging
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from .loaders import KeptLoaders
from .parallel import destroy_distributed

log = logging.getLogger("deadpool.upstream")


def reset_global_state() -> None:
    """Before Megatron-LM's pretrain() runs again in this process: its globals (arguments,
    timers, microbatch calculator, buffers, parallel state, rerun machine) and every group.
    Mixture-of-experts layers' logged auxiliary losses are forgotten. The last rank's
    TensorBoard writer is closed first: Megatron-LM only drops it, and the
    pretrain() run again opens a new one (a new event file in the same directory), so each
    hot-swap left the old writer's thread behind, and its queued scalars unwritten until
    that thread's next flush (every 120 s)."""
    from megatron.training.global_vars import get_tensorboard_writer
    from megatron.training.training import destroy_global_state

    writer = get_tensorboard_writer()
    if writer is not None:
        writer.close()
    destroy_global_state()
    # megatron-core's MoE tracker of auxiliary losses: what the interrupted iteration had
    # added would be logged with the replayed one's (and it names the old groups). From
    # core_v0.19 the tracker is an object (moe_logging) and moe_utils gives a copy of it.
    moe_logging = sys.modules.get("megatron.core.transformer.moe.moe_logging")
    moe_utils = sys.modules.get("megatron.core.transformer.moe.moe_utils")
    if moe_logging is not None and hasattr(moe_logging, "get_moe_metrics_tracker"):
        moe_logging.get_moe_metrics_tracker().clear()  # zeroed; each record names its groups
    elif moe_utils is not None:
        moe_utils.get_moe_layer_wise_logging_tracker().clear()
    destroy_distributed()


def jit_warmup(restoring: bool, then: Callable[[], None] | None = None) -> None:
    """Before pretrain() runs again: skip Megatron-LM's JIT warm-up
    (initialize._warmup_jit_function) when a restore follows the set-up, keep it when the plan
    sets every rank up from the start. It compiles the fused bias-GeLU and bias-dropout-add
    functions with torch.compile on random tensors whatever the fusion flags say, and a
    claimed spare compiled them from nothing inside the recovery (most of its 7.4 s model
    phase here, with both fusions off). Survivors compiled them in generation 0; a used fused
    function compiles at its first call instead; the random draws it skips are overwritten by
    the restore, which sets every generator's state. From the start nothing is restored: the
    draws must be those of generation 0's set-up, which the model's initialization follows.
    `then` runs after a warm-up that runs (it is over before the model is built)."""
    from megatron.training import initialize

    # Megatron-LM's own, kept beside it the first time ours stands in
    own = vars(initialize).setdefault("_deadpool_jit_warmup", initialize._warmup_jit_function)
    if restoring:
        warmup = _no_jit_warmup
    elif then is None:
        warmup = own
    else:

        def warmup(*args, **kwargs) -> None:  # core_v0.19 passes tp_size
            own(*args, **kwargs)
            then()

    if initialize._warmup_jit_function is not warmup:
        initialize._warmup_jit_function = warmup
        if restoring:
            log.info("pretrain() runs again without Megatron-LM's JIT warm-up (compiled at "
                     "first use)")  # fmt: skip


def _no_jit_warmup(*args, **kwargs) -> None:
    pass


def cache_field_docstrings() -> bool:
    """Megatron-LM's parse_args builds its parser anew at every call, twice per pretrain()
    (ft_integration.setup, initialize_megatron), and each build reads and parses the source
    of its config dataclasses for their fields' help texts
    (argument_utils.ArgumentGroupFactory._get_field_docstrings: inspect.getsource, ast.parse):
    0.1 s a parse here, 0.45 s the first, in every process of a recovery. The texts depend on
    the class alone, so each class's are computed once per process. False where this
    Megatron-LM has no such method (nothing to cache); calling it again changes nothing."""
    from megatron.training import argument_utils

    def cache(own: Callable) -> Callable:
        texts: dict[type, dict[str, str]] = {}

        def cached(self, src_cfg_class: type) -> dict[str, str]:
            if src_cfg_class not in texts:
                texts[src_cfg_class] = own(self, src_cfg_class)
            return dict(texts[src_cfg_class])  # the caller's to change

        return cached

    factory = getattr(argument_utils, "ArgumentGroupFactory", None)
    return _replace_once(factory, "_get_field_docstrings", cache)


def print_arguments_once() -> None:
    """Megatron-LM's validate_args prints every argument (some 700 lines, on rank 0) at each
    pretrain(); one run again for a recovery parses the same command line, so it prints its
    table once per process, and one line says so after that. Calling it again changes
    nothing; without Megatron-LM's `_print_args` it does nothing."""
    from megatron.training import arguments

    def once(own: Callable) -> Callable:
        printed: set[str] = set()

        def print_args(title: str, args) -> None:
            if title not in printed:
                printed.add(title)
                own(title, args)
                return
            from megatron.training.utils import is_rank0

            if is_rank0():
                log.info("Megatron-LM's %s: as printed at this process's first pretrain()",
                         title)  # fmt: skip

        return print_args

    _replace_once(arguments, "_print_args", once)


def torch_adam_loads_checkpoints() -> bool:
    """Let Megatron-LM's `--load` restore a distributed optimizer built on torch's Adam/AdamW,
    which megatron-core picks where neither Apex nor Transformer Engine is installed (on CPU
    here). Its DistributedOptimizer fails that load three ways (seen 2026-12-05 on
    core_v0.16.1; the code is the same in core_v0.19.0): preparing the load calls
    state_dict(), which asserts that the fresh optimizer's state holds one Adam `step`, and it
    holds none before a first step; load_state_dict then copies the saved state into fp32 main
    parameters that require grad, outside no_grad; and it gives every parameter one shared
    `step` tensor, which torch's Adam advances once per parameter per step. So a load's
    preparation first gives a fresh optimizer the state a first step would create
    (`materialize_optimizer_state`), its load runs under no_grad, and each parameter then
    gets its own step from the checkpoint's param groups (`own_adam_steps`): what our own
    pretrain_gpt.py's load does. A `--ckpt-format torch` checkpoint's parameter state is
    then copied in outside no_grad too, into every state entry, that step included, which
    its file does not hold: under no_grad, the step kept. False, changing nothing, where
    megatron-core has Apex or TE (their FusedAdam keeps its step in the param groups) or no
    such optimizer."""
    import torch
    from megatron.core.optimizer import distrib_optimizer

    from .checkpointing import materialize_optimizer_state, own_adam_steps

    if getattr(distrib_optimizer, "HAVE_APEX_OR_TE", True):
        return False
    owner = getattr(distrib_optimizer, "DistributedOptimizer", None)

    def materialized_first(own: Callable) -> Callable:
        loading = inspect.signature(own)

        def sharded_state_dict(self, *args, **kwargs):
            if loading.bind(self, *args, **kwargs).arguments.get("is_loading", False):
                materialize_optimizer_state(self)
            return own(self, *args, **kwargs)

        return sharded_state_dict

    def steps_own(own: Callable) -> Callable:
        def load_state_dict(self, state_dict) -> None:
            with torch.no_grad():  # the fp32 main params are views of leaves that require grad
                own(self, state_dict)
            own_adam_steps(self.optimizer, state_dict["optimizer"]["param_groups"])

        return load_state_dict

    def kept_steps(own: Callable) -> Callable:
        # --ckpt-format torch: load_parameter_state copies each saved tensor into the main
        # parameter and every state entry, the per-parameter `step` too (which that file does
        # not hold: load_state_dict set it from the param groups), outside no_grad.
        def _set_main_param_and_optimizer_states(self, model_param, tensors):
            group, order = self.model_param_group_index_map[model_param]
            main = self.optimizer.param_groups[group]["params"][order]
            state = self.optimizer.state.get(main, {})
            kept = {k: v for k, v in state.items() if k not in tensors}  # copied onto itself
            with torch.no_grad():
                own(self, model_param, {**tensors, **kept})

        return _set_main_param_and_optimizer_states

    _replace_once(owner, "_set_main_param_and_optimizer_states", kept_steps)  # where it exists
    return _replace_once(owner, "sharded_state_dict", materialized_first) and _replace_once(
        owner, "load_state_dict", steps_own
    )


def data_iterators_for_hot_swaps(kept: KeptLoaders, counts_carried: Callable[[], bool]) -> bool:
    """Build Megatron-LM's data iterators without moving the training's random streams, and
    with the loaders (and their worker processes) of this process's previous pretrain() where
    they serve again (loaders.KeptLoaders says why). Where a hot-swap carried the counts
    (`counts_carried()`), the validation loader starts at the count as given, 0 included
    (`_valid_count_as_given`).

    Each DataLoader iterator draws its workers' base seed from torch's default CPU generator,
    and pretrain() builds them after the model and optimizer, that is after a hot-swap's
    restore (or Megatron-LM's `--load`) has set every generator to the state the rolled-back
    iteration ended with: the resumed iteration then drew other numbers than the run without
    the failure. Seen 2026-12-05 on CPU with Megatron-LM's default dropout (0.1), whose masks
    come from that generator there: the final digest differed (dropout 0 hid it). On a GPU
    dropout draws from the CUDA generator, which the loaders leave alone, so nothing a GPU
    job draws changes. False where Megatron-LM has no such functions."""
    from megatron.training import training

    from .rng import rng_kept

    def kept_streams(own: Callable) -> Callable:
        def build_train_valid_test_data_iterators(*args, **kwargs):
            reused = kept.reused
            with rng_kept(), kept.building(), _valid_count_as_given(counts_carried()):
                iterators = own(*args, **kwargs)
            if kept.reused > reused:
                log.info("%d data loader(s) of the previous set-up serve again, their "
                         "workers with them", kept.reused - reused)  # fmt: skip
            return iterators

        return build_train_valid_test_data_iterators

    def kept_loader(own: Callable) -> Callable:
        def build_pretraining_data_loader(*args, **kwargs):
            fresh = own(*args, **kwargs)
            return fresh if fresh is None else kept.loader(fresh)

        return build_pretraining_data_loader

    return _replace_once(training, "build_train_valid_test_data_iterators", kept_streams) and (
        _replace_once(training, "build_pretraining_data_loader", kept_loader)
    )


@contextmanager
def _valid_count_as_given(carried: bool) -> Iterator[None]:
    """Megatron-LM's loader set-up takes 0 validation samples consumed at a nonzero iteration
    for a checkpoint saved without the count, and counts them from the iteration instead; a
    hot-swap's count is exact, and it is 0 there when the first evaluation runs again
    (upstream_loop.py): the iteration is hidden from that set-up. Not with
    --phase-transition-iterations, whose training loader's start is counted from the
    iteration (the session runs no evaluation again then)."""
    from megatron.training.global_vars import get_args

    args = get_args()
    if not (carried and args.iteration > 0 and args.consumed_valid_samples == 0) or (
        phase_transitions(args)
    ):
        yield
        return
    iteration, args.iteration = args.iteration, 0
    try:
        yield
    finally:
        args.iteration = iteration


def flush_tensorboard() -> None:
    """Write the last rank's queued TensorBoard scalars to their file (called off the
    training thread, as each iteration starts: log_flush.py says why)."""
    from megatron.training.global_vars import get_tensorboard_writer

    writer = get_tensorboard_writer()
    if writer is not None:
        writer.flush()


def evaluations_reported(starts: Callable[[int], None], ends: Callable[[int], None]) -> bool:
    """Call `starts(iteration)` as each of Megatron-LM's evaluations begins (a fault at phase
    evaluate strikes there) and `ends(iteration)` once it returned, its result printed.
    False where Megatron-LM has no such function."""
    from megatron.training import training

    def reported(own: Callable) -> Callable:
        signature = inspect.signature(own)

        def evaluate_and_print_results(*args, **kwargs):
            iteration = int(signature.bind(*args, **kwargs).arguments["iteration"])
            starts(iteration)
            result = own(*args, **kwargs)
            ends(iteration)
            return result

        return evaluate_and_print_results

    return _replace_once(training, "evaluate_and_print_results", reported)


def logs_resumed_loops_as_one(
    resumed: Callable[[], dict | None], logged: Callable[[int, dict], None]
) -> bool:
    """Megatron-LM's train() logs its first iteration without resetting the loss sums it
    prints (so the next line averages two iterations), meant for the job's start. Where
    `resumed()` gives sums (a hot-swap's train(), going on after a restored iteration: the
    sums as they stood after it, upstream_loop.LoggedSums) that first iteration is logged as
    the uninterrupted loop logs it, from those sums, so the lines printed after the failure
    are the failure-free run's; None: the job's start. `logged(iteration, sums)` after each
    iteration's training_log. False where Megatron-LM has no such function."""
    from megatron.training import training

    def as_one_loop(own: Callable) -> Callable:
        signature = inspect.signature(own)
        if "is_first_iteration" not in signature.parameters:
            return own

        def training_log(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            sums = bound.arguments["total_loss_dict"]
            if bound.arguments.get("is_first_iteration"):
                carried = resumed()
                if carried is not None:
                    bound.arguments["is_first_iteration"] = False
                    sums.update(carried)
            result = own(*bound.args, **bound.kwargs)
            logged(int(bound.arguments["iteration"]), sums)
            return result

        return training_log

    return _replace_once(training, "training_log", as_one_loop)


def evaluate_as_the_loop_does(evaluate: Callable[[], object]) -> None:
    """Run `evaluate` (train()'s own call of evaluate_and_print_results) with the iteration
    timer stopped, as train()'s loop runs it at an --eval-interval."""
    from megatron.training.global_vars import get_timers

    timers = get_timers()
    timers("interval-time").stop()
    evaluate()
    timers("interval-time", log_level=0).start(barrier=True)


def phase_transitions(args) -> bool:
    """Whether the run has --phase-transition-iterations (see _valid_count_as_given)."""
    return bool(getattr(args, "phase_transition_iterations", None))


def restores_skip_load(restoring: Callable[[], bool]) -> bool:
    """Skip Megatron-LM's `--load` in a pretrain() that a hot-swap runs again to restore
    (`restoring()` true): every rank would read its checkpoint shard from storage, minutes for
    a large model, only for the restore from host memory to overwrite it. pretrain() then goes
    on as without `--load` (iteration 0, its position set by the restore); its counts of
    floating-point operations and validation samples are the session's (`LoopCounts`).
    Installed once per process, by its one session. False where Megatron-LM has no such
    function."""
    from megatron.training import training

    def skipped_while_restoring(own: Callable) -> Callable:
        def load_checkpoint(*args, **kwargs):
            if restoring():
                log.info("Megatron-LM's --load is skipped: the hot-swap restores the state from "
                         "host memory")  # fmt: skip
                return 0, 0
            return own(*args, **kwargs)

        return load_checkpoint

    return _replace_once(training, "load_checkpoint", skipped_while_restoring)


def checkpoint_loaded() -> tuple[int, float] | None:
    """The iteration pretrain()'s `--load` resumed from and the seconds its load took
    (Megatron-LM's own `load-checkpoint` timer, read as its one-logger reads it); None where
    it loaded nothing (no `--load`, or no checkpoint under it yet)."""
    from megatron.training.global_vars import get_args, get_timers

    args = get_args()
    if args.load is None or not args.iteration:
        return None
    return int(args.iteration), float(get_timers()("load-checkpoint").active_time())


def batch_size_by_step_schedule() -> bool:
    """Whether this Megatron-LM sizes its global batch by --step-batch-size-schedule and
    ignores --rampup-batch-size (core_v0.18 and later: its calculator takes the schedule only)."""
    from megatron.core import num_microbatches_calculator as calculators

    own = inspect.signature(calculators.init_num_microbatches_calculator).parameters
    return "step_batch_size_schedule" in own


def _replace_once(owner: object, name: str, make: Callable[[Callable], Callable]) -> bool:
    """Put `make(original)` in place of `owner.name`, once however often it is asked; False
    where this Megatron-LM has no such attribute (nothing replaced)."""
    own = getattr(owner, name, None)
    if own is None:
        return False
    if not getattr(own, "_deadpool_replaced", False):
        replacement = make(own)
        replacement._deadpool_replaced = True
        setattr(owner, name, replacement)
    return True


def warm_argument_parser() -> None:
    """Build Megatron-LM's parser once, parsing nothing, so that the help texts are cached
    (cache_field_docstrings) before a recovery: an idle spare does it, whose pretrain() would
    otherwise pay the first build (0.45 s here) while the survivors wait for it."""
    import argparse

    from megatron.training.arguments import add_megatron_arguments

    if cache_field_docstrings():
        add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))


def _signal_handler():
    """Megatron-LM's current --exit-signal-handler handler, or None."""
    from megatron.training import global_vars

    return getattr(global_vars, "_GLOBAL_SIGNAL_HANDLER", None)


def exit_signal_noted() -> Callable[[], bool] | None:
    """Whether Megatron-LM's current --exit-signal-handler handler has received its signal, as
    a question to ask later; None without one. destroy_global_state drops the handler without
    releasing it, so it stays installed and noting until pretrain() installs the next one,
    which starts unaware: what the dropped one noted must be carried over."""
    handler = _signal_handler()
    if handler is None:
        return None
    return lambda: bool(getattr(handler, "_signal_received", False))


def exit_signal_number() -> int | None:
    """The signal Megatron-LM's current handler waits for (--exit-signal), or None."""
    handler = _signal_handler()
    return None if handler is None else int(handler.sig)


def resend_exit_signal() -> bool:
    """Raise Megatron-LM's exit signal in this process, so that its current handler notes it
    (its loop asks only that one); False without a handler."""
    number = exit_signal_number()
    if number is None:
        return False
    signal.raise_signal(number)
    return True
