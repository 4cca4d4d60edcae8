"""scripts/bench_recovery.py's reading of a hot-swap's events: the recovery, what is left of it
beyond one normal iteration (the size's, and the iterations around it in the same run), and
the time until every rank resumed (the recovery without its resumed iteration), each growth
taken between the first and the last model size."""

from __future__ import annotations

import sys

import pytest

from jobs import ROOT

sys.path.insert(0, str(ROOT / "scripts"))

import bench_recovery  # noqa: E402


def _events(total_s: float, first_iteration_s: float) -> list[dict]:
    phases = {"detect": 0.01, "plan": 0.05, "transfer_state": 0.04, "verify": 0.02,
              "first_iteration": first_iteration_s}  # fmt: skip
    return [
        *({"event": "recovery_phase", "phase": k, "duration_s": v} for k, v in phases.items()),
        {
            "event": "recovery_done",
            "total_s": total_s,
            "replayed_iterations": 1,
            "bytes_moved": 64,
            "iteration": 24,  # rolled back to: iteration 25 is the resumed one
        },  # fmt: skip
    ]


def test_the_time_to_resume_leaves_out_the_resumed_iteration():
    out = bench_recovery.breakdown_hotswap(_events(1.2, 0.9), iter_s=0.8)
    assert out["recovery_total_s"] == 1.2
    assert out["beyond_iteration_s"] == pytest.approx(0.4)
    assert out["to_resume_s"] == pytest.approx(0.3)
    assert out["replay"] == pytest.approx(0.8) and out["detect"] == 0.01
    # without the run's iterations, "its own run's" iteration is the size's median
    assert out["beyond_local_iteration_s"] == pytest.approx(0.4)


def test_beyond_its_own_runs_iteration_uses_the_iterations_around_the_resumed_one():
    # This run computed at 1.0 s per iteration around the failure (the size's median over
    # every run: 0.8 s); iteration 1 (warm-up), the resumed 25 and anything further than 5
    # iterations from it say nothing about that.
    ms = {1: 5000.0, 19: 100.0, 25: 1500.0, 31: 100.0}
    ms.update({i: 1000.0 for i in (20, 21, 22, 23, 24, 26, 27, 28, 29, 30)})
    ms[22], ms[28] = 900.0, 1200.0
    assert bench_recovery.local_iteration_s(ms, 25) == pytest.approx(1.0)
    out = bench_recovery.breakdown_hotswap(_events(1.2, 0.9), iter_s=0.8, iteration_ms=ms)
    assert out["local_iteration_s"] == pytest.approx(1.0)
    assert out["beyond_local_iteration_s"] == pytest.approx(0.2)
    assert out["beyond_iteration_s"] == pytest.approx(0.4)
    assert bench_recovery.local_iteration_s({1: 5.0, 25: 9.0}, 25) is None


def test_each_growth_is_taken_between_the_first_and_the_last_size():
    small = {"prebuilt": bench_recovery.breakdown_hotswap(_events(0.4, 0.2), iter_s=0.15)}
    large = {"prebuilt": bench_recovery.breakdown_hotswap(_events(1.2, 0.9), iter_s=0.8)}
    results = [small, large]
    assert bench_recovery._growth(results, "prebuilt", "to_resume_s") == pytest.approx(0.5)
    assert bench_recovery._growth(results, "prebuilt", "recovery_total_s") == pytest.approx(2.0)
    assert bench_recovery._growth(results, "hotswap", "to_resume_s") is None
