"""Multi-node jobs: one agent per node, spare nodes, whole nodes lost and hot-swapped.

The shape is DP6 on 3 worker nodes of 2 processes (ranks 2n, 2n+1 on node n) and one spare
node of 2 spares: two DP peers share every node, so in naive DP order a rank's ring successor
(its replica holder) would often sit on its own node; the node-aware ring puts it on the next
node. Every job ends bitwise identical to the failure-free run of the same shape.
"""

from __future__ import annotations

import re
import time

import psutil
import pytest
from etcd_server import count_keys, start_etcd_cluster
from nodes import result, start_nodes
from slurm_cluster import start_cluster
from slurm_jobs import join_logs, lose_node, node_logs, submit, submit_join, wait_for_iteration

from deadpool_megatron.control import keys
from deadpool_megatron.events import read_events
from deadpool_megatron.metrics import read_metrics
from jobs import ROOT, run_failure_free

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(900)]

NPROC = 2
SHAPE = ["--config", str(ROOT / "configs" / "demo.yaml"), "--tensor-model-parallel-size", "1",
         "--pipeline-model-parallel-size", "1", "--global-batch-size", "12",
         "--train-iters", "14", "--deadpool"]  # fmt: skip
NODE_OF_RANK = {r: r // NPROC for r in range(6)}
# Long enough that an etcd election (a few seconds) and the leases' catching up after it
# end well before training does: the demo's iterations take 0.1-0.15 s at DP6 here.
LONG = [("120" if a == "14" else a) for a in SHAPE]  # --train-iters 120
# Long enough that a node joining once the job trains (its agent's preflight, its spares'
# start: 5-6 s here) is ready well before training ends.
JOINING = [("240" if a == "14" else a) for a in SHAPE]  # --train-iters 240
NODE_TIMEOUT_S = 2.0  # --deadpool-node-timeout's default


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    return run_failure_free(tmp_path_factory, "base_dp6", 6, SHAPE)


@pytest.fixture(scope="module")
def baseline_long(tmp_path_factory):
    return run_failure_free(tmp_path_factory, "base_dp6_long", 6, LONG)


@pytest.fixture(scope="module")
def baseline_joining(tmp_path_factory):
    return run_failure_free(tmp_path_factory, "base_dp6_joining", 6, JOINING)


def _named(events, name):
    return [e for e in events if e["event"] == name]


def _assert_node_swapped(events, node: int, spares: dict[int, str]):
    lost = {e["node"] for e in _named(events, "node_lost")}
    assert lost == {node}, events
    (done,) = _named(events, "recovery_done")
    assert done["replaced"] == {str(r): s for r, s in spares.items()}
    assert done["replayed_iterations"] <= 1
    return done


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    cluster = start_cluster(tmp_path_factory.mktemp("slurm"), 4)
    yield cluster
    cluster.stop()


def test_sbatch_whole_node_lost_is_hot_swapped_onto_the_spare_node(tmp_path, slurm, baseline):
    run_dir = tmp_path / "run"
    metrics = tmp_path / "metrics.jsonl"
    log = tmp_path / "events.jsonl"
    # Without the session's zygote (multiproc/conftest.py): the node's fork server must be
    # in its agent's process tree, which the node's loss below kills.
    job = submit(slurm, tmp_path, run_dir, 4, 1, [*SHAPE, "--metrics-jsonl", str(metrics),
                  "--deadpool-event-log", str(log)], zygote=False, nproc=NPROC)  # fmt: skip
    wait_for_iteration(tmp_path, metrics, 5)
    victims = lose_node(job, 1)
    state = slurm.wait_job(job, 300)
    out = (tmp_path / "batch.out").read_text()
    logs = node_logs(run_dir)
    assert state == "COMPLETED", out + logs[-6000:]
    assert "node(s) 1 lost during the job; it finished on the others" in out
    losses, final = read_metrics(str(metrics))
    assert losses == baseline.losses  # every iteration, the re-executed one included
    assert final["state_digest"] == baseline.digest
    events = read_events(str(log))
    done = _assert_node_swapped(events, 1, {2: "spare-6", 3: "spare-7"})
    # The node-aware ring: ranks 2 and 3's optimizer shards came from node 2 (ranks 4, 5),
    # where naive DP order would have put rank 2's only replica on rank 3, lost with it.
    assert re.search(r"replica 4->2, parameters \d->3, replica 5->3", logs), logs[-4000:]
    assert done["total_s"] > 0
    assert all(not p.is_running() or p.status() == psutil.STATUS_ZOMBIE for p in victims)
    assert "forked from the zygote" not in logs  # node 1's fork server was among the victims


def test_sbatch_a_node_that_joins_the_running_job_takes_over_a_lost_node(
    tmp_path, slurm, baseline_joining
):
    # The Slurm form of the local join test below: a job of 3 worker nodes and no spare node,
    # then scripts/slurm/join.sbatch JOBID, a job of its own on the cluster's fourth node, whose
    # agent joins as node 3; node 1 is lost and node 3's spares take ranks 2 and 3 over.
    run_dir = tmp_path / "run"
    metrics = tmp_path / "metrics.jsonl"
    log = tmp_path / "events.jsonl"
    job = submit(slurm, tmp_path, run_dir, 3, 0, [*JOINING, "--metrics-jsonl", str(metrics),
                 "--deadpool-event-log", str(log)], zygote=False, nproc=NPROC)  # fmt: skip
    wait_for_iteration(tmp_path, metrics, 2)
    assert (run_dir / "join.env").stat().st_mode & 0o077 == 0  # it holds the job's secret
    joining = submit_join(slurm, tmp_path, run_dir, job)
    deadline = time.monotonic() + 120
    while not _sbatch_joined(run_dir, joining):
        assert time.monotonic() < deadline, node_logs(run_dir)[-6000:]
        time.sleep(0.1)
    victims = lose_node(job, 1)
    state = slurm.wait_job(job, 300)
    joined_state = slurm.wait_job(joining, 120)
    out = (tmp_path / "batch.out").read_text() + (tmp_path / "join.out").read_text()
    logs = node_logs(run_dir) + join_logs(run_dir)
    assert (state, joined_state) == ("COMPLETED", "COMPLETED"), out + logs[-6000:]
    assert f"its node(s) served job {job} until it ended" in out
    losses, final = read_metrics(str(metrics))
    assert losses == baseline_joining.losses and final["state_digest"] == baseline_joining.digest
    events = read_events(str(log))
    _assert_node_swapped(events, 1, {2: "spare-3000", 3: "spare-3001"})
    assert all(not p.is_running() or p.status() == psutil.STATUS_ZOMBIE for p in victims)


def _sbatch_joined(run_dir, joining: str) -> bool:
    """The joined node's spares registered, and every launched node's agent watches it."""
    joined = join_logs(run_dir)
    if not all(f"spare {s} registered" in joined for s in (3000, 3001)):
        return False
    return node_logs(run_dir).count("node 3 joined the job as a spare node") == 3


def test_sbatch_requeued_at_its_exit_interval_trains_on_with_its_store_in_etcd(
    tmp_path, slurm, baseline
):
    # Megatron-LM's requeue pattern under Slurm with etcd, which outlives launches: the job
    # stops at --exit-interval 7 and is requeued under the same SLURM_JOB_ID; the second launch
    # gets a job id of its own, loads iteration 7 and trains to 14. Together: the
    # uninterrupted run, bitwise. Each launch's last agent deletes its keys from etcd.
    etcd = start_etcd_cluster(tmp_path, 1)
    run_dir = tmp_path / "run"
    metrics = tmp_path / "metrics.jsonl"
    ckpt = str(tmp_path / "ckpt")
    try:
        job = submit(
            slurm, tmp_path, run_dir, 3, 0,
            [*SHAPE, "--save", ckpt, "--load", ckpt, "--exit-interval", "7",
             "--deadpool-store", "etcd", "--deadpool-etcd-endpoints", etcd.endpoints,
             "--metrics-jsonl", str(metrics)],
            zygote=True, nproc=NPROC, sbatch_args=("--requeue",),
        )  # fmt: skip
        first = slurm.wait_job(job, 300)
        out = (tmp_path / "batch.out").read_text()
        assert first == "COMPLETED", out + node_logs(run_dir)[-6000:]
        assert sorted(read_metrics(str(metrics))[0]) == list(range(1, 8))
        # Slurm delays a requeued job by 2 minutes; 5 s is enough here. Not at once: a job
        # started again in the second its credential was revoked (at its end) is killed.
        for cmd in (("requeue", job), ("update", f"JobId={job}", "StartTime=now+5")):
            done = slurm.run("scontrol", *cmd)
            assert done.returncode == 0, done.stderr
        # The job reads COMPLETED for a moment after `scontrol requeue`: wait for the requeued
        # launch's first line before waiting for the job to end again.
        deadline = time.monotonic() + 300
        while f"(slurm-{job}-requeue1):" not in (tmp_path / "batch.out").read_text():
            assert time.monotonic() < deadline, slurm.run("scontrol", "show", "job", job).stdout
            time.sleep(0.2)
        second = slurm.wait_job(job, 300)
        out = (tmp_path / "batch.out").read_text()
        assert second == "COMPLETED", out + node_logs(run_dir)[-6000:]
        left = {p: etcd.count(p) for launch in (f"slurm-{job}", f"slurm-{job}-requeue1")
                for p in (keys.job_prefix(launch), keys.process_groups_prefix(launch))}  # fmt: skip
    finally:
        etcd.stop()
    assert f"(slurm-{job}) finished" in out and f"(slurm-{job}-requeue1) finished" in out, out
    assert "loaded checkpoint of iteration 7" in (run_dir / "node-0.requeue1.log").read_text()
    # the session's zygote served every agent: PYTHON, which the Slurm script reads, is no
    # reason to refuse (it refused them all before, and each agent imported anew)
    assert node_logs(run_dir).count("forked from the zygote") == 6, node_logs(run_dir)[-4000:]
    losses, final = read_metrics(str(metrics))
    assert losses == baseline.losses
    assert final["state_digest"] == baseline.digest
    assert set(left.values()) == {0}, left


def test_sbatch_signalled_with_the_exit_signal_handler_saves_where_every_rank_stopped(
    tmp_path, slurm, baseline_long
):
    # What Slurm does before a time limit (sbatch --signal=TERM@N) or on scancel --signal:
    # SIGTERM to every process of the step, agents, fork servers, workers and the spare node's
    # spares alike. With --exit-signal-handler the workers stop after one same iteration and
    # save it, the spares leave with status 0, the fork servers (whose death would kill the
    # workers) ignore it, the shells around the agents wait for them: the job ends COMPLETED.
    run_dir = tmp_path / "run"
    metrics = tmp_path / "metrics.jsonl"
    ckpt = tmp_path / "ckpt"
    # Without the session's zygote: each agent's fork server is in the step, and signalled.
    job = submit(slurm, tmp_path, run_dir, 4, 1, [*LONG, "--save", str(ckpt),
                  "--exit-signal-handler", "--metrics-jsonl", str(metrics)], zygote=False, nproc=NPROC)  # fmt: skip
    wait_for_iteration(tmp_path, metrics, 5)
    signalled = slurm.run("scancel", "--signal=TERM", job)
    assert signalled.returncode == 0, signalled.stderr
    state = slurm.wait_job(job, 300)
    out = (tmp_path / "batch.out").read_text()
    logs = node_logs(run_dir)
    assert state == "COMPLETED", out + logs[-6000:]
    assert f"(slurm-{job}) finished (srun status 0)" in out, out
    stopped = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert 5 <= stopped < 120, logs[-4000:]
    losses, final = read_metrics(str(metrics))
    assert losses == {i: baseline_long.losses[i] for i in range(1, stopped + 1)}
    assert final["iteration"] == stopped
    assert f"every rank stops after iteration {stopped}, saving it" in logs
    assert logs.count("stopped by SIGTERM, exiting") == 2, logs[-4000:]  # the spare node's
    assert "classified" not in logs and "Traceback" not in logs, logs[-4000:]
    assert "forked from the zygote" not in logs  # each fork server in its agent's step


def test_a_worker_takes_its_nodes_spare_and_an_agent_killed_alone_takes_its_node(
    tmp_path, baseline
):
    # One job, two failures. Rank 2 (node 1) is killed in iteration 6: node 1's own spare
    # (index 1 x 2 slots + 0 = spare-2) takes it and the spare node stays whole. Then node 2's
    # agent alone is killed: its processes die with it and node 2 is swapped onto the spare node.
    # Every spare builds while idle for the ranks it would be seated on (--deadpool-spare-prebuild
    # 3): spare-2 for node 1's ranks 2 and 3, the spare node's spares for local rank 0, resp. 1,
    # of every node. Both takeovers are seated on their builds; with --deadpool-keep-model,
    # nobody builds or replays a model.
    log = tmp_path / "events.jsonl"
    args = [*SHAPE, "--deadpool-event-log", str(log), "--deadpool-inject", "kill@2:6",
            "--deadpool-spare-prebuild", "3", "--deadpool-keep-model"]  # fmt: skip
    nodes = start_nodes(tmp_path, 3, 1, NPROC, args, spares=1)
    try:
        nodes.wait_for_iteration(9, 300)
        _wait_for_builds(nodes, 3, {6: 4, 7: 5})
        children = nodes.kill_agent(2)
        killed_at = time.time()
        gone_after = None
        while time.time() - killed_at < 10:
            if not any(_running(p) for p in children):
                gone_after = time.time() - killed_at
                break
            time.sleep(0.01)
        rcs = nodes.wait(400)
    finally:
        nodes.stop()
    assert gone_after is not None and gone_after < 2.0, gone_after  # the heartbeat timeout
    assert rcs[:2] + rcs[3:] == [0, 0, 0], result(nodes).failure()
    job = result(nodes)
    assert job.losses == baseline.losses and job.digest == baseline.digest
    events = read_events(str(log))
    first, second = _named(events, "recovery_done")
    assert first["replaced"] == {"2": "spare-2"}
    assert second["replaced"] == {"4": "spare-6", "5": "spare-7"}
    assert [e["node"] for e in _named(events, "node_lost")] == [2]
    assert "spare 0: job finished, exiting" in nodes.output(0)  # node 0's spare, never needed
    out = nodes.all_output()
    assert "spare-2 replaces rank 2 (prebuilt)" in out
    assert "spare-6 replaces rank 4 (prebuilt), spare-7 replaces rank 5 (prebuilt)" in out
    kept = re.findall(r"\[spare (\d)\] .*kept the model built while idle: \d+ process group "
                      r"references swapped, 0 build collectives", out)  # fmt: skip
    assert sorted(kept) == ["2", "6", "7"], out[-6000:]
    replays = re.findall(r"kept the model.*, (\d+) build collectives", out)
    assert replays == ["0"] * 12, replays  # 5 survivors and a spare, then 4 and two spares


@pytest.mark.parametrize("phase", ["setup", "groups"])
def test_a_rank_killed_in_its_set_up_on_another_node_is_set_up_again_with_a_spare_node(
    tmp_path, baseline, phase
):
    # Rank 4 (node 2) dies during its set-up, before anything is trained and while the other
    # nodes' ranks are still in theirs: every rank of the three nodes sets up again in
    # generation 1, a spare of the spare node in rank 4's place. At phase groups it dies as
    # soon as it registered: node 2's agent holds the failure until every rank of every node
    # has registered, records generation 0 itself if node 0 has not yet, and coordinates;
    # the peers stop waiting for rank 4 in their groups' rendezvous at the order.
    log = tmp_path / "events.jsonl"
    args = [*SHAPE, "--deadpool-event-log", str(log), "--deadpool-inject", f"kill@4:0:{phase}"]
    nodes = start_nodes(tmp_path, 3, 1, NPROC, args)
    try:
        rcs = nodes.wait(400)
    finally:
        nodes.stop()
    assert rcs == [0, 0, 0, 0], result(nodes).failure()
    job = result(nodes)
    assert job.losses == baseline.losses and job.digest == baseline.digest
    (done,) = _named(read_events(str(log)), "recovery_done")
    assert done["from_start"] and done["iteration"] == 0
    assert done["replaced"] == {"4": "spare-6"}
    assert "every rank sets up again from the start" in nodes.all_output()


@pytest.mark.parametrize("phase", ["finish", "digest"])
def test_a_rank_that_dies_after_the_last_iteration_on_another_node_ends_the_job_as_finished(
    tmp_path, baseline, phase
):
    # A rank of node 2 is killed once it finished training: rank 5 at phase finish, once every
    # rank is past the job's last collective; rank 4 at phase digest, before the final state
    # digest's gather, which the other ranks then wait in until the recovery's order cuts it
    # (rank 5, which logs the final record, says no digest was gathered). Nodes 0 and 1 have
    # finished, or finish while node 2's agent orders a recovery: each says its ranks finished
    # (from its wait for the others, or following the recovery), no spare is claimed, all end
    # with 0.
    victim = 5 if phase == "finish" else 4
    log = tmp_path / "events.jsonl"
    args = [*SHAPE, "--deadpool-event-log", str(log),
            "--deadpool-inject", f"kill@{victim}:14:{phase}"]  # fmt: skip
    nodes = start_nodes(tmp_path, 3, 0, NPROC, args, spares=1)
    try:
        rcs = nodes.wait(400)
    finally:
        nodes.stop()
    assert rcs == [0, 0, 0], result(nodes).failure()
    job = result(nodes)
    assert job.losses == baseline.losses
    if phase == "finish":
        assert job.digest == baseline.digest
    else:  # rank 4 never sent its part: nobody has the digest, and the last rank says so
        assert job.final is not None and job.final["iteration"] == 14 and job.digest is None
        assert "a rank was lost before the final state digest was gathered" in nodes.output(2)
    events = read_events(str(log))
    (unneeded,) = _named(events, "recovery_unneeded")
    others = [r for r in range(6) if r != victim]
    assert unneeded["failed"] == [victim] and unneeded["finished"] == others, job.failure()
    assert not _named(events, "spare_claimed") and not _named(events, "recovery_done")
    ended = _named(events, "job_ended")
    assert len(ended) == 3 and all(e["status"] == 0 for e in ended), ended
    out = nodes.output(0) + nodes.output(1)
    assert "told its coordinator so" in out or "following the recovery into generation 1" in out


def test_nodes_launched_with_different_flags_are_refused_before_any_process_starts(tmp_path):
    # Node 1 is told to train to 20: its ranks would have waited past the others' end in
    # collectives nobody joins. Every agent names the difference (and not the metrics file,
    # which a node may choose) and exits 2 before starting a process.
    args = [*SHAPE, "--deadpool-event-log", str(tmp_path / "events.jsonl")]
    nodes = start_nodes(tmp_path, 3, 0, NPROC, args, spares=1,
                        node_args={1: ["--train-iters", "20", "--metrics-jsonl", "x.jsonl"]})  # fmt: skip
    try:
        rcs = nodes.wait(120)
    finally:
        nodes.stop()
    out = nodes.all_output()
    assert rcs == [2, 2, 2], out[-3000:]
    for node in range(3):
        said = nodes.output(node)
        assert "the job's 3 nodes were launched with different settings" in said, said[-2000:]
        assert "--train-iters: nodes 0, 2: 14; node 1: 20" in said, said[-2000:]
        assert "metrics" not in said.split("different settings")[1], said[-2000:]
    assert "started worker" not in out and "started spare" not in out, out[-3000:]


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (it may vanish between two looks)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_for_builds(nodes, node: int, built: dict[int, int], timeout_s: float = 60) -> None:
    """Until each spare of `node` in `built` (index -> rank) logged its build for that rank."""
    deadline = time.monotonic() + timeout_s
    while not all(re.search(rf"\[spare {s}\] .*built rank {r}'s model", nodes.output(node))
                  for s, r in built.items()):  # fmt: skip
        assert time.monotonic() < deadline, nodes.output(node)[-4000:]
        time.sleep(0.05)


def test_on_etcd_no_node_and_no_etcd_member_is_a_single_point_of_failure(tmp_path, baseline_long):
    # Control records and every generation's rendezvous in a 3-member etcd cluster: its
    # leader killed mid-job (an election follows) changes nothing; node 0 (the first agent's)
    # lost is hot-swapped.
    etcd = start_etcd_cluster(tmp_path, 3)
    log = tmp_path / "events.jsonl"
    args = [*LONG, "--deadpool-store", "etcd", "--deadpool-etcd-endpoints", etcd.endpoints,
            "--deadpool-event-log", str(log)]  # fmt: skip
    nodes = start_nodes(tmp_path, 3, 1, NPROC, args, launcher=("--job-id", tmp_path.name))
    try:
        nodes.wait_for_iteration(3, 300)
        etcd.kill(etcd.leader())
        etcd.wait_for_leader()
        # Node 0 dies once the election is over, every lease has caught up and the job has
        # trained on: two events, not one. A node whose store requests hung through the
        # election renews late by up to the node timeout; a loss inside that window counted
        # it lost too (seen once: node 1 with node 0, and no spare left for it).
        caught_up = time.monotonic() + 2 * NODE_TIMEOUT_S
        while time.monotonic() < caught_up:
            time.sleep(0.1)
        target = nodes.iteration() + 3
        assert target < 100, f"the election outlasted training (iteration {target - 3})"
        nodes.wait_for_iteration(target, 120)
        nodes.kill_node(0)
        rcs = nodes.wait(400)
        job_id = tmp_path.name
        left = [
            etcd.count(p) for p in (keys.job_prefix(job_id), keys.process_groups_prefix(job_id))
        ]
    finally:
        nodes.stop()
        etcd.stop()
    assert rcs[1:] == [0, 0, 0], result(nodes).failure()
    assert left == [0, 0]  # the last agent to leave (node 0's is lost) deleted the job's keys
    job = result(nodes, 1)
    assert job.losses == baseline_long.losses and job.digest == baseline_long.digest
    events = read_events(str(log))
    assert len(_named(events, "recovery_started")) == 1  # the etcd member's loss cost nothing
    _assert_node_swapped(events, 0, {0: "spare-6", 1: "spare-7"})
    assert "no node's loss takes it with it" in nodes.output(0)


@pytest.mark.parametrize("store", ["tcp", "etcd"])
def test_a_node_that_joins_the_running_job_takes_over_a_lost_node(
    tmp_path, baseline_joining, store, request
):
    # Three worker nodes and no spare node: a lost node would end the job. Once it trains, a
    # fresh node joins (deadpool-launch --join, the same flags) and becomes node 3, a spare
    # node; one launched with another --train-iters is refused (status 2). Then a node is
    # lost, and node 3's spares (3000, 3001) take its ranks over: node 1 with node 0's
    # TCPStore, node 0 itself with etcd, whose keys the last agent to leave deletes (the
    # joined node's agent counted among those that leave).
    log = tmp_path / "events.jsonl"
    args = [*JOINING, "--deadpool-event-log", str(log)]
    launcher: tuple[str, ...] = ()
    if store == "etcd":
        url = request.getfixturevalue("etcd_url")
        args += ["--deadpool-store", "etcd", "--deadpool-etcd-endpoints", url]
        launcher = ("--job-id", f"join-{tmp_path.name}")
    lost = 0 if store == "etcd" else 1
    nodes = start_nodes(tmp_path, 3, 0, NPROC, args, launcher=launcher)
    try:
        nodes.wait_for_iteration(2, 300)
        joined_at = nodes.iteration()
        joined = nodes.join()
        refused = nodes.join(["--train-iters", "99"])
        assert nodes.procs[refused].wait(120) == 2, nodes.output(refused)
        deadline = time.monotonic() + 120
        while not _joined_and_ready(nodes, joined):
            assert time.monotonic() < deadline, nodes.all_output()[-6000:]
            assert all(nodes.procs[n].poll() is None for n in (0, 1, 2, joined)), (
                nodes.all_output()[-6000:]
            )
            time.sleep(0.1)
        ready_at = nodes.iteration()
        assert ready_at < 220, f"the job trained on to {ready_at} before the joined node was ready"
        nodes.kill_node(lost)
        rcs = nodes.wait(400)
    finally:
        nodes.stop()
    survivors = [n for n in (0, 1, 2, joined) if n != lost]
    assert [rcs[n] for n in survivors] == [0, 0, 0], result(nodes, survivors[0]).failure()
    # node 3 or 4: whichever index was next when it compared (it takes none)
    assert re.search(r"--train-iters: nodes 0-2: 240; node [34]: 99", nodes.output(refused))
    job = result(nodes, survivors[0])
    assert job.losses == baseline_joining.losses and job.digest == baseline_joining.digest
    events = read_events(str(log))
    (came,) = _named(events, "node_joined")
    assert (came["node"], came["spares"]) == (3, ["spare-3000", "spare-3001"])
    _assert_node_swapped(events, lost, {2 * lost: "spare-3000", 2 * lost + 1: "spare-3001"})
    if store == "etcd":
        for prefix in (keys.job_prefix(launcher[1]), keys.process_groups_prefix(launcher[1])):
            assert count_keys(url, prefix) == 0, prefix
    print(f"joined at iteration {joined_at}, its spares ready at {ready_at}")


def _joined_and_ready(nodes, joined: int) -> bool:
    """Node 3's spares are registered and every launched node's agent watches its lease."""
    spares = nodes.output(joined)
    if not all(f"spare {s} registered" in spares for s in (3000, 3001)):
        return False
    return all("node 3 joined the job as a spare node" in nodes.output(n) for n in (0, 1, 2))


def test_checkpoint_restart_is_one_restart_of_every_node(tmp_path, baseline):
    # The baseline policy across nodes: rank 3 (node 1) dies; every node's agent stops its
    # processes and starts them again from the newest checkpoint, under one new job id.
    log = tmp_path / "events.jsonl"
    args = [*SHAPE, "--save", str(tmp_path / "ckpt"), "--save-interval", "5",
            "--deadpool-inject", "kill@3:8", "--deadpool-event-log", str(log)]  # fmt: skip
    nodes = start_nodes(tmp_path, 3, 0, NPROC, args, launcher=("--restart-policy", "full"))
    try:
        rcs = nodes.wait(600)
    finally:
        nodes.stop()
    assert rcs == [0, 0, 0], result(nodes).failure()
    job = result(nodes)
    assert job.losses == baseline.losses and job.digest == baseline.digest
    events = read_events(str(log))
    restarts = _named(events, "job_restart")
    assert len(restarts) == 3 and {r["restart"] for r in restarts} == {1}  # one per agent
    assert {e["iteration"] for e in _named(events, "checkpoint_loaded")} == {5}
    for n in range(3):
        assert "checkpoint-restart 1: failure of rank 3" in nodes.output(n)
