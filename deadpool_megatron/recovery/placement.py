"""Which spare takes which failed rank, by node. Pure: no I/O, tested as a table.

A whole lost node is taken over by one node's spares together (a spare node's), so the ranks
that shared a node share one again and the node-aware ring keeps its replicas on other nodes.
A single process failing on a live node takes a spare on that node first (no new network
paths, and spare nodes stay whole for the node failures that need them), then a spare on a
node that already runs ranks, and only then one on an idle spare node.
"""

from __future__ import annotations

from collections.abc import Mapping


def _natural(spare: str) -> tuple:
    head, _, tail = spare.rpartition("-")
    return (head, int(tail)) if tail.isdigit() else (spare, -1)


def order_spares(
    failed: Mapping[int, int | None],
    spares: Mapping[str, int | None],
    lost_nodes: set[int],
    busy_nodes: set[int],
) -> list[str]:
    """The free spares in the order the plan should seat them on `sorted(failed)`.

    `failed`: failed rank -> the node it ran on (None: unknown); `spares`: free spare -> its
    node; `lost_nodes`: nodes that are gone (their spares are not free); `busy_nodes`: live
    nodes that run ranks (their spares are used before an idle spare node's).
    """
    free: dict[int | None, list[str]] = {}
    for s in sorted(spares, key=_natural):
        node = spares[s]
        if node not in lost_nodes:
            free.setdefault(node, []).append(s)
    by_node: dict[int | None, list[int]] = {}
    for rank in sorted(failed):
        by_node.setdefault(failed[rank], []).append(rank)
    seat: dict[int, str] = {}
    # Whole lost nodes first: they need a node's worth of spares in one place.
    for node in sorted(by_node, key=lambda n: (n not in lost_nodes, -1 if n is None else n)):
        ranks = list(by_node[node])
        whole = node in lost_nodes
        if not whole and free.get(node):
            while ranks and free[node]:
                seat[ranks.pop(0)] = free[node].pop(0)
        while ranks:
            candidates = [n for n in free if free[n]]
            if not candidates:
                break  # the plan says no spare is left
            enough = len(ranks)

            def key(n, enough=enough, whole=whole):
                idle = n not in busy_nodes
                return (len(free[n]) < enough, idle != whole, -1 if n is None else n)

            target = min(candidates, key=key)
            while ranks and free[target]:
                seat[ranks.pop(0)] = free[target].pop(0)
    ordered = [seat[r] for r in sorted(seat)]
    rest = [s for n in sorted(free, key=lambda n: -1 if n is None else n) for s in free[n]]
    return ordered + rest
