"""Put a rank back into the exact state of a committed iteration.

Two sources, as in the paper: the rank's own host snapshot (a transient failure: the process
survived), or the ring replica of its optimizer shard held by a DP successor plus the model
parameters of a DP peer with the same TP/PP coordinates (a permanent failure: a fresh process
takes over). Transfers are point-to-point between exactly the ranks involved. A sender may
offer its bytes to be read instead (`offer`): a receiver on the same host reads them from the
sender's memory with one copy (cma.py) and says so, else it asks for them on the group.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

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
    """A part as it arrived: verified bytes, the metadata and iteration they are of, and
    whether they were read from the sender's memory (else they came over the group)."""

    data: torch.Tensor
    meta: bytes
    iteration: int
    pulled: bool


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


def restore_from_parts(
    state: ProtectedState,
    optimizer_part: torch.Tensor,
    meta: bytes,
    params_part: torch.Tensor,
    expected: Expected,
) -> int:
    """Rebuild a rank from a replica of its optimizer shard and a peer's parameters."""
    info = _checked(meta, expected, "the replica")
    layout = state.layout
    flat = torch.empty(layout.total_nbytes, dtype=torch.uint8)
    flat[: layout.optimizer_nbytes] = optimizer_part
    flat[layout.optimizer_nbytes :] = params_part
    state.write_from(flat)
    state.restore_metadata(info)
    return info["iteration"]


def send_part(
    data: torch.Tensor,
    meta: bytes,
    iteration: int,
    dst: int,
    group=None,
    offer: bool = False,
    digest: int | None = None,
) -> None:
    """Send a verified part (replica or parameters) with its iteration and checksum: `digest`
    where it is known (a committed slot's, so that bytes changed since its commit fail at the
    receiver), else taken now. With `offer`, `dst` may read the bytes from this process
    instead; they must stay as they are until this returns."""
    data = data.contiguous()
    pid, address = (os.getpid(), data.data_ptr()) if offer and HOST and data.numel() else (0, 0)
    if digest is None:
        digest = checksum(data, meta, iteration)
    header = _HEADER.pack(iteration, len(meta), digest, pid, address, HOST)
    dist.send(torch.frombuffer(bytearray(header), dtype=torch.uint8), dst, group=group)
    if meta:
        dist.send(torch.frombuffer(bytearray(meta), dtype=torch.uint8), dst, group=group)
    if pid:
        answer = torch.zeros(1, dtype=torch.uint8)
        dist.recv(answer, dst, group=group)
        if int(answer) == PULLED:
            return
    dist.send(data, dst, group=group)


def send_replica(
    replicas: dict[int, SlotPair],
    owner: int,
    dst: int,
    group=None,
    iteration: int | None = None,
    offer: bool = False,
) -> int:
    """Serve the committed replica of `owner`'s shard (of `iteration`, default the newest) to
    `dst`, holding it meanwhile so the replication thread cannot overwrite it; returns the
    iteration sent."""
    pair = replicas[owner]
    slot = pair.find(iteration)
    if slot is None:
        raise DeadpoolError(
            f"this rank holds no committed replica of rank {owner}'s shard"
            + ("" if iteration is None else f" at iteration {iteration} (has {pair.iterations()})")
        )
    pair.hold(slot)
    try:
        send_part(slot.buffer, slot.meta, slot.iteration, dst, group, offer, slot.checksum)
    finally:
        pair.release(slot)
    return slot.iteration


def send_parameters(
    snapshots: SlotPair,
    optimizer_nbytes: int,
    dst: int,
    group=None,
    iteration: int | None = None,
    offer: bool = False,
) -> int:
    """Serve the parameter part of this rank's committed snapshot (of `iteration`, default the
    newest) to `dst` (a DP peer with the same TP/PP coordinates needs exactly these bytes);
    returns the iteration sent."""
    slot = snapshots.find(iteration)
    if slot is None:
        raise DeadpoolError(
            "this rank has no committed snapshot to serve parameters from"
            + ("" if iteration is None else f" at iteration {iteration}")
        )
    snapshots.hold(slot)
    try:
        send_part(slot.buffer[optimizer_nbytes:], b"", slot.iteration, dst, group, offer)
    finally:
        snapshots.release(slot)
    return slot.iteration


def recv_part(nbytes: int, src: int, group=None) -> Part:
    """Receive a part sent by send_part (reading it from the sender where it offers that and
    can be read); raises DeadpoolError when it arrives corrupt."""
    header = torch.empty(_HEADER.size, dtype=torch.uint8)
    dist.recv(header, src, group=group)
    iteration, meta_len, digest, pid, address, host = _HEADER.unpack(header.numpy().tobytes())
    if not 0 <= meta_len <= MAX_META_BYTES:
        raise DeadpoolError(f"rank {src} announced {meta_len} bytes of metadata (at most "
                            f"{MAX_META_BYTES}): a corrupt header")  # fmt: skip
    meta = torch.empty(meta_len, dtype=torch.uint8)
    if meta_len:
        dist.recv(meta, src, group=group)
    data = torch.empty(nbytes, dtype=torch.uint8)
    meta_bytes = meta.numpy().tobytes()
    pulled = False
    if pid:
        pulled = host == HOST and _read(pid, address, data)
        pulled = pulled and checksum(data, meta_bytes, iteration) == digest
        answer = torch.tensor([PULLED if pulled else STREAM_IT], dtype=torch.uint8)
        dist.send(answer, src, group=group)
    if not pulled:
        dist.recv(data, src, group=group)
        if checksum(data, meta_bytes, iteration) != digest:
            raise DeadpoolError(f"part of iteration {iteration} from rank {src} fails its checksum")
    return Part(data, meta_bytes, iteration, pulled)


def _read(pid: int, address: int, into: torch.Tensor) -> bool:
    """Whether `into` could be read from `pid`'s memory; a failure (another PID namespace, a
    kernel that refuses) is not one of the part: it then comes over the group."""
    try:
        cma.read_from(pid, address, memoryview(into.numpy()))
    except OSError:
        return False
    return True
