"""Megatron-LM's counts and printed sums as a hot-swap carries them (upstream_loop.py has
the pure part): what its loop counts beside the iteration (operations, training and
validation samples, by the batches of its batch-size calculator), where its loop goes on
after a restore, and the sums its log line averages, as one rank sends them to another.

With upstream.py, the code that touches Megatron-LM's training globals; imported only by a
patched Megatron-LM (`patches/`).
"""

from __future__ import annotations

import copy

from .upstream_loop import Batches, Counts, LoopCounts


def copy_sums(sums: dict) -> dict:
    """training_log's sums copied (its tensors cloned, on their device: no synchronisation)."""
    import torch

    return {k: v.clone() if torch.is_tensor(v) else v for k, v in sums.items()}


def sums_to_host(sums: dict) -> dict:
    """training_log's sums as plain values, to send to another rank (a claimed spare)."""
    import torch

    return {k: (str(v.dtype), v.tolist()) if torch.is_tensor(v) else v for k, v in sums.items()}


def sums_from_host(sums: dict) -> dict:
    """sums_to_host's values as training_log holds them, on this rank's device."""
    import torch

    device = torch.device("cuda", torch.cuda.current_device()) if (
        torch.cuda.is_available()) else torch.device("cpu")  # fmt: skip
    return {
        k: torch.tensor(v[1], dtype=getattr(torch, v[0].removeprefix("torch.")), device=device)
        if isinstance(v, tuple) else v
        for k, v in sums.items()
    }  # fmt: skip


def on_last_stage() -> bool:
    """Whether this rank is on the last pipeline stage, whose training_log sums the losses
    (and the job's last rank, which prints them, is there too)."""
    from megatron.core import parallel_state

    return parallel_state.is_pipeline_last_stage(ignore_virtual=True)


def _batches(args) -> Batches:
    """The loop's global batches as Megatron-LM's own calculator (a copy of the job's, so
    that asking moves nothing) gives them for the samples consumed; the operations of one
    iteration as train() counts them, for the batch it trained."""
    from megatron.core import num_microbatches_calculator as microbatches
    from megatron.training import training

    calculator = copy.deepcopy(microbatches._GLOBAL_NUM_MICROBATCHES_CALCULATOR)
    flops: dict[int, float] = {}

    def at(consumed: int) -> tuple[int, int]:
        calculator.update(consumed, consistency_check=False)
        return (calculator.get_current_running_global_batch_size(),
                calculator.get_current_global_batch_size())  # fmt: skip

    def of(trained: int) -> float:
        if trained not in flops:
            flops[trained] = training.num_floating_point_operations(args, trained)
        return flops[trained]

    return Batches(at, _steady_from(calculator), of)


def _steady_from(calculator) -> int | None:
    """The samples consumed past which the calculator's batch no longer changes: -1 for a
    constant batch, the ramp's samples for core_v0.16.1's --rampup-batch-size, the last
    threshold's for --step-batch-size-schedule (core_v0.18 and later); None where not known."""
    if type(calculator).__name__ == "ConstantNumMicroBatchesCalculator":
        return -1
    if hasattr(calculator, "ramup_samples"):  # sic, megatron-core's spelling
        return int(calculator.ramup_samples)
    schedule = getattr(calculator, "schedule", None)
    return int(schedule[-1][0]) - 1 if schedule else None


def loop_counts(before: int | None) -> LoopCounts:
    """Megatron-LM's counts as its loop starts (train() has read them, its data iterators are
    built): from its `--load`, from 0, or as a hot-swap carried them (`before`: the samples
    consumed before the iteration it restored, as carried; None: the job's start, where the
    calculator stands at the samples consumed, as `--load` leaves it)."""
    from megatron.training.global_vars import get_args

    args = get_args()
    per_evaluation = 0
    if args.do_valid and args.eval_interval:  # train() evaluates at every --eval-interval
        sets = args.eval_iters if isinstance(args.eval_iters, list) else [args.eval_iters]
        per_evaluation = sum(sets) * args.global_batch_size  # evaluate(): a global batch each
    consumed = int(args.consumed_train_samples)
    return LoopCounts(
        iteration=int(args.iteration),
        flops=float(args.num_floating_point_operations_so_far),
        valid_samples=int(args.consumed_valid_samples),
        train_samples=consumed,
        skipped_samples=int(getattr(args, "skipped_train_samples", 0)),
        before=consumed if before is None else before,
        batches=_batches(args),
        valid_per_evaluation=per_evaluation,
        eval_interval=int(args.eval_interval or 0),
    )


def set_counts(counts: Counts, resumed: bool) -> None:
    """Give Megatron-LM's set-up the counts it goes on from: train() reads the operations,
    the loaders start after the samples; and its batch-size calculator where the loop
    without the failure had it after the restored iteration (`resumed`; else where the
    job's start had it): set by the samples consumed before that iteration, so that train()
    sees a ramp step where that loop saw it (and saves there with --save, as it did)."""
    from megatron.core.num_microbatches_calculator import update_num_microbatches
    from megatron.training.global_vars import get_args

    args = get_args()
    args.num_floating_point_operations_so_far = counts.flops
    args.consumed_valid_samples = counts.valid_samples
    args.consumed_train_samples = counts.train_samples
    args.skipped_train_samples = counts.skipped_samples
    update_num_microbatches(counts.before if resumed else counts.train_samples,
                            consistency_check=False)  # fmt: skip


def batch_changes_after(args, batches: Batches) -> bool:
    """Whether train() meets a new global batch (a ramp's or a schedule's step) at the top of
    its next iteration, where it saves with --save: the batch for the samples consumed
    after this iteration is not the one this iteration trained (asked during its step,
    before the loop counts its samples)."""
    from megatron.core.num_microbatches_calculator import get_current_running_global_batch_size

    steady = batches.steady_from
    if steady is not None and args.consumed_train_samples > steady:  # constant from here on
        return False
    trained = get_current_running_global_batch_size()
    return batches.at(args.consumed_train_samples + trained)[0] != trained


def set_position(iteration: int) -> None:
    """Make Megatron-LM's loop go on after `iteration`: train() starts from args.iteration
    (where it trains from after a hot-swap, set_counts sets its counts)."""
    from megatron.training.global_vars import get_args

    get_args().iteration = iteration
