"""Replicas over MPI (`--deadpool-transport mpi`): Open MPI 5 with its ULFM extensions, between
processes the agent started with MPI_Comm_spawn (agent/mpi_spawn.py), the paper's
host-to-host path.

Each ring edge is an intercommunicator of its own, made by MPI_Comm_connect/accept on ports
the ring's members exchange (`connect_ring`): a dead peer concerns its edges only. A pending
send or receive to it fails (MPI_ERR_PROC_FAILED, from ULFM's failure detector), a recovery's
abort revokes every edge of this rank (its waits end with MPI_ERR_REVOKED, from any thread),
and the edges are freed, never shrunk: the next generation connects anew, the spare with it.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Mapping

import torch

from .transport import Transport

log = logging.getLogger("deadpool.replicate")

PORT_BYTES = 1024  # MPI_MAX_PORT_NAME in Open MPI
TAG = 7


def mpi():
    """mpi4py's MPI, imported (so initialised) only by a job that asks for this transport."""
    from mpi4py import MPI

    return MPI


def spawned() -> bool:
    """This process was started by MPI_Comm_spawn (as the agent does under mpirun)."""
    return mpi().Comm.Get_parent() != mpi().COMM_NULL


def encode_port(port: str) -> bytes:
    """A port name as PORT_BYTES bytes (every member's the same length, for one all-gather)."""
    raw = port.encode()
    if len(raw) >= PORT_BYTES:
        raise ValueError(f"MPI port name of {len(raw)} bytes: at most {PORT_BYTES - 1}")
    return raw.ljust(PORT_BYTES, b"\0")


def decode_port(raw: bytes) -> str:
    return raw.rstrip(b"\0").decode()


def _bytes_of(tensor: torch.Tensor):
    """The tensor's memory as a byte buffer MPI reads or writes in place (no copy)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"MPI moves contiguous host tensors only: got {tensor.device}, "
                         f"contiguous={tensor.is_contiguous()}")  # fmt: skip
    flat = tensor.reshape(-1)
    return [flat.view(torch.uint8).numpy() if flat.numel() else bytearray(), mpi().BYTE]


class MpiWork:
    """One pending send or receive; `wait` blocks in MPI_Wait and raises what it failed with,
    naming the operation and the peer."""

    def __init__(self, request, what: str, peer: int, keep: object):
        self._request = request
        self._what = what
        self._peer = peer
        self._keep = keep  # the tensor MPI reads or writes until the operation completes

    def wait(self, timeout=None) -> bool:
        try:
            self._request.Wait()
        except mpi().Exception as err:
            raise RuntimeError(f"{self._what} with rank {self._peer} failed: "
                               f"{error_name(err)} ({err})") from err  # fmt: skip
        return True


def error_name(err) -> str:
    MPI = mpi()
    names = {MPI.ERR_PROC_FAILED: "MPI_ERR_PROC_FAILED", MPI.ERR_REVOKED: "MPI_ERR_REVOKED"}
    return names.get(err.Get_error_class(), f"MPI error class {err.Get_error_class()}")


class MpiTransport(Transport):
    """Sends and receives on this rank's edges, keyed by the peer's global rank."""

    def __init__(self, send_to: Mapping[int, object], recv_from: Mapping[int, object]):
        self.send_to = dict(send_to)
        self.recv_from = dict(recv_from)
        self._lock = threading.Lock()
        self._revoked = False

    def isend(self, tensor: torch.Tensor, dst: int) -> MpiWork:
        edge = self._edge(self.send_to, dst, "to")
        return MpiWork(edge.Isend(_bytes_of(tensor), dest=0, tag=TAG), "replica send", dst, tensor)

    def irecv(self, tensor: torch.Tensor, src: int) -> MpiWork:
        edge = self._edge(self.recv_from, src, "from")
        return MpiWork(
            edge.Irecv(_bytes_of(tensor), source=0, tag=TAG), "replica receive", src, tensor
        )

    @staticmethod
    def _edge(edges: Mapping[int, object], peer: int, way: str):
        edge = edges.get(peer)
        if edge is None:
            raise ValueError(f"no ring edge {way} rank {peer}: edges {way} {sorted(edges)}")
        return edge

    def abort(self) -> None:
        """Revoke every edge (ULFM): each pending operation on it, here and at the peer, ends
        with MPI_ERR_REVOKED. Safe from any thread (MPI_THREAD_MULTIPLE)."""
        with self._lock:
            if self._revoked:
                return
            self._revoked = True
            for edge in self._edges():
                try:
                    edge.Revoke()
                except mpi().Exception as err:  # a peer already gone: nothing left to end
                    log.debug("revoking an edge: %s", error_name(err))

    def close(self) -> None:
        """Free every edge (local: a dead peer cannot hold it up, as MPI_Comm_disconnect's
        handshake would)."""
        with self._lock:
            edges, self.send_to, self.recv_from = self._edges(), {}, {}
        for edge in edges:
            try:
                edge.Free()
            except mpi().Exception as err:
                log.debug("freeing an edge: %s", error_name(err))

    def _edges(self) -> list:
        return [*self.send_to.values(), *self.recv_from.values()]


def connect_plan(ring: list[int], rank: int, k: int) -> list[tuple[str, int, int]]:
    """This rank's steps to join its ring's edges, in order: ("connect", successor, h) or
    ("accept", predecessor, h), h the distance along the ring (1..k; an edge's accept uses the
    port for that distance). Open MPI deadlocks when one process connects and accepts at once
    (both wait in its context-id agreement), so each process does one at a time: for each
    distance, the cycle of edges i -> i+h has one leader (its lowest position) that connects
    first and then accepts; every other member accepts first. Each cycle then closes in one
    pass, and a distance's cycles never wait on a later distance's."""
    n, i = len(ring), ring.index(rank)
    steps = []
    for h in range(1, min(k, n - 1) + 1):
        to, frm = ("connect", ring[(i + h) % n], h), ("accept", ring[(i - h) % n], h)
        steps += [to, frm] if i == i % math.gcd(n, h) else [frm, to]
    return steps


def connect_ring(
    rank: int,
    generation: int,
    steps: list[tuple[str, int, int]],
    ports: Mapping[int, Mapping[int, str]],
    own_ports: Mapping[int, str],
    accept: Callable[[str], object] | None = None,
    connect: Callable[[str], object] | None = None,
) -> MpiTransport:
    """Carry out `connect_plan`'s steps: connect to a successor at distance h on its port for
    h (`ports[successor][h]`), accept a predecessor on this rank's port for h (`own_ports`).
    Each edge opens with a hello (the connecting rank, the generation); one that names another
    rank or generation than expected is refused."""
    MPI = mpi()
    accept = accept or (lambda p: MPI.COMM_SELF.Accept(p))
    connect = connect or (lambda p: MPI.COMM_SELF.Connect(p))
    send_to: dict[int, object] = {}
    recv_from: dict[int, object] = {}
    try:
        for what, peer, h in steps:
            if what == "connect":
                edge = connect(ports[peer][h])
                send_to[peer] = edge
                hello = torch.tensor([rank, generation], dtype=torch.int64)
                edge.Send(_bytes_of(hello), dest=0, tag=TAG)
                continue
            edge = accept(own_ports[h])
            hello = torch.zeros(2, dtype=torch.int64)
            edge.Recv(_bytes_of(hello), source=0, tag=TAG)
            src, their_generation = hello.tolist()
            if (src, their_generation) != (peer, generation):
                edge.Free()
                raise RuntimeError(f"rank {rank}: an edge from rank {src} of generation "
                                   f"{their_generation}, expected rank {peer} of generation "
                                   f"{generation}")  # fmt: skip
            recv_from[peer] = edge
    except BaseException:
        for edge in [*send_to.values(), *recv_from.values()]:
            edge.Free()
        raise
    log.info("replica ring of generation %d over mpi: sending to rank(s) %s, receiving from %s",
             generation, sorted(send_to), sorted(recv_from))  # fmt: skip
    return MpiTransport(send_to, recv_from)
