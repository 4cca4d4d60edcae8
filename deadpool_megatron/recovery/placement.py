"""Which spare takes which failed rank, by node. Pure: no I/O, tested as a table.

A whole lost node is taken over by one node's spares together (a spare node's), so the ranks
that shared a node share one again and the node-aware ring keeps its replicas on other nodes.
A single process failing on a live node takes a spare on that node first (no new network
paths, and spare nodes stay whole for the node failures that need them), then a spare on a
node that already runs ranks, and only then one on an idle spare node. Among the spares of
one node, one that built the failed rank's model and optimizer while idle is seated first.

Which ranks an idle spare builds for (`prebuild_targets`) is decided here too: their state
fits every rank of the same coordinates (`fitting_ranks`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from ..topology import Topology


def _natural(spare: str) -> tuple:
    head, _, tail = spare.rpartition("-")
    return (head, int(tail)) if tail.isdigit() else (spare, -1)


def order_spares(
    failed: Mapping[int, int | None],
    spares: Mapping[str, int | None],
    lost_nodes: set[int],
    busy_nodes: set[int],
    prebuilt: Mapping[str, Collection[int]] | None = None,
) -> list[str]:
    """The free spares in the order the plan should seat them on `sorted(failed)`.

    `failed`: failed rank -> the node it ran on (None: unknown); `spares`: free spare -> its
    node; `lost_nodes`: nodes that are gone (their spares are not free); `busy_nodes`: live
    nodes that run ranks (their spares are used before an idle spare node's); `prebuilt`:
    spare -> the ranks it can take over without building (`SparePrebuilt`).
    """
    prebuilt = prebuilt or {}
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
                rank = ranks.pop(0)
                seat[rank] = _take(free[node], rank, ranks, prebuilt)
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
                rank = ranks.pop(0)
                seat[rank] = _take(free[target], rank, ranks, prebuilt)
    ordered = [seat[r] for r in sorted(seat)]
    rest = [s for n in sorted(free, key=lambda n: -1 if n is None else n) for s in free[n]]
    return ordered + rest


def _take(pool: list[str], rank: int, later: list[int], prebuilt: Mapping) -> str:
    """The spare of `pool` to seat on `rank` (removed from it): one that built for `rank`,
    else one that built for none of the `later` ranks, else the first."""
    fits = [s for s in pool if rank in prebuilt.get(s, ())]
    needed_later = set(later)
    spare_ones = [s for s in pool if not needed_later & set(prebuilt.get(s, ()))]
    choice = (fits or spare_ones or pool)[0]
    pool.remove(choice)
    return choice


def _fit_key(topo: Topology, rank: int, distributed_optimizer: bool) -> tuple[int, ...]:
    """What a rank's model and optimizer depend on: its tensor-parallel rank (the vocabulary
    range of its embedding shard) and pipeline stage (its layers), and, with the distributed
    optimizer, its data-parallel rank (the optimizer's shard)."""
    c = topo.coords(rank)
    return (c.tp, c.pp, c.dp) if distributed_optimizer else (c.tp, c.pp)


def fitting_ranks(topo: Topology, rank: int, distributed_optimizer: bool) -> tuple[int, ...]:
    """The ranks a model and optimizer built for `rank` fit (`rank` included)."""
    key = _fit_key(topo, rank, distributed_optimizer)
    return tuple(r for r in range(topo.world_size)
                 if _fit_key(topo, r, distributed_optimizer) == key)  # fmt: skip


def spare_local_rank(slot: int, per_node: int, spare_node: bool) -> int:
    """The local rank (device) of a node's spare in `slot`, as the launcher starts them: a
    worker node's after its `per_node` workers, a spare node's from 0."""
    return slot if spare_node else per_node + slot


JOINED_BLOCK = 1000  # spare indices per node that joined the running job: node n's from n x 1000


@dataclass(frozen=True)
class SpareRefills:
    """Where a node's refilling spares are numbered: `first`, then every `stride`, below
    `limit` (past it the numbers would meet a joined node's)."""

    first: int
    stride: int
    limit: int


@dataclass(frozen=True)
class SpareNumbering:
    """Every spare's index, unique across the job: each node numbers its spares in a block of
    its own, as wide as the most spares any node has (a worker node's `spares`, a spare node's
    `per_node`); a spare started later to refill a node's pool takes an index past every
    block, the nodes taking turns. A node that joined the running job (`deadpool-launch
    --join`, index `node_count` on) numbers its spares and their refills from node x
    `JOINED_BLOCK`: nobody knows at launch how many will join."""

    nnodes: int  # worker nodes
    spare_nodes: int
    per_node: int
    spares: int  # a worker node's

    @property
    def node_count(self) -> int:
        return self.nnodes + self.spare_nodes

    @property
    def slots(self) -> int:
        return max(self.spares, self.per_node if self.spare_nodes else 0)

    def started(self, node: int) -> int:
        """How many spares `node` is launched with (a joined node: as a spare node)."""
        return self.per_node if node >= self.nnodes else self.spares

    def index(self, slot: int, node: int) -> int:
        if node >= self.node_count:
            return node * JOINED_BLOCK + slot
        return node * self.slots + slot

    def launched(self) -> dict[int, int]:
        """Every spare the job is launched with: its index -> its node."""
        return {
            self.index(s, node): node
            for node in range(self.node_count)
            for s in range(self.started(node))
        }

    def refills(self, node: int) -> SpareRefills:
        """How `node` numbers the spares it starts to refill its pool."""
        if node >= self.node_count:
            base = node * JOINED_BLOCK
            return SpareRefills(base + self.per_node, 1, base + JOINED_BLOCK)
        first = self.node_count * self.slots + node
        return SpareRefills(first, self.node_count, self.node_count * JOINED_BLOCK)


def spare_slot(local_rank: int, per_node: int) -> int:
    """The slot among its node's spares of the spare at `local_rank` (the inverse of
    `spare_local_rank`); a fresh spare started in a lost worker's place takes that worker's."""
    return local_rank - per_node if local_rank >= per_node else local_rank


def prebuild_targets(
    topo: Topology, node: int, slot: int, count: int, distributed_optimizer: bool
) -> list[int]:
    """The ranks the spare in `slot` of `node` builds a model and optimizer for while idle:
    `count` kinds of rank (by `fitting_ranks`), each kind by its first rank, among the ranks it
    would be seated on. A worker node's spares take its own ranks' failures first
    (`order_spares`): they take consecutive kinds of that node's ranks in turn, so that
    together they cover as many as they can. A spare node takes a lost node over slot by slot:
    its spare in slot i builds for local rank i of the worker nodes, each spare node starting
    at another node. One node holding every rank (or no node layout) is the first case."""
    per_node = topo.ranks_per_node or topo.world_size
    nodes = topo.world_size // per_node
    if node < nodes:  # a worker node's spare
        candidates = list(range(node * per_node, (node + 1) * per_node))
        start = slot * count
    else:  # a spare node's: it would take local rank `slot` of whichever node is lost
        local = slot % per_node
        candidates = [n * per_node + local for n in range(nodes)]
        start = (node - nodes) * count
    kinds: dict[tuple[int, ...], int] = {}
    for r in candidates:
        kinds.setdefault(_fit_key(topo, r, distributed_optimizer), r)
    order = list(kinds.values())
    count = min(count, len(order))
    return [order[(start + i) % len(order)] for i in range(count)]
