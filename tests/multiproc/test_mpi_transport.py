"""`--deadpool-transport mpi`: real Open MPI 5 (its PyPI wheel, installed into the test's
environment by scripts/setup_mpi.sh) under a real `mpirun --with-ft ulfm`.

The transport's edges between processes spawned apart (a killed peer fails a pending receive,
an abort ends one from another thread), then the whole job: the agent under mpirun spawns
every worker and spare through MPI_Comm_spawn, replicas travel over MPI, a killed rank is
hot-swapped and the run ends bit for bit as the failure-free one (which used tcp).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
from hotswap_jobs import SHAPE_DP4, assert_recovered, assert_same_run, named

from deadpool_megatron.events import read_events
from jobs import ROOT, run_failure_free, run_job

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(420)]


def test_edges_fail_on_a_dead_peer_and_end_at_an_abort(mpirun, tmp_path):
    driver = ROOT / "tests" / "drivers" / "mpi_edges_driver.py"
    done = subprocess.run([*mpirun, "-n", "1", sys.executable, str(driver), "parent", str(tmp_path)],
                          capture_output=True, text=True, timeout=240, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    results = {i: json.loads((tmp_path / f"result-{i}.json").read_text()) for i in (1, 2)
               if (tmp_path / f"result-{i}.json").exists()}  # fmt: skip
    assert set(results) == {1, 2}, (done.stdout + done.stderr)[-4000:]
    assert all(r["bytes_ok"] for r in results.values())  # a 1 MiB tensor went round the ring
    assert "replica receive with rank 0 failed: MPI_ERR_PROC_FAILED" in results[1]["error"]
    assert "replica receive with rank 1 failed: MPI_ERR_REVOKED" in results[2]["error"]
    assert results[2]["waited_s"] < 30


@pytest.fixture(scope="module")
def baseline_dp4(tmp_path_factory):
    return run_failure_free(tmp_path_factory, "base_dp4", 4, SHAPE_DP4)


def test_a_killed_rank_is_hot_swapped_with_replicas_over_mpi_bitwise(mpirun, tmp_path,
                                                                     baseline_dp4):  # fmt: skip
    log = tmp_path / "events.jsonl"
    args = [*SHAPE_DP4, "--deadpool-transport", "mpi", "--deadpool-inject", "kill@1:5:optimizer",
            "--deadpool-event-log", str(log)]  # fmt: skip
    result = run_job(tmp_path, 4, args, spares=1, prefix=[*mpirun, "-n", "1"])
    events = read_events(str(log))
    (ended,) = named(events, "job_ended")
    # mpirun's own status reports the killed process (137); the job's is the agent's
    assert ended["status"] == 0, result.failure()
    assert_same_run(dataclasses.replace(result, returncode=ended["status"]), baseline_dp4)
    (done,) = assert_recovered(events)
    assert done["replaced"] == {"1": "spare-0"}
    rings = [line for line in result.output.splitlines() if "replica ring of generation" in line]
    assert rings and all("over mpi" in line for line in rings)
    assert any("generation 1 over mpi" in line for line in rings)  # the spare joined the ring


def test_overhead_benchmark_compares_mpi_with_tcp_in_one_run(mpirun, tmp_path):
    """scripts/bench_overhead.py's short form with MPI: its launcher under mpirun spawns the
    workers, and the MPI windows alternate with tcp's in one job, each keeping every replica
    current."""
    out = tmp_path / "overhead.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_overhead.py"), "--window", "2",
         "--windows", "4", "--warmup", "1", "--hidden-size", "64", "--num-layers", "2",
         "--global-batch-size", "8", "--transports", "tcp,mpi", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    last = json.loads(done.stdout.strip().splitlines()[-1])
    assert last["ratio"] == min(last["ratio_tcp"], last["ratio_mpi"])
    summary = json.loads(out.read_text())
    assert [w["on"] for w in summary["windows"]] == [None, "tcp", None, "mpi"]
    for figures in summary["by_transport"].values():
        assert figures["replica_lag_max"] <= 1 and figures["rejected"] == 0
        assert figures["replicate_ms"] > 0
    assert "replica ring of generation 0 over mpi" in done.stdout + done.stderr
