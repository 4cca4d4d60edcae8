"""The agent of one node: hosts the job's store (node 0), starts the workers and spares, watches
them, and acts on each classified failure as agent/decide.py says: hot-swap (recovery/
coordinator.py), checkpoint-restart, or a clean end with one line."""

from __future__ import annotations

import argparse
import datetime
import logging
import signal
import time
import uuid
from dataclasses import astuple

from ..control import keys
from ..control.chaos import Chaos
from ..control.connect import control_store
from ..control.context import JobContext
from ..control.membership import MembershipStore
from ..control.messages import Flag, Member, Membership, Registration, spare_id
from ..control.monitor import Detection, Monitor
from ..control.store import StoreTimeout
from ..control.tcp_store import TcpKVStore
from ..control.wait import wait_until
from ..events import (
    FAILURE_DETECTED,
    FENCED,
    JOB_ENDED,
    JOB_RESTART,
    SPARE_LOST,
    SUSPECTED,
    EventLog,
)
from ..failure.classify import describe
from ..failure.evidence import ProcessExited, describe_exit
from ..failure.hang import HangPolicy
from ..recovery.coordinator import Coordinator
from ..recovery.plan import Unrecoverable
from ..runtime import ROLE_SPARE, ROLE_WORKER
from ..topology import Topology
from .children import Child, Children, Launch, job_env
from .decide import Action, respond
from .settings import LaunchSettings

log = logging.getLogger("deadpool.launch")

RECOVERY_TIMEOUT_S = 300.0
RESTART = -1  # watch() asks its caller to watch the restarted job
POLL_S = 0.02
MEMBERSHIP_POLL_S = 0.25  # looking for every rank's registration: store reads, not every poll
FINISH_TIMEOUT_S = 600.0  # for every node's workers to succeed
SPARES_EXIT_S = 10.0


class Agent:
    def __init__(self, args: argparse.Namespace, settings: LaunchSettings):
        self.args = args
        self.settings = settings
        self.world_size = args.nnodes * args.nproc_per_node
        self.job_id = args.job_id or uuid.uuid4().hex[:8]
        self.fault_scope = self.job_id  # injected faults fire once across restarts
        self.restarts = 0
        self.extra_args: list[str] = []  # --load DIR after a checkpoint-restart
        self.children = Children(
            Launch(args.script, tuple(args.script_args), args.master_addr, self.world_size,
                   args.nproc_per_node)
        )  # fmt: skip
        self.port = args.master_port
        self.store = None
        self.kv = None
        self.ctx: JobContext | None = None  # the job's standing; a restart starts a new one
        self._stop_signal: int | None = None
        p = settings.protection
        self.events = EventLog(
            p.deadpool_event_log, generation=lambda: self.ctx.generation if self.ctx else 0
        )

    # -- start-up ---------------------------------------------------------------------------
    def host_store(self) -> None:
        """The job's TCPStore, in this process so it outlives every worker (node 0 hosts it)."""
        import torch.distributed as dist

        self.store = dist.TCPStore(
            self.args.master_addr,
            self.port,
            is_master=self.args.node_rank == 0,
            timeout=datetime.timedelta(seconds=300),
            wait_for_workers=False,
        )
        self.port = self.store.port
        p = self.settings.protection
        if p.deadpool_store == "etcd":
            self.kv = control_store("etcd", p.deadpool_etcd_endpoints, "", 0)
        else:
            self.kv = TcpKVStore.wrap(self.store, f"{self.args.master_addr}:{self.port}")
        self.ctx = JobContext(self.kv, self.job_id)

    def start(self) -> None:
        a = self.args
        env = job_env(self.job_id, self.port, self.fault_scope)
        for local in range(a.nproc_per_node):
            rank = a.node_rank * a.nproc_per_node + local
            self.children.spawn(ROLE_WORKER, rank, local, env, self.extra_args)
        for s in range(a.spares):
            index = a.node_rank * a.spares + s
            self.children.spawn(ROLE_SPARE, index, a.nproc_per_node + s, env, self.extra_args)
        log.info(
            "job %s: %d worker(s) (ranks %d-%d of %d) and %d spare(s) started, store on port %d",
            self.job_id, a.nproc_per_node, a.node_rank * a.nproc_per_node,
            (a.node_rank + 1) * a.nproc_per_node - 1, self.world_size, a.spares, self.port,
        )  # fmt: skip

    def topology(self) -> Topology:
        return Topology(self.world_size, self.settings.tp, self.settings.pp,
                        self.args.nproc_per_node)  # fmt: skip

    def on_signal(self, signum, frame) -> None:
        self._stop_signal = signum

    # -- watching ---------------------------------------------------------------------------
    def watch(self) -> int:
        """Watch the job until it ends (exit status) or restarts (RESTART)."""
        p = self.settings.protection
        workers = {c.index: c for c in self.children.all if c.role == ROLE_WORKER}
        spares = [c for c in self.children.all if c.role == ROLE_SPARE]
        monitor = Monitor(
            self.ctx, sorted(workers), lambda r: workers[r].proc.poll(),
            p.deadpool_heartbeat_interval, HangPolicy.from_config(p),
            watch_heartbeats=p.deadpool, probe=lambda r: workers[r].probe(),
            on_suspect=self._on_suspect,
        )  # fmt: skip
        topo = self.topology()
        coordinator = Coordinator(self.ctx, topo, p.deadpool_replicas, self.events)
        chaos = Chaos(
            p.deadpool_chaos_mtbf, p.deadpool_chaos_seed, self.world_size, self.ctx,
            lambda: {r: c.proc.pid for r, c in workers.items() if c.alive()}, self.events,
        )  # fmt: skip
        spare_kills = self.settings.spare_kills()
        up = self.args.node_rank != 0 or not p.deadpool
        next_membership_check = 0.0
        while True:
            if self._stop_signal is not None:
                name = signal.Signals(self._stop_signal).name
                log.info("received %s: forwarding it to every process", name)
                self.children.terminate(self._stop_signal)
                return 128 + self._stop_signal
            detection = monitor.poll()
            if detection is not None:
                rc = self._act(detection, workers, spares, monitor, coordinator, up)
                if rc is not None:
                    return rc
            if coordinator.pending is not None:
                coordinator.poll_done()
                pending = coordinator.pending
                if pending is not None and time.time() - pending.ordered_at > RECOVERY_TIMEOUT_S:
                    log.error("recovery into generation %d did not finish within %.0f s; "
                              "ending the job", pending.generation, RECOVERY_TIMEOUT_S)  # fmt: skip
                    return self._end("recovery timed out")
            self._watch_spares(spares, spare_kills, monitor.iteration)
            chaos.step(monitor.iteration, running=coordinator.pending is None)
            if not up and time.monotonic() >= next_membership_check:
                next_membership_check = time.monotonic() + MEMBERSHIP_POLL_S
                up = self._write_membership(spares)
            if all(c.proc.poll() == 0 for c in workers.values()):
                return self.finish(spares)
            time.sleep(POLL_S)

    def _act(self, detection, workers, spares, monitor, coordinator, up) -> int | None:
        c = detection.classification
        response = respond(c, self.args.restart_policy, self.settings.protection.deadpool, up)
        fence_s = 0.0
        if response.fence:
            t = time.time()
            self._fence(workers[c.rank], c.rank, describe(c.evidence), monitor)
            fence_s = time.time() - t
        self._log_detection(detection, monitor.iteration)
        if response.action is Action.RESTART:
            return self.restart(f"failure of rank {c.rank}")
        if response.action is Action.END:
            child = workers[c.rank]
            if isinstance(c.evidence, ProcessExited):
                log.error("worker rank %d (pid %d) %s; ending the job", c.rank, child.proc.pid,
                          describe_exit(c.evidence.returncode))  # fmt: skip
            else:
                log.error("rank %d failed and the job has no --deadpool protection; ending it",
                          c.rank)  # fmt: skip
            return self._end(f"failure of rank {c.rank}")
        if not response.replace:
            monitor.record_transient(c.rank, c.evidence.at)
        return self.hot_swap(detection, response.replace, fence_s, workers, spares, monitor,
                             coordinator)  # fmt: skip

    def _on_suspect(self, rank: int, reason: str) -> None:
        """A late heartbeat from a process that is still progressing: say so, never fence."""
        log.warning("rank %d suspected, not fenced: %s", rank, reason)
        self.events.emit(SUSPECTED, rank=rank, reason=reason)

    def _watch_spares(self, spares: list[Child], spare_kills: list, iteration: int) -> None:
        for fault in list(spare_kills):
            if iteration >= fault.iteration:
                spare_kills.remove(fault)
                for child in spares:
                    if child.index == fault.target and child.alive():
                        log.warning("injecting %s (pid %d)", fault, child.proc.pid)
                        child.kill()
        for child in spares:
            rc = child.proc.poll()
            if rc is not None and not child.reported:
                child.reported = True
                if rc != 0:
                    log.warning(
                        "spare %d (pid %d) %s; it leaves the pool and the job goes on",
                        child.index, child.proc.pid, describe_exit(rc),
                    )  # fmt: skip
                    self.kv.delete(keys.spare(self.job_id, spare_id(child.index)))
                    self.events.emit(SPARE_LOST, spare=child.index, pid=child.proc.pid,
                                     how=describe_exit(rc))  # fmt: skip

    def _write_membership(self, spares: list[Child]) -> bool:
        """Generation 0's membership, once every rank has registered its process."""
        holders = [
            self.ctx.get(keys.registration(self.job_id, 0, r), Registration)
            for r in range(self.world_size)
        ]
        if any(h is None for h in holders):
            return False
        topo = self.topology()
        members = tuple(
            Member(r, h.process_id, astuple(topo.coords(r))) for r, h in enumerate(holders)
        )
        ids = tuple(spare_id(c.index) for c in spares if c.alive())
        MembershipStore(self.kv, self.job_id).create(Membership(0, members, ids))
        log.info("generation 0: %d ranks and %d spare(s) recorded", len(members), len(ids))
        return True

    def _fence(self, child: Child, rank: int, reason: str, monitor: Monitor) -> None:
        """Kill a process that must not come back (hung, or unfit) before anything is rebuilt:
        a hung gloo collective cannot be aborted, its peers fail once it is gone."""
        if child.alive():
            child.kill()
            child.proc.wait()
            self.events.emit(FENCED, rank=rank, pid=child.proc.pid, reason=reason)
            log.warning("fenced rank %d (pid %d): %s", rank, child.proc.pid, reason)
        monitor.forget(rank)

    def _log_detection(self, detection: Detection, iteration: int) -> None:
        c = detection.classification
        latency = detection.latency_s
        self.events.emit(
            FAILURE_DETECTED, rank=c.rank, kind=c.kind.value, evidence=type(c.evidence).__name__,
            reason=c.reason, detect_latency_s=latency, heartbeat_iteration=iteration,
        )  # fmt: skip
        log.error(
            "failure of rank %d classified %s: %s%s",
            c.rank, c.kind.value, c.reason,
            "" if latency is None else f" (detected {latency:.3f} s after the injection)",
        )  # fmt: skip

    # -- acting -----------------------------------------------------------------------------
    def hot_swap(
        self,
        detection: Detection,
        replace: bool,
        fence_s: float,
        workers: dict[int, Child],
        spares: list[Child],
        monitor: Monitor,
        coordinator: Coordinator,
    ) -> int | None:
        """Recover without restarting the job: order every process to stop, plan from what
        they hold, seat spares, publish the new generation. Returns an exit status only when
        the job cannot go on."""
        c = detection.classification
        permanent = {c.rank} if replace else set()
        failed_at = detection.injected_at or c.evidence.at
        rec = coordinator.order(permanent, c.reason, failed_at)
        rec.phases["detect"] = detection.detected_at - failed_at
        rec.phases["fence"] = fence_s
        held = coordinator.gather(
            rec,
            lost=monitor.lost,
            on_lost=lambda r, why: self._fence(
                workers[r], r, f"lost during the recovery: {why}", monitor
            ),  # fmt: skip
        )
        free = [s for s in spares if s.alive()]
        try:
            plan = coordinator.decide(rec, held, [spare_id(s.index) for s in free])
        except Unrecoverable as err:
            lost = sorted(rec.permanent) or [c.rank]
            if self.settings.on_unrecoverable == "checkpoint-restart":
                log.error("cannot hot-swap the failure of rank(s) %s: %s; falling back to the "
                          "persistent checkpoint", lost, err)  # fmt: skip
                return self.restart(f"unrecoverable in memory: {err}")
            log.error("cannot recover from the failure of rank(s) %s: %s; ending the job",
                      lost, err)  # fmt: skip
            return self._end(f"unrecoverable: {err}")
        for rank, sid in plan.replaced.items():
            spare = next(s for s in free if spare_id(s.index) == sid)
            spares.remove(spare)
            workers[rank] = spare
            log.info("spare %d (pid %d) takes over rank %d", spare.index, spare.proc.pid, rank)
        return None

    def restart(self, reason: str) -> int:
        """Checkpoint-restart: stop every process, start the job again under a new job id
        (a fresh key space) with --load, so it resumes from the newest complete checkpoint."""
        save = self.settings.save
        if self.restarts >= self.args.max_restarts or not save:
            why = "no --save directory" if not save else f"--max-restarts {self.args.max_restarts}"
            log.error("cannot restart the job (%s) after %s; ending it", why, reason)
            return self._end(f"{reason}; no restart ({why})")
        self.events.emit(JOB_RESTART, reason=reason, restart=self.restarts + 1, load=save)
        log.warning("checkpoint-restart %d: %s; stopping every process", self.restarts + 1, reason)
        self.children.terminate(signal.SIGTERM)
        self.children.forget_all()
        self.restarts += 1
        self.job_id = f"{self.fault_scope}-r{self.restarts}"
        self.ctx = JobContext(self.kv, self.job_id)
        if self.settings.load is None:
            self.extra_args = ["--load", save]
        self.start()
        return RESTART

    def _end(self, reason: str) -> int:
        self.children.terminate(signal.SIGTERM)
        self.events.emit(JOB_ENDED, status=1, reason=reason)
        return 1

    def finish(self, spares: list[Child]) -> int:
        """Every local worker succeeded: tell the spares once every node is done."""
        finished = keys.job_finished(self.job_id)
        if self.kv.add(keys.nodes_done(self.job_id), 1) >= self.args.nnodes:
            self.ctx.put(finished, Flag("agent"))
        try:
            wait_until(lambda: self.ctx.get(finished, Flag), FINISH_TIMEOUT_S,
                       "every node's workers to succeed", interval_s=0.2)  # fmt: skip
            wait_until(lambda: True if not any(s.alive() for s in spares) else None,
                       SPARES_EXIT_S, "the spares to exit", interval_s=0.05)  # fmt: skip
        except StoreTimeout as err:
            log.warning("%s; stopping what is left", err)
        self.children.terminate(signal.SIGTERM)
        self.events.emit(JOB_ENDED, status=0, reason="all workers succeeded")
        log.info(
            "job %s finished: all %d worker(s) succeeded", self.job_id, self.args.nproc_per_node
        )
        return 0

    def close(self) -> None:
        self.children.close()
        self.events.close()
