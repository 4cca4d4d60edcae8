"""The in-memory checkpoint on real jobs: snapshots, ring replicas, restore, atomic commit.

Every run is compared bitwise (per-iteration loss hex values and the final state digest)
with an unprotected run of the same configuration.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from deadpool_megatron.metrics import read_metrics
from jobs import JOB_TIMEOUT_S, ROOT, JobResult, run_job

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(900)]

DEMO = ["--config", str(ROOT / "configs" / "demo.yaml")]
SHAPE_3D = [*DEMO, "--train-iters", "10"]  # TP2 x PP2 x DP2, 8 processes
SHAPE_DP4 = [*DEMO, "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
             "--train-iters", "8"]  # fmt: skip


def run_driver(tmp_path, nproc: int, checks: list[str], job: list[str], name: str):
    result_path = tmp_path / f"{name}.json"
    metrics = tmp_path / f"{name}.jsonl"
    cmd = [
        sys.executable, "-m", "deadpool_megatron.launch", "--no-preflight",
        "--nproc-per-node", str(nproc), str(ROOT / "tests" / "drivers" / "protect_driver.py"),
        "--result", str(result_path), *checks, *job, "--deadpool", "--metrics-jsonl", str(metrics),
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    output = done.stdout + done.stderr
    (tmp_path / f"{name}.log").write_text(output)
    assert done.returncode == 0, output[-4000:]
    losses, final = read_metrics(str(metrics))
    return json.loads(result_path.read_text()), JobResult(done.returncode, output, losses, final)


@pytest.fixture(scope="module")
def baseline_3d(tmp_path_factory):
    return run_job(tmp_path_factory.mktemp("base3d"), 8, SHAPE_3D)


@pytest.fixture(scope="module")
def baseline_dp4(tmp_path_factory):
    return run_job(
        tmp_path_factory.mktemp("basedp4"), 4, [*SHAPE_DP4, "--use-distributed-optimizer"]
    )


def test_deadpool_on_and_off_give_identical_training(tmp_path, baseline_3d):
    on = run_job(tmp_path, 8, [*SHAPE_3D, "--deadpool"])
    assert baseline_3d.returncode == 0 and on.returncode == 0, on.failure()
    assert on.losses == baseline_3d.losses
    assert on.digest == baseline_3d.digest
    summaries = [line for line in on.output.splitlines() if "protection:" in line]
    assert len(summaries) == 8
    # 11: the state training starts from (iteration 0), then each of the 10 iterations'.
    assert all("11 snapshots" in line and "0 rejected" in line and "errors 0" in line
               for line in summaries)  # fmt: skip


def test_replicas_match_and_restores_are_bitwise_in_3d(tmp_path, baseline_3d):
    # Rank 2 (tp0 pp0 dp1) is rebuilt from its ring replica + a DP peer's parameters after
    # iteration 3; rank 5 (tp1 pp1 dp0) from its own host snapshot after iteration 6.
    result, run = run_driver(
        tmp_path, 8, ["--check-replicas", "--wipe-replica", "3:2", "--wipe-local", "6:5"],
        SHAPE_3D, "3d",
    )  # fmt: skip
    assert len(result["checked"]) == 8 * 10  # every rank's replica, every iteration
    assert result["mismatches"] == []
    assert sorted((kind, it, rank) for kind, it, rank, _ in result["restored"]) == [
        ("local", 6, 5), ("replica", 3, 2),
    ]  # fmt: skip
    assert run.losses == baseline_3d.losses
    assert run.digest == baseline_3d.digest
    assert result["lag_max"] <= 1
    # The training thread's own protection time is measured once per snapshot (10 here).
    assert len(result["stall_s"]) == 10 and all(0 <= s < 60 for s in result["stall_s"])


def test_two_replicas_corruption_rejected_and_restore_in_dp4(tmp_path, baseline_dp4):
    # K=2: both DP-ring successors hold each shard. Rank 1's copy of rank 0's shard for
    # iteration 4 has bytes flipped: it must be rejected and iteration 3's replica kept.
    result, run = run_driver(
        tmp_path, 4,
        ["--check-replicas", "--corrupt", "4:1:0", "--wipe-replica", "6:3"],
        [*SHAPE_DP4, "--deadpool-replicas", "2"], "dp4",
    )  # fmt: skip
    assert len(result["checked"]) == 4 * 2 * 8 - 1  # the corrupted one is checked below
    assert result["mismatches"] == []
    (corrupt,) = result["corrupt"]
    assert corrupt["rejected"] == 1
    assert corrupt["kept_iteration"] == 3
    assert corrupt["kept_verifies"] and corrupt["kept_equals_live_of_previous"]
    assert "failed its checksum" in corrupt["errors"][0]
    assert [r[:3] for r in result["restored"]] == [["replica", 6, 3]]
    assert run.losses == baseline_dp4.losses
    assert run.digest == baseline_dp4.digest


def test_overhead_benchmark_compares_the_transports_in_one_run(tmp_path):
    """scripts/bench_overhead.py's short form: the windows of gloo, of tcp streamed and of tcp
    read from the sender's memory alternate in one job, each transport gets its own figures,
    and each keeps every replica current."""
    out = tmp_path / "overhead.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_overhead.py"), "--window", "2",
         "--windows", "6", "--warmup", "1", "--hidden-size", "64", "--num-layers", "2",
         "--global-batch-size", "8", "--transports", "gloo,tcp-stream,tcp", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=JOB_TIMEOUT_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    last = json.loads(done.stdout.strip().splitlines()[-1])
    transports = ("gloo", "tcp-stream", "tcp")
    assert last["transport"] in transports
    assert last["ratio"] == min(last[f"ratio_{t}"] for t in transports)
    assert last["ratio_by_neighbours"] > 0
    summary = json.loads(out.read_text())
    assert [w["on"] for w in summary["windows"]] == [None, "gloo", None, "tcp-stream", None, "tcp"]
    assert "are read from their memory (one copy)" in done.stdout + done.stderr
    for figures in summary["by_transport"].values():
        assert figures["replica_lag_max"] <= 1 and figures["rejected"] == 0
        assert figures["replicate_ms"] > 0  # replicas went out over each
    assert out.with_suffix(".png").exists()
