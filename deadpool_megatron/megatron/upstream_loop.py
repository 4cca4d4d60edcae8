"""Megatron-LM's training loop as DeadPool follows it: what train() does after an iteration
(evaluate, save, end), what it counts beside the iteration, carried across a hot-swap (its
floating-point operations and validation samples, `LoopCounts`), and which evaluation a
failure cut short (`EvaluationRecord`), which the hot-swap runs again.

Megatron-LM's train() evaluates after the step of every --eval-interval-th iteration: the
iteration is snapshotted before its evaluation starts, so a failure during the evaluation is
recovered to that iteration, and the resumed loop would go on with the next step: the
validation loss of that iteration never printed (nor written to TensorBoard), while the
samples it was to read count as consumed, so that every later evaluation reads what it reads
without the failure. The evaluation is collective, and its result is printed and written by
the job's last rank alone: each survivor says whether it finished the evaluation of the
iteration the recovery restores (a claimed spare knows nothing and says no), and it runs
again, from its first sample, where the last rank survived and had not finished it, or where
the last rank died and any survivor had not (`evaluate_again`).

Pure: no Megatron-LM here (upstream.py reads and sets its counts, its args are given).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class Batches:
    """The global batch of each iteration, as Megatron-LM's batch-size calculator gives it
    for the training samples consumed before the iteration (constant, or ramped up by
    --rampup-batch-size or --step-batch-size-schedule): `at(consumed)` is (the batch
    trained, the batch asked for), which differ by what --decrease-batch-size-if-needed
    leaves out; `steady_from`: the samples consumed past which the batch no longer changes
    (None: it may change anywhere); `flops(batch)`: one iteration's floating-point
    operations for a batch trained."""

    at: Callable[[int], tuple[int, int]]
    steady_from: int | None
    flops: Callable[[int], float]

    @classmethod
    def constant(cls, batch: int, flops: float) -> Batches:
        return cls(lambda consumed: (batch, batch), -1, lambda trained: flops)


class Counts(NamedTuple):
    """Megatron-LM's counts after an iteration (`before`: the training samples consumed
    before it, which the batch of that iteration was chosen by)."""

    flops: float
    valid_samples: int
    train_samples: int
    skipped_samples: int
    before: int


@dataclass(frozen=True)
class LoopCounts:
    """What Megatron-LM's loop counts beside the iteration, in its args, and saves with every
    checkpoint: floating-point operations, training samples consumed (and left out of a
    batch) and validation samples consumed. A hot-swap's pretrain() run again counts them
    from 0 (its `--load` is skipped), and a sample-based run (--train-samples) would even
    validate from the first sample again: the ranks that kept where their loop started carry
    them to the restored iteration. They follow from the iteration and the loop's start: each
    iteration adds one global batch (`Batches`), and every --eval-interval an evaluation's
    validation samples."""

    iteration: int  # where the loop started
    flops: float
    valid_samples: int
    train_samples: int
    skipped_samples: int
    before: int  # training samples consumed before the start's iteration (Counts.before)
    batches: Batches
    valid_per_evaluation: int  # samples one evaluation consumes; 0 where the loop has none
    eval_interval: int

    def at(self, iteration: int) -> Counts:
        """The counts after `iteration` (at least the start: a roll-back never goes before
        it), walked iteration by iteration as the loop counts: the operations added one at a
        time (a product rounds otherwise once counts pass 2**53); once the batch is steady
        the samples are a product, which is exact."""
        flops, consumed, skipped = self.flops, self.train_samples, self.skipped_samples
        before, left = self.before, max(iteration - self.iteration, 0)
        steady = self.batches.steady_from
        while left and (steady is None or consumed <= steady):
            trained, asked = self.batches.at(consumed)
            before, consumed, skipped = consumed, consumed + trained, skipped + asked - trained
            flops += self.batches.flops(trained)
            left -= 1
        if left:
            trained, asked = self.batches.at(consumed)
            before, consumed = consumed + (left - 1) * trained, consumed + left * trained
            skipped += left * (asked - trained)
            per_iteration = self.batches.flops(trained)
            for _ in range(left):
                flops += per_iteration
        evaluations = 0
        if self.eval_interval and iteration > self.iteration:
            evaluations = iteration // self.eval_interval - self.iteration // self.eval_interval
        valid = self.valid_samples + evaluations * self.valid_per_evaluation
        return Counts(flops, valid, consumed, skipped, before)


class LoggedSums:
    """What Megatron-LM's training_log has summed since its last printed line (its
    total_loss_dict: each loss's sum, the advanced, skipped and nan iterations), as it stood
    after each of the last few iterations, copied (`copy`). A hot-swap's train() starts an
    empty dict, so the next line after a restored iteration averaged only the iterations
    since the restore (with --log-interval 100, the iterations before it in the interval
    were missing; at the job's second iteration, the first's); the ranks carry the sums as
    they stood after the restored iteration instead, which the resumed loop's first
    training_log starts from."""

    KEEP = 4  # a recovery restores the newest committed iteration or the one before

    def __init__(self, copy: Callable[[dict], dict]):
        self._copy = copy
        self._after: dict[int, dict] = {}

    def logged(self, iteration: int, sums: dict) -> None:
        self._after[iteration] = self._copy(sums)
        for old in sorted(self._after)[: -self.KEEP]:
            del self._after[old]

    def after(self, iteration: int) -> dict | None:
        """The sums as they stood after `iteration` (a copy), None where not kept."""
        sums = self._after.get(iteration)
        return None if sums is None else self._copy(sums)


@dataclass
class EvaluationRecord:
    """One process's evaluations: the newest iteration its loop was to evaluate after, and
    the newest whose evaluation it finished."""

    due: int | None = None
    done: int = -1

    def after_step(self, iteration: int, evaluates: bool) -> None:
        """The loop completed `iteration`; `evaluates`: its evaluation comes next."""
        if evaluates:
            self.due = iteration

    def finished(self, iteration: int) -> None:
        """An evaluation after `iteration` returned."""
        self.done = max(self.done, iteration)

    def cut_short(self, restored: int) -> bool:
        """Whether the evaluation after `restored`, the iteration a recovery restores, was
        due in this process and did not finish."""
        return self.due == restored and self.done < restored


def evaluate_again(any_cut_short: bool, last_rank_kept: bool, last_rank_cut_short: bool) -> bool:
    """Whether the evaluation after the restored iteration runs again, from what the ranks
    that kept their place say (EvaluationRecord.cut_short). The last rank prints and writes
    its result: where it survived, its word decides, so no result is printed twice. Where it
    died nobody can tell whether it printed: it runs again where any survivor had not
    finished (the result may then appear twice), not where every survivor had (it is missing
    if the last rank died between its last collective and its print)."""
    return last_rank_cut_short if last_rank_kept else any_cut_short


def redo_start(valid_samples: int, per_evaluation: int) -> int | None:
    """Where the validation data starts for the evaluation run again: `valid_samples` is
    what the loop has consumed after the restored iteration, its evaluation included. None
    where that count cannot hold one evaluation (a count this loop did not make): the
    evaluation is then not run again, rather than failing the recovery."""
    if valid_samples < per_evaluation:
        return None
    return valid_samples - max(per_evaluation, 0)


def slow_work_after(args, iteration: int, batch_changes: bool = False) -> str | None:
    """What Megatron-LM's train() does after `iteration` that can take minutes (the progress
    phase to mark, so a healthy evaluation or save is never taken for a hang): it evaluates
    at every --eval-interval and saves at every --save-interval (checkpoint_and_decide_exit),
    and with --save where the next iteration's global batch is a new one (`batch_changes`:
    a ramp's or a schedule's step, saved at the top of that iteration)."""
    if args.eval_interval and iteration % args.eval_interval == 0 and args.do_valid:
        return "evaluate"
    if args.save and args.save_interval and iteration % args.save_interval == 0:
        return "save"
    if args.save and batch_changes:
        return "save"
    return None


def ends_after(args, iteration: int) -> bool:
    """Whether Megatron-LM's train() ends after `iteration`: at --train-iters, or at a multiple
    of --exit-interval (where it saves first with --save, then calls sys.exit(0))."""
    return iteration >= args.train_iters or bool(
        args.exit_interval and iteration % args.exit_interval == 0
    )


def loss_value(loss_dict: dict) -> float | None:
    """The iteration's language-model loss, exact, where it is known (last pipeline stage)."""
    value = loss_dict.get("lm loss") if loss_dict else None
    if value is None:
        return None
    if isinstance(value, (tuple, list)):  # (sum, count) in some releases
        value = value[0] / value[1]
    return float(value)
