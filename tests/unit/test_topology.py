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
