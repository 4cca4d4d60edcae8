"""Host-to-host transport of replicas: a small interface, one implementation per backend.

The replicator only needs ordered, asynchronous point-to-point messages between two ranks of
dedicated groups; gloo over TCP is the one here (MPI or NCCL can be added behind the same
interface; plain TCP connections that an abort ends at once are in tcp_transport.py). Ranks
are global ranks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist


class Transport(ABC):
    @abstractmethod
    def isend(self, tensor: torch.Tensor, dst: int):
        """Start sending `tensor` to global rank `dst`; returns a handle with wait()."""

    @abstractmethod
    def irecv(self, tensor: torch.Tensor, src: int):
        """Start receiving into `tensor` from global rank `src`; returns a handle with wait()."""

    def abort(self) -> None:  # noqa: B027 (optional: nothing to end by default)
        """End pending operations now, from any thread (a recovery's stop). gloo's cannot:
        a recovery cuts the process's connections for it (recovery/abort.py)."""

    def close(self) -> None:  # noqa: B027 (optional: nothing held by default)
        """Release what the transport holds, by the thread that used it, once it is done."""


class GlooTransport(Transport):
    """Point-to-point over gloo groups owned by the replication thread alone: one group per
    peer (the two ranks of a ring edge), keyed by the peer's global rank. Each send and receive
    goes through `ended_at_abort` (the job passes `gloo_ops.OpenWork`), so that a recovery's
    abort ends those still open: gloo does not always wake one whose peer died, and the thread
    and the edge's group would wait out the group's timeout."""

    def __init__(
        self,
        groups: Mapping[int, dist.ProcessGroup],
        ended_at_abort: Callable[..., object] = lambda work, **_: work,
    ):
        self.groups = dict(groups)
        self._ended_at_abort = ended_at_abort  # registers a work with the abort (gloo_ops)

    def isend(self, tensor: torch.Tensor, dst: int):
        group = self._group(dst)
        work = dist.isend(tensor, dst=dst, group=group)
        return self._ended_at_abort(work, op="replica send", group=group)

    def irecv(self, tensor: torch.Tensor, src: int):
        group = self._group(src)
        work = dist.irecv(tensor, src=src, group=group)
        return self._ended_at_abort(work, op="replica receive", group=group)

    def _group(self, peer: int) -> dist.ProcessGroup:
        group = self.groups.get(peer)
        if group is None:
            raise ValueError(f"no ring edge to rank {peer}: edges to {sorted(self.groups)}")
        return group
