"""Topology maths against megatron-core's documented layout (TP fastest, PP slowest)."""

import pytest

from deadpool_megatron.errors import ConfigError
from deadpool_megatron.topology import Coordinates, Topology


def test_groups_match_megatron_order_for_tp2_pp2_dp2():
    topo = Topology(world_size=8, tp=2, pp=2)
    assert topo.dp == 2
    assert [topo.tp_group(r) for r in (0, 2, 4, 6)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [topo.dp_group(r) for r in (0, 1, 4, 5)] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert [topo.pp_group(r) for r in (0, 1, 2, 3)] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_rank_and_coords_are_inverse():
    topo = Topology(world_size=24, tp=2, pp=3)
    seen = set()
    for rank in range(24):
        c = topo.coords(rank)
        assert topo.rank(c) == rank
        seen.add((c.tp, c.pp, c.dp))
    assert len(seen) == 24


def test_ring_neighbours_stay_inside_tp_pp_coordinates():
    topo = Topology(world_size=16, tp=2, pp=2)  # dp = 4
    for rank in range(16):
        c = topo.coords(rank)
        succ = topo.ring_successors(rank, k=2)
        assert len(succ) == 2
        for hop, s in enumerate(succ, start=1):
            sc = topo.coords(s)
            assert (sc.tp, sc.pp) == (c.tp, c.pp)
            assert sc.dp == (c.dp + hop) % 4
        assert topo.ring_predecessors(succ[0])[0] == rank


def test_ring_is_capped_by_dp_size():
    topo = Topology(world_size=4, tp=2, pp=1)  # dp = 2
    assert topo.ring_successors(0, k=3) == [2]
    assert Topology(world_size=2, tp=2, pp=1).ring_successors(0) == []


def test_bad_sizes_and_ranks_are_rejected_with_the_value():
    with pytest.raises(ConfigError, match="world size 6 is not divisible by tp 2 x pp 2"):
        Topology(world_size=6, tp=2, pp=2)
    topo = Topology(world_size=8, tp=2, pp=2)
    with pytest.raises(ConfigError, match="rank 8 is outside"):
        topo.coords(8)
    with pytest.raises(ConfigError, match="lie outside"):
        topo.rank(Coordinates(tp=2, pp=0, dp=0))


def test_on_one_node_the_ring_is_dp_order():
    topo = Topology(world_size=8, tp=2, pp=1, ranks_per_node=8)  # dp = 4: ring [0, 2, 4, 6]
    assert topo.ring(2) == [0, 2, 4, 6] == Topology(8, 2, 1).ring(2)
    assert topo.ring_successors(6, 2) == [0, 2] and topo.ring_predecessors(0) == [6]


def test_across_nodes_the_ring_puts_every_replica_on_another_node():
    # 3 nodes of 2 ranks, DP 6: naive order would place rank 0's replica on rank 1, its own
    # node; the ring visits the nodes in turn instead.
    topo = Topology(world_size=6, tp=1, pp=1, ranks_per_node=2)
    assert [topo.node(r) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    assert topo.ring(0) == [0, 2, 4, 1, 3, 5]
    for rank in range(6):
        for succ in topo.ring_successors(rank, 2):
            assert topo.node(succ) != topo.node(rank)
        assert rank in topo.ring_successors(topo.ring_predecessors(rank)[0])
    assert topo.unprotected_against_node_loss(2) == []


def test_shards_a_node_loss_would_take_are_named():
    # TP2 x DP2 with 4 ranks per node: each DP group ([0, 2], [1, 3]) lies on one node.
    topo = Topology(world_size=8, tp=2, pp=2, ranks_per_node=4)
    assert topo.unprotected_against_node_loss(1) == list(range(8))
    # 2 ranks per node: DP peers 0 and 2 are on nodes 0 and 1.
    assert Topology(8, 2, 2, ranks_per_node=2).unprotected_against_node_loss(1) == []


@pytest.mark.parametrize(
    "world,tp,pp,k", [(32, 1, 2, 1), (16, 2, 1, 2), (12, 1, 1, 3), (6, 1, 2, 1)]
)
def test_ring_edges_come_in_rounds_where_no_rank_has_two(world, tp, pp, k):
    topo = Topology(world, tp, pp)
    edges = topo.ring_edges(k)
    expected = {tuple(sorted((r, s))) for r in range(world) for s in topo.ring_successors(r, k)}
    assert sorted(edges) == sorted(expected) and len(edges) == len(expected)
    # walking the order, a round ends where a rank comes again: a group of two connects
    # once both ranks reach it, so the rounds bound the chain of connections one after
    # another (plain sorted order: (0,1), (0,15), (1,2), (2,3), ... about one per rank)
    rounds, seen = 1, set()
    for a, b in edges:
        if a in seen or b in seen:
            rounds, seen = rounds + 1, set()
        seen |= {a, b}
    assert rounds <= 2 * k + 1  # a ring's edges need 2 rounds (3 when odd), k rings' 2k + 1
    assert edges == topo.ring_edges(k)  # the same order on every rank


@pytest.mark.parametrize(
    "world, tp, pp, ep, etp",
    [(4, 1, 1, 2, None), (8, 1, 2, 2, None), (8, 2, 1, 2, None), (16, 2, 2, 2, 1),
     (16, 1, 1, 4, None), (8, 2, 1, 1, 1), (16, 2, 1, 2, 4), (8, 1, 2, 4, None)],
)  # fmt: skip
def test_expert_coordinates_follow_megatron_core_s_expert_layout(world, tp, pp, ep, etp):
    # megatron-core's own generator of the expert groups (parallel_state.initialize_model_parallel)
    from megatron.core.parallel_state import RankGenerator

    topo = Topology(world, tp, pp, ep=ep, etp=etp)
    expert_tp = tp if etp is None else etp
    layout = RankGenerator(tp=expert_tp, ep=ep, dp=world // (expert_tp * ep * pp), pp=pp, cp=1,
                           order="tp-cp-ep-dp-pp", rank_offset=0)  # fmt: skip
    for group in layout.get_ranks("ep"):
        assert [topo.expert_coords(r)[1] for r in group] == list(range(ep))
    for group in layout.get_ranks("tp"):
        assert [topo.expert_coords(r)[0] for r in group] == list(range(expert_tp))
    holders = {}  # ranks holding the same parameters: same dense and expert slices
    for group in layout.get_ranks("dp"):  # megatron-core's expert data-parallel groups
        for r in group:
            holders[r] = {p for p in group if p != r and topo.coords(p).tp == topo.coords(r).tp}
    assert {r: set(topo.parameter_peers(r)) for r in range(world)} == holders
    assert topo.sole_parameter_holders() == [r for r in range(world) if not holders[r]]


def test_without_experts_every_dp_peer_holds_the_same_parameters():
    topo = Topology(8, tp=2, pp=1)
    assert topo.parameter_peers(0) == [2, 4, 6] and topo.sole_parameter_holders() == []
    assert topo.expert_coords(5) == (1, 0)


def test_experts_as_wide_as_data_parallelism_leave_each_on_one_rank():
    assert Topology(4, tp=1, pp=1, ep=2).parameter_peers(1) == [3]
    assert Topology(4, tp=1, pp=1, ep=4).sole_parameter_holders() == [0, 1, 2, 3]
    with pytest.raises(ConfigError, match="not divisible by expert tensor-parallel size 1 x "
                                          "expert-parallel size 3"):  # fmt: skip
        Topology(4, tp=1, pp=1, ep=3)
