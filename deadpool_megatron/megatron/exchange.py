"""Fixed-layout exchanges between ranks: integers and equal-length byte strings as tensors.

What one rank learns about the others (verification facts, replica sizes, digests) never
goes through `all_gather_object`, which unpickles what peers send.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def _device(group) -> str:
    return "cuda" if dist.get_backend(group) == "nccl" else "cpu"


def all_gather_ints(values: Sequence[int], group=None) -> list[list[int]]:
    """Every rank's `values` (the same count everywhere), in group-rank order."""
    mine = torch.tensor(list(values), dtype=torch.int64, device=_device(group))
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    return [t.tolist() for t in everyone]


def all_gather_bytes(data: bytes, group=None) -> list[bytes]:
    """Every rank's `data` (the same length everywhere), in group-rank order."""
    mine = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(_device(group))
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    return [t.cpu().numpy().tobytes() for t in everyone]
