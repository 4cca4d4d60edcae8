"""Put a rank back into the exact state of a committed iteration.

Two sources, as in the paper: the rank's own host snapshot (a transient failure: the process
survived), or the ring replica of its optimizer shard held by a DP successor plus the model
parameters of a DP peer with the same TP/PP coordinates (a permanent failure: a fresh process
takes over). Transfers are point-to-point between exactly the ranks involved.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import DeadpoolError
from . import metadata
from .buffers import MAX_META_BYTES, Slot, SlotPair, checksum
from .layout import ProtectedState

_HEADER = struct.Struct("<qqQ")  # iteration, meta length, checksum (over all three parts)


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


def send_part(data: torch.Tensor, meta: bytes, iteration: int, dst: int, group=None) -> None:
    """Send a verified part (replica or parameters) with its iteration and checksum."""
    header = _HEADER.pack(iteration, len(meta), checksum(data, meta, iteration))
    dist.send(torch.frombuffer(bytearray(header), dtype=torch.uint8), dst, group=group)
    if meta:
        dist.send(torch.frombuffer(bytearray(meta), dtype=torch.uint8), dst, group=group)
    dist.send(data.contiguous(), dst, group=group)


def send_replica(
    replicas: dict[int, SlotPair], owner: int, dst: int, group=None, iteration: int | None = None
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
        send_part(slot.buffer, slot.meta, slot.iteration, dst, group)
    finally:
        pair.release(slot)
    return slot.iteration


def send_parameters(
    snapshots: SlotPair, optimizer_nbytes: int, dst: int, group=None, iteration: int | None = None
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
        send_part(slot.buffer[optimizer_nbytes:], b"", slot.iteration, dst, group)
    finally:
        snapshots.release(slot)
    return slot.iteration


def recv_part(nbytes: int, src: int, group=None) -> tuple[torch.Tensor, bytes, int]:
    """Receive a part sent by send_part; raises DeadpoolError when it arrives corrupt."""
    header = torch.empty(_HEADER.size, dtype=torch.uint8)
    dist.recv(header, src, group=group)
    iteration, meta_len, digest = _HEADER.unpack(header.numpy().tobytes())
    if not 0 <= meta_len <= MAX_META_BYTES:
        raise DeadpoolError(f"rank {src} announced {meta_len} bytes of metadata (at most "
                            f"{MAX_META_BYTES}): a corrupt header")  # fmt: skip
    meta = torch.empty(meta_len, dtype=torch.uint8)
    if meta_len:
        dist.recv(meta, src, group=group)
    data = torch.empty(nbytes, dtype=torch.uint8)
    dist.recv(data, src, group=group)
    meta_bytes = meta.numpy().tobytes()
    if checksum(data, meta_bytes, iteration) != digest:
        raise DeadpoolError(f"part of iteration {iteration} from rank {src} fails its checksum")
    return data, meta_bytes, iteration
