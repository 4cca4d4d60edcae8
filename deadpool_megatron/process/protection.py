"""Wire DeadPool's protection pipeline into a megatron-core training job.

The training loop calls `pipeline.after_step(iteration)` after the optimizer step; the fence
before the next step (megatron/fence.py), the replication ring's own group and the replica
sizes of every predecessor are set up here, once per generation.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

import torch.distributed as dist

from ..checkpoint import tcp_connections, tcp_transport
from ..checkpoint.buffers import Reusable
from ..checkpoint.pipeline import ProtectionPipeline
from ..checkpoint.transport import GlooTransport, Transport
from ..config import JobConfig
from ..megatron import gloo_ops, parallel
from ..megatron.exchange import all_gather_bytes, all_gather_ints
from ..megatron.fence import step_fence_installer
from ..megatron.model import TrainState
from ..megatron.shard import RankState
from ..runtime import ProcessEnv
from ..topology import Topology, job_topology


def build_pipeline(
    cfg: JobConfig,
    state: TrainState,
    env: ProcessEnv,
    on_gpu: bool,
    generation: int = 0,
    before_send: Callable[[int], bool | None] | None = None,
    on_error: Callable[[BaseException], None] | None = None,
    reuse: Reusable | None = None,
) -> ProtectionPipeline:
    """Collective over every ring: its edges' groups are created, then shard sizes exchanged
    on it. `reuse`: a recovery's slot pairs (see `Reusable`)."""
    p = cfg.parallel
    world = dist.get_world_size()
    rank = dist.get_rank()
    topo = job_topology(world, p, env.local_world_size)
    k = cfg.deadpool.deadpool_replicas
    ring = parallel.dp_group()
    if cfg.deadpool.deadpool_transport in ("tcp", "tcp-stream"):
        # The interface gloo is told to use, if any (its first, when several are named).
        ifname = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0] or None
        transport = tcp_ring(topo, k, ring, env.master_addr, generation,
                             cfg.system.distributed_timeout_minutes * 60, ifname,
                             pull=cfg.deadpool.deadpool_transport == "tcp")  # fmt: skip
    elif cfg.deadpool.deadpool_transport == "mpi":
        transport = mpi_ring(topo, k, ring, generation)
    else:
        transport = GlooTransport(parallel.ring_pairs(topo, k), gloo_ops.OpenWork)
    coords = topo.coords(rank)
    rank_state = RankState(state.model, state.optimizer, state.scheduler)
    # Replica sizes over the ring's members (megatron's DP group, on this thread, before the
    # replication thread starts): every predecessor is one of them.
    sizes = all_gather_ints([rank_state.layout.optimizer_nbytes], ring)
    shard_sizes = {r: n for r, (n,) in zip(dist.get_process_group_ranks(ring), sizes, strict=True)}
    predecessors = topo.ring_predecessors(rank, k)
    return ProtectionPipeline(
        rank_state,
        transport,
        successors=topo.ring_successors(rank, k),
        predecessors=predecessors,
        replica_nbytes={p: shard_sizes[p] for p in predecessors},
        use_cuda=on_gpu,
        snapshot_interval=cfg.deadpool.deadpool_snapshot_interval,
        local_ranks=env.local_world_size,
        metadata={
            "coordinates": (coords.tp, coords.pp, coords.dp),
            "generation": generation,
            "global_batch_size": cfg.training.global_batch_size,
        },
        install_fence=step_fence_installer(state.optimizer),
        before_send=before_send,
        on_error=on_error,
        reuse=reuse,
    )


def tcp_ring(
    topo: Topology,
    k: int,
    ring: dist.ProcessGroup,
    master_addr: str,
    generation: int,
    timeout_s: float,
    interface: str | None = None,
    pull: bool = True,
) -> Transport:
    """Connections to this rank's ring successors and from its predecessors: each member
    listens on a fresh port of `interface` (a network interface's name), or else of the
    interface that routes to MASTER_ADDR; the ring's members exchange their addresses (a
    collective of the training thread), then connect. With `pull`, a receiver on the sender's
    host reads large messages from the sender's memory itself where the kernel lets it
    (`tcp_connections.negotiate_pull`)."""
    rank = dist.get_rank()
    host = (
        tcp_connections.interface_address(interface)
        if interface
        else tcp_connections.reachable_host(master_addr)
    )
    listener = tcp_connections.listen(host)
    try:
        addresses = all_gather_ints(_encode(listener.getsockname()), ring)
        members = dict(zip(dist.get_process_group_ranks(ring), map(_decode, addresses),
                           strict=True))  # fmt: skip
        if sorted(members) != sorted(topo.dp_group(rank)):
            raise RuntimeError(f"megatron-core's DP group {sorted(members)} differs from the "
                               f"ring {topo.dp_group(rank)}: unsupported rank order")  # fmt: skip
    except BaseException:
        listener.close()  # connect_ring closes it otherwise
        raise
    send_to, recv_from = tcp_connections.connect_ring(
        rank,
        generation,
        listener,
        {dst: members[dst] for dst in topo.ring_successors(rank, k)},
        topo.ring_predecessors(rank, k),
        timeout_s,
    )
    try:
        pulled_by, pull_from = tcp_connections.negotiate_pull(send_to, recv_from, timeout_s, pull)
    except BaseException:
        for sock in [*send_to.values(), *recv_from.values()]:
            sock.close()
        raise
    return tcp_transport.TcpTransport(
        send_to, recv_from, timeout_s, pulled_by=pulled_by, pull_from=pull_from
    )


def mpi_ring(topo: Topology, k: int, ring: dist.ProcessGroup, generation: int) -> Transport:
    """MPI intercommunicators to this rank's ring successors and from its predecessors: each
    member opens an MPI port per ring distance, the ring's members exchange the port names (a
    collective of the training thread), then connect in `connect_plan`'s order
    (checkpoint/mpi_transport.py)."""
    from ..checkpoint import mpi_transport as mt

    if not mt.spawned():
        raise RuntimeError("--deadpool-transport mpi: this process was not started through "
                           "MPI_Comm_spawn; start the job with deadpool-launch under mpirun "
                           "(README: the MPI transport)")  # fmt: skip
    rank = dist.get_rank()
    members = topo.ring(rank)
    steps = mt.connect_plan(members, rank, k)
    distances = sorted({h for _, _, h in steps})
    MPI = mt.mpi()
    own = {h: MPI.Open_port() for h in distances}
    try:
        mine = b"".join(mt.encode_port(own[h]) for h in distances)
        names = all_gather_bytes(mine, ring)
        ports = {
            r: {h: mt.decode_port(raw[n * mt.PORT_BYTES:(n + 1) * mt.PORT_BYTES])
                for n, h in enumerate(distances)}
            for r, raw in zip(dist.get_process_group_ranks(ring), names, strict=True)
        }  # fmt: skip
        return mt.connect_ring(rank, generation, steps, ports, own)
    finally:
        for port in own.values():
            MPI.Close_port(port)


def _encode(sockname: tuple) -> list[int]:
    """A listener's address as a fixed number of integers: family, port, 16 address bytes."""
    host, port = sockname[0], sockname[1]
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    packed = socket.inet_pton(family, host).ljust(16, b"\0")
    return [6 if family == socket.AF_INET6 else 4, port, *packed]


def _decode(values: list[int]) -> tcp_connections.Address:
    family, port, *packed = values
    if family == 6:
        return tcp_connections.Address(socket.inet_ntop(socket.AF_INET6, bytes(packed)), port)
    return tcp_connections.Address(socket.inet_ntop(socket.AF_INET, bytes(packed[:4])), port)
