"""The replication ring's groups: one group of two per ring edge, connected by its two ranks
only, created in an order that never deadlocks, carrying replicas to the right peers."""

from __future__ import annotations

import pytest

from jobs import ROOT, run_drivers

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(240)]


def _run(tmp_path, world, tp, pp, replicas, per_node):
    driver = ROOT / "tests" / "drivers" / "ring_pairs_driver.py"
    args = [str(a) for a in (world, tp, pp, replicas, per_node)]
    argvs = [[str(rank), *args, str(tmp_path / "store")] for rank in range(world)]
    return run_drivers(driver, argvs, timeout_s=200)


def test_two_replicas_on_a_ring_of_six_spanning_three_nodes(tmp_path):
    # DP6 over 3 nodes of 2: the ring interleaves nodes, 0 -> 2 -> 4 -> 1 -> 3 -> 5 -> 0.
    outs = _run(tmp_path, 6, 1, 1, 2, 2)
    ring = [0, 2, 4, 1, 3, 5]
    for out in outs:
        i = ring.index(out["rank"])
        succ = [ring[(i + 1) % 6], ring[(i + 2) % 6]]
        pred = [ring[(i - 1) % 6], ring[(i - 2) % 6]]
        assert out["edges"] == sorted(set(succ + pred))
        assert out["edge_sizes"] == [2] and out["groups_added"] == 4  # not the whole ring
        assert out["received"] == {str(p): p * 100 + out["rank"] for p in pred}


def test_one_replica_on_rings_of_two_share_one_edge_each_way(tmp_path):
    # TP2 x DP2: rings [0, 2] and [1, 3]; successor and predecessor are the same peer.
    outs = _run(tmp_path, 4, 2, 1, 1, 0)
    peer = {0: 2, 2: 0, 1: 3, 3: 1}
    for out in outs:
        p = peer[out["rank"]]
        assert out["edges"] == [p] and out["groups_added"] == 1
        assert out["received"] == {str(p): p * 100 + out["rank"]}
