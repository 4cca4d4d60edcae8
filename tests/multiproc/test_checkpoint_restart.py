"""Checkpoint-restart, the baseline and DeadPool's fallback: on a failure every process stops,
the job starts again from the newest complete persistent checkpoint and replays; the final
state equals the failure-free run's, bit for bit."""

from __future__ import annotations

import signal

import pytest
from hotswap_jobs import TOGETHER

from deadpool_megatron.events import read_events
from deadpool_megatron.megatron.checkpointing import latest_iteration
from jobs import ROOT, run_failure_free, run_job, run_job_and_kill

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(900)]

DEMO = ["--config", str(ROOT / "configs" / "demo.yaml")]
SHAPE_PP2 = [*DEMO, "--tensor-model-parallel-size", "1", "--train-iters", "12"]
SHAPE_DP4 = [*DEMO, "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
             "--train-iters", "10", "--deadpool"]  # fmt: skip


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    return run_failure_free(tmp_path_factory, "base", 4, SHAPE_PP2)


def _restart_run(tmp_path, spec: str):
    log = tmp_path / "events.jsonl"
    args = [*SHAPE_PP2, "--save", str(tmp_path / "ckpt"), "--save-interval", "5",
            "--deadpool-inject", spec, "--deadpool-event-log", str(log)]  # fmt: skip
    result = run_job(tmp_path, 4, args, launcher=["--restart-policy", "full"])
    return result, read_events(str(log))


def test_kill_during_training_restarts_from_the_checkpoint_bitwise(tmp_path, baseline):
    result, events = _restart_run(tmp_path, "kill@3:8")
    assert result.returncode == 0, result.failure()
    assert result.losses == baseline.losses and result.digest == baseline.digest
    (restart,) = [e for e in events if e["event"] == "job_restart"]
    assert restart["reason"] == "failure of rank 3"
    (loaded,) = [e for e in events if e["event"] == "checkpoint_loaded"]
    assert loaded["iteration"] == 5  # replays 6 and 7, then goes on


def test_under_torchrun_a_kill_restarts_from_the_checkpoint_bitwise(tmp_path, baseline):
    """The restart path users know (the benchmarks' other baseline): torchrun restarts every
    process; each attempt meets on a store prefix of its own and loads the newest checkpoint."""
    log, ckpt = tmp_path / "events.jsonl", str(tmp_path / "ckpt")
    args = [*SHAPE_PP2, "--save", ckpt, "--load", ckpt, "--save-interval", "5",
            "--deadpool-inject", "kill@3:8", "--deadpool-event-log", str(log)]  # fmt: skip
    result = run_job(tmp_path, 4, args, torchrun_restarts=1)
    assert result.returncode == 0, result.failure()
    assert result.losses == baseline.losses and result.digest == baseline.digest
    events = read_events(str(log))
    assert [e["fault"] for e in events if e["event"] == "fault_injected"] == ["kill@3:8:forward"]
    (loaded,) = [e for e in events if e["event"] == "checkpoint_loaded"]
    assert loaded["iteration"] == 5
    assert result.executions[6] == [baseline.losses[6]] * 2  # replayed after the restart


def test_a_save_interrupted_before_its_finalization_leaves_nothing_for_the_next(
    tmp_path, run_drivers
):
    # A recovery can abort the barrier between a save's write and its finalization, which
    # reads the write's results from a queue. With megatron-core's single queue the next save
    # read that leftover as its own: it committed a checkpoint whose index points at the
    # first save's offsets, and its load failed. Each save's own queue keeps it whole.
    driver = ROOT / "tests" / "drivers" / "interrupted_save_driver.py"
    (out,) = run_drivers(driver, [[str(tmp_path / "store"), str(tmp_path / "ckpt")]], 120)
    assert out["fresh"] == "loaded whole"
    assert out["single"] != "loaded whole"  # what the fresh queue prevents


def test_kill_during_a_save_never_loads_the_incomplete_checkpoint(tmp_path, baseline):
    # Rank 2 dies after writing its shard of iteration 10, before the checkpoint is complete.
    result, events = _restart_run(tmp_path, "kill@2:10:save")
    assert result.returncode == 0, result.failure()
    assert result.losses == baseline.losses and result.digest == baseline.digest
    (loaded,) = [e for e in events if e["event"] == "checkpoint_loaded"]
    assert loaded["iteration"] == 5


def test_unrecoverable_hot_swap_falls_back_to_the_checkpoint(tmp_path):
    # DP4, K=1: ranks 1 and 2 (ring neighbours) die together (at iteration 5's optimizer step,
    # TOGETHER), so rank 1's optimizer shard is lost from memory; with --save the job restarts
    # from its checkpoint instead of stopping.
    base = run_job(tmp_path, 4, SHAPE_DP4, name="baseline")
    assert base.returncode == 0, base.failure()
    log = tmp_path / "events.jsonl"
    args = [*SHAPE_DP4, "--save", str(tmp_path / "ckpt"), "--save-interval", "3",
            "--deadpool-inject", TOGETHER, "--deadpool-event-log", str(log)]  # fmt: skip
    result = run_job(tmp_path, 4, args, spares=2)
    assert result.returncode == 0, result.failure()
    assert result.losses == base.losses and result.digest == base.digest
    assert "falling back to the persistent checkpoint" in result.output
    events = read_events(str(log))
    (restart,) = [e for e in events if e["event"] == "job_restart"]
    assert "was replicated on ranks [2] only" in restart["reason"]


def test_a_recovery_failing_the_same_way_falls_back_to_the_checkpoint_bitwise(tmp_path, baseline):
    # Every process holding rank 0 fails in the recovery from iteration 5 (its own error,
    # bug@0:5:recovery): reset, replaced, then the spare meets it too. A restart from the
    # persistent checkpoint runs no recovery, so with --save the job falls back to it and
    # finishes, equal to the failure-free run.
    log = tmp_path / "events.jsonl"
    args = [*SHAPE_PP2, "--deadpool", "--save", str(tmp_path / "ckpt"), "--save-interval", "3",
            "--deadpool-inject", "raise@1:5,bug@0:5:recovery", "--deadpool-event-log",
            str(log)]  # fmt: skip
    result = run_job(tmp_path, 4, args, spares=1)
    assert result.returncode == 0, result.failure()
    assert result.losses == baseline.losses and result.digest == baseline.digest
    assert "the recovery cannot succeed in memory: falling back to the persistent checkpoint" in (
        result.output
    )
    events = read_events(str(log))
    (restart,) = [e for e in events if e["event"] == "job_restart"]
    assert restart["reason"] == "rank 0's recovery failed the same way again"
    (loaded,) = [e for e in events if e["event"] == "checkpoint_loaded"]
    assert loaded["iteration"] == 3


def test_async_save_restarts_from_a_committed_checkpoint_bitwise(tmp_path):
    # Checkpoints are written by background processes and committed a few iterations later;
    # the restart loads the newest committed one (never one still being written).
    shape = [*SHAPE_PP2, "--train-iters", "40"]
    base = run_job(tmp_path, 4, shape, name="baseline")
    assert base.returncode == 0, base.failure()
    log = tmp_path / "events.jsonl"
    args = [*shape, "--save", str(tmp_path / "ckpt"), "--save-interval", "5", "--async-save",
            "--deadpool-inject", "kill@3:30", "--deadpool-event-log", str(log)]  # fmt: skip
    result = run_job(tmp_path, 4, args, launcher=["--restart-policy", "full"])
    assert result.returncode == 0, result.failure()
    assert result.losses == base.losses and result.digest == base.digest
    (loaded,) = [e for e in read_events(str(log)) if e["event"] == "checkpoint_loaded"]
    assert loaded["iteration"] in (5, 10, 15, 20, 25), loaded
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "40"


@pytest.mark.parametrize("policy", ["hotswap", "full"])
def test_a_load_the_ranks_cannot_use_ends_the_job_with_one_error_not_a_recovery(tmp_path, policy):
    # The tracker under --load names an iteration whose directory is gone. Every rank finds
    # that, after the job is up (ranks registered, the spare idle): it is bad input, not a
    # failure, so neither a spare nor a restart is tried (each would be given the same).
    load = tmp_path / "ckpt"
    load.mkdir()
    (load / "latest_checkpointed_iteration.txt").write_text("5")
    log = tmp_path / "events.jsonl"
    args = [*SHAPE_DP4, "--load", str(load), "--deadpool-event-log", str(log)]
    spares = 1 if policy == "hotswap" else 0
    result = run_job(tmp_path, 4, args, spares, launcher=["--restart-policy", policy])
    assert result.returncode == 2, result.failure()
    missing = f"names iteration 5 but {load / 'iter_0000005'} is missing"
    assert f"pretrain_gpt.py: error: {load}" in result.output, result.output[-3000:]
    assert missing in result.output  # the ranks still up were stopped: one error may be all
    assert "it refused its input" in result.output
    assert "classified" not in result.output and "Traceback" not in result.output
    events = read_events(str(log))
    assert not [e for e in events if e["event"] in ("job_restart", "spare_claimed",
                                                     "failure_detected")]  # fmt: skip
    (ended,) = [e for e in events if e["event"] == "job_ended"]
    assert ended["status"] == 2 and "refused its input" in ended["reason"]


def test_sigterm_with_the_exit_signal_handler_saves_the_iteration_every_rank_stopped_after(
    tmp_path, baseline
):
    # Slurm's notice of a time limit: SIGTERM to deadpool-launch once iteration 4 is logged.
    # The workers stop after one same iteration, save it and exit 0; the launcher ends 0, its
    # spare with the job. The same command again loads that iteration and trains to 12:
    # together, the uninterrupted run, bitwise. Without the flag, the signal ends every
    # process at once (143) and the iterations since the last save are lost.
    ckpt = str(tmp_path / "ckpt")
    job = [*SHAPE_PP2, "--deadpool", "--log-interval", "1", "--save", ckpt, "--load", ckpt]
    args = [*job, "--exit-signal-handler"]
    first, _, _ = run_job_and_kill(tmp_path, 4, args, None, 4, signal.SIGTERM, spares=1)
    assert first.returncode == 0, first.failure()
    stopped = latest_iteration(ckpt)
    assert stopped is not None and 4 <= stopped < 12, first.output[-3000:]
    assert sorted(first.losses) == list(range(1, stopped + 1))
    assert f"every rank stops after iteration {stopped}, saving it" in first.output
    assert "spare 0: job finished, exiting" in first.output
    assert "Traceback" not in first.output
    second = run_job(tmp_path, 4, args, name="second")
    assert second.returncode == 0, second.failure()
    assert f"loaded checkpoint of iteration {stopped}" in second.output
    assert {**first.losses, **second.losses} == baseline.losses
    assert second.digest == baseline.digest

    plain = tmp_path / "plain"
    plain.mkdir()
    for f in (tmp_path / "ckpt").iterdir():  # a fresh --save: nothing to load
        f.rename(plain / f.name)
    cut, _, _ = run_job_and_kill(tmp_path, 4, job, None, 4, signal.SIGTERM)
    assert cut.returncode == 128 + signal.SIGTERM, cut.failure()
    assert latest_iteration(ckpt) is None  # nothing was saved


def test_sigterm_noted_before_a_failure_stops_every_rank_after_the_recovered_iteration(
    tmp_path, baseline
):
    # Slurm's notice comes while rank 1 is in a slow phase of iteration 6, and rank 1 dies as
    # that iteration's snapshot starts, before the ranks ask each other about the signal: the
    # recovery rolls back to 5 and a spare takes rank 1 over. The signal the survivors noted
    # before the recovery still stops every rank after one same iteration, saved, every loss
    # equal to the uninterrupted run's (resuming such a save: the test above).
    ckpt = str(tmp_path / "ckpt")
    args = [*SHAPE_PP2, "--deadpool", "--log-interval", "1", "--save", ckpt, "--load", ckpt,
            "--exit-signal-handler"]  # fmt: skip
    faults = ["--deadpool-inject", "slow@1:6,kill@1:6:snapshot"]
    # sent once rank 1's slow phase has begun: the ranks have agreed on iteration 5's stop
    # by then (after iteration 5 was logged, a loaded machine once delivered it before that
    # agreement, and every rank stopped after 5, before the kill)
    first, _, _ = run_job_and_kill(tmp_path, 4, [*args, *faults], None, 5, signal.SIGTERM,
                                   spares=1, when_logged="injecting slow@1:6")  # fmt: skip
    assert first.returncode == 0, first.failure()
    assert "spare 0 claimed: takes over rank 1" in first.output
    stopped = latest_iteration(ckpt)
    assert stopped is not None and 6 <= stopped < 12, first.output[-3000:]
    assert first.losses == {i: baseline.losses[i] for i in range(1, stopped + 1)}
    assert f"every rank stops after iteration {stopped}, saving it" in first.output
