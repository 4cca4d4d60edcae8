"""The replication ring's groups: one group of two per ring edge, connected by its two ranks
only, created in an order that never deadlocks, carrying replicas to the right peers.

Both jobs run in one set of driver processes, one after the other, each with process groups
of its own (tests/drivers/ring_pairs_driver.py): the processes' start-up was most of each
test's time."""

from __future__ import annotations

import pytest

from jobs import ROOT

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(240)]

SIX_OVER_THREE_NODES = "6,1,1,2,2"  # WORLD,TP,PP,REPLICAS,RANKS_PER_NODE
TWO_RINGS_OF_TWO = "4,2,1,1,0"


@pytest.fixture(scope="module")
def seen(tmp_path_factory, run_drivers) -> dict[str, list[dict]]:
    """job -> what each of its ranks saw, in rank order."""
    driver = ROOT / "tests" / "drivers" / "ring_pairs_driver.py"
    store = tmp_path_factory.mktemp("ring_pairs") / "store"
    jobs = [SIX_OVER_THREE_NODES, TWO_RINGS_OF_TWO]
    outs = run_drivers(driver, [[str(r), str(store), *jobs] for r in range(6)], timeout_s=200)
    return {job: [out[job] for out in outs if job in out] for job in jobs}


def test_two_replicas_on_a_ring_of_six_spanning_three_nodes(seen):
    # DP6 over 3 nodes of 2: the ring interleaves nodes, 0 -> 2 -> 4 -> 1 -> 3 -> 5 -> 0.
    outs = seen[SIX_OVER_THREE_NODES]
    ring = [0, 2, 4, 1, 3, 5]
    assert [out["rank"] for out in outs] == list(range(6))
    for out in outs:
        i = ring.index(out["rank"])
        succ = [ring[(i + 1) % 6], ring[(i + 2) % 6]]
        pred = [ring[(i - 1) % 6], ring[(i - 2) % 6]]
        assert out["edges"] == sorted(set(succ + pred))
        assert out["edge_sizes"] == [2] and out["groups_added"] == 4  # not the whole ring
        assert out["received"] == {str(p): p * 100 + out["rank"] for p in pred}


def test_one_replica_on_rings_of_two_share_one_edge_each_way(seen):
    # TP2 x DP2: rings [0, 2] and [1, 3]; successor and predecessor are the same peer.
    outs = seen[TWO_RINGS_OF_TWO]
    peer = {0: 2, 2: 0, 1: 3, 3: 1}
    assert [out["rank"] for out in outs] == list(range(4))
    for out in outs:
        p = peer[out["rank"]]
        assert out["edges"] == [p] and out["groups_added"] == 1
        assert out["received"] == {str(p): p * 100 + out["rank"]}
