"""The agent of one node: hosts the job's store (node 0) or connects to it, starts this node's
workers and spares (a spare node: spares only), watches them and the other nodes' leases
(agent/nodes.py), and acts on each classified failure as agent/decide.py says: hot-swap
(recovery/coordinator.py), checkpoint-restart, or a clean end with one line.

No node is special in a recovery: the first agent to write a generation's order coordinates
it (a failure of its own processes, or another node's lapsed lease), every other agent follows
it from the store (reports its own lost ranks, fences only its own processes, and adopts the
plan's word on which local processes hold which rank), and a checkpoint-restart is one record
that every agent carries out."""

from __future__ import annotations

import argparse
import logging
import signal
import time

from ..control import keys
from ..control.chaos import Chaos
from ..control.context import JobContext
from ..control.messages import (
    AgentBeat,
    Flag,
    PlanDecision,
    RecoveryOrder,
    RestartOrder,
    spare_id,
)
from ..control.monitor import Detection, Monitor
from ..control.store import StoreTimeout, StoreUnreachable
from ..control.wait import wait_until
from ..events import (
    FAILURE_DETECTED,
    JOB_ENDED,
    JOB_RESTART,
    NODE_JOINED,
    STALLED,
    SUSPECTED,
    EventLog,
)
from ..failure.classify import Classification, Decision, describe
from ..failure.evidence import HealthCheckFailed, ProcessExited
from ..failure.hang import HangPolicy
from ..recovery.coordinator import Coordinator
from ..recovery.placement import SpareNumbering, spare_local_rank
from ..runtime import ROLE_SPARE, ROLE_WORKER
from ..topology import Topology, job_topology
from .children import Child, Children, Launch, exit_seen, job_env
from .decide import Action, Response, refused_its_input, respond, why_it_ends
from .ending import Ending
from .first_generation import FirstGeneration
from .hotswap import RECOVERY_TIMEOUT_S, HotSwap, Run, Stop
from .launches import agree_job_id, agree_on_launch, claim_launch, log_layout, open_store
from .nodes import Hosted, Lease, NodeWatch, count_node_lost, lease_context
from .pool import SparePool
from .replenish import Replenisher, SpareStart
from .settings import LaunchSettings
from .signals import ReceivedSignals

log = logging.getLogger("deadpool.launch")

SUCCEEDED = "all workers succeeded"  # how a job that ran to its end without a late failure ends
RESTART = -1  # watch() asks its caller to watch the restarted job
POLL_S = 0.02
STORE_LOOK_S = 0.1  # other nodes' leases, orders and restarts: store reads, not every poll
MEMBERSHIP_POLL_S = 0.25  # looking for every rank's registration: store reads, not every poll
SPARES_EXIT_S = 10.0


class Agent:
    def __init__(self, args: argparse.Namespace, settings: LaunchSettings):
        self.args = args
        self.settings = settings
        self.node = args.node_rank
        self.node_count = args.nnodes + args.spare_nodes  # launched; more may join later
        self.spare_node = args.node_rank >= args.nnodes  # runs spares only (a joined node too)
        self.joined = args.join  # this node joined the running job (`agent/joining.py`)
        self.world_size = args.nnodes * args.nproc_per_node
        self.numbering = SpareNumbering(args.nnodes, args.spare_nodes, args.nproc_per_node,
                                        args.spares)  # fmt: skip
        self.job_id = args.job_id or ""  # agreed in host_store() when not given
        self.fault_scope = self.job_id  # injected faults fire once across restarts
        self.restarts = 0
        self.extra_args: list[str] = []  # --load DIR after a checkpoint-restart
        self.children = Children(
            Launch(args.script, tuple(args.script_args), args.master_addr, self.world_size,
                   args.nproc_per_node, args.node_rank, fork_server=not args.no_fork_server,
                   fork_zygote=args.fork_zygote,
                   mpi_spawn=args.mpi_spawn)
        )  # fmt: skip
        self.port = args.master_port
        self.store = None
        self.kv = None
        self.ctx: JobContext | None = None  # the job's standing; a restart starts a new one
        self.lease: Lease | None = None
        self.swap: HotSwap | None = None  # this start's hot-swaps (watch() makes it)
        self.first: FirstGeneration | None = None  # this start's generation 0 (watch() too)
        self._hosted = Hosted(0, (), ())  # what the lease says this node hosts (a snapshot)
        self.signals = ReceivedSignals()  # launch.py installs `signals.note` as the handler
        self._signalled = False  # the workers were told to stop after an iteration
        p = settings.protection
        self.events = EventLog(
            p.deadpool_event_log, generation=lambda: self.ctx.generation if self.ctx else 0
        )

    # -- start-up ---------------------------------------------------------------------------
    def host_store(self) -> None:
        """The job's store (`launches.open_store`), the job id every agent uses, this
        launch's claim on its keys where they outlive it, and, with several nodes, every
        node's launch compared with the others' before any process starts. Where this agent
        imports torch for a TCPStore (a second or more), its fork server boots meanwhile."""
        if not self._outlives_launches():
            self.children.prepare()
        self.store, self.kv, self.port = open_store(self.args, self.settings.protection,
                                                    self.port)  # fmt: skip
        if not self.job_id:
            self.job_id = agree_job_id(self.kv, f"{self.args.master_addr}:{self.port}",
                                       self.node_count, self._outlives_launches())  # fmt: skip
        self.fault_scope = self.job_id
        self.ctx = JobContext(self.kv, self.job_id)
        if self._outlives_launches():
            claim_launch(self.ctx, self.node, self.node_count)
        if self.node_count > 1 and not self.joined:  # a joining node compared its own
            forget = self._ending().forget if self._outlives_launches() else None
            timeout_s = self.settings.protection.deadpool_slow_phase_timeout
            agree_on_launch(self.ctx, self.args, self.settings.flags, self.node_count, timeout_s,
                            forget)  # fmt: skip

    def _outlives_launches(self) -> bool:
        """etcd keeps a job's keys after its launch; node 0's TCPStore ends with it."""
        return self.settings.protection.deadpool_store == "etcd"

    def expected_spares(self) -> dict[str, int]:
        """Every spare the job is launched with: its id -> its node."""
        return {spare_id(i): node for i, node in self.numbering.launched().items()}

    def start(self) -> None:
        a = self.args
        env = job_env(self.job_id, self.port, self.fault_scope)
        if not self.spare_node:
            for local in range(a.nproc_per_node):
                rank = self.node * a.nproc_per_node + local
                self._start_seat(rank, local)
        count = self.numbering.started(self.node)
        indices = [self.numbering.index(s, self.node) for s in range(count)]
        for s, index in enumerate(indices):
            local = spare_local_rank(s, a.nproc_per_node, self.spare_node)
            self.children.spawn(ROLE_SPARE, index, local, env, self.extra_args)
        if self.joined and self.restarts == 0:
            self.events.emit(NODE_JOINED, node=self.node, spares=[spare_id(i) for i in indices])
        if self.spare_node:
            log.info("job %s: %s node %d: %d spare(s) started", self.job_id,
                     "joined" if self.joined else "spare", self.node, count)  # fmt: skip
        else:
            log.info(
                "job %s: node %d: %d worker(s) (ranks %d-%d of %d) and %d spare(s) started, "
                "%s", self.job_id, self.node, a.nproc_per_node,
                self.node * a.nproc_per_node, (self.node + 1) * a.nproc_per_node - 1,
                self.world_size, count, f"store at {self.kv.endpoint}" if self.store is None
                else f"store on port {self.port}",
            )  # fmt: skip
        if self.node == 0 and self.restarts == 0:
            log_layout(self.settings.protection, self.node_count,
                       f"{self.args.master_addr}:{self.port}", self.topology())  # fmt: skip
        # The first lease already names what this node hosts: a failure in the job's first
        # second must find this node's spares in it (the watch loop keeps it current).
        started = self.children.all
        self._hosted = Hosted(
            self.ctx.generation,
            tuple(sorted(c.index for c in started if c.role == ROLE_WORKER)),
            tuple(spare_id(c.index) for c in started if c.role == ROLE_SPARE),
        )  # fmt: skip
        self._stop_lease()
        if self.node_count > 1:  # nobody watches a single node's lease
            hosted = None if self.store is None else (self.args.master_addr, self.port)
            self.lease = Lease(lease_context(self.ctx, hosted), self.node, lambda: self._hosted,
                               self.settings.protection.deadpool_heartbeat_interval)  # fmt: skip
            self.lease.start()

    def topology(self) -> Topology:
        return job_topology(self.world_size, self.settings.parallel, self.args.nproc_per_node)

    # -- watching ---------------------------------------------------------------------------
    def _new_run(self) -> Run:
        p = self.settings.protection
        workers = {c.index: c for c in self.children.all if c.role == ROLE_WORKER}
        spares = [c for c in self.children.all if c.role == ROLE_SPARE]
        refills = self.numbering.refills(self.node)
        replenisher = Replenisher(p.deadpool and p.deadpool_replenish_spares, refills.first,
                                  refills.stride, refills.limit)  # fmt: skip
        pool = SparePool(self.node, spares, replenisher, self._start_spare, self.kv,
                         self.job_id, self.events, self.settings.spare_kills())  # fmt: skip
        monitor = Monitor(
            self.ctx, sorted(workers), lambda r: exit_seen(workers[r].proc),
            p.deadpool_heartbeat_interval, HangPolicy.from_config(p),
            watch_heartbeats=p.deadpool, probe=lambda r: workers[r].probe(),
            on_suspect=self._on_suspect, world_size=self.world_size, on_stall=self._on_stall,
        )  # fmt: skip
        coordinator = Coordinator(self.ctx, self.topology(), p.deadpool_replicas, self.events,
                                  node=self.node)  # fmt: skip
        chaos = Chaos(
            p.deadpool_chaos_mtbf, p.deadpool_chaos_seed, self.world_size, self.ctx,
            lambda: {r: c.proc.pid for r, c in workers.items() if c.alive()}, self.events,
        )  # fmt: skip
        lease = self.lease
        renewed = (lambda: lease.renewed) if lease is not None else (lambda: 0)
        own_needed = max(1, int(p.deadpool_node_timeout / p.deadpool_heartbeat_interval) - 1)
        nodes = NodeWatch(self.ctx, self.node, list(range(self.node_count + self._joined())),
                          p.deadpool_node_timeout, renewed, own_needed,
                          startup_timeout_s=p.deadpool_slow_phase_timeout)  # fmt: skip
        return Run(workers, pool, monitor, coordinator, chaos, nodes, up=not p.deadpool)

    def _start_seat(self, rank: int, local_rank: int) -> Child:
        env = job_env(self.job_id, self.port, self.fault_scope)
        return self.children.spawn(ROLE_WORKER, rank, local_rank, env, self.extra_args)

    def _start_spare(self, start: SpareStart) -> Child:
        env = job_env(self.job_id, self.port, self.fault_scope)
        return self.children.spawn(ROLE_SPARE, start.index, start.local_rank, env,
                                   self.extra_args)  # fmt: skip

    def _stop(self, stop: Stop | None, run: Run) -> int | None:
        if stop is None:
            return None
        if stop.finished:
            # Every rank finished training or failed after it: whoever planned that says so
            # for all (a failed rank never counts itself done), then each node finishes.
            self.ctx.put(keys.job_finished(self.job_id), Flag("training finished before a failure"))
            return self.finish(run, stop.reason)
        return self.restart(stop.reason) if stop.restart else self._end(stop.reason)

    def watch(self) -> int:
        """Watch the job until it ends (exit status) or restarts (RESTART)."""
        run = self._new_run()
        self.swap = HotSwap(self.ctx, self.node, run, self.events, self.settings.on_unrecoverable,
                            self.expected_spares())  # fmt: skip
        self.first = FirstGeneration(
            self.ctx, self.topology(), list(self.expected_spares()),
            self.settings.protection.deadpool_slow_phase_timeout, self._start_seat, self.events,
        )  # fmt: skip
        try:
            return self._watch(run)
        except StoreUnreachable as err:
            log.error("%s; stopping this node's processes", err)
            return self._end(str(err))

    def _watch(self, run: Run) -> int:
        next_store_look = 0.0
        next_membership_check = 0.0
        while True:
            self._hosted = Hosted(
                self.ctx.generation, tuple(sorted(run.workers)),
                run.pool.alive_ids(),
            )  # fmt: skip
            for signum in self.signals.take():
                if not self._stop_after_iteration(signum, run):
                    log.info("received %s: forwarding it to every process",
                             signal.Signals(signum).name)  # fmt: skip
                    self.children.terminate(signum)
                    return 128 + signum
            if time.monotonic() >= next_store_look:
                next_store_look = time.monotonic() + STORE_LOOK_S
                rc = self._look_at_the_job(run)
                if rc is not None:
                    return rc
            detection = run.monitor.poll()
            if detection is not None:
                rc = self._act(detection, run)
                if rc is not None:
                    return rc
            coordinator = run.coordinator
            if coordinator.pending is not None:
                coordinator.poll_done()
                pending = coordinator.pending
                if pending is not None and time.time() - pending.ordered_at > RECOVERY_TIMEOUT_S:
                    log.error("recovery into generation %d did not finish within %.0f s; "
                              "ending the job", pending.generation, RECOVERY_TIMEOUT_S)  # fmt: skip
                    return self._end("recovery timed out")
            run.pool.watch(run.monitor.iteration)
            running = coordinator.pending is None and not run.monitor.training_over()
            if running and run.up:
                run.pool.refill()
            run.chaos.step(run.monitor.iteration, running=running)
            if not run.up and time.monotonic() >= next_membership_check:
                next_membership_check = time.monotonic() + MEMBERSHIP_POLL_S
                # node 0 records it, and an agent holding a failure until it is recorded
                run.up = self.first.up(run.pool.idle, record=self.node == 0 or bool(run.held))
            if run.workers and all(c.proc.poll() == 0 for c in run.workers.values()):
                return self.finish(run)
            time.sleep(POLL_S)

    def _stop_after_iteration(self, signum: int, run: Run) -> bool:
        """With --exit-signal-handler, the first SIGTERM goes to the workers alone: they stop
        after the same iteration, save, and exit 0, and the job finishes as usual (its spares
        told at the end). False: stop every process now (any other signal, or a second)."""
        flags = self.settings.flags or {}
        if signum != signal.SIGTERM or not flags.get("exit_signal_handler") or self._signalled:
            return False
        self._signalled = True
        log.info("received SIGTERM: forwarding it to the workers, which stop after the same "
                 "iteration%s (--exit-signal-handler); another signal stops every process now",
                 " and save it" if flags.get("save") else "")  # fmt: skip
        for child in run.workers.values():
            child.kill(signal.SIGTERM)
        return True

    def _look_at_the_job(self, run: Run) -> int | None:
        """What other nodes did or lost: a restart to join, this node counted lost, another
        node's lease lapsed, a recovery another agent ordered."""
        order = self.ctx.get(keys.restart(self.fault_scope, self.restarts + 1), RestartOrder)
        if order is not None:
            return self._restart(order)
        if self.ctx.get(keys.node_lost(self.job_id, self.node), Flag) is not None:
            log.error("this node (%d) was counted lost by the job (its lease lapsed); stopping "
                      "its processes, which no longer hold any rank", self.node)  # fmt: skip
            return self._end(f"node {self.node} counted lost")
        self._watch_joined(run)
        run.nodes_lost(run.nodes.poll(run.up))
        while run.lost_nodes:
            rc = self._node_lost(run.lost_nodes.pop(0), run)
            if rc is not None:
                return rc
        generation = self.ctx.generation + 1
        if self.ctx.get(keys.recovery_order(self.job_id, generation), RecoveryOrder) is not None:
            return self._stop(self.swap.follow(generation), run)
        if not run.workers and self.ctx.get(keys.job_finished(self.job_id), Flag) is not None:
            return self.finish(run)  # a node without ranks (a spare node) ends with the job
        return None

    def _joined(self) -> int:
        """How many nodes have joined the running job (`deadpool-launch --join`)."""
        if self.node_count == 1:
            return 0  # a one-node job cannot be joined
        return self.ctx.kv.add(keys.joined_nodes(self.fault_scope), 0)

    def _watch_joined(self, run: Run) -> None:
        """Watch the nodes that joined the job since the last look: their spares join the
        pool once their lease lists them, and a lapsed lease is a lost node like any."""
        for node in range(self.node_count, self.node_count + self._joined()):
            if run.nodes.watch(node):
                log.info("node %d joined the job as a spare node", node)

    def _act(self, detection: Detection, run: Run) -> int | None:
        c = detection.classification
        held = run.held.pop(c.rank, None)  # while it waited for every rank to register
        if held is not None and held.pid != run.workers[c.rank].proc.pid:
            held = None  # of a process no longer in the seat
        if not run.up and self.settings.protection.deadpool and held is None:
            # every rank may have registered since: any agent deciding on a failure records
            # generation 0 then, not only node 0 (whose poll may come a moment later)
            run.up = self.first.up(run.pool.idle, record=True)
        registered = run.up or not isinstance(c.evidence, ProcessExited)
        registered = registered or self.first.registered(c.rank)
        falls_back = self.settings.on_unrecoverable == "checkpoint-restart"
        response = respond(c, self.args.restart_policy, self.settings.protection.deadpool,
                           run.up, registered, c.rank in run.relaunched, falls_back)  # fmt: skip
        if response.action is Action.WAIT:
            if held is None:
                self._log_detection(detection, run.monitor.iteration)

            if self.first.hold(detection, held, run, lambda: self._fence(c, response)):
                return None
            return self._end(f"failure of rank {c.rank} before every rank registered")
        fence_s = self._fence(c, response)
        if held is not None and not response.fence:
            fence_s = held.fence_s  # fenced as its wait began
        if not refused_its_input(c) and held is None:  # not a failure: said below
            self._log_detection(detection, run.monitor.iteration)
        if held is not None:
            detection = held.detection  # the recovery counts from the failure, not the wait's end
        if response.action is Action.RESTART:
            if c.kind is Decision.REPEATED:
                log.error("%s; the recovery cannot succeed in memory: falling back to the "
                          "persistent checkpoint", c.reason)  # fmt: skip
                return self.restart(f"rank {c.rank}'s recovery failed the same way again")
            return self.restart(f"failure of rank {c.rank}")
        if response.action is Action.RELAUNCH:
            return self.first.relaunch(c.rank, c.evidence, run)
        if response.action is Action.END:
            line, reason, status = why_it_ends(c, run.workers[c.rank].proc.pid)
            log.error("%s", line)
            return self._end(reason, status)
        if isinstance(c.evidence, HealthCheckFailed):
            run.pool.node_unfit(f"rank {c.rank} failed its health check: {c.reason}")
        if not response.replace:
            run.monitor.record_transient(c.rank, c.evidence.at)
        run.monitor.record_error(c.cause)
        permanent = {c.rank} if response.replace else set()
        failed_at = detection.injected_at or detection.classification.evidence.at
        phases = {"detect": detection.detected_at - failed_at, "fence": fence_s}
        return self._stop(self.swap.recover(permanent, c.reason, failed_at, phases), run)

    def _fence(self, c: Classification, response: Response) -> float:
        """Fence the failed rank's process if the response says so; the seconds it took."""
        if not response.fence:
            return 0.0
        t = time.time()
        self.swap.fence(c.rank, describe(c.evidence))
        return time.time() - t

    def _node_lost(self, beat: AgentBeat, run: Run) -> int | None:
        """Another node's lease lapsed: its agent and processes are gone (or cut off, and
        about to stop themselves). The first agent to count it (first writer of its flag)
        takes its spares out of the pool and hot-swaps the ranks it still held; the others
        follow that recovery."""
        what = beat.holder
        ranks = count_node_lost(self.ctx, self.node, beat, run.replaced_in, run.nodes.timeout_s,
                                self.events)  # fmt: skip
        if not ranks:
            return None
        if self.args.restart_policy == "full":
            return self.restart(f"loss of {what}")
        if not self.settings.protection.deadpool or not run.up:
            log.error("%s was lost and the job %s; ending it", what, "is not up yet"
                      if run.up is False else "has no --deadpool protection")  # fmt: skip
            return self._end(f"loss of {what}")
        phases = {"detect": time.time() - beat.at}
        return self._stop(self.swap.recover(set(ranks), f"{what} lost", beat.at, phases), run)

    def _on_suspect(self, rank: int, reason: str) -> None:
        """A late heartbeat from a process that is still progressing: say so, never fence."""
        log.warning("rank %d suspected, not fenced: %s", rank, reason)
        self.events.emit(SUSPECTED, rank=rank, reason=reason)

    def _on_stall(self, rank: int, reason: str) -> None:
        """A process beating on time whose training thread stopped: say where, never fence."""
        log.warning("rank %d stalled, not fenced: %s", rank, reason)
        self.events.emit(STALLED, rank=rank, reason=reason)

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

    # -- hot-swap ---------------------------------------------------------------------------
    def restart(self, reason: str) -> int:
        """Checkpoint-restart, decided here: recorded in the store so every node's agent
        takes part in the same one (first writer wins), then carried out."""
        save = self.settings.save
        if self.restarts >= self.args.max_restarts or not save:
            why = "no --save directory" if not save else f"--max-restarts {self.args.max_restarts}"
            log.error("cannot restart the job (%s) after %s; ending it", why, reason)
            return self._end(f"{reason}; no restart ({why})")
        count = self.restarts + 1
        order = RestartOrder(keys.restarted_job(self.fault_scope, count), reason, count)
        self.ctx.create(keys.restart(self.fault_scope, count), order)
        return self._restart(self.ctx.get(keys.restart(self.fault_scope, count), RestartOrder))

    def _restart(self, order: RestartOrder) -> int:
        """Stop every local process, start them again under the order's job id (a fresh key
        space) with --load, so the job resumes from the newest complete checkpoint."""
        self.events.emit(JOB_RESTART, reason=order.reason, restart=order.count,
                         load=self.settings.save)  # fmt: skip
        log.warning("checkpoint-restart %d: %s; stopping every process", order.count,
                    order.reason)  # fmt: skip
        self.children.terminate(signal.SIGTERM)
        self.children.forget_all()
        self.restarts = order.count
        self.job_id = order.job
        self.ctx = JobContext(self.kv, self.job_id)
        if self.settings.load is None:
            self.extra_args = ["--load", self.settings.save]
        self.start()
        return RESTART

    def _end(self, reason: str, status: int = 1) -> int:
        self.children.terminate(signal.SIGTERM)
        self.events.emit(JOB_ENDED, status=status, reason=reason)
        return status

    def finish(self, run: Run, reason: str = SUCCEEDED) -> int:
        """This node's workers succeeded (or it has none and the job is done): tell the
        spares once every rank is done."""
        ending = self._ending()
        try:
            got = ending.wait(run.workers)
            if isinstance(got, RestartOrder):
                return self._restart(got)
            if isinstance(got, PlanDecision):
                log.error("the job cannot end: %s", got.unrecoverable)
                return self._end(f"unrecoverable: {got.unrecoverable}")
            run.pool.stop_warming()
            wait_until(lambda: True if not run.pool.size() else None,
                       SPARES_EXIT_S, "the spares to exit", interval_s=0.05)  # fmt: skip
        except StoreTimeout as err:
            log.warning("%s; stopping what is left", err)
        self.children.terminate(signal.SIGTERM)
        if ending.outlives:
            self._stop_lease()  # no renewal may write its key back after the deletion
        ending.leave(run.nodes.members(self.node_count))
        self.events.emit(JOB_ENDED, status=0, reason=reason)
        succeeded = sum(c.proc.poll() == 0 for c in run.workers.values())
        log.info("job %s finished: %d worker(s) on node %d succeeded%s", self.job_id, succeeded,
                 self.node, "" if reason == SUCCEEDED else f" ({reason})")  # fmt: skip
        return 0

    def _ending(self) -> Ending:
        return Ending(self.ctx, self.node, self.node_count, self.world_size, self.fault_scope,
                      self.restarts, hosts_store=self.store is not None,
                      outlives=self._outlives_launches())  # fmt: skip

    def _stop_lease(self) -> None:
        if self.lease is not None:
            self.lease.stop()
            if self.lease.ctx.kv is not self.kv:
                self.lease.ctx.kv.close()
            self.lease = None

    def close(self) -> None:
        self._stop_lease()
        self.children.close()
        self.events.close()
