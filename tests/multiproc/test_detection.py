"""Failure detection on real jobs: injected kills, hangs and transient errors are noticed,
classified, logged and (for a hang) fenced; a healthy job is never accused, not while it is
slow, not on a machine whose every core is busy. Jobs without a spare cannot replace a lost
rank, so a permanent failure ends them (test_hotswap.py has the recoveries)."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import signal
import threading
import time

import pytest
from etcd_server import count_keys

from deadpool_megatron.control import keys, messages
from deadpool_megatron.control.etcd_store import EtcdKVStore
from deadpool_megatron.control.membership import MembershipStore
from deadpool_megatron.control.messages import JobLaunch
from deadpool_megatron.control.signed import ENV_JOB_SECRET, SignedKVStore, new_secret
from deadpool_megatron.events import read_events
from deadpool_megatron.failure.inject import ChaosSchedule
from deadpool_megatron.megatron.checkpointing import latest_iteration
from jobs import ROOT, run_failure_free, run_job, run_job_and_kill

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(900)]

# PP2 x DP2 on 4 processes: ranks 0, 1 are the first pipeline stage, 2, 3 the last.
DEFAULTS = ["--config", str(ROOT / "configs" / "demo.yaml"), "--tensor-model-parallel-size", "1",
            "--deadpool"]  # fmt: skip
SHAPE = [*DEFAULTS, "--deadpool-heartbeat-interval", "0.5", "--deadpool-heartbeat-timeout", "2.0"]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """The failure-free run the jobs that recover are compared with, bit for bit."""
    return run_failure_free(tmp_path_factory, "base", 4, [*SHAPE, "--train-iters", "40"], "run")


def _inject(tmp_path, spec: str, iters: int = 40, spares: int = 0, extra=()):
    log = tmp_path / "events.jsonl"
    args = [*SHAPE, "--train-iters", str(iters), "--deadpool-inject", spec,
            "--deadpool-event-log", str(log), *extra]  # fmt: skip
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


def test_a_process_frozen_from_outside_is_fenced_and_replaced(tmp_path, baseline):
    # SIGSTOP from outside the job (no injection record): every thread of rank 2 stops.
    log = tmp_path / "events.jsonl"
    args = [*SHAPE, "--train-iters", "40", "--deadpool-event-log", str(log)]
    result, pid, stopped_at = run_job_and_kill(
        tmp_path, 4, args, victim_rank=2, after_iteration=8, signum=signal.SIGSTOP, spares=1
    )
    assert result.returncode == 0, result.failure()
    assert result.losses == baseline.losses and result.digest == baseline.digest
    events = read_events(str(log))
    detected = _only(events, "failure_detected")
    assert (detected["rank"], detected["evidence"]) == (2, "HeartbeatStale")
    assert "stopped" in detected["reason"]
    assert detected["time"] - stopped_at <= 2.0 + 1.0, detected
    fenced = _only(events, "fenced")
    assert (fenced["rank"], fenced["pid"]) == (2, pid)
    assert _only(events, "recovery_done")["replaced"] == {"2": "spare-0"}


def test_raise_is_classified_transient_and_reset_in_place(tmp_path, baseline):
    # In the optimizer phase the training thread raises; in the replicate phase the error is
    # raised in the replication thread, which the training thread never sees: the thread
    # reports it itself. Each is a transient failure, reset in place with no spare.
    result, events = _inject(tmp_path, "raise@1:4:optimizer,raise@2:12:replicate")
    assert result.returncode == 0, result.failure()
    assert result.losses == baseline.losses and result.digest == baseline.digest
    detected = [e for e in events if e["event"] == "failure_detected"]
    assert [(d["rank"], d["kind"], d["evidence"]) for d in detected] == [
        (1, "transient", "InjectedTransient"),
        (2, "transient", "InjectedTransient"),
    ]
    assert all(d["detect_latency_s"] <= 1.0 for d in detected), detected
    assert [e["generation"] for e in events if e["event"] == "recovery_done"] == [1, 2]


def test_an_error_the_replay_meets_again_is_replaced_once_then_ends_the_job(tmp_path):
    # A bug in the training (bug@1:6:optimizer raises every time rank 1 gets there, in the
    # spare too): reset in place, then replaced when the replay fails the same way (a device
    # at fault would), then the job ends when the spare's replay does. Before, the same
    # error was reset three times, escalated, replaced, and fell back to checkpoint-restarts
    # until --max-restarts (seen with Megatron-LM's own --full-validation bug: 12
    # generations in 4 minutes).
    # In the optimizer phase: the forward and backward passes before it give the replica of
    # iteration 5, sent again after each recovery, the time to land on rank 0 (a bug in the
    # forward pass can fire before it has, and then rank 1's state at 5 is nowhere else
    # when the second failure replaces it: "cannot recover", seen once in the suite).
    result, events = _inject(tmp_path, "bug@1:6:optimizer", iters=12, spares=2)
    assert result.returncode == 1, result.failure()
    detected = [(e["rank"], e["kind"]) for e in events if e["event"] == "failure_detected"]
    assert detected == [(1, "transient"), (1, "permanent"), (1, "repeated")], events
    assert "the same error as 2 time(s) before at iteration 6 (phase optimizer)" in result.output
    assert "a deterministic error in the training, not a fault; ending the job" in result.output
    assert "InjectedBug: injected bug at iteration 6, phase optimizer" in result.output
    assert "raise InjectedBug(" in result.output  # the traceback, in the rank's log
    assert result.output.count("spare 0 claimed: takes over rank 1") == 1
    assert "spare 1 claimed" not in result.output
    assert "falling back to the persistent checkpoint" not in result.output


def test_an_error_in_a_recovery_is_reset_then_replaced_then_ends_the_job_in_seconds(tmp_path):
    # Rank 1's transient failure in iteration 5 starts a recovery, in which rank 0 fails with
    # an error of its own (bug@0:5:recovery: every process holding rank 0 meets it there, a
    # spare too). Before, the failed attempt waited for a newer order nobody gave and the job
    # ended after the launcher's 300 s recovery timeout; now the error is reported in the
    # generation it recovered into: reset in place, replaced when the recovery meets it
    # again, and the job ends when the spare, which reports it and exits, does.
    result, events = _inject(tmp_path, "raise@1:5,bug@0:5:recovery", iters=12, spares=1)
    assert result.returncode == 1, result.failure()
    detected = [(e["rank"], e["kind"]) for e in events if e["event"] == "failure_detected"]
    assert detected == [(1, "transient"), (0, "transient"), (0, "permanent"), (0, "repeated")]
    assert "the same error as 2 time(s) before in the recovery from a failure in iteration 5" in (
        result.output
    )
    assert "a deterministic error in the recovery, not a fault; ending the job" in result.output
    assert (
        "ProcessExited: rank 0 exited with status 1 after CollectiveError: rank 0: InjectedBug"
        in (result.output)
    )
    assert result.output.count("spare 0 claimed: takes over rank 0") == 1
    assert "did not finish within" not in result.output
    (ended,) = [e for e in events if e["event"] == "job_ended"]
    assert ended["reason"] == "rank 0 failed the same way again"
    started = [e["time"] for e in events if e["event"] == "recovery_started"]
    assert ended["time"] - started[0] < 60, events  # seconds here; the timeout was 300


def test_heartbeats_and_membership_through_etcd(tmp_path, baseline, etcd_url):
    job = f"etcd-{tmp_path.name[-12:]}"
    log = tmp_path / "events.jsonl"
    args = [*SHAPE, "--train-iters", "40", "--deadpool-inject", "hang@1:5",
            "--deadpool-store", "etcd", "--deadpool-etcd-endpoints", etcd_url,
            "--deadpool-event-log", str(log)]  # fmt: skip
    secret = new_secret()
    members = MembershipStore(SignedKVStore(EtcdKVStore(etcd_url), secret.encode()), job)
    seen = []  # generation 1's membership, read from etcd while the job runs

    def watch() -> None:
        while not seen and runner.is_alive():
            current = members.current()
            if current is not None and current.generation == 1:
                seen.append((current, EtcdKVStore(etcd_url).get(keys.membership(job))))
            time.sleep(0.05)

    runner = threading.Thread(target=lambda: seen.append(run_job(
        tmp_path, 4, args, spares=1, launcher=["--job-id", job], env={ENV_JOB_SECRET: secret},
    )))  # fmt: skip
    runner.start()
    watch()
    runner.join()
    result = seen.pop()
    assert result.returncode == 0, result.failure()
    assert result.losses == baseline.losses and result.digest == baseline.digest
    events = read_events(str(log))
    detected = _only(events, "failure_detected")
    assert (detected["rank"], detected["evidence"]) == (1, "HeartbeatStale")
    assert detected["detect_latency_s"] <= 3.0
    # The hot-swap went through etcd too: generation 1 has the spare holding rank 1; what the
    # job wrote there is signed with its secret.
    assert seen, "generation 1's membership never appeared in etcd"
    membership, raw = seen[0]
    assert not raw.startswith(b"{")
    assert [m.rank for m in membership.ranks] == [0, 1, 2, 3]
    assert [m.coords for m in membership.ranks] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert membership.member(1).process_id == "spare-0"
    assert membership.spares == ()
    # Finished, the job left nothing in etcd, which serves job after job.
    assert count_keys(etcd_url, keys.job_prefix(job)) == 0
    assert count_keys(etcd_url, keys.process_groups_prefix(job)) == 0


@pytest.mark.parametrize("secret", ["another", "the same"])
def test_a_job_id_whose_keys_another_launch_left_in_etcd_is_refused_before_any_process(
    tmp_path, etcd_url, secret
):
    # A launch that ended without finishing leaves its keys in etcd, signed with its secret.
    # Another launch under the same id would ignore them (another secret) yet add to their
    # counters, or (the same secret, exported by the user) read its membership as its own:
    # it is refused, with the two commands that clean up, before any process starts.
    job = f"left-{tmp_path.name[-12:]}"
    mine = new_secret()
    earlier = SignedKVStore(EtcdKVStore(etcd_url),
                            (mine if secret == "the same" else new_secret()).encode())  # fmt: skip
    assert messages.create(earlier, keys.launch(job), JobLaunch("elsewhere", 0, time.time()))
    earlier.set(keys.membership(job), b"an earlier launch's membership")
    args = [*SHAPE, "--train-iters", "4", "--deadpool-store", "etcd",
            "--deadpool-etcd-endpoints", etcd_url]  # fmt: skip
    result = run_job(tmp_path, 4, args, launcher=["--job-id", job], env={ENV_JOB_SECRET: mine})
    assert result.returncode == 2, result.failure()
    assert f"job id '{job}' already has keys in the store at {etcd_url}" in result.output
    assert ("with the same DEADPOOL_JOB_SECRET" in result.output) == (secret == "the same")
    assert f"etcdctl del --prefix deadpool/{job}/" in result.output
    assert "worker" not in result.output and "Traceback" not in result.output  # none started
    assert result.losses == {}


def test_slow_phases_are_suspected_never_fenced_and_join_a_recovery(tmp_path, baseline):
    # Rank 1's training thread holds the GIL for 3 x the heartbeat timeout, twice: in iteration
    # 3 on its own (its heartbeat goes late: a suspicion, nothing more), and in iteration 7
    # right after its optimizer step, when rank 3's replication thread fails transiently: the
    # recovery is ordered while rank 1 is still computing. It is waited for, joins at its
    # next phase boundary, and no spare is used.
    spec = "slow@1:3,slow@1:7:snapshot,raise@3:7:replicate"
    result, events = _inject(tmp_path, spec, spares=1)
    assert result.returncode == 0, result.failure()
    assert result.losses == baseline.losses and result.digest == baseline.digest
    assert result.output.count("slow phase over") == 2
    detected = _only(events, "failure_detected")
    assert (detected["rank"], detected["kind"]) == (3, "transient")
    assert [e for e in events if e["event"] in ("fenced", "spare_claimed")] == []
    suspected = [e for e in events if e["event"] == "suspected"]
    assert suspected and {e["rank"] for e in suspected} == {1}, suspected
    assert "leaving so that a spare" not in result.output
    done = _only(events, "recovery_done")
    assert done["replaced"] == {} and done["replayed_iterations"] <= 1


def test_a_training_thread_stuck_while_its_process_beats_is_said_stalled_then_replaced(
    tmp_path, baseline
):
    # stall@1:6: rank 1's training thread waits for good (a deadlock of its own), its
    # heartbeat thread beats on, and ranks 0, 2 and 3 wait for it in their collectives. Past
    # the hang limit (--deadpool-hang-timeout 5 s) the agent says which ranks stopped and
    # where, fencing nobody; the collectives' timeout (15 s) ends the others' waits, their
    # errors point at rank 1, whose training thread the recovery finds stuck: a spare takes
    # it over, and the run ends bitwise equal to the failure-free one.
    extra = ["--deadpool-hang-timeout", "5", "--distributed-timeout-minutes", "0.25"]
    result, events = _inject(tmp_path, "stall@1:6", spares=1, extra=extra)
    assert result.returncode == 0, result.failure()
    assert result.losses == baseline.losses and result.digest == baseline.digest
    injected = _only(events, "fault_injected")
    stalled = [e for e in events if e["event"] == "stalled"]
    first = {e["rank"]: e for e in reversed(stalled)}
    assert 1 in first and "at iteration 6, phase forward" in first[1]["reason"], stalled
    assert "heartbeat is on time" in first[1]["reason"]
    # counted from when the agent saw the phase begin, just before the fault fired
    assert 4.0 < first[1]["time"] - injected["time"] < 5.0 + 3.0, (first[1], injected)
    assert "rank 1 stalled, not fenced" in result.output
    detected = _only(events, "failure_detected")
    assert detected["rank"] == 1 and detected["time"] - injected["time"] >= 15, detected
    assert "Timed out waiting 15000ms" in detected["reason"], detected
    assert _only(events, "recovery_done")["replaced"] == {"1": "spare-0"}


def _hog() -> None:
    while True:
        pass


def test_healthy_job_with_saves_on_a_machine_with_every_core_busy_is_never_accused(
    tmp_path, baseline
):
    # Default detection settings; two busy processes per core beside the job, and a checkpoint
    # every 3 iterations (saves hold the GIL for long stretches). Spare 0 is killed at
    # iteration 10: it leaves the pool, the job goes on, spare 1 exits with the job.
    hogs = [multiprocessing.get_context("spawn").Process(target=_hog, daemon=True)
            for _ in range(2 * (os.cpu_count() or 2))]  # fmt: skip
    for h in hogs:
        h.start()
    try:
        log = tmp_path / "events.jsonl"
        args = [*DEFAULTS, "--train-iters", "40", "--save", str(tmp_path / "ckpt"),
                "--save-interval", "3", "--deadpool-inject", "kill-spare@0:10",
                "--deadpool-event-log", str(log)]  # fmt: skip
        result = run_job(tmp_path, 4, args, spares=2)
    finally:
        for h in hogs:
            h.kill()
            h.join(10)
    assert result.returncode == 0, result.failure()
    events = read_events(str(log))
    assert [e for e in events if e["event"] in ("failure_detected", "fenced")] == []
    assert result.losses == baseline.losses and result.digest == baseline.digest
    lost = _only(events, "spare_lost")
    assert lost["spare"] == 0 and "SIGKILL" in lost["how"]
    registered = sorted(e["spare"] for e in events if e["event"] == "spare_registered")
    # Spare 2 replenishes the pool after spare 0's loss; forked from the fork server it
    # usually registers before the job ends (started as its own interpreter, it did not).
    assert registered in ([0, 1], [0, 1, 2]), registered
    assert "spare 1: job finished, exiting" in result.output


def test_a_death_during_the_final_save_is_hot_swapped_and_one_after_the_end_needs_none(
    tmp_path, baseline
):
    # Rank 1 dies once its shards of iteration 40 are written, before the commit, in the save
    # at the end of training (40 is off the interval): a spare takes over, the survivors roll
    # back to their snapshot and the save runs again. Then rank 2 is killed once it finished
    # training, saved and stopped replicating: the others exit 0 before or during the
    # recovery its death orders, nothing is left to recover (no second spare is claimed) and
    # the job succeeds with the final checkpoint whole.
    save = tmp_path / "ckpt"
    result, events = _inject(
        tmp_path, "kill@1:40:save,kill@2:40:finish", spares=2,
        extra=["--save", str(save), "--save-interval", "50"],  # the final save only
    )  # fmt: skip
    assert result.returncode == 0, result.failure()
    assert result.losses == baseline.losses and result.digest == baseline.digest
    assert latest_iteration(str(save)) == 40
    assert [e["rank"] for e in events if e["event"] == "failure_detected"] == [1, 2]
    assert _only(events, "spare_claimed")["replaces"] == 1
    assert _only(events, "recovery_done")["generation"] == 1
    unneeded = _only(events, "recovery_unneeded")
    assert (unneeded["generation"], unneeded["failed"], unneeded["finished"]) == (2, [2], [0, 1, 3])
    ended = _only(events, "job_ended")
    assert ended["status"] == 0 and "finished training before rank(s) [2]" in ended["reason"]


def test_a_death_during_the_last_periodic_save_is_hot_swapped_and_the_save_runs_again(
    tmp_path, baseline
):
    # The same death in the last periodic save (40 is on the interval, the only save): after
    # the recovery the loop has no iteration left, and the save runs again because no tracker
    # names iteration 40.
    save = tmp_path / "ckpt"
    result, events = _inject(
        tmp_path, "kill@1:40:save", spares=1,
        extra=["--save", str(save), "--save-interval", "40"],
    )  # fmt: skip
    assert result.returncode == 0, result.failure()
    assert result.losses == baseline.losses and result.digest == baseline.digest
    assert latest_iteration(str(save)) == 40
    assert _only(events, "spare_claimed")["replaces"] == 1
    assert _only(events, "recovery_done")["generation"] == 1
    assert _only(events, "job_ended")["status"] == 0


def test_chaos_times_every_fault_and_records_the_generation_of_every_event(tmp_path, baseline):
    # Seed 991 at a 4 s mean: kill rank 2 at 0.64 s of training, hang rank 1 at 1.85 s, kill
    # rank 1 at 8.18 s, kill rank 3 at 10.06 s. The first two come early enough that even a
    # fast machine (40 iterations here take 8-36 s of training, about half that on CI) sees
    # both; the later ones fire only where training lasts that long. Each goes into a running
    # job (never into a recovery), and each is detected and timed in the generation it
    # happened in. A fault that lands after a rank's training (a loaded machine) needs no
    # recovery: the job ends as finished (test_a_death_during_the_final_save_...), without
    # the final digest when it came before the digest's gather.
    log = tmp_path / "events.jsonl"
    args = [*SHAPE, "--train-iters", "40", "--deadpool-chaos-mtbf", "4",
            "--deadpool-chaos-seed", "991", "--deadpool-event-log", str(log)]  # fmt: skip
    result = run_job(tmp_path, 4, args, spares=4)
    assert result.returncode == 0, result.failure()
    events = read_events(str(log))
    unneeded = [e for e in events if e["event"] == "recovery_unneeded"]
    assert result.losses == baseline.losses
    if unneeded:  # after training: no digest if it hit rank 3 (which logs it) or the gather
        assert result.digest in (None, baseline.digest)
    else:
        assert result.digest == baseline.digest
    assert all(isinstance(e["generation"], int) for e in events), events
    injected = [e for e in events if e["event"] == "fault_injected"]
    detected = [e for e in events if e["event"] == "failure_detected"]
    # the seeded schedule goes on (kill rank 3 at 13.31 s, ...): a slow machine sees more
    schedule = [f"chaos-{e.action}@{e.rank}" for e in itertools.islice(ChaosSchedule(4, 991, 4), 8)]
    assert schedule[:4] == ["chaos-kill@2", "chaos-hang@1", "chaos-kill@1", "chaos-kill@3"]
    assert len(injected) >= 2 and [e["fault"] for e in injected] == schedule[: len(injected)]
    assert len(detected) == len(injected)
    for inj, det in zip(injected, detected, strict=True):
        assert (det["rank"], det["generation"]) == (inj["rank"], inj["generation"])
        assert det["detect_latency_s"] is not None and det["detect_latency_s"] <= 3.0, det
    started = [e["generation"] for e in events if e["event"] == "recovery_started"]
    assert started == list(range(1, len(injected) + 1))
    done = [e["generation"] for e in events if e["event"] == "recovery_done"]
    assert done + [e["generation"] for e in unneeded] == started  # only the last can be unneeded
