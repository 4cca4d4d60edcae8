"""Put a rank back into the exact state of a committed iteration.

Two sources, as in the paper: the rank's own host snapshot (a transient failure: the process
survived), or the ring replica of its optimizer shard held by a DP successor plus the model
parameters of a DP peer with the same TP/PP coordinates (a permanent failure: a fresh process
takes over). Transfers are point-to-point between exactly the ranks involved. A sender may
offer its bytes to be read instead (`offer`): a receiver on the same host reads them from the
sender's memory with one copy (cma.py) and says so, else it asks for them on the group. A
rank being restored reads them straight into its live tensors (`receive_into`): no buffer to
fill and copy out of (at 12.7M parameters the spare's transfer and the wait for it went from
0.12 to 0.07 s; README, "The spare's state read into its tensors").
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
import xxhash

from ..errors import DeadpoolError
from . import cma, metadata
from .buffers import MAX_META_BYTES, Slot, SlotPair, checksum
from .layout import ProtectedState

# iteration, meta length, checksum (over all three parts); then, for an offer, the sender's
# pid (0: no offer), the address of the data and the sender's host (cma.host_id)
_HEADER = struct.Struct("<qqQqQQ")
PULLED, STREAM_IT = 1, 2  # a receiver's answer to an offer
HOST = cma.host_id()


class Part(NamedTuple):
    """A part as it arrived: verified bytes (None: they were read into the live tensors and
    verified there), the metadata and iteration they are of, and whether they were read from
    the sender's memory (else they came over the group)."""

    data: torch.Tensor | None
    meta: bytes
    iteration: int
    pulled: bool


class Announced(NamedTuple):
    """What a sender says of a part before its bytes: iteration, metadata, checksum and,
    for an offer, where to read it (pid 0: no offer)."""

    iteration: int
    meta: bytes
    digest: int
    pid: int
    address: int
    host: int


# Where a part's bytes go in a live state: (offset in the part, a byte view of a tensor).
Segments = Sequence[tuple[int, torch.Tensor]]


@dataclass(frozen=True)
class Expected:
    """What the plan says the restored state must be: checked before anything is written."""

    iteration: int
    coordinates: tuple[int, int, int]  # (tp, pp, dp) of the rank being restored


def _checked(meta: bytes, expected: Expected, source: str) -> dict:
    info = metadata.decode(meta)
    iteration, coords = info.get("iteration"), info.get("coordinates")
    if iteration != expected.iteration:
        raise DeadpoolError(f"{source} holds iteration {iteration}, the plan needs "
                            f"{expected.iteration}")  # fmt: skip
    if coords is None or tuple(coords) != expected.coordinates:
        raise DeadpoolError(f"{source} is of coordinates (tp, pp, dp) {coords}, the rank "
                            f"restored holds {expected.coordinates}")  # fmt: skip
    return info


def restore_from_snapshot(state: ProtectedState, slot: Slot | None, expected: Expected) -> int:
    """Roll this rank back to its own committed snapshot; returns its iteration."""
    if slot is None or not slot.committed:
        raise DeadpoolError("no committed local snapshot to restore from")
    if not slot.verify():
        raise DeadpoolError(f"local snapshot of iteration {slot.iteration} fails its checksum")
    info = _checked(slot.meta, expected, "the local snapshot")
    state.write_from(slot.buffer)
    state.restore_metadata(info)
    return info["iteration"]


def live_segments(state: ProtectedState, kind: str) -> list[tuple[int, torch.Tensor]] | None:
    """Byte views of the live tensors that hold one part ("replica": the optimizer shard,
    "parameters": the rest), at their offsets in that part; None where a tensor is not
    contiguous (then the part goes through a flat buffer)."""
    layout = state.layout
    first, stop = (
        (0, layout.optimizer_nbytes) if kind == "replica"
        else (layout.optimizer_nbytes, layout.total_nbytes)
    )  # fmt: skip
    out = []
    for entry, t in zip(layout.entries, state.tensors(), strict=True):
        if not first <= entry.offset < stop:
            continue
        if not t.is_contiguous():
            return None
        view = t.detach().reshape(-1).view(torch.uint8)
        if view.numel() != entry.nbytes:
            return None
        out.append((entry.offset - first, view))
    return out


def restore_from_parts(
    state: ProtectedState,
    optimizer_part: torch.Tensor | None,
    meta: bytes,
    params_part: torch.Tensor | None,
    expected: Expected,
) -> int:
    """Rebuild a rank from a replica of its optimizer shard and a peer's parameters; a part
    given as None was read into the live tensors already (receive_into)."""
    info = _checked(meta, expected, "the replica")
    parts = {"replica": optimizer_part, "parameters": params_part}
    segments = {kind: live_segments(state, kind) for kind, part in parts.items()}
    if all(s is not None for s in segments.values()):
        for kind, part in parts.items():
            if part is not None:
                for offset, view in segments[kind]:
                    view.copy_(part[offset : offset + view.numel()])
    else:  # a tensor without a byte view: whole-buffer copy (neither part was read in place)
        layout = state.layout
        flat = torch.empty(layout.total_nbytes, dtype=torch.uint8)
        flat[: layout.optimizer_nbytes] = optimizer_part
        flat[layout.optimizer_nbytes :] = params_part
        state.write_from(flat)
    state.restore_metadata(info)
    return info["iteration"]


class Serving:
    """A part posted to its receiver and not finished yet: the bytes stay as they are (their
    slot held) until `finish`, which waits for the posted messages and, for an offer, for the
    receiver's answer, and streams the bytes where it asks for them. Meanwhile the serving
    rank can do its own restore while the receiver reads."""

    def __init__(self, data: torch.Tensor, dst: int, group, tag: int, release=None):
        self.data, self.dst, self.group, self.tag = data, dst, group, tag
        self.works: list = []
        self.keep: list[torch.Tensor] = []  # posted tensors live until their sends complete
        self.answer: torch.Tensor | None = None
        self.answered = None
        self._release = release
        self._open = True

    def finish(self) -> None:
        try:
            for work in self.works:
                work.wait()
            if self.answered is not None:
                self.answered.wait()
                if int(self.answer) != PULLED:
                    dist.send(self.data, self.dst, group=self.group, tag=self.tag)
        finally:
            self.release()

    def release(self) -> None:
        """Let the slot go (after finish, or when the recovery gives up on this part)."""
        if self._open:
            self._open = False
            if self._release is not None:
                self._release()


def post_part(
    data: torch.Tensor,
    meta: bytes,
    iteration: int,
    dst: int,
    group=None,
    offer: bool = False,
    digest: int | None = None,
    tag: int = 0,
    release=None,
) -> Serving:
    """Post a verified part (replica or parameters) with its iteration and checksum: `digest`
    where it is known (a committed slot's, so that bytes changed since its commit fail at the
    receiver), else taken now. With `offer`, `dst` may read the bytes from this process
    instead. Nothing waits here: the returned Serving's `finish` does (`tag` keeps its
    messages apart from other parts' between the same two ranks)."""
    data = data.contiguous()
    pid, address = (os.getpid(), data.data_ptr()) if offer and HOST and data.numel() else (0, 0)
    if digest is None:
        digest = checksum(data, meta, iteration)
    serving = Serving(data, dst, group, tag, release)
    header = torch.frombuffer(bytearray(_HEADER.pack(iteration, len(meta), digest, pid, address,
                                                     HOST)), dtype=torch.uint8)  # fmt: skip
    serving.keep.append(header)
    serving.works.append(dist.isend(header, dst, group=group, tag=tag))
    if meta:
        blob = torch.frombuffer(bytearray(meta), dtype=torch.uint8)
        serving.keep.append(blob)
        serving.works.append(dist.isend(blob, dst, group=group, tag=tag))
    if pid:
        serving.answer = torch.zeros(1, dtype=torch.uint8)
        serving.answered = dist.irecv(serving.answer, dst, group=group, tag=tag)
    else:
        serving.works.append(dist.isend(data, dst, group=group, tag=tag))
    return serving


def serve_replica(
    replicas: dict[int, SlotPair],
    owner: int,
    dst: int,
    group=None,
    iteration: int | None = None,
    offer: bool = False,
    tag: int = 0,
) -> tuple[int, Serving]:
    """Post the committed replica of `owner`'s shard (of `iteration`, default the newest) to
    `dst`, held until the Serving finishes so the replication thread cannot overwrite it;
    returns the iteration posted and the Serving."""
    pair = replicas[owner]
    slot = pair.find(iteration)
    if slot is None:
        raise DeadpoolError(
            f"this rank holds no committed replica of rank {owner}'s shard"
            + ("" if iteration is None else f" at iteration {iteration} (has {pair.iterations()})")
        )
    return slot.iteration, _posted(pair, slot, slot.buffer, slot.meta, dst, group, offer,
                                   slot.checksum, tag)  # fmt: skip


def serve_parameters(
    snapshots: SlotPair,
    optimizer_nbytes: int,
    dst: int,
    group=None,
    iteration: int | None = None,
    offer: bool = False,
    tag: int = 0,
) -> tuple[int, Serving]:
    """Post the parameter part of this rank's committed snapshot (of `iteration`, default the
    newest) to `dst` (a DP peer with the same TP/PP coordinates needs exactly these bytes);
    returns the iteration posted and the Serving."""
    slot = snapshots.find(iteration)
    if slot is None:
        raise DeadpoolError(
            "this rank has no committed snapshot to serve parameters from"
            + ("" if iteration is None else f" at iteration {iteration}")
        )
    return slot.iteration, _posted(snapshots, slot, slot.buffer[optimizer_nbytes:], b"", dst,
                                   group, offer, None, tag)  # fmt: skip


def _posted(pair: SlotPair, slot: Slot, data, meta, dst, group, offer, digest, tag) -> Serving:
    pair.hold(slot)
    try:
        return post_part(data, meta, slot.iteration, dst, group, offer, digest, tag,
                         release=lambda: pair.release(slot))  # fmt: skip
    except BaseException:
        pair.release(slot)
        raise


def sent(posted: tuple[int, Serving]) -> int:
    """A part from serve_replica or serve_parameters, finished: returns the iteration sent
    once the receiver has the bytes."""
    iteration, serving = posted
    serving.finish()
    return iteration


def recv_part(nbytes: int, src: int, group=None, tag: int = 0) -> Part:
    """Receive a part posted by post_part (reading it from the sender where it offers that and
    can be read); raises DeadpoolError when it arrives corrupt."""
    return recv_body(recv_header(src, group, tag), nbytes, src, group, tag=tag)


def receive_into(
    state: ProtectedState,
    kind: str,
    nbytes: int,
    src: int,
    group,
    expected: Expected,
    tag: int = 0,
) -> Part:
    """Receive a part of the state restored here: where the sender offers it and it is of
    the planned iteration (a replica: and coordinates), read straight into the live tensors
    (Part.data None), else into a buffer the caller checks and writes from."""
    head = recv_header(src, group, tag)
    fits = head.iteration == expected.iteration
    if fits and kind == "replica":
        try:
            _checked(head.meta, expected, "the replica")
        except DeadpoolError:
            fits = False
    into = live_segments(state, kind) if fits and head.pid else None
    if into is not None and any(view.device.type != "cpu" for _, view in into):
        into = None
    return recv_body(head, nbytes, src, group, into, tag)


def recv_header(src: int, group=None, tag: int = 0) -> Announced:
    header = torch.empty(_HEADER.size, dtype=torch.uint8)
    dist.recv(header, src, group=group, tag=tag)
    iteration, meta_len, digest, pid, address, host = _HEADER.unpack(header.numpy().tobytes())
    if not 0 <= meta_len <= MAX_META_BYTES:
        raise DeadpoolError(f"rank {src} announced {meta_len} bytes of metadata (at most "
                            f"{MAX_META_BYTES}): a corrupt header")  # fmt: skip
    meta = torch.empty(meta_len, dtype=torch.uint8)
    if meta_len:
        dist.recv(meta, src, group=group, tag=tag)
    return Announced(iteration, meta.numpy().tobytes(), digest, pid, address, host)


def recv_body(
    head: Announced,
    nbytes: int,
    src: int,
    group=None,
    into: Segments | None = None,
    tag: int = 0,
) -> Part:
    """The bytes of an announced part: read from the sender where it offers them (into the
    views `into` when given: Part.data None), else over the group; DeadpoolError when they
    arrive corrupt. Bytes read and found corrupt are asked for again over the group."""
    iteration, meta = head.iteration, head.meta
    data = None if into is not None else torch.empty(nbytes, dtype=torch.uint8)
    pulled = False
    if head.pid:
        if head.host == HOST:
            segments = into if into is not None else [(0, data)]
            pulled = _read_into(head, nbytes, segments) == head.digest
        answer = torch.tensor([PULLED if pulled else STREAM_IT], dtype=torch.uint8)
        dist.send(answer, src, group=group, tag=tag)
    if not pulled:
        data = torch.empty(nbytes, dtype=torch.uint8) if data is None else data
        dist.recv(data, src, group=group, tag=tag)
        if checksum(data, meta, iteration) != head.digest:
            raise DeadpoolError(f"part of iteration {iteration} from rank {src} fails its checksum")
    return Part(data, meta, iteration, pulled)


def _read_into(head: Announced, nbytes: int, into: Segments) -> int | None:
    """Read an offered part into the views `into` (the bytes between them into scratch, as
    the checksum covers them), hashing each piece while it is in cache; returns the part's
    checksum as `checksum` defines it, or None when the kernel would not read it (another
    PID namespace, a kernel that refuses: not a fault of the part, which then comes over the
    group)."""
    h = xxhash.xxh3_64()
    at = 0
    try:
        for offset, view in [*sorted(into, key=lambda s: s[0]), (nbytes, None)]:
            if offset > at:  # alignment padding: covered by the checksum, held nowhere
                gap = bytearray(offset - at)
                cma.read_from(head.pid, head.address + at, memoryview(gap))
                h.update(gap)
            if view is None:
                break
            piece = memoryview(view.numpy())
            cma.read_from(head.pid, head.address + offset, piece)
            h.update(piece)
            at = offset + view.numel()
    except OSError:
        return None
    h.update(head.meta)
    h.update(head.iteration.to_bytes(8, "little", signed=True))
    return h.intdigest()
