"""Where a rank's state sits in one flat host buffer, and what the in-memory checkpoint needs
of that state. Pure description: the megatron adapter (megatron/shard.py) builds the layout
from the distributed optimizer and implements `ProtectedState`; nothing here knows megatron.

The buffer holds the part replicated around the DP ring first (the optimizer shard), then
the part every DP peer holds identically (the model parameters).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class Entry:
    name: str
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class StateLayout:
    """Where every live tensor sits in the flat snapshot buffer."""

    entries: tuple[Entry, ...]
    optimizer_nbytes: int
    total_nbytes: int

    @property
    def params_nbytes(self) -> int:
        return self.total_nbytes - self.optimizer_nbytes


class ProtectedState(Protocol):
    """A rank's live state as the snapshot, the replication and the restore see it."""

    layout: StateLayout

    def tensors(self) -> list[torch.Tensor]:
        """The live tensors, in layout order."""

    def capture_metadata(self, iteration: int, extra: dict) -> bytes:
        """Everything besides tensors a restored rank needs (scheduler, RNG, ...)."""

    def restore_metadata(self, meta: dict) -> None:
        """Apply captured metadata, decoded (checkpoint/metadata.py)."""

    def write_from(self, flat: torch.Tensor) -> None:
        """Copy a whole flat buffer back into the live tensors."""


def view_of(flat: torch.Tensor, entry: Entry) -> torch.Tensor:
    """The part of a flat uint8 buffer that holds `entry`, typed and shaped like it."""
    return flat[entry.offset : entry.offset + entry.nbytes].view(entry.dtype).view(entry.shape)


def align(n: int, to: int = 64) -> int:
    return (n + to - 1) // to * to


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
