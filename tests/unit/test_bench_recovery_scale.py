"""scripts/bench_recovery_scale.py's summary: the CPU bound (every rank's CPU over the
recovery spread over the machine's cores) and each phase's CPU per process, by job size."""

from __future__ import annotations

import argparse
import sys

import pytest

from jobs import ROOT

sys.path.insert(0, str(ROOT / "scripts"))

import bench_recovery_scale as bench  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def _run(n: int, recovery_s: float, cpu_mean: float, build_cpu: float) -> dict:
    phases = dict.fromkeys(bench.PHASES, recovery_s / len(bench.PHASES))
    return {"recovery_s": recovery_s, "phases": phases, "iteration_s": 0.2,
            "cpu_s_max": cpu_mean * 1.5, "cpu_s_mean": cpu_mean, "cpu_s_busiest_rank": 0,
            "phase_cpu_s_mean": {"rebuild_communicators": build_cpu, "first_iteration": 0.05},
            "bitwise_equal": True}  # fmt: skip


def test_the_cpu_bound_is_every_ranks_cpu_over_the_cores_and_grows_with_the_processes():
    a = argparse.Namespace(cores=2, hidden_size=32, num_layers=2)
    runs = {8: _run(8, 1.0, 0.15, 0.02), 32: _run(32, 5.0, 0.25, 0.06)}
    s = bench.summarize(a, runs)
    assert s["cpu_bound_s"] == {"8": 0.6, "32": 4.0}  # 0.15 x 8 / 2, 0.25 x 32 / 2
    assert s["recovery_over_cpu_bound"] == {"8": pytest.approx(1.667, abs=1e-3), "32": 1.25}
    assert s["cpu_bound_growth_8_to_32"] == pytest.approx(6.667, abs=1e-3)
    assert s["growth_8_to_32"] == 5.0
    assert s["phase_cpu_growth_8_to_32"] == {"rebuild_communicators": 3.0, "first_iteration": 1.0}


def test_runs_without_cpu_figures_have_no_bound():
    a = argparse.Namespace(cores=2, hidden_size=32, num_layers=2)
    runs = {n: _run(n, 1.0, 0.1, 0.01) for n in (4, 8)}
    for r in runs.values():
        r["cpu_s_mean"] = r["phase_cpu_s_mean"] = None
    s = bench.summarize(a, runs)
    assert s["cpu_bound_s"] is None and s["cpu_bound_growth_4_to_8"] is None
    assert s["phase_cpu_growth_4_to_8"] is None
