"""scripts/bench_megatron_lm.py without Megatron-LM: its reading of a job's metrics and events
(time not spent on the iterations that count, a replayed iteration's last run, the recovery's
phases), its refusal of a failure run that is not bitwise equal, and of bad flags."""

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


def test_time_lost_is_the_span_not_spent_on_iterations_that_count():
    free = bench.analyse(_records({i: 10.0 + 0.1 * i for i in range(1, 13)}), [])
    assert free["unexplained_s"] == pytest.approx(0.0) and "recovery" not in free
    # iteration 6 ran twice (its first run lost with the failure): its last run counts once,
    # and 1.2 s went to the recovery
    times = {i: 10.0 + 0.1 * i + (1.2 if i >= 6 else 0.0) for i in range(1, 13)}
    records = _records(times)
    records.insert(5, {"iteration": 6, "lm_loss": 0.0, "iteration_ms": 100.0, "time": 10.5})
    failed = bench.analyse(records, _recovery(1.25))
    assert failed["unexplained_s"] == pytest.approx(1.2)
    assert failed["losses"] == free["losses"]
    assert failed["recovery"]["recovery_total_s"] == 1.25
    assert failed["recovery"]["rebuild_model"] == 0.3
    out = bench.summarize([(free, failed)])
    assert out["lost_s"] == pytest.approx(1.2) and out["recovery_s"] == 1.25 and out["bitwise"]


def test_a_failure_run_that_is_not_bitwise_equal_fails_the_benchmark():
    times = {i: 10.0 + 0.1 * i for i in range(1, 13)}
    free = bench.analyse(_records(times), [])
    other = bench.analyse(_records(times, digest="d1"), _recovery(1.0))
    with pytest.raises(SystemExit, match="bitwise"):
        bench.summarize([(free, other)])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--megatron-lm", "/nonexistent"], "neither a Megatron-LM checkout"),
        (["--megatron-lm", str(ROOT), "--fail-at", "13"], r"--fail-at 13 must lie in \[2, 12\]"),
        (["--megatron-lm", str(ROOT), "--victim", "4"], r"--victim 4 must be a rank in \[0, 3\]"),
        (["--megatron-lm", str(ROOT), "--repeats", "0"], "--repeats 0 must be 1 or more"),
    ],
)
def test_bad_flags_are_refused_before_any_job(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert re.search(message, capsys.readouterr().err)
