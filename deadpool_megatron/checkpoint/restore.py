"""Put a rank back into the exact state of a committed iteration.

Two sources, as in the paper: the rank's own host snapshot (a transient failure: the process
survived), or the ring replica of its optimizer shard held by a DP successor plus the model
parameters of a DP peer with the same TP/PP coordinates (a permanent failure: a fresh process
takes over). Transfers are point-to-point between exactly the ranks involved.
"""

from __future__ import annotations

import struct

import torch
import torch.distributed as dist

from ..errors import DeadpoolError
from .buffers import Slot, SlotPair, checksum
from .layout import ProtectedState

_HEADER = struct.Struct("<qqQ")  # iteration, meta length, checksum


def restore_from_snapshot(state: ProtectedState, slot: Slot | None) -> int:
    """Roll this rank back to its own committed snapshot; returns its iteration."""
    if slot is None or not slot.committed:
        raise DeadpoolError("no committed local snapshot to restore from")
    if not slot.verify():
        raise DeadpoolError(f"local snapshot of iteration {slot.iteration} fails its checksum")
    state.write_from(slot.buffer)
    return state.restore_metadata(slot.meta)["iteration"]


def restore_from_parts(
    state: ProtectedState, optimizer_part: torch.Tensor, meta: bytes, params_part: torch.Tensor
) -> int:
    """Rebuild a rank from a replica of its optimizer shard and a peer's parameters."""
    layout = state.layout
    flat = torch.empty(layout.total_nbytes, dtype=torch.uint8)
    flat[: layout.optimizer_nbytes] = optimizer_part
    flat[layout.optimizer_nbytes :] = params_part
    state.write_from(flat)
    return state.restore_metadata(meta)["iteration"]


def send_part(data: torch.Tensor, meta: bytes, iteration: int, dst: int, group=None) -> None:
    """Send a verified part (replica or parameters) with its iteration and checksum."""
    header = _HEADER.pack(iteration, len(meta), checksum(data, meta))
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
    meta = torch.empty(meta_len, dtype=torch.uint8)
    if meta_len:
        dist.recv(meta, src, group=group)
    data = torch.empty(nbytes, dtype=torch.uint8)
    dist.recv(data, src, group=group)
    meta_bytes = meta.numpy().tobytes()
    if checksum(data, meta_bytes) != digest:
        raise DeadpoolError(f"part of iteration {iteration} from rank {src} fails its checksum")
    return data, meta_bytes, iteration
