"""Spare placement by node, as a table: a lost node's ranks move together onto one node with
room for all of them, preferring an idle spare node; a single failure on a live node takes a
local spare first, then a spare on a node that already runs ranks, spare nodes last."""

import pytest

from deadpool_megatron.agent.replenish import Replenisher
from deadpool_megatron.recovery.placement import SpareNumbering, order_spares

# Worker nodes 0, 1, 2 (ranks 2n, 2n+1), one local spare each (spare-0, spare-2, spare-4);
# spare node 3 with spare-6 and spare-7.
SPARES = {"spare-0": 0, "spare-2": 1, "spare-4": 2, "spare-6": 3, "spare-7": 3}
BUSY = {0, 1, 2}


def seat(failed, spares=SPARES, lost=frozenset(), busy=BUSY):
    order = order_spares(failed, spares, set(lost), set(busy))
    return dict(zip(sorted(failed), order))


@pytest.mark.parametrize(
    ("failed", "lost", "expected"),
    [
        # A whole node: both ranks onto the spare node, together.
        ({2: 1, 3: 1}, {1}, {2: "spare-6", 3: "spare-7"}),
        # One process on a live node: its own node's spare.
        ({3: 1}, set(), {3: "spare-2"}),
        # Two processes on one live node with one local spare: the local one, then a spare on
        # a busy node rather than breaking into the spare node.
        ({2: 1, 3: 1}, set(), {2: "spare-2", 3: "spare-0"}),
        # Processes on two live nodes: each takes its own node's spare.
        ({1: 0, 5: 2}, set(), {1: "spare-0", 5: "spare-4"}),
        # Rank of unknown node: any busy node's spare first.
        ({4: None}, set(), {4: "spare-0"}),
    ],
)
def test_seating(failed, lost, expected):
    assert seat(failed, lost=lost) == expected


def test_a_lost_nodes_spares_are_not_free():
    spares = dict(SPARES, **{"spare-8": 4, "spare-9": 4})
    assert seat({0: 0, 1: 0}, spares, lost={0, 3}) == {0: "spare-8", 1: "spare-9"}
    order = order_spares({0: 0}, spares, {0, 3}, BUSY)
    assert "spare-0" not in order and "spare-6" not in order


def test_without_a_node_with_room_for_all_the_lost_ranks_the_spare_node_goes_first():
    spares = {"spare-0": 0, "spare-2": 1, "spare-6": 3}
    assert seat({4: 2, 5: 2}, spares, lost={2}) == {4: "spare-6", 5: "spare-0"}


def test_every_free_spare_is_listed_once_after_the_seated_ones():
    order = order_spares({3: 1}, SPARES, set(), BUSY)
    assert order[0] == "spare-2" and sorted(order) == sorted(SPARES)


@pytest.mark.parametrize(
    "nnodes, spare_nodes, per_node, spares, launched, refill",
    [
        (1, 0, 4, 1, {0: 0}, [1]),  # one node, one spare; its refills 1, 2, ...
        (2, 0, 4, 2, {0: 0, 1: 0, 2: 1, 3: 1}, [4, 5]),
        # a spare node's block is as wide as a node: every node's is
        (2, 1, 4, 1, {0: 0, 4: 1, 8: 2, 9: 2, 10: 2, 11: 2}, [12, 13, 14]),
    ],
)
def test_spares_are_numbered_in_a_block_per_node_and_refills_past_every_block(
    nnodes, spare_nodes, per_node, spares, launched, refill
):
    numbering = SpareNumbering(nnodes, spare_nodes, per_node, spares)
    assert numbering.launched() == launched
    assert [numbering.refills(n).first for n in range(nnodes + spare_nodes)] == refill
    # a node's next refill is node_count further on (Replenisher's stride): never a clash
    firsts = set(refill)
    assert not firsts & set(launched)


@pytest.mark.parametrize("nnodes, spare_nodes, per_node, spares", [(1, 0, 4, 1), (2, 1, 4, 1),
                                                                      (3, 0, 2, 0)])  # fmt: skip
def test_nodes_that_join_number_their_spares_apart_from_every_launched_nodes(
    nnodes, spare_nodes, per_node, spares
):
    numbering = SpareNumbering(nnodes, spare_nodes, per_node, spares)
    count = nnodes + spare_nodes
    joined = range(count, count + 3)
    taken: dict[int, str] = {}

    def take(index: int, who: str) -> None:
        assert index not in taken, (index, who, taken.get(index))
        taken[index] = who

    for index, node in numbering.launched().items():
        take(index, f"launched on node {node}")
    for node in joined:  # a joined node starts as a spare node: --nproc-per-node spares
        assert numbering.started(node) == per_node
        for slot in range(per_node):
            take(numbering.index(slot, node), f"joined node {node}")
    for node in [*range(count), *joined]:  # every refill each node can ever start
        refills = numbering.refills(node)
        index = refills.first
        while index < refills.limit:
            take(index, f"refill of node {node}")
            index += refills.stride
    assert numbering.index(1, count) == count * 1000 + 1  # readable: node 3's spare-3001


def test_a_node_whose_refill_numbers_are_used_up_stops_refilling():
    r = Replenisher(True, first_index=10, stride=5, limit=20)
    r.lost(0), r.lost(1), r.lost(2)
    assert [r.next_start().index, r.next_start().index, r.next_start()] == [10, 15, None]
    assert r.stopped and "used up" in r.stopped
