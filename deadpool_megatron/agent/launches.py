"""A launch of the job in its store, from its agents' start to their end: the store itself
(node 0's TCPStore, or etcd), the job id its agents agree on, its claim on that id's keys in a
store that outlives launches, the comparison of what each node was launched with before any
process starts, what the layout risks (said once), and the deletion of the job's keys once it
is over."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable

from ..agreement import LAUNCH_SHAPE, refuse_unlike_launches
from ..config import DeadpoolConfig
from ..control import keys, messages
from ..control.connect import control_store
from ..control.context import JobContext
from ..control.messages import JobIdentity, JobLaunch, NodeLaunch
from ..control.signed import ForgedRecord, job_secret, signed
from ..control.store import KVStore, StoreTimeout
from ..control.tcp_store import TcpKVStore
from ..control.wait import wait_until
from ..errors import ConfigError, LaunchError
from ..topology import Topology

log = logging.getLogger("deadpool.launch")

# How long node 0's agent, which may host the store, waits after refusing for the other
# agents to have read every launch (they would find the store gone, not the reason).
COMPARED_WAIT_S = 10.0


def open_store(
    args: argparse.Namespace, protection: DeadpoolConfig, port: int
) -> tuple[object | None, KVStore, int]:
    """(the TCPStore this agent hosts or reaches, None with etcd; the job's signed key-value
    store; the port it listens on). With --deadpool-store etcd, etcd holds everything
    (control records and the process groups' rendezvous) and no agent hosts anything;
    otherwise node 0's agent hosts a TCPStore, in its own process so it outlives every
    worker, and the other nodes' agents connect to it."""
    if protection.deadpool_store == "etcd":
        return None, control_store(protection, "", 0), port
    import torch.distributed as dist

    store = dist.TCPStore(args.master_addr, port, is_master=args.node_rank == 0,
                          timeout=datetime.timedelta(seconds=300), wait_for_workers=False)  # fmt: skip
    hosted = TcpKVStore.wrap(store, f"{args.master_addr}:{store.port}")
    return store, signed(hosted, job_secret()), store.port


def agree_job_id(kv: KVStore, launch: str, node_count: int, outlives: bool) -> str:
    """One node: a fresh id. Several: the first agent to write one under this launch's store
    address (`launch`) wins and everyone reads it (the TCPStore is new with every launch; a
    store that outlives launches, etcd, needs --job-id instead)."""
    fresh = uuid.uuid4().hex[:8]
    if node_count == 1:
        return fresh
    if outlives:
        raise ConfigError("--deadpool-store etcd with several nodes needs --job-id (the "
                          "same on every node; under Slurm, $SLURM_JOB_ID)")  # fmt: skip
    key = keys.launch_identity(launch)
    messages.create(kv, key, JobIdentity(fresh))
    return messages.get(kv, key, JobIdentity).job


def claim_launch(ctx: JobContext, node: int, node_count: int) -> None:
    """Make sure this launch owns its job id's keys, in a store that outlives launches,
    before any process starts. Another launch's (signed with another secret) read as absent,
    so its registrations and leases would be ignored while its counters (unsigned) were added
    to, and its membership refused ours with a traceback: such a job id is refused here, by
    name. One node's agent is its launch's only one: a record it did not write is an earlier
    launch's, even signed with the same secret."""
    mine = JobLaunch(socket.gethostname(), node, time.time())
    try:
        if ctx.create(keys.launch(ctx.job), mine) or node_count > 1:
            return  # this agent's, or (several nodes) another agent of this launch's
        whose = "an earlier launch with the same DEADPOOL_JOB_SECRET"
    except ForgedRecord:
        whose = "another launch (not signed with this launch's DEADPOOL_JOB_SECRET)"
    raise ConfigError(
        f"job id {ctx.job!r} already has keys in the store at {ctx.kv.endpoint} written by "
        f"{whose}: it ended without finishing, or still runs. Launch with another --job-id "
        "(the Slurm script gives a requeued job one of its own), or, once nothing of that "
        f"launch runs, delete its keys: etcdctl del --prefix {keys.job_prefix(ctx.job)} and "
        f"etcdctl del --prefix {keys.process_groups_prefix(ctx.job)}"
    )


def recorded_launches(ctx: JobContext, node_count: int) -> dict[int, NodeLaunch | None]:
    """What each of the job's launched nodes recorded it was launched with (None: nothing
    yet)."""
    return {n: ctx.get(keys.node_launch(ctx.job, n), NodeLaunch) for n in range(node_count)}


def compare_launches(
    ctx: JobContext,
    mine: NodeLaunch,
    node_count: int,
    timeout_s: float,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Write this node's launch, wait up to `timeout_s` for every node's, and compare them.
    Returns how many nodes were compared; raises ConfigError naming every difference (the
    same on every agent), LaunchError naming the nodes that did not start."""
    ctx.put(keys.node_launch(ctx.job, mine.node), mine)

    def read() -> dict[int, NodeLaunch | None]:
        return recorded_launches(ctx, node_count)

    def poll() -> dict[int, NodeLaunch] | None:
        got = read()
        return None if any(v is None for v in got.values()) else got

    try:
        launches = wait_until(poll, timeout_s, "every node's agent", interval_s=0.1,
                              clock=clock, sleep=sleep)  # fmt: skip
    except StoreTimeout:
        missing = [n for n, launch in read().items() if launch is None]
        raise LaunchError(
            f"node(s) {missing} of {node_count} did not start their agent within "
            f"{timeout_s:g} s (--deadpool-slow-phase-timeout)"
        ) from None
    compared = keys.launches_compared(ctx.job)
    ctx.kv.add(compared, 1)
    try:
        refuse_unlike_launches({n: launch.as_compared() for n, launch in launches.items()})
    except ConfigError:
        if mine.node == 0:
            with contextlib.suppress(StoreTimeout):
                wait_until(lambda: True if ctx.kv.add(compared, 0) >= node_count else None,
                           COMPARED_WAIT_S, "every agent to compare", interval_s=0.05,
                           clock=clock, sleep=sleep)  # fmt: skip
        raise
    return len(launches)


def node_shape(args: argparse.Namespace) -> dict:
    """deadpool-launch's flags that every node of a job must be given alike (the script by
    its file name: it is mounted elsewhere on each node)."""
    shape = {key: getattr(args, key) for key in LAUNCH_SHAPE}
    shape["script"] = os.path.basename(shape["script"])
    return shape


def forget_job(kv: KVStore, jobs: list[str]) -> int:
    """Delete the keys and process-group rendezvous of `jobs` (a job and its
    checkpoint-restarts); returns how many keys went."""
    removed = 0
    for job in jobs:
        for prefix in (keys.job_prefix(job), keys.process_groups_prefix(job)):
            removed += kv.delete_prefix(prefix) or 0
    return removed


def agree_on_launch(
    ctx: JobContext,
    args: argparse.Namespace,
    flags: dict | None,
    node_count: int,
    timeout_s: float,
    forget: Callable[[str], None] | None,
) -> None:
    """Every node's agent compares every node's launch before any process starts: a node
    given other flags would build other process groups, load or train to another
    iteration, and hang the job. Each agent refuses the same differences (exit 2);
    node 0's then deletes the refused launch's keys with `forget` (etcd's; None: no keys
    outlive the launch)."""
    mine = NodeLaunch(args.node_rank, socket.gethostname(), node_shape(args), flags)
    try:
        compared = compare_launches(ctx, mine, node_count, timeout_s)
    except ConfigError:
        if args.node_rank == 0 and forget is not None:
            forget("was refused")
        raise
    if args.node_rank == 0:
        log.info("job %s: its %d nodes were launched alike (%d training flags compared)",
                 ctx.job, compared, len(flags or ()))  # fmt: skip


def log_layout(
    protection: DeadpoolConfig, node_count: int, store_at: str, topology: Topology
) -> None:
    """Once per job, by node 0: where the store lives, and what one node's loss would cost."""
    if node_count == 1:
        return
    if protection.deadpool_store == "etcd":
        log.info("the job's state is in etcd (%s): control records and every generation's "
                 "process-group rendezvous; no node's loss takes it with it",
                 protection.deadpool_etcd_endpoints)  # fmt: skip
    else:
        log.info(
            "the job's TCPStore runs in node 0's agent (%s): if node 0 is lost, every other "
            "agent stops its processes and the job ends (resubmit it with --load to resume "
            "from the newest checkpoint under --save; --deadpool-store etcd keeps the job's "
            "state off every node)", store_at,
        )  # fmt: skip
    if protection.deadpool:
        bare = topology.unprotected_against_node_loss(protection.deadpool_replicas)
        if bare:
            log.warning(
                "the optimizer shards of rank(s) %s and all their %d replica(s) share a "
                "node: losing that node loses them (DP groups must span nodes, or raise "
                "--deadpool-replicas)", bare, protection.deadpool_replicas,
            )  # fmt: skip
