"""The soak's short form: one job, a seeded mix of six faults of every kind (kill, hang,
transient error, idle spare killed, a spare killed while it recovers, a corrupted replica), with
replenishment on; it must recover from all of them, bitwise equal to its failure-free twin,
without accusing a healthy process, and no process may grow (fds, threads, RSS) from one
generation to the next. The full soak (30 faults over about 10 minutes, 8 workers) is
scripts/soak.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from jobs import ROOT

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(1500)]


def test_short_soak_recovers_every_fault_bitwise(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "soak.py"), "--nproc", "4", "--tp", "1",
         "--failures", "6", "--iters-per-failure", "6", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=1400,
    )  # fmt: skip
    assert done.stdout.strip(), done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    detail = (result, done.stdout[-3000:], (tmp_path / "soak.log").read_text()[-4000:])
    assert result["recovered"] and result["bitwise_equal"], detail
    assert result["false_accusations"] == 0, detail
    assert result["failures"] >= 6 and result["recoveries"] >= 4, detail
    assert result["spares_started"] >= 1, detail  # the pool was replenished
    # Nothing grows with generations (each process's floor, soak.growth): a leaked generation
    # of process groups is +64 fds and +48 threads here; the margins cover threads that come
    # and go (helper pools, checks) and one group held until its timeout by an operation the
    # abort's residual race left pending (recovery/abort.py).
    assert result["processes_followed"] >= 2, detail
    assert result["fd_growth"] <= 24 and result["thread_growth"] <= 8, detail
    assert result["rss_growth_pct"] <= 5.0, detail
    assert done.returncode == 0, detail
