"""Pure rank <-> (tp, pp, dp) maths, in megatron-core's default rank order.

megatron-core orders ranks "tp-cp-ep-dp-pp" (tensor fastest, pipeline slowest), so with
TP=2, PP=2 on 8 ranks the TP groups are [0,1],[2,3].., the DP groups [0,2],[1,3],[4,6],[5,7]
and the PP groups [0,4],[1,5]... The DP ring (each rank sends its optimizer shard to the next
K members of its DP group, inside the same TP/PP coordinates) is derived here too, so planning
code never touches torch.distributed.

Nodes hold consecutive ranks (`ranks_per_node` of them, as every launcher places them). When a
DP group spans nodes, its ring visits the nodes in turn (the first member of each node, then
the second, ...), so a rank's replicas live on other nodes than its own and one node's loss
never takes a shard together with its replicas; `unprotected_against_node_loss` names the
shards the shape and K cannot protect that way.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Protocol

from .errors import ConfigError


class ParallelShape(Protocol):
    """What a topology reads of a job's parallel settings (config.ParallelConfig)."""

    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    expert_model_parallel_size: int
    expert_tensor_parallel_size: int | None


@dataclass(frozen=True)
class Coordinates:
    tp: int
    pp: int
    dp: int


@dataclass(frozen=True)
class Topology:
    world_size: int
    tp: int
    pp: int
    ranks_per_node: int | None = None  # None: every rank on one node
    # Expert layers (MoE): megatron-core lays each pipeline stage's ranks out again for them,
    # "tp-ep-dp" with the expert tensor-parallel size (default: tp) fastest
    ep: int = 1
    etp: int | None = None

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1 or self.world_size < 1:
            raise ConfigError(
                f"topology sizes must be positive: world={self.world_size} tp={self.tp} pp={self.pp}"
            )
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise ConfigError(f"ranks per node must be positive, got {self.ranks_per_node}")
        if self.world_size % (self.tp * self.pp):
            raise ConfigError(
                f"world size {self.world_size} is not divisible by tp {self.tp} x pp {self.pp}"
            )
        if (
            self.ep < 1
            or self.expert_tp < 1
            or (self.world_size // self.pp) % (self.expert_tp * self.ep)
        ):
            raise ConfigError(
                f"{self.world_size // self.pp} ranks per pipeline stage are not divisible by "
                f"expert tensor-parallel size {self.expert_tp} x expert-parallel size {self.ep}"
            )

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def experts_apart(self) -> bool:
        """Whether expert layers are laid out apart from the rest (some data-parallel peers
        then hold other experts than this rank's)."""
        return self.ep > 1 or self.expert_tp != self.tp

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    def coords(self, rank: int) -> Coordinates:
        self._check(rank)
        return Coordinates(
            tp=rank % self.tp,
            dp=(rank // self.tp) % self.dp,
            pp=rank // (self.tp * self.dp),
        )

    def rank(self, c: Coordinates) -> int:
        if not (0 <= c.tp < self.tp and 0 <= c.pp < self.pp and 0 <= c.dp < self.dp):
            raise ConfigError(f"coordinates {c} lie outside tp={self.tp} pp={self.pp} dp={self.dp}")
        return c.tp + self.tp * (c.dp + self.dp * c.pp)

    def dp_group(self, rank: int) -> list[int]:
        """Ranks sharing this rank's (tp, pp) coordinates, in DP order."""
        c = self.coords(rank)
        return [self.rank(Coordinates(c.tp, c.pp, d)) for d in range(self.dp)]

    def tp_group(self, rank: int) -> list[int]:
        c = self.coords(rank)
        return [self.rank(Coordinates(t, c.pp, c.dp)) for t in range(self.tp)]

    def pp_group(self, rank: int) -> list[int]:
        c = self.coords(rank)
        return [self.rank(Coordinates(c.tp, p, c.dp)) for p in range(self.pp)]

    def expert_coords(self, rank: int) -> tuple[int, int]:
        """This rank's (expert tensor-parallel, expert-parallel) ranks: which slice of which
        experts it holds."""
        self._check(rank)
        local = rank % (self.world_size // self.pp)
        return local % self.expert_tp, (local // self.expert_tp) % self.ep

    def parameter_peers(self, rank: int) -> list[int]:
        """The other ranks holding exactly this rank's parameters, in DP order: its DP peers
        (same tp, pp), of those with experts the ones holding the same experts' same slice."""
        mine = self.expert_coords(rank)
        return [p for p in self.dp_group(rank) if p != rank and self.expert_coords(p) == mine]

    def sole_parameter_holders(self) -> list[int]:
        """Ranks whose parameters no other rank holds (expert parallelism as wide as data
        parallelism): a spare could not be given them. One pass over the ranks (a job's
        validation asks it of every rank)."""
        holders = Counter(self._parameter_key(r) for r in range(self.world_size))
        return [r for r in range(self.world_size) if holders[self._parameter_key(r)] == 1]

    def _parameter_key(self, rank: int) -> tuple[int, int, int, int]:
        """What decides a rank's parameters: its pipeline stage, tensor slice, experts' slice
        and experts (parameter_peers' peers share it)."""
        c = self.coords(rank)
        return (c.pp, c.tp, *self.expert_coords(rank))

    def node(self, rank: int) -> int:
        self._check(rank)
        return 0 if self.ranks_per_node is None else rank // self.ranks_per_node

    def ring(self, rank: int) -> list[int]:
        """This rank's DP group in ring order: DP order on one node; across nodes, the first
        member of each node (in node order), then the second of each, and so on."""
        members = self.dp_group(rank)
        by_node: dict[int, list[int]] = {}
        for m in members:
            by_node.setdefault(self.node(m), []).append(m)
        if len(by_node) == 1:
            return members
        columns = [by_node[n] for n in sorted(by_node)]
        return [col[i] for i in range(max(map(len, columns))) for col in columns if i < len(col)]

    def ring_successors(self, rank: int, k: int = 1) -> list[int]:
        """The k next ranks on this rank's DP ring (who holds replicas of its shard)."""
        ring = self.ring(rank)
        i, n = ring.index(rank), len(ring)
        return [ring[(i + h) % n] for h in range(1, min(k, n - 1) + 1)]

    def ring_predecessors(self, rank: int, k: int = 1) -> list[int]:
        """The k previous ranks on this rank's DP ring (whose shards this rank replicates)."""
        ring = self.ring(rank)
        i, n = ring.index(rank), len(ring)
        return [ring[(i - h) % n] for h in range(1, min(k, n - 1) + 1)]

    def ring_edges(self, k: int = 1) -> list[tuple[int, int]]:
        """Every ring edge of the job (a rank to each of its k successors) as (low, high), in
        rounds in which no rank has two edges: the order every rank creates the edges' groups.

        A group of two connects only once both of its ranks reach it, so with the edges in
        plain sorted order each rank's second edge waited for its peer's first, which waited
        for the next rank's first...: the connections went one after another around each
        ring. In rounds (a greedy edge colouring), each round's pairs connect at once."""
        edges = sorted(
            {tuple(sorted((r, s))) for r in range(self.world_size)
             for s in self.ring_successors(r, k)}
        )  # fmt: skip
        used: dict[int, set[int]] = {}
        rounds = {}
        for a, b in edges:
            taken = used.setdefault(a, set()) | used.setdefault(b, set())
            rounds[(a, b)] = next(c for c in range(len(edges) + 1) if c not in taken)
            used[a].add(rounds[(a, b)])
            used[b].add(rounds[(a, b)])
        return sorted(edges, key=lambda e: (rounds[e], e))

    def unprotected_against_node_loss(self, k: int) -> list[int]:
        """Ranks whose optimizer shard and every one of its k replicas share one node: losing
        that node loses the shard (their DP group does not span nodes enough for k)."""
        return [
            r
            for r in range(self.world_size)
            if all(self.node(s) == self.node(r) for s in self.ring_successors(r, k))
        ]

    def is_last_stage(self, rank: int) -> bool:
        return self.coords(rank).pp == self.pp - 1

    def _check(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} is outside the world of size {self.world_size}")


def job_topology(
    world_size: int, parallel: ParallelShape, ranks_per_node: int | None = None
) -> Topology:
    """The topology of a job of `world_size` ranks laid out as `parallel` says."""
    return Topology(
        world_size, parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
        ranks_per_node, ep=parallel.expert_model_parallel_size,
        etp=parallel.expert_tensor_parallel_size,
    )  # fmt: skip
