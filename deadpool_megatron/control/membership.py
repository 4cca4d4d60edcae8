"""Membership: the generation-numbered view of who holds each rank, and the spares left.

Every change makes a new generation and is committed by compare-and-swap against the exact
view the writer planned from, so a process of an older generation (a zombie that was fenced
off, or a straggler that lost a race) can never overwrite the current view. No rank is
special: rank 0 is replaced like any other.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import NamedTuple

from ..errors import DeadpoolError
from . import keys
from .store import KVStore


class MembershipError(DeadpoolError):
    """A membership that is malformed, missing, or cannot be changed as asked."""


class StaleGeneration(MembershipError):
    """A write by a process whose generation is not the current one was refused."""

    def __init__(self, job: str, writer_generation: int, current_generation: int):
        super().__init__(
            f"job {job}: write by generation {writer_generation} refused, the membership is at "
            f"generation {current_generation}"
        )
        self.writer_generation = writer_generation
        self.current_generation = current_generation


class Member(NamedTuple):
    rank: int
    process_id: str
    coords: tuple[int, int, int]  # (tp, pp, dp)


@dataclass(frozen=True)
class Membership:
    generation: int
    ranks: tuple[Member, ...]
    spares: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        members = tuple(
            sorted((Member(int(r), str(p), tuple(int(c) for c in xyz)) for r, p, xyz in self.ranks))
        )
        object.__setattr__(self, "ranks", members)
        object.__setattr__(self, "spares", tuple(str(s) for s in self.spares))
        if self.generation < 0:
            raise MembershipError(f"generation {self.generation} must be 0 or more")
        rank_list = [m.rank for m in members]
        if len(set(rank_list)) != len(rank_list):
            raise MembershipError(f"ranks {rank_list} are not unique")
        holders = [m.process_id for m in members] + list(self.spares)
        if len(set(holders)) != len(holders):
            raise MembershipError(f"process ids {holders} (ranks, then spares) are not unique")

    def member(self, rank: int) -> Member:
        for m in self.ranks:
            if m.rank == rank:
                return m
        known = [m.rank for m in self.ranks]
        raise MembershipError(f"rank {rank} is not in generation {self.generation} (ranks {known})")

    def to_json(self) -> bytes:
        """Canonical bytes: equal views serialise identically, which compare-and-swap needs."""
        doc = {
            "generation": self.generation,
            "ranks": [[m.rank, m.process_id, list(m.coords)] for m in self.ranks],
            "spares": list(self.spares),
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Membership:
        try:
            doc = json.loads(data)
            return cls(doc["generation"], tuple(doc["ranks"]), tuple(doc.get("spares", ())))
        except (ValueError, KeyError, TypeError) as err:
            raise MembershipError(f"malformed membership {data[:200]!r}: {err}") from err


def replace(view: Membership, failed_rank: int, spare_id: str | None = None) -> Membership:
    """Plan the next generation: `spare_id` (default: the first spare) takes `failed_rank`.

    The spare inherits the failed rank's (tp, pp, dp) coordinates, so every other rank keeps
    its groups and only the failed rank's state has to be restored.
    """
    failed = view.member(failed_rank)
    if not view.spares:
        raise MembershipError(
            f"no spare left to replace failed rank {failed_rank} (process {failed.process_id}) "
            f"in generation {view.generation}"
        )
    spare_id = view.spares[0] if spare_id is None else spare_id
    if spare_id not in view.spares:
        raise MembershipError(
            f"spare {spare_id!r} is not free in generation {view.generation} "
            f"(free: {list(view.spares)})"
        )
    ranks = tuple(
        Member(m.rank, spare_id, m.coords) if m.rank == failed_rank else m for m in view.ranks
    )
    spares = tuple(s for s in view.spares if s != spare_id)
    return Membership(view.generation + 1, ranks, spares)


class MembershipStore:
    """A job's membership in a KVStore; every change is fenced by the writer's generation."""

    def __init__(self, store: KVStore, job_id: str):
        self._store = store
        self._job = job_id
        self._key = keys.membership(job_id)

    def create(self, initial: Membership) -> None:
        """Write the first view; refused if the job already has one."""
        ok, existing = self._store.compare_and_swap(self._key, None, initial.to_json())
        if not ok:
            generation = Membership.from_json(existing).generation if existing else "?"
            raise MembershipError(
                f"job {self._job} already has a membership (generation {generation}) "
                f"in the store at {self._store.endpoint}"
            )

    def current(self) -> Membership | None:
        raw = self._store.get(self._key)
        return None if raw is None else Membership.from_json(raw)

    def _read(self) -> tuple[bytes, Membership]:
        raw = self._store.get(self._key)
        if raw is None:
            raise MembershipError(
                f"job {self._job} has no membership in the store at {self._store.endpoint}"
            )
        return raw, Membership.from_json(raw)

    def commit(self, new: Membership, writer_generation: int) -> None:
        """Make `new` (planned from generation `writer_generation`) the current view.

        Raises StaleGeneration if the membership is no longer at `writer_generation`: the
        writer is a zombie, or lost the race to another writer of its generation.
        """
        if new.generation != writer_generation + 1:
            raise MembershipError(
                f"a writer of generation {writer_generation} must commit generation "
                f"{writer_generation + 1}, not {new.generation}"
            )
        raw, view = self._read()
        if view.generation != writer_generation:
            raise StaleGeneration(self._job, writer_generation, view.generation)
        ok, now = self._store.compare_and_swap(self._key, raw, new.to_json())
        if not ok:
            current = Membership.from_json(now).generation if now else -1
            raise StaleGeneration(self._job, writer_generation, current)

    def claim_spare(self, spare_id: str, by_generation: int, claimer: str = "") -> bool:
        """Atomically claim a free spare for a swap planned in `by_generation`.

        True for exactly one of any number of concurrent claimers. A claim whose commit then
        loses leaves the spare marked as claimed by that generation (visible in its claim key).
        """
        _, view = self._read()
        if view.generation != by_generation:
            raise StaleGeneration(self._job, by_generation, view.generation)
        if spare_id not in view.spares:
            raise MembershipError(
                f"spare {spare_id!r} is not free in generation {view.generation} "
                f"(free: {list(view.spares)})"
            )
        claim = json.dumps({"generation": by_generation, "claimer": claimer}).encode()
        ok, _ = self._store.compare_and_swap(keys.spare_claim(self._job, spare_id), None, claim)
        return ok
