"""The committed snapshots and replicas a process keeps from before a failure: what it reports
holding, where the rollback reads its own state, and which idle buffers the next generation's
protection pipeline may reuse instead of allocating new ones."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..checkpoint.buffers import Reusable, Slot, SlotPair
from ..checkpoint.pipeline import ProtectionPipeline
from ..errors import DeadpoolError
from .plan import RankHoldings


@dataclass
class Held:
    """Committed snapshots and replicas kept from before a failure, newest source first."""

    snapshots: list[SlotPair] = field(default_factory=list)
    replicas: dict[int, list[SlotPair]] = field(default_factory=dict)
    # Pairs (ids) of a pipeline whose snapshot thread had not ended when it was kept: never
    # handed over. Ids, not the pipelines: those would keep their process groups reachable.
    in_use: set[int] = field(default_factory=set)

    def keep(self, pipeline: ProtectionPipeline) -> None:
        if not pipeline.snapshotter.stopped:
            self.in_use.update(id(p) for p in pipeline.slot_pairs())
        if pipeline.snapshotter.slots.committed() is None:
            return
        self.snapshots.insert(0, pipeline.snapshotter.slots)
        for owner, pair in pipeline.replicator.replicas.items():
            self.replicas.setdefault(owner, []).insert(0, pair)

    def offer(self, iteration: int) -> Reusable:
        """The idle pairs holding `iteration`, for the generation that rolls back to it; the
        copies newer than it are dropped from them. Their other slot (an older copy, if any)
        is the first a new pipeline overwrites, as in training; the copy of `iteration` stays
        served until a new one is committed. A replication thread left behind (a wait gloo
        does not wake) touches no pair after its abort but the one it holds a slot of, which
        is busy, so its other pairs are handed over too."""

        def fit(pairs: list[SlotPair]) -> list[SlotPair]:
            found = [p for p in dict.fromkeys(pairs) if id(p) not in self.in_use and p.idle
                     and p.find(iteration) is not None]  # fmt: skip
            for p in found:
                p.drop_newer(iteration)
            return found

        return Reusable(
            tuple(fit(self.snapshots)),
            tuple((o, p) for o, ps in self.replicas.items() for p in fit(ps)),
        )

    def holdings(self) -> RankHoldings:
        return RankHoldings(
            frozenset(i for p in self.snapshots for i in p.iterations()),
            {
                o: frozenset(i for p in ps for i in p.iterations())
                for o, ps in self.replicas.items()
            },
        )

    def snapshot(self, iteration: int) -> tuple[SlotPair, Slot]:
        for pair in self.snapshots:
            slot = pair.find(iteration)
            if slot is not None:
                return pair, slot
        raise DeadpoolError(f"no committed snapshot of iteration {iteration} is held here")

    def replica(self, owner: int, iteration: int) -> SlotPair:
        for pair in self.replicas.get(owner, []):
            if pair.find(iteration) is not None:
                return pair
        raise DeadpoolError(f"no replica of rank {owner}'s shard at iteration {iteration} here")
