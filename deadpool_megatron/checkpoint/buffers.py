"""Preallocated host buffers with atomic commit.

A `Slot` is one flat byte buffer plus what makes it trustworthy: the iteration it holds, its
metadata and a checksum over every byte. A slot is committed only after its copy completed and
its checksum verified; a `SlotPair` (ping-pong) always keeps the last committed slot intact
while the other one is being written, so a half-written or corrupt copy never replaces it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import xxhash

from ..errors import DeadpoolError

# Per-iteration timings are kept for the latest SAMPLES iterations only: a job runs for months.
SAMPLES = 1000


# Metadata is a few KB (RNG states, scheduler, param groups); a header announcing more is
# corrupt and is refused before anything is allocated for it.
MAX_META_BYTES = 64 * 2**20


def checksum(buffer: torch.Tensor, meta: bytes = b"", iteration: int = -1) -> int:
    """xxh3-64 over the bytes of a contiguous CPU uint8 buffer, the metadata and the iteration
    the copy is of (a header field a reader trusts, so it is covered too)."""
    h = xxhash.xxh3_64()
    h.update(memoryview(buffer.numpy()))
    h.update(meta)
    h.update(iteration.to_bytes(8, "little", signed=True))
    return h.intdigest()


def checksums(buffer: torch.Tensor, prefix: int, meta: bytes, iteration: int) -> tuple[int, int]:
    """(checksum of the whole buffer, checksum of its first `prefix` bytes), each as
    `checksum` defines it, in one pass over the bytes: a snapshot's part that is replicated
    (the optimizer shard) gets the digest its replicas are checked against for free."""
    data = memoryview(buffer.numpy())
    tail = meta + iteration.to_bytes(8, "little", signed=True)
    h = xxhash.xxh3_64()
    h.update(data[:prefix])
    part = h.copy()
    part.update(tail)
    h.update(data[prefix:])
    h.update(tail)
    return h.intdigest(), part.intdigest()


def allocate(nbytes: int, pin: bool) -> torch.Tensor:
    """A host buffer, touched once now so no page fault lands on the training path."""
    buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pin)
    buf.zero_()
    return buf[:nbytes]


# Buffers carved from an arena start on a page: typed views of a slot (float32, int64, bf16
# entries at their layout offsets) stay aligned as in a buffer of their own.
ALIGN = 4096


def aligned(nbytes: int) -> int:
    return -(-max(nbytes, 1) // ALIGN) * ALIGN


class HostArena:
    """Host memory allocated and touched ahead of need, handed out as slot buffers.

    An idle spare reserves one as large as the largest rank's protection buffers
    (`arena_nbytes` of each rank's footprint): when it is claimed, its pipeline's slot pairs
    are carved from it instead of being allocated and zeroed then, which a recovery waited
    for (0.2 s at 12.7M parameters on this machine, growing with the model)."""

    def __init__(self, nbytes: int, pin: bool):
        self.pin = pin
        self.buffer = allocate(nbytes, pin)
        self._used = 0
        self._lock = threading.Lock()

    @property
    def free(self) -> int:
        with self._lock:
            return self.buffer.numel() - self._used

    def take(self, nbytes: int, pin: bool) -> torch.Tensor | None:
        """`nbytes` of it (page-aligned), or None when it cannot give them: too little left,
        or pinned memory asked of a pageable arena (or the other way round)."""
        if pin != self.pin:
            return None
        with self._lock:
            if self._used + aligned(nbytes) > self.buffer.numel():
                return None
            start, self._used = self._used, self._used + aligned(nbytes)
        return self.buffer[start : start + nbytes]


def arena_nbytes(buffers: tuple[int, ...] | list[int]) -> int:
    """The arena that holds buffers of these sizes."""
    return sum(aligned(n) for n in buffers)


def _age(slot: Slot) -> tuple[int, int]:
    return slot.iteration, slot.order


@dataclass
class Slot:
    buffer: torch.Tensor
    iteration: int = -1
    meta: bytes = b""
    checksum: int | None = None
    prefix_checksum: int | None = None  # of the pair's first prefix_nbytes bytes (the sent part)
    committed: bool = False
    busy: bool = False  # being written, or read by a sender
    order: int = 0  # commits of its pair so far when it was committed: the later of two
    # copies of one iteration (a recovery's new generation rewrites the one it rolled back to)

    def verify(self) -> bool:
        return self.checksum is not None and (
            checksum(self.buffer, self.meta, self.iteration) == self.checksum
        )


class CorruptCopy(DeadpoolError):
    """A copy whose bytes do not match its checksum; the previous committed copy stays."""


class SlotPair:
    """Two slots of the same size: one holds the last committed copy, one takes the next."""

    def __init__(
        self,
        nbytes: int,
        pin: bool = False,
        prefix_nbytes: int | None = None,
        arena: HostArena | None = None,
    ):
        """`prefix_nbytes`: the leading part a sender ships on its own; each commit also
        records that part's checksum (`Slot.prefix_checksum`) in the same pass. `arena`:
        where the slots' memory comes from while it lasts (else it is allocated now)."""

        def buffer() -> torch.Tensor:
            taken = arena.take(nbytes, pin) if arena is not None else None
            return allocate(nbytes, pin) if taken is None else taken

        self.slots = [Slot(buffer()), Slot(buffer())]
        self.nbytes = nbytes
        self.pin = pin
        self._commits = 0
        self.prefix_nbytes = nbytes if prefix_nbytes is None else prefix_nbytes
        if not 0 <= self.prefix_nbytes <= nbytes:
            raise ValueError(f"prefix_nbytes {prefix_nbytes} must lie in [0, {nbytes}]")
        self.lock = threading.Condition()

    def committed(self) -> Slot | None:
        """The newest committed slot."""
        with self.lock:
            done = [s for s in self.slots if s.committed]
            return max(done, key=_age) if done else None

    def find(self, iteration: int | None = None) -> Slot | None:
        """The committed slot holding `iteration` (None: the newest), if any."""
        if iteration is None:
            return self.committed()
        with self.lock:
            return next((s for s in self.slots if s.committed and s.iteration == iteration), None)

    def fits(self, nbytes: int, pin: bool, prefix_nbytes: int | None = None) -> bool:
        """Whether this pair can take the place of a new `SlotPair(nbytes, pin, prefix_nbytes)`."""
        prefix = nbytes if prefix_nbytes is None else prefix_nbytes
        return (self.nbytes, self.pin, self.prefix_nbytes) == (nbytes, pin, prefix)

    def drop_newer(self, iteration: int) -> None:
        """Uncommit every copy newer than `iteration`: a generation that rolled back to it
        must neither serve nor keep a state it has not reached again."""
        with self.lock:
            for s in self.slots:
                if s.committed and s.iteration > iteration:
                    s.committed = False
            self.lock.notify_all()

    @property
    def idle(self) -> bool:
        """Neither slot is being written or read."""
        with self.lock:
            return not any(s.busy for s in self.slots)

    def iterations(self) -> list[int]:
        """Every committed iteration this pair holds (one or two)."""
        with self.lock:
            return sorted(s.iteration for s in self.slots if s.committed)

    def acquire_for_write(self) -> Slot:
        """The slot that is not busy and not the newest committed one (if both are free:
        the older). Blocks while the other is busy, which a sender never holds for long."""
        with self.lock:
            while True:
                free = [s for s in self.slots if not s.busy]
                if free:
                    newest = max((s for s in self.slots if s.committed), key=_age, default=None)
                    candidates = [s for s in free if s is not newest] or free
                    slot = min(candidates, key=lambda s: (s.committed, *_age(s)))
                    slot.busy = True
                    slot.committed = False
                    return slot
                self.lock.wait()

    def commit(self, slot: Slot, iteration: int, meta: bytes, digest: int | None = None) -> None:
        """Mark `slot` as holding `iteration` once its bytes verify; raises CorruptCopy else."""
        actual, part = checksums(slot.buffer, self.prefix_nbytes, meta, iteration)
        with self.lock:
            slot.busy = False
            if digest is not None and actual != digest:
                slot.committed = False
                self.lock.notify_all()
                raise CorruptCopy(
                    f"copy of iteration {iteration} failed its checksum "
                    f"({actual:#018x} != {digest:#018x}); keeping iteration "
                    f"{self._newest_iteration()}"
                )
            slot.iteration, slot.meta, slot.checksum = iteration, meta, actual
            slot.prefix_checksum, slot.committed = part, True
            self._commits += 1
            slot.order = self._commits
            self.lock.notify_all()

    def abandon(self, slot: Slot) -> None:
        with self.lock:
            slot.busy = False
            slot.committed = False
            self.lock.notify_all()

    def _newest_iteration(self) -> int:
        done = [s.iteration for s in self.slots if s.committed]
        return max(done) if done else -1

    def hold(self, slot: Slot) -> None:
        with self.lock:
            slot.busy = True

    def release(self, slot: Slot) -> None:
        with self.lock:
            slot.busy = False
            self.lock.notify_all()


@dataclass(frozen=True)
class Reusable:
    """Slot pairs a recovery hands to its new generation's pipeline instead of allocating new
    ones. Each holds the committed copy the generation rolled back to (and nothing newer): the
    pipeline's first writes go to the other slot, so that copy stays served until the new
    generation has committed its own. Survivors keep their coordinates, so their snapshot and
    replicas keep their sizes: a recovery then allocates (and zeroes) nothing, and its host
    memory stays at two copies instead of four while it runs."""

    snapshots: tuple[SlotPair, ...] = ()
    replicas: tuple[tuple[int, SlotPair], ...] = ()  # (owner, pair)
    arena: HostArena | None = None  # a claimed spare's reserve: the pairs not handed over

    def new_pair(
        self, nbytes: int, pin: bool = False, prefix_nbytes: int | None = None
    ) -> SlotPair:
        """A pair none of the held ones could stand for, from the arena while it lasts."""
        return SlotPair(nbytes, pin, prefix_nbytes, self.arena)

    def snapshot(self, nbytes: int, pin: bool, prefix_nbytes: int) -> SlotPair | None:
        return next((p for p in self.snapshots if p.fits(nbytes, pin, prefix_nbytes)), None)

    def replica(self, owner: int, nbytes: int) -> SlotPair | None:
        return next((p for o, p in self.replicas if o == owner and p.fits(nbytes, False)), None)
