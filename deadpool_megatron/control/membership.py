"""Membership: the generation-numbered view of who holds each rank, and the spares left.

Every change makes a new generation and is committed by compare-and-swap against the exact
view the writer planned from, so a process of an older generation (a zombie that was fenced
off, or a straggler that lost a race) can never overwrite the current view. No rank is
special: rank 0 is replaced like any other.
"""

from __future__ import annotations

from . import keys
from .messages import Claim, Member, Membership, MembershipError
from .store import KVStore

__all__ = ["Member", "Membership", "MembershipError", "MembershipStore", "StaleGeneration"]

WITHDRAWN = "withdrawn"  # the claimer named in the claim key of a spare that took itself out


class StaleGeneration(MembershipError):
    """A write by a process whose generation is not the current one was refused."""

    def __init__(self, job: str, writer_generation: int, current_generation: int):
        super().__init__(
            f"job {job}: write by generation {writer_generation} refused, the membership is at "
            f"generation {current_generation}"
        )
        self.writer_generation = writer_generation
        self.current_generation = current_generation


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
        ok, existing = self._store.compare_and_swap(self._key, None, initial.encode())
        if not ok:
            generation = Membership.decode(existing).generation if existing else "?"
            raise MembershipError(
                f"job {self._job} already has a membership (generation {generation}) "
                f"in the store at {self._store.endpoint}"
            )

    def current(self) -> Membership | None:
        raw = self._store.get(self._key)
        return None if raw is None else Membership.decode(raw)

    def _read(self) -> tuple[bytes, Membership]:
        raw = self._store.get(self._key)
        if raw is None:
            raise MembershipError(
                f"job {self._job} has no membership in the store at {self._store.endpoint}"
            )
        return raw, Membership.decode(raw)

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
        ok, now = self._store.compare_and_swap(self._key, raw, new.encode())
        if not ok:
            current = Membership.decode(now).generation if now else -1
            raise StaleGeneration(self._job, writer_generation, current)

    def claim_spare(
        self, spare_id: str, by_generation: int, claimer: str = "", joined: tuple[str, ...] = ()
    ) -> bool:
        """Atomically claim a free spare for a swap planned in `by_generation`.

        True for exactly one of any number of concurrent claimers, and again for the claim
        the same claimer holds in the same generation (a coordinator planning again). False
        when the spare withdrew (`withdraw_spare`) or someone else claimed it: a claim whose
        commit then lost leaves the spare marked as claimed by that generation (its claim key).
        `joined`: spares that registered after this generation's membership was committed (a
        replenished pool); the caller saw their registrations.
        """
        _, view = self._read()
        if view.generation != by_generation:
            raise StaleGeneration(self._job, by_generation, view.generation)
        if spare_id not in view.spares and spare_id not in joined:
            raise MembershipError(
                f"spare {spare_id!r} is not free in generation {view.generation} "
                f"(free: {list(view.spares)})"
            )
        claim = Claim(claimer, by_generation)
        ok, held = self._store.compare_and_swap(
            keys.spare_claim(self._job, spare_id), None, claim.encode()
        )
        if ok:
            return True
        return held is not None and Claim.decode(held) == claim

    def withdraw_spare(self, spare_id: str) -> bool:
        """The spare takes itself out (SIGTERM while idle), by the same first-writer-wins key
        a claim takes: True if no recovery can claim it any more, False if one already has
        (then it must take its rank over: the recovery waits for it)."""
        ok, _ = self._store.compare_and_swap(
            keys.spare_claim(self._job, spare_id), None, Claim(WITHDRAWN, -1).encode()
        )
        return ok

    def claimable(self, spare_id: str, by_generation: int, claimer: str) -> bool:
        """Whether `claim_spare` could still give `claimer` this spare: nobody claimed it, or
        this claimer did in this generation. Not if it withdrew or another claim holds it."""
        held = self._store.get(keys.spare_claim(self._job, spare_id))
        return held is None or Claim.decode(held) == Claim(claimer, by_generation)
