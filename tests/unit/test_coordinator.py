"""The agent's half of a recovery on a real in-process TCPStore, no worker processes: one order
per generation, a newer recovery planned from the last, spare claims by compare-and-swap, the
unrecoverable path, a failure after training finished, waiting for holdings, and the account of
a finished recovery."""

import pytest

from deadpool_megatron.control import keys
from deadpool_megatron.control.context import JobContext
from deadpool_megatron.control.membership import MembershipStore
from deadpool_megatron.control.messages import (
    Claim,
    HoldingsReport,
    Member,
    Membership,
    PlanDecision,
    RankHoldings,
    Recovered,
    RecoveryOrder,
    SpareAssignment,
)
from deadpool_megatron.control.monitor import Monitor
from deadpool_megatron.events import EventLog, read_events
from deadpool_megatron.failure.hang import HangPolicy
from deadpool_megatron.recovery.coordinator import (
    Coordinator,
    OrderExists,
    SpareUnavailable,
    rank_phases,
)
from deadpool_megatron.recovery.plan import TrainingFinished, Unrecoverable
from deadpool_megatron.topology import Topology

JOB = "coord-test"
TOPO = Topology(4, 1, 2)  # PP2 x DP2: DP rings [0, 1] and [2, 3]


class Clock:
    def __init__(self):
        self.t = 5000.0

    def __call__(self):
        return self.t


@pytest.fixture(autouse=True)
def generation0(kv):
    members = tuple(Member(r, f"host:{100 + r}", (0, r // 2, r % 2)) for r in range(4))
    MembershipStore(kv, JOB).create(Membership(0, members, ("spare-0", "spare-1")))


def make(kv, tmp_path=None, clock=None):
    ctx = JobContext(kv, JOB)
    events = EventLog(
        str(tmp_path / "ev.jsonl") if tmp_path else None, generation=lambda: ctx.generation
    )
    return Coordinator(ctx, TOPO, 1, events, clock=clock or Clock()), ctx


def holdings(kv, generation, ranks, iterations=(4, 5)):
    for r in ranks:
        peer = r ^ 1  # its DP-ring predecessor's replica
        h = RankHoldings(frozenset(iterations), {peer: frozenset(iterations)})
        kv.set(keys.holdings(JOB, generation, r), HoldingsReport(h, 5).encode())


def test_one_order_per_generation_and_the_agent_moves_to_it(kv):
    coord, ctx = make(kv)
    rec = coord.order({3}, "rank 3 exited", failed_at=1.0)
    assert rec.generation == 1 and ctx.generation == 1
    order = RecoveryOrder.decode(kv.get(keys.recovery_order(JOB, 1)))
    assert order == RecoveryOrder("rank 3 exited", (3,))
    other, _ = make(kv)  # a second writer that still stands in generation 0
    with pytest.raises(OrderExists, match="generation 1 was already ordered"):
        other.order({2}, "rank 2 exited", failed_at=2.0)


def test_a_newer_recovery_is_planned_from_the_last_one(kv, tmp_path):
    coord, ctx = make(kv, tmp_path)
    rec = coord.order({3}, "rank 3 exited", 1.0)
    holdings(kv, 1, [0, 1, 2])
    held = coord.gather(rec, lost=lambda r: None, on_lost=None, sleep=lambda s: None)
    plan = coord.decide(rec, held, ["spare-0", "spare-1"])
    assert plan.generation == 1 and plan.replaced == {3: "spare-0"} and plan.iteration == 5
    assert SpareAssignment.decode(kv.get(keys.assignment(JOB, "spare-0"))) == SpareAssignment(3, 1)
    decision = PlanDecision.decode(kv.get(keys.recovery_plan(JOB, 1)))
    assert decision.plan == plan and decision.failed_iteration == 6
    # The spare dies while it recovers: the next recovery goes into generation 2.
    rec2 = coord.order({3}, "spare-0 exited", 2.0)
    assert rec2.generation == 2
    holdings(kv, 2, [0, 1, 2])
    plan2 = coord.decide(rec2, coord.gather(rec2, lambda r: None, None), ["spare-1"])
    assert plan2.replaced == {3: "spare-1"}
    current = MembershipStore(kv, JOB).current()
    assert current.generation == 2 and current.member(3).process_id == "spare-1"
    assert current.spares == ()
    started = [
        e for e in read_events(str(tmp_path / "ev.jsonl")) if e["event"] == "recovery_started"
    ]
    assert [e["generation"] for e in started] == [1, 2]


def test_a_seated_spare_whose_takeover_a_newer_order_cut_short_stays_and_takes_no_spare(
    kv, tmp_path
):
    # Generation 1 seats spare-0 on rank 3; rank 0 fails in that recovery (transient), so
    # generation 2 is ordered before spare-0 finished. spare-0 reports that it holds nothing
    # (arriving): it keeps rank 3 and receives its state again; spare-1 stays free. Before,
    # spare-0 left and rank 3 took spare-1 (or, with no spare left, the job could not go on).
    coord, ctx = make(kv, tmp_path)
    rec = coord.order({3}, "rank 3 exited", 1.0)
    holdings(kv, 1, [0, 1, 2])
    coord.decide(rec, coord.gather(rec, lambda r: None, None), ["spare-0", "spare-1"])
    rec2 = coord.order(set(), "rank 0 failed in the recovery", 2.0)
    holdings(kv, 2, [0, 1, 2])
    nothing = HoldingsReport(RankHoldings(frozenset()), 0, trained=False, arriving=True)
    kv.set(keys.holdings(JOB, 2, 3), nothing.encode())
    plan = coord.decide(rec2, coord.gather(rec2, lambda r: None, None), ["spare-1"])
    assert plan.replaced == {3: "spare-0"} and plan.arriving == (3,)
    assert plan.local_restores == (0, 1, 2) and plan.iteration == 5
    assert {(t.kind, t.src, t.dst) for t in plan.transfers} == {
        ("parameters", 2, 3), ("replica", 2, 3)}  # fmt: skip
    current = MembershipStore(kv, JOB).current()
    assert current.generation == 2 and current.member(3).process_id == "spare-0"
    assert current.spares == ("spare-1",)
    assert kv.get(keys.spare_claim(JOB, "spare-1")) is None  # never claimed
    assert SpareAssignment.decode(kv.get(keys.assignment(JOB, "spare-0"))).generation == 1
    claimed = [e for e in read_events(str(tmp_path / "ev.jsonl")) if e["event"] == "spare_claimed"]
    assert [(e["spare"], e["replaces"]) for e in claimed] == [("spare-0", 3)]  # once
    assert PlanDecision.decode(kv.get(keys.recovery_plan(JOB, 2))).plan.arriving == (3,)


@pytest.mark.parametrize("holder", ["another agent", "withdrawn"])
def test_a_spare_claimed_by_someone_else_or_withdrawn_is_not_seated(kv, holder):
    # Nothing is published or committed: the agent plans again without that spare.
    coord, _ = make(kv)
    if holder == "withdrawn":
        assert MembershipStore(kv, JOB).withdraw_spare("spare-0")
    else:
        kv.set(keys.spare_claim(JOB, "spare-0"), Claim(holder, 0).encode())
    rec = coord.order({3}, "rank 3 exited", 1.0)
    holdings(kv, 1, [0, 1, 2])
    held = coord.gather(rec, lambda r: None, None)
    with pytest.raises(SpareUnavailable, match="spare spare-0 withdrew or was claimed before"):
        coord.decide(rec, held, ["spare-0", "spare-1"])
    assert kv.get(keys.recovery_plan(JOB, 1)) is None
    assert MembershipStore(kv, JOB).current().generation == 0  # nothing committed
    plan = coord.decide(rec, held, ["spare-1"])
    assert plan.replaced == {3: "spare-1"}
    assert MembershipStore(kv, JOB).current().spares == ()


def test_planning_again_keeps_the_spares_this_recovery_claimed_already(kv):
    # Two lost ranks: spare-0 is claimed for the first, spare-1 has withdrawn, so the plan
    # fails at the second claim. Planned again with a spare that joined since, spare-0 is
    # still this coordinator's to seat.
    coord, _ = make(kv)
    MembershipStore(kv, JOB).withdraw_spare("spare-1")
    rec = coord.order({1, 3}, "ranks 1 and 3 exited", 1.0)
    holdings(kv, 1, [0, 2])
    held = coord.gather(rec, lambda r: None, None)
    with pytest.raises(SpareUnavailable, match="spare-1"):
        coord.decide(rec, held, ["spare-0", "spare-1"])
    assert MembershipStore(kv, JOB).claimable("spare-0", 0, coord.claimer)
    plan = coord.decide(rec, held, ["spare-0", "spare-2"])
    assert plan.replaced == {1: "spare-0", 3: "spare-2"}


def test_unrecoverable_is_published_so_that_every_process_stops(kv):
    coord, _ = make(kv)
    rec = coord.order({3}, "rank 3 exited", 1.0)
    holdings(kv, 1, [0, 1, 2])
    with pytest.raises(Unrecoverable, match="no spare left to replace failed rank 3"):
        coord.decide(rec, coord.gather(rec, lambda r: None, None), [])
    decision = PlanDecision.decode(kv.get(keys.recovery_plan(JOB, 1)))
    assert "no spare left" in decision.unrecoverable


def test_gather_waits_for_a_slow_rank_and_adds_a_lost_one_to_the_failed(kv):
    coord, _ = make(kv)
    rec = coord.order({3}, "rank 3 exited", 1.0)
    holdings(kv, 1, [0])
    polls = []

    def sleep(_):
        polls.append(1)
        if len(polls) == 5:  # rank 1 was still computing; it reports after 5 polls
            holdings(kv, 1, [1])

    lost_calls = []
    held = coord.gather(
        rec,
        lost=lambda r: "it exited" if r == 2 else None,
        on_lost=lambda r, why: lost_calls.append((r, why)),
        sleep=sleep,
    )
    assert sorted(held) == [0, 1] and rec.permanent == {2, 3}
    assert lost_calls == [(2, "it exited")] and len(polls) == 5


def test_a_failure_after_every_other_rank_finished_training_ends_the_job_as_finished(kv, tmp_path):
    # Rank 1 died after the last iteration; ranks 0 and 3 had exited 0, rank 2 exits 0 while
    # the gather waits. Nothing is planned, no spare is claimed, every process is told why.
    coord, _ = make(kv, tmp_path)
    rec = coord.order({1}, "rank 1 exited", 1.0)
    exited = {0, 3}

    def sleep(_):
        exited.add(2)

    held = coord.gather(
        rec, lost=lambda r: None, on_lost=None, sleep=sleep, finished=lambda r: r in exited,
    )  # fmt: skip
    assert held == {} and rec.finished == {0, 2, 3} and rec.permanent == {1}
    with pytest.raises(TrainingFinished, match=r"rank\(s\) \[0, 2, 3\] finished training"):
        coord.decide(rec, held, ["spare-0", "spare-1"])
    decision = PlanDecision.decode(kv.get(keys.recovery_plan(JOB, 1)))
    assert decision.plan is None and decision.unrecoverable is None
    assert "failure came after the job's last collective" in decision.finished
    assert kv.get(keys.assignment(JOB, "spare-0")) is None
    assert MembershipStore(kv, JOB).current().generation == 0
    unneeded = [e for e in read_events(str(tmp_path / "ev.jsonl"))
                if e["event"] == "recovery_unneeded"]  # fmt: skip
    assert [(e["generation"], e["failed"], e["finished"]) for e in unneeded] == [
        (1, [1], [0, 2, 3])
    ]


def test_a_rank_that_finished_beside_live_ones_is_replaced_like_a_failed_one(kv):
    coord, _ = make(kv)
    rec = coord.order({1}, "rank 1 exited", 1.0)
    holdings(kv, 1, [0, 3])  # they had not exited when the order reached them
    held = coord.gather(rec, lambda r: None, None, finished=lambda r: r == 2)
    assert rec.finished == {2} and rec.permanent == {1}
    plan = coord.decide(rec, held, ["spare-0", "spare-1"])
    assert plan.replaced == {1: "spare-0", 2: "spare-1"} and plan.local_restores == (0, 3)


def test_a_rank_that_exits_cleanly_between_the_gathers_two_looks_is_finished_not_lost(kv):
    # The gather asks the launcher's monitor whether a rank finished, then whether it is lost;
    # the exit with status 0 (reported by the fork server's reader thread) can land between
    # the two. It was then called lost and replaced as failed (a CI run: failed [2, 3]).
    coord, ctx = make(kv)
    rec = coord.order({2}, "rank 2 exited", 1.0)
    holdings(kv, 1, [0, 1])
    looks = []

    def returncode(rank):  # rank 3: running at its first look, exited 0 from the second on
        if rank == 2:
            return -9
        if rank == 3:
            looks.append(rank)
            return None if len(looks) == 1 else 0
        return None

    monitor = Monitor(ctx, [2, 3], returncode, 0.5, HangPolicy(2.0, 10.0, 5.0, 30.0),
                      watch_heartbeats=True, clock=Clock())  # fmt: skip
    coord.gather(rec, monitor.lost, lambda r, why: None, finished=monitor.finished)
    assert rec.permanent == {2} and rec.finished == {3}


def test_a_finished_recovery_is_accounted_once_every_rank_ran_its_first_iteration(kv, tmp_path):
    clock = Clock()
    coord, _ = make(kv, tmp_path, clock)
    rec = coord.order({3}, "rank 3 exited", failed_at=clock.t - 0.5)
    holdings(kv, 1, [0, 1, 2])
    coord.decide(rec, coord.gather(rec, lambda r: None, None), ["spare-0"])
    assert coord.poll_done() is None
    for r in range(4):
        assert coord.poll_done() is None
        phases = {"rebuild_communicators": 0.1 * (r + 1), "first_iteration": 0.2}
        cpu = {"rebuild_communicators": 0.02 * (r + 1)} | ({"before_rebuild": 0.3} if r else {})
        record = Recovered(phases, clock.t + 1.0 + r, 5, 1000 if r == 3 else 0, cpu_s=0.5 + r,
                           phase_cpu_s=cpu)  # fmt: skip
        kv.set(keys.recovered(JOB, 1, r), record.encode())
    summary = coord.poll_done()
    assert summary["total_s"] == pytest.approx(0.5 + 1.0 + 3)
    assert summary["cpu_s_max"] == 3.5 and summary["cpu_s_mean"] == 2.0  # per process
    assert summary["cpu_s_busiest_rank"] == 3
    # each phase's CPU per process: the mean over the ranks that timed it (the spare, rank 0
    # here, joined at the rebuild)
    assert summary["phase_cpu_s_mean"] == {"rebuild_communicators": 0.05, "before_rebuild": 0.3}
    assert summary["bytes_moved"] == 1000 and summary["replaced"] == {"3": "spare-0"}
    assert coord.pending is None and coord.poll_done() is None
    events = read_events(str(tmp_path / "ev.jsonl"))
    phases = {e["phase"]: e["duration_s"] for e in events if e["event"] == "recovery_phase"}
    assert phases["rebuild_communicators"] == pytest.approx(0.4)  # the slowest rank's
    # every rank's first iteration took 0.2 s from its own resume, the ranks resumed 1 s
    # apart: the iteration itself, from the last resume to the last finish, took 0.2 s
    assert phases["first_iteration"] == pytest.approx(0.2)
    assert phases["resume_skew"] == pytest.approx(3.0)
    assert [e["generation"] for e in events if e["event"] == "recovery_done"] == [1]


def test_a_finished_recovery_retires_what_the_generations_before_it_wrote_in_etcd(etcd_url):
    # A months-long job must not leave its store growing: once generation 1 runs, generation
    # 0's keys (and its process groups' rendezvous) are deleted; generation 1's stay.
    from deadpool_megatron.control.etcd_store import EtcdKVStore

    store = EtcdKVStore(etcd_url)
    job = f"retire-{id(store) % 100000}"
    members = tuple(Member(r, f"host:{100 + r}", (0, r // 2, r % 2)) for r in range(4))
    MembershipStore(store, job).create(Membership(0, members, ("spare-0",)))
    ctx = JobContext(store, job)
    coord = Coordinator(ctx, TOPO, 1, EventLog(None, generation=lambda: ctx.generation))
    old_beat, rendezvous = keys.heartbeat(job, 0, 2), f"{keys.C10D_ROOT}{job}/gen0/0"
    tenth = f"{keys.C10D_ROOT}{job}/gen10/0"  # shares "gen1" as a string prefix: kept
    for key in (old_beat, rendezvous, tenth):
        store.set(key, b"x")
    rec = coord.order({3}, "rank 3 exited", failed_at=0.0)
    for r in (0, 1, 2):
        h = RankHoldings(frozenset((4, 5)), {r ^ 1: frozenset((4, 5))})
        store.set(keys.holdings(job, 1, r), HoldingsReport(h, 5).encode())
    coord.decide(rec, coord.gather(rec, lambda r: None, None), ["spare-0"])
    for r in range(4):
        store.set(keys.recovered(job, 1, r), Recovered({}, 1.0, 5, 0).encode())
    assert coord.poll_done() is not None
    assert store.get(old_beat) is None and store.get(rendezvous) is None
    assert store.get(tenth) == b"x"
    assert store.get(keys.recovery_plan(job, 1)) is not None  # the running generation's
    assert MembershipStore(store, job).current().generation == 1


def test_the_first_resumed_iteration_is_counted_from_the_last_rank_resumed():
    # rank 0 resumed at t=10.0 and waited for rank 1 (resumed at 10.3) in its first iteration
    early = Recovered({"first_iteration": 0.6, "verify": 0.1}, 10.6, 5, 0)
    late = Recovered({"first_iteration": 0.35, "verify": 0.4}, 10.65, 5, 0)
    phases = rank_phases([early, late])
    assert phases["first_iteration"] == pytest.approx(0.35)  # not rank 0's 0.6
    assert phases["resume_skew"] == pytest.approx(0.3)
    assert phases["verify"] == pytest.approx(0.4)  # other phases: the slowest rank's


def test_a_failure_before_anything_was_trained_is_planned_from_the_start(kv, tmp_path):
    # Rank 3 died in its set-up; ranks 0-2 report nothing trained, rank 1 held nothing: every
    # rank sets up again. A spare's idle build is not counted on (every rank builds, seeded as
    # at the start), and the account names where the set-up found training starts.
    coord, _ = make(kv, tmp_path)
    rec = coord.order({3}, "rank 3 exited", 1.0)
    for r, snapshots in ((0, {0}), (1, set()), (2, {0})):
        report = HoldingsReport(RankHoldings(frozenset(snapshots), {}), 0, trained=False)
        kv.set(keys.holdings(JOB, 1, r), report.encode())
    held = coord.gather(rec, lambda r: None, None)
    plan = coord.decide(rec, held, ["spare-0"], {"spare-0": (3,)})
    assert plan.from_start and plan.replaced == {3: "spare-0"} and plan.prebuilt == ()
    assert PlanDecision.decode(kv.get(keys.recovery_plan(JOB, 1))).plan == plan
    for r in range(4):  # each resumed at 5 (--load), the first iteration 6 done
        kv.set(keys.recovered(JOB, 1, r), Recovered({}, 2.0, 6, 0).encode())
    summary = coord.poll_done()
    assert summary["from_start"] and summary["iteration"] == 5
    assert summary["replayed_iterations"] == 0
