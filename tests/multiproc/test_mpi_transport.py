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
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hotswap_jobs import DEMO, HEARTBEATS, SHAPE_DP4, assert_recovered, assert_same_run, named

from deadpool_megatron.control.signed import ENV_JOB_SECRET, new_secret
from deadpool_megatron.events import read_events
from deadpool_megatron.metrics import read_metrics
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


# Two worker nodes of two processes and a spare node, one launcher each (mpirun's ranks 0-2);
# two replicas, so that a node's two adjacent ring ranks can both be lost.
SHAPE_NODES = [*DEMO, "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
               "--train-iters", "20", "--deadpool", "--deadpool-replicas", "2", *HEARTBEATS]  # fmt: skip


@pytest.fixture(scope="module")
def baseline_nodes(tmp_path_factory):
    return run_failure_free(tmp_path_factory, "base_nodes", 4, SHAPE_NODES)


def _launcher_of(rank: int) -> int:
    """The pid of mpirun's rank `rank` (a launcher)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"deadpool_megatron.launch" in cmd and f"OMPI_COMM_WORLD_RANK={rank}".encode() in env:
            return int(pid)
    raise AssertionError(f"no launcher of rank {rank}")


def test_a_lost_node_under_mpirun_is_hot_swapped_onto_the_spare_node_bitwise(
    mpirun, tmp_path, baseline_nodes
):
    """mpirun starts one launcher per node; node 1 (its launcher and both its workers) is
    killed at once: mpirun keeps the other launchers, the spare node's spawned processes take
    ranks 2 and 3 over, and the replicas they restore from came over MPI."""
    log, metrics, out = tmp_path / "events.jsonl", tmp_path / "run.jsonl", tmp_path / "out.log"
    port = 20000 + os.getpid() % 10000
    cmd = [*mpirun, "-n", "3", sys.executable, "-m", "deadpool_megatron.launch", "--nnodes", "2",
           "--spare-nodes", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(port), str(ROOT / "pretrain_gpt.py"), *SHAPE_NODES,
           "--deadpool-transport", "mpi", "--deadpool-event-log", str(log),
           "--metrics-jsonl", str(metrics)]  # fmt: skip
    env = {**os.environ, ENV_JOB_SECRET: new_secret()}
    with open(out, "w") as fh:
        job = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 240
            while not (metrics.exists() and max(read_metrics(str(metrics))[0], default=0) >= 6):
                assert job.poll() is None and time.monotonic() < deadline, out.read_text()[-4000:]
                time.sleep(0.2)
            text = out.read_text()
            workers = {int(r): int(p) for r, p in
                       re.findall(r"started worker rank (\d+) \(pid (\d+)\)", text)}  # fmt: skip
            for pid in (_launcher_of(1), workers[2], workers[3]):
                os.kill(pid, signal.SIGKILL)
            job.wait(timeout=240)
        finally:
            if job.poll() is None:
                job.kill()
    losses, final = read_metrics(str(metrics))
    events = read_events(str(log))
    ended = named(events, "job_ended")
    assert ended and all(e["status"] == 0 for e in ended), out.read_text()[-6000:]
    assert final is not None and final["state_digest"] == baseline_nodes.digest
    assert losses == baseline_nodes.losses
    (done,) = named(events, "recovery_done")  # a lost node's ranks have no process to fence
    assert sorted(done["replaced"]) == ["2", "3"] and done["replayed_iterations"] <= 1
    assert "node 1 (agent pid" in out.read_text()
