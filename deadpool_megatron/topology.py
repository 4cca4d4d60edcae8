"""Pure rank <-> (tp, pp, dp) maths, in megatron-core's default rank order.

megatron-core orders ranks "tp-cp-ep-dp-pp" (tensor fastest, pipeline slowest), so with
TP=2, PP=2 on 8 ranks the TP groups are [0,1],[2,3].., the DP groups [0,2],[1,3],[4,6],[5,7]
and the PP groups [0,4],[1,5]... The DP ring (rank d sends its optimizer shard to d+1 mod DP,
inside the same TP/PP coordinates) is derived here too, so planning code never touches
torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError


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

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1 or self.world_size < 1:
            raise ConfigError(
                f"topology sizes must be positive: world={self.world_size} tp={self.tp} pp={self.pp}"
            )
        if self.world_size % (self.tp * self.pp):
            raise ConfigError(
                f"world size {self.world_size} is not divisible by tp {self.tp} x pp {self.pp}"
            )

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

    def ring_successors(self, rank: int, k: int = 1) -> list[int]:
        """The k next ranks on this rank's DP ring (who holds replicas of its shard)."""
        c = self.coords(rank)
        hops = min(k, self.dp - 1)
        return [
            self.rank(Coordinates(c.tp, c.pp, (c.dp + h) % self.dp)) for h in range(1, hops + 1)
        ]

    def ring_predecessors(self, rank: int, k: int = 1) -> list[int]:
        """The k previous ranks on this rank's DP ring (whose shards this rank replicates)."""
        c = self.coords(rank)
        hops = min(k, self.dp - 1)
        return [
            self.rank(Coordinates(c.tp, c.pp, (c.dp - h) % self.dp)) for h in range(1, hops + 1)
        ]

    def is_last_stage(self, rank: int) -> bool:
        return self.coords(rank).pp == self.pp - 1

    def _check(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} is outside the world of size {self.world_size}")
