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

from dataclasses import dataclass


@dataclass(frozen=True)
class LoopCounts:
    """What Megatron-LM's loop counts beside the iteration, in its args, and saves with every
    checkpoint: floating-point operations and validation samples consumed. A hot-swap's
    pretrain() run again counts both from 0 (its `--load` is skipped), and a sample-based run
    (--train-samples) would even validate from the first sample again: the ranks that kept
    where their loop started carry both to the restored iteration. Both follow from the
    iteration alone once the loop runs (--rampup-batch-size is refused with --deadpool)."""

    iteration: int  # where the loop started
    flops: float
    valid_samples: int
    flops_per_iteration: float
    valid_per_evaluation: int  # samples one evaluation consumes; 0 where the loop has none
    eval_interval: int

    def at(self, iteration: int) -> tuple[float, int]:
        """The two counts after `iteration`: one global batch's operations per iteration,
        added one at a time as the loop adds them (a product rounds otherwise once counts
        pass 2**53), and one evaluation's samples at every --eval-interval."""
        flops = self.flops
        if iteration < self.iteration:  # not met (a roll-back never goes before the start)
            flops += (iteration - self.iteration) * self.flops_per_iteration
        for _ in range(iteration - self.iteration):
            flops += self.flops_per_iteration
        evaluations = 0
        if self.eval_interval:
            evaluations = iteration // self.eval_interval - self.iteration // self.eval_interval
        return flops, self.valid_samples + evaluations * self.valid_per_evaluation


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


def slow_work_after(args, iteration: int) -> str | None:
    """What Megatron-LM's train() does after `iteration` that can take minutes (the progress
    phase to mark, so a healthy evaluation or save is never taken for a hang): it evaluates
    at every --eval-interval and saves at every --save-interval (checkpoint_and_decide_exit)."""
    if args.eval_interval and iteration % args.eval_interval == 0 and args.do_valid:
        return "evaluate"
    if args.save and args.save_interval and iteration % args.save_interval == 0:
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
