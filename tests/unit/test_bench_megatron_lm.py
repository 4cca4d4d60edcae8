"""scripts/bench_megatron_lm.py without Megatron-LM: its reading of a job's metrics and events
(time not spent on the iterations that count, a replayed iteration's last run, the recovery's
phases and the checkpoint-restart's), its refusal of a failure run that is not bitwise equal
or did not go the way it was run for, and of bad flags."""

from __future__ import annotations

import re
import sys

import pytest

from jobs import ROOT

sys.path.insert(0, str(ROOT / "scripts"))

import bench_megatron_lm as bench  # noqa: E402


def _records(times: dict[int, float], ms: float = 100.0, digest: str = "d0") -> list[dict]:
    its = [{"iteration": i, "lm_loss": 7.0 - i / 10, "iteration_ms": ms, "time": t}
           for i, t in times.items()]  # fmt: skip
    return [*its, {"event": "final", "iteration": max(times), "state_digest": digest}]


def _recovery(total_s: float) -> list[dict]:
    return [
        {"event": "recovery_phase", "phase": "rebuild_model", "duration_s": 0.3},
        {"event": "recovery_phase", "phase": "first_iteration", "duration_s": 0.5},
        {"event": "recovery_done", "total_s": total_s, "replayed_iterations": 0,
         "bytes_moved": 10, "iteration": 5},
    ]  # fmt: skip


def _restart(injected: float, detected: float, loaded: float, load_s: float) -> list[dict]:
    return [
        {"event": "fault_injected", "time": injected},
        {"event": "failure_detected", "time": detected},
        {"event": "checkpoint_loaded", "time": loaded, "iteration": 4, "load_s": load_s},
    ]


STEADY = {i: 10.0 + 0.1 * i for i in range(1, 13)}  # 0.1 s an iteration, nothing lost


def _free() -> dict:
    return bench.analyse(_records(STEADY), [], 6)


def _hot_swapped(digest: str = "d0") -> dict:
    return bench.analyse(_records(STEADY, digest=digest), _recovery(1.0), 6)


def _restarted() -> dict:
    # killed in iteration 6; the job started again, loaded 4's checkpoint and ran 5 again:
    # 9 s from the failure to the restarted 5's end, of which 0.1 s is 5's own run
    times = {i: 10.0 + 0.1 * i + (9.0 if i >= 5 else 0.0) for i in range(1, 13)}
    records = _records(times)
    records.insert(4, {"iteration": 5, "lm_loss": 6.5, "iteration_ms": 100.0, "time": 10.5})
    return bench.analyse(records, _restart(10.55, 10.6, 19.0, 0.5), 6)


def test_time_lost_is_the_span_not_spent_on_iterations_that_count():
    free = _free()
    assert free["unexplained_s"] == pytest.approx(0.0) and "recovery" not in free
    # iteration 6 ran twice (its first run lost with the failure): its last run counts once,
    # and 1.2 s went to the recovery
    times = {i: 10.0 + 0.1 * i + (1.2 if i >= 6 else 0.0) for i in range(1, 13)}
    records = _records(times)
    records.insert(5, {"iteration": 6, "lm_loss": 0.0, "iteration_ms": 100.0, "time": 10.5})
    failed = bench.analyse(records, _recovery(1.25), 6)
    assert failed["unexplained_s"] == pytest.approx(1.2)
    assert failed["losses"] == free["losses"]
    assert failed["recovery"]["recovery_total_s"] == 1.25
    assert failed["recovery"]["rebuild_model"] == 0.3
    assert "restart" not in failed
    restarted = _restarted()
    assert "recovery" not in restarted
    assert restarted["unexplained_s"] == pytest.approx(9.0)
    assert restarted["restart"]["loaded_iteration"] == 4
    assert restarted["restart"]["detect"] == pytest.approx(0.05)
    assert restarted["restart"]["restart_processes"] == pytest.approx(19.0 - 0.5 - 10.6)
    assert restarted["restart"]["replay"] == pytest.approx(0.1)  # iteration 5, once more
    out = bench.summarize([(free, failed)], [(_free(), restarted)])
    assert out["lost_s"] == pytest.approx(1.2) and out["recovery_s"] == 1.25 and out["bitwise"]
    assert out["ckpt_restart_lost_s"] == pytest.approx(9.0)
    assert out["ckpt_restart_phases"]["load"] == 0.5
    assert out["ratio"] == pytest.approx(7.5)


def test_a_failure_run_that_is_not_bitwise_equal_fails_the_benchmark():
    free = _free()
    with pytest.raises(SystemExit, match="bitwise"):
        bench.summarize([(free, _hot_swapped("d1"))], [(free, _restarted())])
    with pytest.raises(SystemExit, match="bitwise"):  # the restart's too
        bench.summarize([(free, _hot_swapped())], [(free, {**_restarted(), "digest": "d1"})])


def test_a_failure_run_that_went_another_way_fails_the_benchmark():
    # a "restart" job that hot-swapped instead (or loaded nothing) measures something else
    with pytest.raises(SystemExit, match="logged no restart"):
        bench.summarize([(_free(), _hot_swapped())], [(_free(), _hot_swapped())])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--megatron-lm", "/nonexistent"], "neither a Megatron-LM checkout"),
        (["--megatron-lm", str(ROOT), "--fail-at", "13"], r"--fail-at 13 must lie in \[2, 12\]"),
        (["--megatron-lm", str(ROOT), "--victim", "4"], r"--victim 4 must be a rank in \[0, 3\]"),
        (["--megatron-lm", str(ROOT), "--repeats", "0"], "--repeats 0 must be 1 or more"),
        (
            ["--megatron-lm", str(ROOT), "--save-interval", "6"],
            r"--save-interval 6 must lie in \[1, 5\]: a checkpoint must precede",
        ),
    ],
)
def test_bad_flags_are_refused_before_any_job(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert re.search(message, capsys.readouterr().err)


def test_the_plot_draws_both_ways_from_a_summary(tmp_path):
    summary = bench.summarize([(_free(), _hot_swapped())], [(_free(), _restarted())])
    bench.plot(summary, tmp_path / "out.png")
    assert (tmp_path / "out.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
