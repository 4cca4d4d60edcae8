"""Host-to-host transport of replicas: a small interface, one implementation per backend.

The replicator only needs ordered, asynchronous point-to-point messages between two ranks of
a dedicated group; gloo over TCP is the one here (MPI or NCCL can be added behind the same
interface). Ranks are global ranks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.distributed as dist


class Transport(ABC):
    @abstractmethod
    def isend(self, tensor: torch.Tensor, dst: int):
        """Start sending `tensor` to global rank `dst`; returns a handle with wait()."""

    @abstractmethod
    def irecv(self, tensor: torch.Tensor, src: int):
        """Start receiving into `tensor` from global rank `src`; returns a handle with wait()."""


class GlooTransport(Transport):
    """Point-to-point over a gloo process group owned by the replication thread alone."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group

    def isend(self, tensor: torch.Tensor, dst: int):
        return dist.isend(tensor, dst=dst, group=self.group)

    def irecv(self, tensor: torch.Tensor, src: int):
        return dist.irecv(tensor, src=src, group=self.group)
