"""The hook API patched Megatron-LM calls: a no-op without --deadpool, DeadPool's flags in
Megatron-LM's parser, DeadPool's view of a Megatron-LM command line, and a patch series that
adds nothing but calls into it."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from deadpool_megatron import hooks
from deadpool_megatron.errors import ConfigError
from deadpool_megatron.megatron.upstream_args import parse_job_config
from deadpool_megatron.megatron.upstream_loop import (
    Batches,
    Counts,
    EvaluationRecord,
    LoggedSums,
    LoopCounts,
    ends_after,
    evaluate_again,
    redo_start,
    slow_work_after,
)
from deadpool_megatron.runtime import ENV_ROLE

PATCHES = Path(__file__).resolve().parents[2] / "patches"
BASE = shlex.split("--micro-batch-size 2 --train-iters 10 --use-distributed-optimizer")
SAMPLES = shlex.split("--micro-batch-size 2 --global-batch-size 32 --train-samples 400 "
                      "--use-distributed-optimizer --deadpool")  # fmt: skip


def pretrain(*args, **kwargs):
    return "trained"


def test_without_deadpool_pretrain_is_returned_unchanged(monkeypatch):
    monkeypatch.delenv(ENV_ROLE, raising=False)
    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", "--num-layers", "2"])
    assert hooks.wrap_pretrain(pretrain) is pretrain
    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", "--deadpool"])
    assert hooks.wrap_pretrain(pretrain) is not pretrain


def test_without_deadpool_core_v019s_main_runs_once_as_before(monkeypatch):
    # core_v0.19's pretrain_gpt.py: its parsing, configs and pretrain() in main(store)
    monkeypatch.delenv(ENV_ROLE, raising=False)
    calls = []
    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", "--num-layers", "2"])
    hooks.run_main(calls.append, store="its store")
    assert calls == ["its store"]


def test_help_is_shown_only_when_a_deadpool_flag_asks_for_it(monkeypatch):
    # before Megatron-LM's first parse; without --help, or without a --deadpool* flag (nor
    # deadpool-launch), it returns at once and imports nothing of Megatron-LM
    monkeypatch.delenv(ENV_ROLE, raising=False)
    for argv in (["--num-layers", "2"], ["--help"], ["-h"], ["--deadpool", "--num-layers", "2"]):
        monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", *argv])
        assert hooks.show_help(None) is None
    assert "megatron.training" not in sys.modules


def test_a_bare_percent_in_a_help_text_is_escaped_and_placeholders_kept():
    # argparse formats each help text with `%`: core_v0.18's and later's have a bare one
    # ("(e.g. 1.10 = 10%)."), which fails every --help; ours have %(default)s placeholders
    texts = {
        "headroom (e.g. 1.10 = 10%).": "headroom (e.g. 1.10 = 10%%).",
        "default %(default)s, 100% of it": "default %(default)s, 100%% of it",
        "50%% and %(choices)r or %(default)5.2f": "50%% and %(choices)r or %(default)5.2f",
        "a trailing %": "a trailing %%",
        "no percent": "no percent",
    }  # fmt: skip
    for text, escaped in texts.items():
        assert hooks.escaped_help(text) == escaped
        assert hooks.escaped_help(text) % {"default": 1.5, "choices": [1]} is not None
    assert hooks.escaped_help(None) is None


def test_hooks_do_nothing_without_a_session():
    hooks.after_setup(None, None, None)
    hooks.before_loop(3, lambda: pytest.fail("evaluated without a session"))
    hooks.before_step(3)
    hooks.after_step(4, {"lm loss": 1.0})
    hooks.after_final_save(4, lambda: pytest.fail("saved without a session"))


def test_extra_args_provider_adds_deadpool_flags_after_the_scripts_own():
    seen = []

    def inner(parser):
        seen.append(parser)
        parser.add_argument("--modelopt-thing", type=int)
        return parser

    parser = hooks.extra_args_provider(inner)(argparse.ArgumentParser())
    ns = parser.parse_args(["--deadpool", "--deadpool-replicas", "1", "--modelopt-thing", "3"])
    assert seen and ns.deadpool is True and ns.deadpool_replicas == 1 and ns.modelopt_thing == 3


def test_parse_job_config_reads_the_shared_megatron_flags():
    argv = [*BASE, "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
            "--deadpool", "--hidden-size", "64", "--deadpool-metrics-jsonl", "m.jsonl"]  # fmt: skip
    cfg = parse_job_config(argv, world_size=4)
    assert cfg.parallel.pipeline_model_parallel_size == 2
    assert cfg.training.global_batch_size == 4  # Megatron-LM's default: micro x data-parallel
    assert cfg.deadpool.deadpool and cfg.logging.metrics_jsonl == "m.jsonl"
    assert cfg.parallel.expert_model_parallel_size == 1
    experts = parse_job_config([*BASE, "--deadpool", "--expert-model-parallel-size", "2"], 4)
    assert experts.parallel.expert_model_parallel_size == 2  # every expert on two ranks


@pytest.mark.parametrize(
    "argv, world, message",
    [
        ([*BASE, "--pipeline-model-parallel-size", "3"], 4, "not divisible"),
        (["--train-iters", "10", "--deadpool"], 4, "--micro-batch-size"),
        ([*BASE, "--deadpool", "--inprocess-restart"], 4, "--inprocess-restart"),
        ([*BASE, "--deadpool", "--rampup-batch-size", "8", "8", "100"], 4,
         "--rampup-batch-size 8 8 100 needs a sample-based run"),
        ([*SAMPLES, "--rampup-batch-size", "8", "8"], 4, "give three integers"),
        ([*SAMPLES, "--rampup-batch-size", "8", "x", "100"], 4, "8 x 100: give three integers"),
        ([*SAMPLES, "--rampup-batch-size", "32", "8", "100"], 4,
         "the start batch must be positive and less than --global-batch-size 32"),
        ([*SAMPLES, "--rampup-batch-size", "8", "16", "100"], 4,
         "--global-batch-size 32 minus the start batch 8 is not a multiple of the increment 16"),
        ([*SAMPLES, "--rampup-batch-size", "4", "4", "100"], 4,
         "every batch of the ramp must be a multiple of --micro-batch-size 2 x data-parallel "
         "size 4 = 8"),
        (["--micro-batch-size", "2", "--train-iters", "10", "--deadpool"], 4,
         "--use-distributed-optimizer"),
        ([*BASE, "--deadpool", "--pipeline-model-parallel-size", "4"], 4, "data-parallel size"),
        ([*BASE, "--deadpool", "--exit-interval", "8", "--deadpool-inject", "kill@1:10:finish"],
         4, "last iteration, 8, not after 10"),  # Megatron-LM's train() exits there
        (["--micro-batch-size", "2", "--use-distributed-optimizer", "--deadpool"], 4,
         r"--train-iters or --train-samples \(got neither\)"),
        ([*BASE, "--train-samples", "80", "--deadpool"], 4, r"\(got both\)"),
        ([*BASE, "--deadpool", "--deadpool-inject", "kill@1:5:optimizer"], 4,
         "kill@1:5:optimizer: phase optimizer strikes inside our pretrain_gpt.py's training "
         "step; Megatron-LM's train_step has no hook there"),
        (["--micro-batch-size", "2", "--global-batch-size", "8", "--train-samples", "7",
          "--use-distributed-optimizer", "--deadpool"], 4,
         r"--train-samples 7 is less than one global batch \(8\): use at least 8"),
        # experts as wide as data parallelism: each on one rank, which a spare could not get
        ([*BASE, "--deadpool", "--num-experts", "4", "--expert-model-parallel-size", "4"], 4,
         r"--expert-model-parallel-size 4 with --deadpool: rank 0's experts \(4 of 4 ranks "
         r"alike\) are held by no other rank.* at most 2 "),
        ([*BASE, "--deadpool", "--use-megatron-fsdp"], 4,
         "--use-megatron-fsdp is not supported with --deadpool: it shards the parameters"),
        ([*BASE, "--deadpool", "--use-torch-fsdp2"], 4, "--use-torch-fsdp2 is not supported"),
        ([*BASE, "--deadpool", "--expert-model-parallel-size", "3"], 4,
         "--expert-model-parallel-size 3: 4 ranks per pipeline stage are not divisible"),
    ],
)  # fmt: skip
def test_parse_job_config_names_the_bad_value(argv, world, message):
    with pytest.raises(ConfigError, match=message):
        parse_job_config(argv, world)


def test_a_sample_based_run_trains_whole_global_batches_as_megatron_lm_counts_them():
    argv = ["--micro-batch-size", "2", "--global-batch-size", "8", "--train-samples", "100",
            "--use-distributed-optimizer", "--deadpool", "--deadpool-inject", "kill@1:12:finish"]  # fmt: skip
    assert parse_job_config(argv, world_size=4).training.train_iters == 12  # 100 // 8
    with pytest.raises(ConfigError, match="last iteration, 12, not after 13"):
        parse_job_config([*argv[:-1], "kill@1:13:finish"], world_size=4)


def test_a_ramped_up_run_trains_the_iterations_megatron_lms_update_train_iters_counts():
    # megatron-core's own calculator, walked as Megatron-LM's update_train_iters walks it
    from megatron.core.num_microbatches_calculator import (
        RampupBatchsizeNumMicroBatchesCalculator as Calculator,
    )

    for start, increment, ramp, samples in [(8, 8, 100, 400), (8, 8, 1, 400), (16, 8, 250, 330),
                                            (8, 24, 1000, 5000), (8, 8, 100, 37)]:  # fmt: skip
        argv = [*SAMPLES, "--train-samples", str(samples), "--rampup-batch-size", str(start),
                str(increment), str(ramp)]  # fmt: skip
        got = parse_job_config(argv, world_size=4).training.train_iters
        calculator = Calculator(32, 2, 4, False, 1, start, increment, ramp)
        iterations = consumed = 0
        while consumed <= ramp and consumed <= samples:
            calculator.update(consumed, consistency_check=True)
            consumed += calculator.get_current_global_batch_size()
            iterations += 1
        iterations += max(samples - consumed, 0) // 32
        assert got == iterations, (start, increment, ramp, samples)
    # 8 x 5, 16 x 2, 24 x 2 (100 / 3 samples a step; 120 > 100 ends the ramp), 280 // 32
    argv = [*SAMPLES, "--rampup-batch-size", "8", "8", "100"]
    assert parse_job_config(argv, world_size=4).training.train_iters == 9 + 8


def test_loop_counts_at_an_iteration_are_what_megatron_lms_loop_counts_there():
    # From a loop that started at 4 (a --load's): 3 flops per iteration, 16 validation
    # samples at every multiple of 3 (an evaluation there comes before any save or failure),
    # 8 training samples per iteration.
    start = LoopCounts(iteration=4, flops=12.0, valid_samples=16, train_samples=32,
                       skipped_samples=0, before=24, batches=Batches.constant(8, 3.0),
                       valid_per_evaluation=16, eval_interval=3)  # fmt: skip
    assert start.at(4) == (12.0, 16, 32, 0, 24)
    assert start.at(5) == (15.0, 16, 40, 0, 32)  # no evaluation since the start's (at 3)
    assert [start.at(i)[1] for i in (5, 6, 8, 9, 12)] == [16, 32, 32, 48, 64]
    assert start.at(12) == Counts(36.0, 64, 96, 0, 88)
    # added one iteration at a time as the loop adds them, not multiplied (which rounds)
    big = LoopCounts(iteration=0, flops=2.0**53, valid_samples=0, train_samples=0,
                     skipped_samples=0, before=0, batches=Batches.constant(8, 1.0),
                     valid_per_evaluation=0, eval_interval=0)  # fmt: skip
    assert big.at(2).flops == 2.0**53  # each +1 rounds away, as in the loop (a product: +2)


def test_loop_counts_follow_a_batch_size_ramp_as_megatron_lms_loop_walks_it():
    # The loop asks the batch for the samples consumed before each iteration, trains the
    # running batch (the asked one rounded down to whole micro-batches x DP, here 8, with
    # --decrease-batch-size-if-needed), adds what it trained and counts the rest as skipped.
    def asked(consumed: int) -> int:
        return 30 if consumed > 60 else 6 + consumed // 20 * 6  # 6, 12, 18, 24, then 30

    def at(consumed: int) -> tuple[int, int]:
        return asked(consumed) // 8 * 8, asked(consumed)

    batches = Batches(at, 60, lambda trained: trained * 0.5)
    loop = LoopCounts(iteration=0, flops=0.0, valid_samples=0, train_samples=0,
                      skipped_samples=0, before=0, batches=batches, valid_per_evaluation=0,
                      eval_interval=0)  # fmt: skip
    flops, consumed, skipped, before = 0.0, 0, 0, 0
    for iteration in range(1, 15):
        trained, wanted = at(consumed)
        before, consumed, skipped = consumed, consumed + trained, skipped + wanted - trained
        flops += trained * 0.5
        assert loop.at(iteration) == Counts(flops, 0, consumed, skipped, before), iteration
    # the same from a loop that a hot-swap started at iteration 9 (its counts carried)
    there = loop.at(9)
    later = LoopCounts(iteration=9, flops=there.flops, valid_samples=0,
                       train_samples=there.train_samples, skipped_samples=there.skipped_samples,
                       before=there.before, batches=batches, valid_per_evaluation=0,
                       eval_interval=0)  # fmt: skip
    assert later.at(9) == there and later.at(14) == loop.at(14)


def test_logged_sums_keep_copies_of_the_last_iterations_sums():
    # Megatron-LM's training_log changes its dict in place each iteration (and empties it at
    # a printed line): what is kept, and what is given, are copies of it.
    sums = {"lm loss": [1.5], "advanced iterations": 1}
    logged = LoggedSums(lambda d: {k: list(v) if isinstance(v, list) else v for k, v in d.items()})
    logged.logged(1, sums)
    sums["lm loss"].append(2.5)
    sums["advanced iterations"] = 2
    logged.logged(2, sums)
    assert logged.after(1) == {"lm loss": [1.5], "advanced iterations": 1}
    given = logged.after(2)
    given["lm loss"].append(9.0)  # the resumed loop's training_log adds to what it is given
    assert logged.after(2) == {"lm loss": [1.5, 2.5], "advanced iterations": 2}
    for iteration in range(3, 8):
        logged.logged(iteration, sums)
    assert logged.after(3) is None and logged.after(4) is not None  # the last KEEP (4) only
    assert logged.after(99) is None


def test_an_evaluation_is_cut_short_where_it_was_due_after_the_restored_iteration_and_unfinished():
    record = EvaluationRecord()
    assert not record.cut_short(3)  # a claimed spare's: nothing due, it says no
    record.after_step(3, evaluates=True)
    assert record.cut_short(3)  # the failure struck before or during that evaluation
    assert not record.cut_short(2)  # rolled back before it: the loop evaluates after 3 again
    record.finished(3)
    assert not record.cut_short(3)  # finished: a failure in the save after it
    record.after_step(4, evaluates=False)
    assert not record.cut_short(4) and not record.cut_short(3)
    record.after_step(6, evaluates=True)
    record.finished(6)  # the evaluations after training report the last iteration again
    record.finished(3)
    assert record.done == 6 and not record.cut_short(6)


def test_the_last_rank_which_prints_the_result_decides_where_it_survived():
    # kept and cut short: run again; kept and finished: printed, not again (others not)
    assert evaluate_again(any_cut_short=True, last_rank_kept=True, last_rank_cut_short=True)
    assert not evaluate_again(any_cut_short=True, last_rank_kept=True, last_rank_cut_short=False)
    # the last rank replaced: any survivor that had not finished says it was cut short
    assert evaluate_again(any_cut_short=True, last_rank_kept=False, last_rank_cut_short=False)
    assert not evaluate_again(any_cut_short=False, last_rank_kept=False, last_rank_cut_short=False)


def test_an_evaluation_run_again_reads_from_its_first_sample():
    assert redo_start(valid_samples=48, per_evaluation=16) == 32
    assert redo_start(valid_samples=16, per_evaluation=16) == 0  # the job's first evaluation
    # --full-validation with --eval-iters 0 counts none (its loaders start at 0 anyway)
    assert redo_start(valid_samples=16, per_evaluation=0) == 16
    assert redo_start(valid_samples=8, per_evaluation=16) is None  # not this loop's count


def test_a_fault_in_an_evaluation_needs_one_after_its_iteration():
    argv = [*BASE, "--deadpool", "--eval-interval", "3", "--deadpool-inject", "kill@1:6:evaluate"]
    assert parse_job_config(argv, 4).deadpool.deadpool_inject == "kill@1:6:evaluate"
    with pytest.raises(ConfigError, match=r"kill@1:4:evaluate: Megatron-LM evaluates after "
                       r"every multiple of --eval-interval \(3\), not after iteration 4"):  # fmt: skip
        parse_job_config([*argv[:-1], "kill@1:4:evaluate"], 4)
    with pytest.raises(ConfigError, match=r"--eval-interval \(not given: never\)"):
        parse_job_config([*BASE, "--deadpool", "--deadpool-inject", "kill@1:6:evaluate"], 4)


def test_evaluations_and_saves_after_a_step_are_marked_as_slow_phases():
    args = SimpleNamespace(eval_interval=10, do_valid=True, save="ckpt", save_interval=4)
    assert [slow_work_after(args, i) for i in (3, 4, 10, 20)] == [None, "save", "evaluate",
                                                                   "evaluate"]  # fmt: skip
    # a --rampup-batch-size step: train() saves at the top of the next iteration (--save)
    assert slow_work_after(args, 3, batch_changes=True) == "save"
    assert slow_work_after(args, 10, batch_changes=True) == "evaluate"  # that comes first
    args = SimpleNamespace(eval_interval=10, do_valid=False, save=None, save_interval=None)
    assert slow_work_after(args, 10) is None
    assert slow_work_after(args, 3, batch_changes=True) is None  # nothing saved without --save


def test_training_ends_after_the_last_iteration_or_a_multiple_of_the_exit_interval():
    # What follows is the end (phase finish, a slow one): the save at an exit interval that is
    # not a save interval must not be timed as an ordinary iteration's end.
    args = SimpleNamespace(train_iters=12, exit_interval=8)
    assert [ends_after(args, i) for i in (7, 8, 9, 12)] == [False, True, False, True]
    args = SimpleNamespace(train_iters=12, exit_interval=None)
    assert [ends_after(args, i) for i in (8, 11, 12)] == [False, False, True]


def test_the_tracker_megatron_lm_and_we_share_names_an_iteration_or_nothing(tmp_path):
    from deadpool_megatron.megatron.checkpointing import TRACKER, tracked_iteration

    assert tracked_iteration(str(tmp_path)) is None
    (tmp_path / TRACKER).write_text("12\n")
    assert tracked_iteration(str(tmp_path)) == 12
    (tmp_path / TRACKER).write_text("release")  # a released Megatron-LM checkpoint
    assert tracked_iteration(str(tmp_path)) is None


def test_the_patch_series_adds_only_calls_into_deadpool():
    """Every line a patch adds calls into DeadPool, but those it moves: core_v0.19's
    pretrain_gpt.py parses, builds its configs and calls pretrain() in a function of its own
    (main), each line as it was, the script's extra-arguments provider wrapped by DeadPool's."""
    patches = sorted(PATCHES.glob("megatron-lm-*/*.patch"))
    assert {p.parent.name for p in patches} >= {
        "megatron-lm-core_v0.16.1",
        "megatron-lm-core_v0.19.0",
    }
    for patch in patches:
        removed, plain, calls = [], [], []
        for line in patch.read_text().splitlines():
            code = line[1:].strip()
            if line.startswith("-") and not line.startswith("---"):
                removed.append(code)
            elif line.startswith("+") and not line.startswith("+++") and code:
                if "deadpool" in code:
                    calls.append(code)
                elif not code.startswith("#"):
                    plain.append(code)
        moved = [c for c in plain if c in removed]
        assert [c for c in plain if c not in removed] in ([], ["def main(store):"]), patch.name
        for code in removed:
            assert code in moved or any(code.rstrip(",").split("=", 1)[-1] in c for c in calls), (
                f"{patch.name} removes a line: {code}"
            )


def test_a_step_schedule_is_read_as_megatron_core_reads_it_and_refused_where_it_refuses():
    # core_v0.18 and later: the ramp is --step-batch-size-schedule, thresholds in tokens
    # (samples of --seq-length tokens), K/M/B/T allowed; --rampup-batch-size is ignored there
    ramp = [*SAMPLES, "--rampup-batch-size", "8", "8", "100"]
    assert parse_job_config(ramp, 4).training.train_iters > 0  # core_v0.16.1 ramps
    with pytest.raises(ConfigError, match="ignores it and trains every iteration"):
        parse_job_config(ramp, 4, step_schedule=True)
    assert parse_job_config(SAMPLES, 4, step_schedule=True).training.train_iters == 12
    base = [a for a in SAMPLES if a not in ("--global-batch-size", "32")]

    def parsed(schedule: str, *more: str, step_schedule: bool = True):
        argv = [*base, "--seq-length", "64", "--step-batch-size-schedule", schedule, *more]
        return parse_job_config(argv, 4, step_schedule).training

    # 8 samples a batch from 0, 16 from 1600 / 64 = 25 samples, 32 from 64K / 64 = 1000:
    # 8 x 4 (32 samples), 16 x 61 (1008), then 32 x 13 (1424 >= 1400), the last passing
    got = parsed("0:8 1.6K:16 64K:32", "--train-samples", "1400")
    assert (got.train_iters, got.global_batch_size) == (4 + 61 + 13, 32)
    # commas as spaces, any order (sorted), iteration-based runs as given
    got = parsed("64K:32,0:8, 1600:16", "--train-samples", "1400")
    assert got.train_iters == 78
    argv = [*base[:2], *base[4:], "--seq-length", "64", "--train-iters", "7",
            "--step-batch-size-schedule", "0:8 1600:16"]  # fmt: skip
    assert parse_job_config(argv, 4, True).training.train_iters == 7
    refused = {
        "0:8 16:16x": "entry '16:16x' is not THRESHOLD:BATCH",
        "8": "entry '8' is not THRESHOLD:BATCH",
        "64:8 1600:16": "the first threshold must be 0",  # 64 tokens: sample 1
        "": "the first threshold must be 0",
        "0:8 10:16 20:32": "two thresholds fall on the same sample",  # 10 // 64 == 0
        "0:8 1600:12": r"every batch must be a positive multiple of --micro-batch-size 2 x "
                       r"data-parallel size 4 = 8 \(not \[12\]\)",
        "0:-8 1600:16": r"every batch .* \(not \[-8\]\)",
        "0:16 1600:8": r"a batch smaller than the one before \(\[16, 8\]\)",
    }  # fmt: skip
    for schedule, why in refused.items():
        with pytest.raises(ConfigError, match=f"--step-batch-size-schedule '{schedule}': {why}"):
            parsed(schedule)
    with pytest.raises(ConfigError, match="with --global-batch-size 32: Megatron-LM refuses"):
        parsed("0:8", "--global-batch-size", "32")
    with pytest.raises(ConfigError, match="megatron-core's step schedules refuse it"):
        parsed("0:8", "--decrease-batch-size-if-needed")
    with pytest.raises(ConfigError, match="with --step-batch-size-schedule '0:8'"):
        parsed("0:8", "--rampup-batch-size", "8", "8", "100")
    # from a checkpoint, batches the job may be past are Megatron-LM's to check
    assert parsed("0:12 1600:16", "--load", "ckpt").global_batch_size == 16


def test_fully_sharded_data_parallel_is_left_alone_without_deadpool():
    cfg = parse_job_config([*BASE, "--use-megatron-fsdp"], 4)  # a checkpoint-restart job's
    assert not cfg.deadpool.deadpool


def test_the_batch_is_steady_where_megatron_cores_calculators_stop_changing_it():
    # past it, LoopCounts.at multiplies instead of walking, and no ramp step is looked for
    from megatron.core.num_microbatches_calculator import (
        ConstantNumMicroBatchesCalculator,
        RampupBatchsizeNumMicroBatchesCalculator,
    )

    from deadpool_megatron.megatron.upstream_counts import _steady_from

    assert _steady_from(ConstantNumMicroBatchesCalculator(32, 2, 4, False, 1)) == -1
    ramp = RampupBatchsizeNumMicroBatchesCalculator(32, 2, 4, False, 1, 8, 8, 100)
    assert _steady_from(ramp) == 100
    ramp.update(99, consistency_check=False)
    assert ramp.get_current_global_batch_size() == 24  # still ramping
    for consumed in (101, 10**6):  # past the ramp's samples: the final batch for good
        ramp.update(consumed, consistency_check=False)
        assert ramp.get_current_global_batch_size() == 32
    # core_v0.19's step schedule: (threshold, batch) pairs, the last batch from its threshold
    assert _steady_from(SimpleNamespace(schedule=[(0, 8), (50, 16), (120, 32)])) == 119
    assert _steady_from(object()) is None  # unknown: walked iteration by iteration
