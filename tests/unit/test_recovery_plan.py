"""The recovery planner as a table: who replaces whom, what moves, or what was lost."""

import dataclasses

import pytest

from deadpool_megatron.control.membership import Member, Membership
from deadpool_megatron.errors import DeadpoolError
from deadpool_megatron.recovery.plan import (
    FROM_START,
    RankHoldings,
    RecoveryPlan,
    TrainingFinished,
    Transfer,
    Unrecoverable,
    check_plan,
    generation_problems,
    plan_recovery,
)
from deadpool_megatron.topology import Topology

TOPO_3D = Topology(8, tp=2, pp=2)  # DP rings: [0,2] [1,3] [4,6] [5,7]
TOPO_DP4 = Topology(4, tp=1, pp=1)  # one ring: 0 -> 1 -> 2 -> 3 -> 0


def view(topo, spares=("spare-0", "spare-1")):
    members = tuple(
        Member(r, f"w{r}", tuple(vars(topo.coords(r))[k] for k in ("tp", "pp", "dp")))
        for r in range(topo.world_size)
    )
    return Membership(0, members, spares)


def holdings(topo, failed, snapshots=(4, 5), k=1, overrides=None):
    """Every live rank holds `snapshots` and replicas of its k predecessors at them."""
    out = {}
    for r in range(topo.world_size):
        if r in failed:
            continue
        reps = {p: frozenset(snapshots) for p in topo.ring_predecessors(r, k)}
        out[r] = RankHoldings(frozenset(snapshots), reps)
    out.update(overrides or {})
    return out


def test_one_dead_rank_in_3d_gets_a_spare_a_peer_and_its_replica():
    plan = plan_recovery(view(TOPO_3D), TOPO_3D, {0}, holdings(TOPO_3D, {0}))
    assert plan.iteration == 5 and plan.generation == 1
    assert plan.replaced == {0: "spare-0"}
    assert plan.membership.member(0).process_id == "spare-0"
    assert plan.membership.member(0).coords == (0, 0, 0)
    assert plan.membership.spares == ("spare-1",)
    assert plan.local_restores == (1, 2, 3, 4, 5, 6, 7)
    assert set(plan.transfers) == {
        Transfer("parameters", 2, 0, 0, 5),  # the only DP peer of rank 0
        Transfer("replica", 2, 0, 0, 5),  # its ring successor holds the shard
    }
    check_plan(plan, TOPO_3D)


def test_transient_failures_only_roll_back_locally():
    plan = plan_recovery(view(TOPO_3D), TOPO_3D, set(), holdings(TOPO_3D, set()))
    assert plan.replaced == {} and plan.transfers == () and plan.generation == 1
    assert plan.local_restores == tuple(range(8))
    check_plan(plan, TOPO_3D)


def test_rolls_back_to_the_newest_iteration_everyone_can_serve():
    h = holdings(TOPO_DP4, {2})
    h[3] = RankHoldings(frozenset({4, 5}), {2: frozenset({4})})  # replica of 5 not yet in
    plan = plan_recovery(view(TOPO_DP4), TOPO_DP4, {2}, h)
    assert plan.iteration == 4
    assert Transfer("replica", 3, 2, 2, 4) in plan.transfers
    assert Transfer("parameters", 1, 2, 2, 4) in plan.transfers  # ring predecessor first


def test_two_adjacent_ranks_with_one_replica_are_unrecoverable_and_say_why():
    with pytest.raises(Unrecoverable) as err:
        plan_recovery(view(TOPO_DP4), TOPO_DP4, {1, 2}, holdings(TOPO_DP4, {1, 2}))
    assert "rank 1 (tp 0, pp 0, dp 1)" in str(err.value)
    assert "replicated on ranks [2] only, and [2] failed too (--deadpool-replicas 1)" in str(
        err.value
    )


def test_two_adjacent_ranks_with_two_replicas_recover():
    h = holdings(TOPO_DP4, {1, 2}, k=2)
    plan = plan_recovery(view(TOPO_DP4), TOPO_DP4, {1, 2}, h, replicas=2)
    assert plan.replaced == {1: "spare-0", 2: "spare-1"} and plan.generation == 1
    assert Transfer("replica", 3, 1, 1, 5) in plan.transfers  # rank 2 died: the 2nd holder
    assert Transfer("replica", 3, 2, 2, 5) in plan.transfers
    check_plan(plan, TOPO_DP4)


def test_no_spare_left_is_unrecoverable():
    with pytest.raises(Unrecoverable, match="no spare left to replace failed rank 3"):
        plan_recovery(view(TOPO_DP4, spares=()), TOPO_DP4, {3}, holdings(TOPO_DP4, {3}))


def test_a_failure_after_everyone_else_finished_needs_no_recovery():
    with pytest.raises(
        TrainingFinished, match=r"\[0, 2, 3\] finished training before rank\(s\) \[1\]"
    ):
        plan_recovery(view(TOPO_DP4), TOPO_DP4, {1}, {}, finished={0, 2, 3})
    # some still live beside finished ones: those are replaced like failed ranks (here rank 0
    # and rank 1 held each other's replica only: both copies are gone)
    with pytest.raises(Unrecoverable, match="rank 0.*replicated on ranks \\[1\\] only"):
        plan_recovery(view(TOPO_DP4), TOPO_DP4, {1}, holdings(TOPO_DP4, {0, 1}), finished={0})
    plan = plan_recovery(view(TOPO_DP4), TOPO_DP4, {1}, holdings(TOPO_DP4, {1, 3}), finished={3})
    assert plan.replaced == {1: "spare-0", 3: "spare-1"} and plan.local_restores == (0, 2)
    with pytest.raises(ValueError, match=r"ranks \[3\] are neither live, failed nor finished"):
        plan_recovery(view(TOPO_DP4), TOPO_DP4, {1}, {}, finished={0, 2})


def test_a_whole_dp_group_lost_names_the_parameters():
    topo = Topology(4, tp=2, pp=1)  # rings [0,2] [1,3]
    with pytest.raises(Unrecoverable, match="no live DP peer with the same TP/PP"):
        plan_recovery(view(topo), topo, {0, 2}, holdings(topo, {0, 2}))


def test_no_common_snapshot_is_unrecoverable():
    h = holdings(TOPO_DP4, {0})
    h[1] = RankHoldings(frozenset({7}), {0: frozenset({7})})
    with pytest.raises(Unrecoverable, match="share no committed snapshot iteration"):
        plan_recovery(view(TOPO_DP4), TOPO_DP4, {0}, h)


@pytest.mark.parametrize("held", ["nothing", "some", "start snapshots"])
def test_before_anything_is_trained_every_rank_sets_up_again_where_nothing_restores(held):
    # A failure during the set-up: a rank whose set-up failed holds nothing, others may hold
    # the start's snapshot. Where a plan can restore it, it does; else everything is set up
    # again from the start. Trained ranks never are: their work would be redone.
    h = holdings(TOPO_3D, {0}, snapshots=(0,))
    if held != "start snapshots":
        h[1] = RankHoldings(frozenset(), {})
    if held == "nothing":
        h = {r: RankHoldings(frozenset(), {}) for r in h}
    plan = plan_recovery(view(TOPO_3D), TOPO_3D, {0}, h, untrained=True)
    check_plan(plan, TOPO_3D)
    assert plan.replaced == {0: "spare-0"} and plan.generation == 1
    if held == "start snapshots":
        assert not plan.from_start and plan.iteration == 0 and plan.transfers
    else:
        assert plan.from_start and plan.iteration == FROM_START
        assert plan.transfers == () and plan.local_restores == ()
        with pytest.raises(Unrecoverable, match="share no committed snapshot iteration"):
            plan_recovery(view(TOPO_3D), TOPO_3D, {0}, h)  # trained: nothing to set up again


def test_a_plan_from_the_start_restores_nothing_and_its_ranks_must_agree_where_they_start():
    h = {r: RankHoldings(frozenset(), {}) for r in range(1, 8)}
    plan = plan_recovery(view(TOPO_3D), TOPO_3D, {0}, h, untrained=True)
    with pytest.raises(DeadpoolError, match="restores nothing"):
        check_plan(dataclasses.replace(plan, local_restores=(1,)), TOPO_3D)
    facts = _facts(plan, TOPO_3D, 42)
    facts = [(g, 5, v, *c) for g, _, v, *c in facts]  # each found the checkpoint of 5
    assert generation_problems(plan, 42, facts, TOPO_3D) == []
    facts[3] = (facts[3][0], 0, *facts[3][2:])  # one found none
    assert generation_problems(plan, 42, facts, TOPO_3D) == [
        "rank 3 restored iteration 0, rank 0 5"
    ]


def test_check_plan_rejects_a_rank_restored_twice_or_from_a_failed_source():
    good = plan_recovery(view(TOPO_DP4), TOPO_DP4, {0}, holdings(TOPO_DP4, {0}))
    twice = RecoveryPlan(good.membership, good.iteration, good.replaced,
                         (0, *good.local_restores), good.transfers)  # fmt: skip
    with pytest.raises(DeadpoolError, match="rank 0 would be restored from"):
        check_plan(twice, TOPO_DP4)
    bad_source = RecoveryPlan(good.membership, good.iteration, good.replaced,
                              good.local_restores,
                              (*good.transfers[:1], Transfer("replica", 0, 0, 0, 5)))  # fmt: skip
    with pytest.raises(DeadpoolError, match="reads from failed rank 0"):
        check_plan(bad_source, TOPO_DP4)


def _facts(plan, topo, view_hash):
    return [
        (plan.generation, plan.iteration, view_hash, *(vars(topo.coords(r))[k] for k in
                                                        ("tp", "pp", "dp")),
         *topo.expert_coords(r))
        for r in range(topo.world_size)
    ]  # fmt: skip


@pytest.mark.parametrize(
    "rank, field, value, problem",
    [
        (None, None, None, None),
        (3, 0, 7, "rank 3 is in generation 7 / view 0x2a"),
        (5, 2, 41, "rank 5 is in generation 1 / view 0x29"),
        (0, 1, 4, "rank 0 restored iteration 4"),
        (6, 3, 1, "rank 6 holds coordinates (1, 1, 1, 0, 0)"),
    ],
)
def test_the_ranks_reports_after_a_restore_are_checked_against_the_plan(
    rank, field, value, problem
):
    plan = plan_recovery(view(TOPO_3D), TOPO_3D, {0}, holdings(TOPO_3D, {0}))
    facts = _facts(plan, TOPO_3D, 42)
    if rank is not None:
        facts[rank] = tuple(value if i == field else f for i, f in enumerate(facts[rank]))
    got = generation_problems(plan, 42, facts, TOPO_3D)
    assert got == ([] if problem is None else [problem])


def test_with_experts_the_parameters_come_from_a_rank_holding_the_same_experts():
    # EP2 x DP4: ranks 0 and 2 hold experts 0-1, ranks 1 and 3 experts 2-3. Rank 1's ring
    # predecessor is rank 0, whose experts are not rank 1's: its parameters come from rank 3.
    topo = Topology(4, tp=1, pp=1, ep=2)
    plan = plan_recovery(view(topo), topo, {1}, holdings(topo, {1}))
    assert set(plan.transfers) == {Transfer("parameters", 3, 1, 1, 5),
                                   Transfer("replica", 2, 1, 1, 5)}  # fmt: skip
    check_plan(plan, topo)
    with pytest.raises(Unrecoverable, match=r"same TP/PP and expert coordinates .* \[3\]"):
        plan_recovery(view(topo), topo, {1, 3}, holdings(topo, {1, 3}, k=2), replicas=2)


def test_a_seated_spare_that_holds_nothing_yet_receives_its_rank_s_state_without_a_spare():
    # Rank 0's spare was seated by a recovery a newer order cut short: in the membership it
    # holds rank 0 ("spare-0"), it holds no state yet. It is sourced as a replaced rank (a
    # DP peer's parameters, its ring successor's replica) and keeps its process; no spare is
    # taken, so it plans even with none left.
    seated = view(TOPO_3D, spares=())
    members = tuple(m._replace(process_id="spare-0") if m.rank == 0 else m for m in seated.ranks)
    seated = Membership(3, members, ())
    plan = plan_recovery(seated, TOPO_3D, set(), holdings(TOPO_3D, {0}), arriving={0})
    assert plan.replaced == {0: "spare-0"} and plan.arriving == (0,)
    assert plan.membership.member(0).process_id == "spare-0" and plan.generation == 4
    assert plan.local_restores == (1, 2, 3, 4, 5, 6, 7)
    assert set(plan.transfers) == {
        Transfer("parameters", 2, 0, 0, 5),
        Transfer("replica", 2, 0, 0, 5),
    }
    check_plan(plan, TOPO_3D)
    # beside a failed rank that takes the one spare there is
    two = plan_recovery(view(TOPO_3D, ("spare-1",)), TOPO_3D, {5}, holdings(TOPO_3D, {0, 5}),
                        arriving={0})  # fmt: skip
    assert two.replaced == {0: "w0", 5: "spare-1"} and two.arriving == (0,)
    check_plan(two, TOPO_3D)
    # its state gone with its only peer: unrecoverable as for any replaced rank
    with pytest.raises(Unrecoverable, match="no live DP peer"):
        plan_recovery(view(TOPO_3D, ("spare-1",)), TOPO_3D, {2}, holdings(TOPO_3D, {0, 2}),
                      arriving={0})  # fmt: skip
    with pytest.raises(ValueError, match="arriving ranks"):
        plan_recovery(view(TOPO_3D), TOPO_3D, {0}, holdings(TOPO_3D, {0}), arriving={0})
