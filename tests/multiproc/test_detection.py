"""Failure detection on real jobs: injected kills, hangs and transient errors are noticed,
classified, logged and (for a hang) fenced; a healthy job is never accused. Jobs without a
spare cannot replace a lost rank, so a permanent failure ends them (test_hotswap.py has the
recoveries)."""

from __future__ import annotations

import pytest

from deadpool_megatron.control.etcd_store import EtcdKVStore
from deadpool_megatron.control.membership import MembershipStore
from deadpool_megatron.events import read_events
from jobs import ROOT, run_job

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(900)]

# PP2 x DP2 on 4 processes: ranks 0, 1 are the first pipeline stage, 2, 3 the last.
SHAPE = ["--config", str(ROOT / "configs" / "demo.yaml"), "--tensor-model-parallel-size", "1",
         "--deadpool", "--deadpool-heartbeat-interval", "0.5",
         "--deadpool-heartbeat-timeout", "2.0"]  # fmt: skip


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """The failure-free run the jobs that recover are compared with, bit for bit."""
    result = run_job(tmp_path_factory.mktemp("base"), 4, [*SHAPE, "--train-iters", "40"])
    assert result.returncode == 0, result.output[-3000:]
    return result


def _inject(tmp_path, spec: str, iters: int = 40, spares: int = 0):
    log = tmp_path / "events.jsonl"
    args = [*SHAPE, "--train-iters", str(iters), "--deadpool-inject", spec,
            "--deadpool-event-log", str(log)]  # fmt: skip
    result = run_job(tmp_path, 4, args, spares=spares)
    events = read_events(str(log)) if log.exists() else []
    return result, events


def _only(events, name):
    found = [e for e in events if e["event"] == name]
    assert len(found) == 1, events
    return found[0]


@pytest.mark.parametrize("rank", [0, 3], ids=["rank0-first-stage", "rank3-last-stage"])
def test_kill_is_detected_as_permanent_within_a_second(tmp_path, rank):
    result, events = _inject(tmp_path, f"kill@{rank}:5")
    assert result.returncode == 1
    detected = _only(events, "failure_detected")
    assert detected["rank"] == rank and detected["kind"] == "permanent"
    assert detected["evidence"] == "ProcessExited"
    assert 0 < detected["detect_latency_s"] <= 1.0, detected
    assert f"rank {rank} was killed by signal SIGKILL" in result.output
    assert "no spare left to replace failed rank" in result.output


def test_hang_is_detected_within_timeout_plus_one_second_and_fenced(tmp_path):
    result, events = _inject(tmp_path, "hang@2:6:backward")
    assert result.returncode == 1
    detected = _only(events, "failure_detected")
    assert detected["rank"] == 2 and detected["kind"] == "permanent"
    assert detected["evidence"] == "HeartbeatStale"
    assert detected["detect_latency_s"] <= 2.0 + 1.0, detected
    fenced = _only(events, "fenced")
    assert fenced["rank"] == 2 and fenced["time"] <= detected["time"] + 0.1
    injected = _only(events, "fault_injected")
    assert injected["fault"] == "hang@2:6:backward"


@pytest.mark.parametrize("phase", ["optimizer", "replicate"])
def test_raise_is_classified_transient(tmp_path, baseline, phase):
    # In the replicate phase the error is raised in the replication thread, which the
    # training thread never sees: the thread reports it itself.
    result, events = _inject(tmp_path, f"raise@1:4:{phase}")
    assert result.returncode == 0, result.output[-3000:]  # reset in place, no spare needed
    assert result.losses == baseline.losses and result.digest == baseline.digest
    detected = _only(events, "failure_detected")
    assert detected["rank"] == 1 and detected["kind"] == "transient"
    assert detected["evidence"] == "InjectedTransient"
    assert detected["detect_latency_s"] <= 1.0


def test_healthy_job_is_never_accused_and_a_dead_spare_leaves_the_pool(tmp_path):
    # 100 iterations with heartbeats on and no worker fault; spare 0 is killed at iteration 10.
    result, events = _inject(tmp_path, "kill-spare@0:10", iters=100, spares=2)
    assert result.returncode == 0, result.output[-3000:]
    assert sorted(result.losses) == list(range(1, 101))
    assert [e for e in events if e["event"] in ("failure_detected", "fenced")] == []
    lost = _only(events, "spare_lost")
    assert lost["spare"] == 0 and "SIGKILL" in lost["how"]
    registered = sorted(e["spare"] for e in events if e["event"] == "spare_registered")
    assert registered == [0, 1]
    assert "spare 1: job finished, exiting" in result.output


def test_heartbeats_and_membership_through_etcd(tmp_path, baseline, etcd_url):
    job = f"etcd-{tmp_path.name[-12:]}"
    log = tmp_path / "events.jsonl"
    args = [*SHAPE, "--train-iters", "40", "--deadpool-inject", "hang@1:5",
            "--deadpool-store", "etcd", "--deadpool-etcd-endpoints", etcd_url,
            "--deadpool-event-log", str(log)]  # fmt: skip
    result = run_job(tmp_path, 4, args, spares=1, launcher=["--job-id", job])
    assert result.returncode == 0, result.output[-3000:]
    assert result.losses == baseline.losses and result.digest == baseline.digest
    events = read_events(str(log))
    detected = _only(events, "failure_detected")
    assert (detected["rank"], detected["evidence"]) == (1, "HeartbeatStale")
    assert detected["detect_latency_s"] <= 3.0
    # The hot-swap went through etcd too: generation 1 has the spare holding rank 1.
    membership = MembershipStore(EtcdKVStore(etcd_url), job).current()
    assert membership.generation == 1
    assert [m.rank for m in membership.ranks] == [0, 1, 2, 3]
    assert [m.coords for m in membership.ranks] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert membership.member(1).process_id == "spare-0"
    assert membership.spares == ()
