"""Hot-swap recovery on real jobs: a failed rank is replaced (or a transiently failed one reset)
while the job keeps running, and the run ends bitwise identical to the failure-free run of
the same configuration (per-iteration loss hex values and the final state digest): which
failures, where, and how many. What the restore brings back across model configurations is
test_hotswap_state.py's; the jobs are tests/hotswap_jobs.py's."""

from __future__ import annotations

import re
import shutil

import pytest
from hotswap_jobs import (
    DEMO,
    HEARTBEATS,
    SHAPE_DP4,
    SHAPE_PP2,
    TOGETHER,
    assert_recovered,
    assert_same_run,
    held_snapshots,
    named,
    replays,
    run_injected,
)

from deadpool_megatron.events import read_events
from jobs import run_failure_free, run_job

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def first_five(tmp_path_factory):
    """The same job with --exit-interval 5 and --save: iterations 1-5 and their checkpoint,
    which tests copy (a job that loads it trains on from iteration 5)."""
    path = tmp_path_factory.mktemp("first_five")
    ckpt = str(path / "ckpt")
    again = [*SHAPE_PP2, "--save", ckpt, "--load", ckpt, "--exit-interval", "5"]
    result = run_job(path, 4, again, name="first")
    assert result.returncode == 0, result.failure()
    assert sorted(result.losses) == [1, 2, 3, 4, 5]
    return result, path / "ckpt"


@pytest.fixture(scope="module")
def baseline_dp4(tmp_path_factory):
    return run_failure_free(tmp_path_factory, "base_dp4", 4, SHAPE_DP4)


@pytest.mark.parametrize(
    "spec",
    [
        "kill@0:6:forward",  # global rank 0, first pipeline stage
        "kill@3:7:backward",  # last stage, DP rank 1
        "kill@1:5:optimizer",  # first stage, DP rank 1
        "kill@2:6:snapshot",  # last stage, DP rank 0, between its step and its snapshot
        "kill@3:5:replicate",  # while its replication thread sends
    ],
)
def test_killed_rank_is_replaced_by_a_spare_bitwise(tmp_path, baseline_pp2, spec):
    result, events = run_injected(tmp_path, 4, SHAPE_PP2, spec, spares=1)
    assert_same_run(result, baseline_pp2)
    victim = int(spec.split("@")[1].split(":")[0])
    detected = named(events, "failure_detected")
    assert [(d["rank"], d["kind"]) for d in detected] == [(victim, "permanent")]
    assert [(c["spare"], c["replaces"]) for c in named(events, "spare_claimed")] == [
        ("spare-0", victim)
    ]
    (done,) = assert_recovered(events)
    assert done["replaced"] == {str(victim): "spare-0"}
    assert done["bytes_moved"] > 0  # parameters + optimizer shard, to the spare only
    # Stop points on every model a loop trains: 4 ranks' in generation 0, then the spare's and
    # the 3 survivors' rebuilt ones (2 transformer layers each, PP2).
    covered = [line for line in result.output.splitlines() if "stop points before" in line]
    assert len(covered) == 8 and all("before 2 transformer" in line for line in covered), covered
    if victim != 3:  # rank 3 writes the metrics: killed, its last line may be missing
        # A replayed iteration's first run has its metrics line, also when the order stopped
        # rank 3 between that iteration's optimizer step and its snapshot (seen in one run of
        # kill@0:6: it snapshots the iteration, then obeys). Rank 3 repeats what it had done
        # beyond the roll-back: with PP2 the last stage can still be in the iteration the
        # first stage has finished (seen in a fresh-clone suite, kill@0:6: rank 1 held 5,
        # rank 3 only 4), and then repeats none of the one iteration the recovery replays.
        beyond = max(held_snapshots(result.output, rank=3, generation=1)) - done["iteration"]
        assert replays(result) == beyond <= done["replayed_iterations"]


@pytest.mark.parametrize(
    "spec, kind", [("kill@1:1:forward", "permanent"), ("raise@2:1:backward", "transient")]
)
def test_a_failure_in_the_first_iteration_rolls_back_to_the_state_training_started_from(
    tmp_path, baseline_pp2, spec, kind
):
    # Before the first step no iteration's snapshot exists: every rank snapshots the state it
    # starts from, and the ring holds it, before the first iteration. Without it, this job
    # ended: "the live ranks share no committed snapshot iteration".
    result, events = run_injected(tmp_path, 4, SHAPE_PP2, spec, spares=1)
    assert_same_run(result, baseline_pp2)
    victim = int(spec.split("@")[1].split(":")[0])
    detected = named(events, "failure_detected")
    assert [(d["rank"], d["kind"]) for d in detected] == [(victim, kind)]
    (done,) = assert_recovered(events)
    assert done["iteration"] == 0 and done["replayed_iterations"] <= 1, done
    assert done["replaced"] == ({str(victim): "spare-0"} if kind == "permanent" else {})
    # Restored from the start's snapshot, not set up again. A rank whose ring was still
    # replicating it when the order came stops waiting without its log line (seen: 2 of 4).
    assert not done.get("from_start"), done
    started = re.findall(r"iteration 0, where training starts, snapshotted and replicated",
                         result.output)  # fmt: skip
    assert started, result.output[-3000:]


@pytest.mark.parametrize("spec, kind, load", [("kill@1:0:setup", "permanent", False),
                                              ("raise@2:0:setup", "transient", True)])  # fmt: skip
def test_a_failure_during_the_set_up_sets_every_rank_up_again_bitwise(
    tmp_path, baseline_pp2, first_five, spec, kind, load
):
    # Nothing is trained yet, and a rank whose set-up failed holds no snapshot: every rank
    # sets up again in the next generation (a spare in a dead rank's place), the model seeded
    # as at the job's start, or --load's checkpoint (of iteration 5) read again. Before, the
    # job ended (with --save: restarted every process).
    extra = []
    if load:
        shutil.copytree(first_five[1], tmp_path / "ckpt")
        extra = ["--load", str(tmp_path / "ckpt")]
    result, events = run_injected(tmp_path, 4, SHAPE_PP2, spec, spares=1, extra=extra)
    start = 5 if load else 0
    assert result.returncode == 0, result.failure()
    assert result.losses == {i: baseline_pp2.losses[i] for i in range(start + 1, 13)}
    assert result.digest == baseline_pp2.digest
    victim = int(spec.split("@")[1].split(":")[0])
    detected = named(events, "failure_detected")
    assert [(d["rank"], d["kind"]) for d in detected] == [(victim, kind)]
    (done,) = assert_recovered(events)
    assert done["from_start"] and done["iteration"] == start and done["replayed_iterations"] == 0
    assert done["replaced"] == ({str(victim): "spare-0"} if kind == "permanent" else {})
    assert "every rank sets up again from the start" in result.output


def test_deaths_before_and_just_after_registering_start_a_seat_again_and_hot_swap_bitwise(
    tmp_path, baseline_pp2
):
    # Rank 1 dies in its first moments (connected to the store, not registered): no peer has
    # met it, so its agent starts its seat again. Rank 2 dies as soon as it registered, as its
    # groups are about to be created: its failure waits for every rank to register (the new
    # rank 1 included), and its peers, in their groups' rendezvous waiting for its address,
    # stop there at the recovery order; every rank sets up again from the start, a spare in
    # rank 2's seat. Before, either death ended the job (or the peers sat in the rendezvous
    # until the recovery took them for blocked and every rank was lost).
    result, events = run_injected(
        tmp_path, 4, SHAPE_PP2, "kill@1:0:launch,kill@2:0:groups", spares=1
    )
    assert_same_run(result, baseline_pp2)
    (again,) = named(events, "rank_relaunched")
    assert again["rank"] == 1 and again["returncode"] == -9 and again["pid"] != again["old_pid"]
    detected = named(events, "failure_detected")
    assert sorted((d["rank"], d["kind"]) for d in detected) == [(1, "permanent"), (2, "permanent")]
    (done,) = assert_recovered(events)
    assert done["from_start"] and done["iteration"] == 0 and done["replayed_iterations"] == 0
    assert done["replaced"] == {"2": "spare-0"}, done
    assert "before it registered with the job" in result.output
    assert "every rank sets up again from the start" in result.output


def test_replicas_over_tcp_connections_serve_a_hot_swap_and_a_reset_bitwise(tmp_path, baseline_pp2):
    # --deadpool-transport tcp (the default): rank 3 dies while its replication thread sends,
    # rank 0 fails transiently later; the new generation's ring is connected anew each time.
    spec = "kill@3:5:replicate,raise@0:8"
    result, events = run_injected(tmp_path, 4, SHAPE_PP2, spec, spares=1,
                          extra=["--deadpool-transport", "tcp"])  # fmt: skip
    assert_same_run(result, baseline_pp2)
    assert [(d["rank"], d["kind"]) for d in named(events, "failure_detected")] == [
        (3, "permanent"),
        (0, "transient"),
    ]
    assert_recovered(events, recoveries=2)
    assert "left the replication thread behind" not in result.output
    for generation in range(3):  # every rank's ring, at the start and after each recovery
        line = f"replica ring of generation {generation} over tcp"
        assert result.output.count(line) == 4, (generation, result.output)
    # One host: every receiver reads its predecessor's parts from its memory, in each of the
    # three generations (the spare's ring included).
    assert result.output.count("are read from their memory (one copy)") == 3 * 4
    # ... and the spare reads its optimizer shard and its parameters from the ranks that
    # serve them (the transient reset restores from the rank's own snapshot).
    assert result.output.count("read from its memory into place)") == 2, result.output


def test_without_the_fork_server_every_process_is_its_own_interpreter_and_trains_alike(
    tmp_path, baseline_pp2
):
    # The baseline's processes were forked from the agent's fork server; these start with
    # `python pretrain_gpt.py`: the same losses and digest, through a hot-swap.
    log = tmp_path / "events.jsonl"
    args = [*SHAPE_PP2, "--deadpool-inject", "kill@2:6", "--deadpool-event-log", str(log)]
    result = run_job(tmp_path, 4, args, spares=1, launcher=["--no-fork-server"])
    assert "fork server ready" in baseline_pp2.output
    assert_same_run(result, baseline_pp2)
    assert "fork server" not in result.output
    assert_recovered(read_events(str(log)))


def test_corrupted_replica_is_rejected_and_the_recovery_rolls_back_past_it_bitwise(
    tmp_path, baseline_pp2
):
    # Rank 1's replica of iteration 6 reaches rank 0 (its ring successor) corrupt and is
    # rejected; rank 1 dies late in iteration 7: the newest iteration whole everywhere is 5.
    spec = "corrupt@1:6,kill@1:7:optimizer"
    result, events = run_injected(tmp_path, 4, SHAPE_PP2, spec, spares=1)
    assert_same_run(result, baseline_pp2)
    assert "rejected replica from rank 1" in result.output
    (done,) = assert_recovered(events)
    assert done["iteration"] == 5 and done["replaced"] == {"1": "spare-0"}
    assert replays(result) == done["replayed_iterations"] >= 1  # 6 at least runs twice


def test_two_sequential_permanent_failures_use_two_spares(tmp_path, baseline_pp2):
    result, events = run_injected(tmp_path, 4, SHAPE_PP2, "kill@1:4,kill@2:8", spares=2)
    assert_same_run(result, baseline_pp2)
    done = assert_recovered(events, recoveries=2)
    assert [d["replaced"] for d in done] == [{"1": "spare-0"}, {"2": "spare-1"}]
    assert [e["generation"] for e in named(events, "recovery_started")] == [1, 2]
    # Spare 1 idled through generation 0's start: it reserved its buffers before its claim.
    assert re.search(r"\[spare 1\] .*reserved while the spare was idle", result.output)


@pytest.mark.parametrize("kill", ["kill@1:8", "kill@1:6:forward"])
def test_a_job_submitted_again_at_its_exit_interval_trains_on_and_its_spare_stops_with_it(
    tmp_path, baseline_pp2, first_five, kill
):
    # Megatron-LM's requeue pattern: the same flags each time, --exit-interval 5 and --load of
    # the job's own --save. The first job trains 1-5 and exits; the second loads 5 and trains
    # to 10, the next multiple, losing rank 1 in iteration 8 to a spare: the spare starts from
    # the resumed iteration, and stops at 10 with the survivors because it reads the job's end
    # from the store (from iteration 0, the flags alone would end it at 5). Or in iteration 6,
    # the first after the load: rolled back to the loaded state, snapshotted before it. The
    # third trains 11-12. Together: the uninterrupted 12-iteration run, bitwise.
    first, saved = first_five  # the first launch, shared
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(saved, ckpt)
    again = [*SHAPE_PP2, "--save", ckpt, "--load", ckpt, "--exit-interval", "5"]
    second, events = run_injected(tmp_path, 4, again, kill, spares=1)
    third = run_job(tmp_path, 4, again, name="third")
    for job in (first, second, third):
        assert job.returncode == 0, job.failure()
    assert sorted(first.losses) == [1, 2, 3, 4, 5]
    assert "loaded checkpoint of iteration 5" in second.output
    assert sorted(second.losses) == [6, 7, 8, 9, 10]
    (done,) = assert_recovered(events)
    assert done["replaced"] == {"1": "spare-0"}
    if kill.endswith(":6:forward"):
        assert done["iteration"] == 5, done  # the loaded state
    assert "loaded checkpoint of iteration 10" in third.output
    assert sorted(third.losses) == [11, 12]
    assert {**first.losses, **second.losses, **third.losses} == baseline_pp2.losses
    assert third.digest == baseline_pp2.digest


def test_a_fresh_spare_replenishes_the_pool_and_serves_the_next_failure(tmp_path, baseline_pp2):
    # One spare: it takes over rank 1 (dead in iteration 4), and the agent starts a fresh
    # spare in the freed slot; rank 2 dies in iteration 7, while that one is still starting:
    # the recovery waits for it rather than give up.
    result, events = run_injected(tmp_path, 4, SHAPE_PP2, "kill@1:4,kill@2:7", spares=1)
    assert_same_run(result, baseline_pp2)
    first, second = assert_recovered(events, recoveries=2)
    assert first["replaced"] == {"1": "spare-0"} and second["replaced"] == {"2": "spare-1"}
    started = named(events, "spare_started")
    assert [(e["spare"], e["local_rank"]) for e in started][:2] == [(1, 1), (2, 2)]
    assert [e["size"] for e in named(events, "spare_pool")][:4] == [0, 1, 0, 1]


def test_transient_error_resets_in_place_without_a_spare(tmp_path, baseline_pp2):
    result, events = run_injected(tmp_path, 4, SHAPE_PP2, "raise@1:6:backward", spares=1)
    assert_same_run(result, baseline_pp2)
    detected = named(events, "failure_detected")
    assert [(d["rank"], d["kind"]) for d in detected] == [(1, "transient")]
    assert named(events, "spare_claimed") == []
    (done,) = assert_recovered(events)
    assert done["replaced"] == {} and done["bytes_moved"] == 0
    assert "spare 0: job finished, exiting" in result.output  # never used, still idle


def test_single_process_job_with_local_snapshots_only_resets_a_transient_error_bitwise(tmp_path):
    # Data-parallel size 1 leaves nowhere for a replica: --deadpool-replicas 0 (what a
    # one-GPU NCCL job runs, tests/gpu); the rank resets from its own snapshot.
    shape = [*DEMO, "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
             "--train-iters", "10", "--deadpool", "--deadpool-replicas", "0", *HEARTBEATS]  # fmt: skip
    baseline = run_job(tmp_path, 1, shape, name="baseline")
    assert baseline.returncode == 0, baseline.failure()
    result, events = run_injected(tmp_path, 1, shape, "raise@0:6:backward", spares=0)
    assert_same_run(result, baseline)
    (done,) = assert_recovered(events)
    assert done["replaced"] == {} and done["bytes_moved"] == 0


def test_hung_rank_is_fenced_then_replaced(tmp_path, baseline_pp2):
    result, events = run_injected(tmp_path, 4, SHAPE_PP2, "hang@2:6:backward", spares=1)
    assert_same_run(result, baseline_pp2)
    (fenced,) = named(events, "fenced")
    assert fenced["rank"] == 2
    (detected,) = named(events, "failure_detected")
    assert detected["evidence"] == "HeartbeatStale" and detected["kind"] == "permanent"
    (done,) = assert_recovered(events)
    assert done["replaced"] == {"2": "spare-0"}


def test_spare_dying_during_its_own_recovery_is_replaced_by_the_next(tmp_path, baseline_pp2):
    # Rank 3 dies in iteration 6; the spare taking it over dies while it recovers into
    # iteration 6: the recovery starts again in a newer generation with the second spare.
    result, events = run_injected(tmp_path, 4, SHAPE_PP2, "kill@3:6,kill@3:6:recovery", spares=2)
    assert_same_run(result, baseline_pp2)
    started = named(events, "recovery_started")
    assert [s["generation"] for s in started] == [1, 2]
    claimed = [(c["spare"], c["replaces"]) for c in named(events, "spare_claimed")]
    assert claimed == [("spare-0", 3), ("spare-1", 3)]
    (done,) = assert_recovered(events)
    assert done["replaced"] == {"3": "spare-1"}


def test_a_failure_during_a_spare_s_takeover_keeps_the_spare_and_recovers_bitwise(
    tmp_path, baseline_pp2
):
    # Rank 3 dies in iteration 6 and spare-0 is seated on it; rank 0 fails transiently while
    # they recover (raise@0:6:recovery), so generation 2 is ordered before spare-0 finished.
    # spare-0 holds rank 3 in the membership: it stays and receives rank 3's state again, one
    # spare for one lost rank. Before, it left too, and with no spare left the job ended.
    result, events = run_injected(tmp_path, 4, SHAPE_PP2, "kill@3:6,raise@0:6:recovery", spares=1)
    assert_same_run(result, baseline_pp2)
    assert [s["generation"] for s in named(events, "recovery_started")] == [1, 2]
    claimed = [(c["spare"], c["replaces"]) for c in named(events, "spare_claimed")]
    assert claimed == [("spare-0", 3)]
    (done,) = assert_recovered(events)
    assert done["generation"] == 2 and done["replaced"] == {"3": "spare-0"}
    assert "spare-0 replaces rank 3 (seated already)" in result.output
    assert "taking over rank 3 in generation 1 was cut short" in result.output


def test_adjacent_ring_ranks_lost_together_with_one_replica_is_unrecoverable(tmp_path):
    # Rank 1's optimizer shard lives on rank 1 and its ring successor 2 only: both die.
    result, events = run_injected(tmp_path, 4, SHAPE_DP4, TOGETHER, spares=2)
    assert result.returncode == 1
    assert "its optimizer shard at iteration" in result.output
    assert "was replicated on ranks [2] only, and [2] failed too (--deadpool-replicas 1)" in (
        result.output
    )
    assert named(events, "recovery_done") == []
    (ended,) = named(events, "job_ended")
    assert ended["status"] == 1 and ended["reason"].startswith("unrecoverable")
    # what failed, beside why it cannot be recovered (whichever death was seen first)
    assert re.search(r"; the failure: ProcessExited: rank [12] was killed by signal SIGKILL$",
                     ended["reason"]), ended["reason"]  # fmt: skip


def test_adjacent_ring_ranks_lost_together_with_two_replicas_recover(tmp_path, baseline_dp4):
    result, events = run_injected(
        tmp_path, 4, SHAPE_DP4, TOGETHER, spares=2, extra=["--deadpool-replicas", "2"]
    )
    assert_same_run(result, baseline_dp4)
    (done,) = assert_recovered(events)
    assert done["replaced"] == {"1": "spare-0", "2": "spare-1"}


def test_two_replicas_over_gloo_groups_serve_adjacent_ranks_lost_together(tmp_path, baseline_dp4):
    # --deadpool-transport gloo (the other tests' replicas go over tcp, the default): a gloo
    # group per ring edge, two successors and two predecessors per rank.
    result, events = run_injected(tmp_path, 4, SHAPE_DP4, TOGETHER, spares=2,
                          extra=["--deadpool-replicas", "2", "--deadpool-transport", "gloo"])  # fmt: skip
    assert_same_run(result, baseline_dp4)
    (done,) = assert_recovered(events)
    assert done["replaced"] == {"1": "spare-0", "2": "spare-1"}


def test_rank_failing_its_health_check_is_fenced_and_replaced(tmp_path):
    # Rank 1's device starts computing wrong results in iteration 5: it is alive and beating,
    # but unfit, so it is killed and a spare takes its place.
    shape = [*SHAPE_PP2, "--train-iters", "30", "--deadpool-health-check-interval", "0.3"]
    base = run_job(tmp_path, 4, shape, name="baseline")
    assert base.returncode == 0, base.failure()
    result, events = run_injected(tmp_path, 4, shape, "unhealthy@1:5", spares=1)
    assert_same_run(result, base)
    (detected,) = named(events, "failure_detected")
    assert (detected["rank"], detected["kind"]) == (1, "permanent")
    assert detected["evidence"] == "HealthCheckFailed"
    (fenced,) = named(events, "fenced")
    assert fenced["rank"] == 1
    (done,) = assert_recovered(events)
    assert done["replaced"] == {"1": "spare-0"}
