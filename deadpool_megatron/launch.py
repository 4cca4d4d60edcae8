"""deadpool-launch: start a job's workers and spares on this node and watch them.

The launcher hosts the job's coordination store (a torch TCPStore, on node 0) in its own
process, so the store outlives any worker. It checks the script's arguments once (a
"preflight" run of the script with DEADPOOL_PREFLIGHT=1, which must validate its flags and
exit) before starting anything, prefixes every line of a child's output with its role and rank,
forwards SIGINT/SIGTERM, and acts on failures: with --deadpool it hot-swaps (recovery/
coordinator.py), with --restart-policy full it restarts the job from its newest checkpoint, and
otherwise it ends the job with one clear line when a worker dies.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import astuple, dataclass, field

from .config import DeadpoolConfig
from .control import keys
from .control.chaos import Chaos
from .control.connect import control_store
from .control.membership import Member, Membership, MembershipStore
from .control.monitor import Detection, Monitor, ProcessProbe
from .control.store import StoreUnreachable
from .control.tcp_store import TcpKVStore
from .errors import ConfigError
from .events import (
    FAILURE_DETECTED,
    FENCED,
    JOB_ENDED,
    JOB_RESTART,
    SPARE_LOST,
    SUSPECTED,
    EventLog,
)
from .failure.classify import Decision, describe
from .failure.evidence import HeartbeatStale, ProcessExited, describe_exit
from .failure.hang import HangPolicy
from .failure.inject import parse_faults
from .failure.procstate import process_state
from .failure.progress import ProgressBoard, create_board_file
from .logging_setup import setup_logging
from .recovery.coordinator import Coordinator
from .recovery.plan import Unrecoverable
from .runtime import (
    ENV_FAULT_SCOPE,
    ENV_JOB_ID,
    ENV_PREFLIGHT,
    ENV_PREFLIGHT_OUT,
    ENV_PROGRESS_FILE,
    ENV_ROLE,
    ENV_SPARE_INDEX,
    ENV_SPARES,
    ROLE_SPARE,
    ROLE_WORKER,
)
from .topology import Topology

log = logging.getLogger("deadpool.launch")

TERMINATE_GRACE_S = 5.0
RECOVERY_TIMEOUT_S = 300.0
RESTART = -1  # watch() asks main() to watch the restarted job
POLL_S = 0.02


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deadpool-launch",
        description="Start N workers and S spare processes of SCRIPT on this node, host the "
        "job's store, and watch them.",
    )
    parser.add_argument("--nproc-per-node", type=int, required=True, metavar="N",
                        help="Worker processes on this node.")  # fmt: skip
    parser.add_argument("--spares", type=int, default=0, metavar="S",
                        help="Spare processes on this node (default: 0).")  # fmt: skip
    parser.add_argument("--nnodes", type=int, default=1, help="Nodes in the job (default: 1).")
    parser.add_argument("--node-rank", type=int, default=0, help="This node's rank (default: 0).")
    parser.add_argument("--master-addr", default="127.0.0.1",
                        help="Address of node 0, which hosts the store (default: 127.0.0.1).")  # fmt: skip
    parser.add_argument("--master-port", type=int, default=0,
                        help="Store port on node 0; 0 picks a free one on a single node.")  # fmt: skip
    parser.add_argument("--job-id", default=None, help="Job id (default: a random one).")
    parser.add_argument(
        "--restart-policy", choices=("hotswap", "full"), default="hotswap",
        help="What a failure costs. hotswap (default): a job with --deadpool recovers in place "
        "(a spare replaces a lost rank), falling back to a full restart only when that is "
        "impossible and --deadpool-on-unrecoverable says so; a job without --deadpool ends. "
        "full: checkpoint-restart, the baseline: stop every process, start the job again and "
        "load the newest complete checkpoint under --save.",
    )  # fmt: skip
    parser.add_argument("--max-restarts", type=int, default=10, metavar="N",
                        help="Full restarts allowed before the job gives up (default: 10).")  # fmt: skip
    parser.add_argument("--no-preflight", action="store_true",
                        help="Skip the argument check for a script that does not honour "
                        f"{ENV_PREFLIGHT}=1.")  # fmt: skip
    parser.add_argument("script", help="Training script, e.g. pretrain_gpt.py.")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="Its arguments.")
    return parser


def validate_launch_args(a: argparse.Namespace) -> None:
    if a.nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node={a.nproc_per_node} must be at least 1")
    if a.spares < 0:
        raise ConfigError(f"--spares={a.spares} must be 0 or more")
    if a.nnodes < 1:
        raise ConfigError(f"--nnodes={a.nnodes} must be at least 1")
    if not 0 <= a.node_rank < a.nnodes:
        raise ConfigError(f"--node-rank={a.node_rank} must lie in [0, {a.nnodes - 1}]")
    if not 0 <= a.master_port < 65536:
        raise ConfigError(f"--master-port={a.master_port} must lie in [0, 65535]")
    if a.nnodes > 1 and a.master_port == 0:
        raise ConfigError("--master-port 0 (pick a free port) only works with --nnodes 1")
    if a.max_restarts < 0:
        raise ConfigError(f"--max-restarts={a.max_restarts} must be 0 or more")
    if not os.path.isfile(a.script):
        raise ConfigError(f"script {a.script!r} does not exist")


@dataclass
class LaunchSettings:
    """What the launcher acts on, learnt from the script's flags (preflight): the workers' own
    DeadpoolConfig, so every knob has one definition and one default, plus the job's shape."""

    protection: DeadpoolConfig = field(default_factory=DeadpoolConfig)
    tp: int = 1
    pp: int = 1
    save: str | None = None
    load: str | None = None

    @classmethod
    def from_preflight(cls, d: dict) -> LaunchSettings:
        names = {f.name for f in dataclasses.fields(DeadpoolConfig)}
        return cls(
            protection=DeadpoolConfig(**{k: v for k, v in d.items() if k in names}),
            tp=int(d.get("tensor_model_parallel_size", 1)),
            pp=int(d.get("pipeline_model_parallel_size", 1)),
            save=d.get("save"),
            load=d.get("load"),
        )

    @property
    def on_unrecoverable(self) -> str:
        return self.protection.deadpool_on_unrecoverable or "stop"

    def spare_kills(self):
        return (f for f in parse_faults(self.protection.deadpool_inject or "") if f.on_spare)


@dataclass
class Child:
    role: str
    index: int  # global rank for a worker, spare index for a spare
    proc: subprocess.Popen
    board: ProgressBoard  # its progress marks, read from shared memory
    pump: threading.Thread | None = None
    reported: bool = field(default=False)

    def probe(self) -> ProcessProbe:
        return ProcessProbe(self.proc.pid, self.board.read(), process_state(self.proc.pid))

    @property
    def label(self) -> str:
        return f"{self.role} {self.index}"


class Launcher:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.world_size = args.nnodes * args.nproc_per_node
        self.job_id = args.job_id or uuid.uuid4().hex[:8]
        self.fault_scope = self.job_id  # injected faults fire once across restarts
        self.restarts = 0
        self.extra_args: list[str] = []  # --load DIR after a checkpoint-restart
        self.children: list[Child] = []
        # Progress boards live in memory where the node has /dev/shm.
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.board_dir = tempfile.mkdtemp(prefix="deadpool-progress-", dir=shm)
        self._spawned = 0
        self.store = None
        self.port = args.master_port
        self._print_lock = threading.Lock()
        self._stop_signal: int | None = None
        self.settings = LaunchSettings()
        self.events = EventLog(None)
        self.kv = None
        self.monitor: Monitor | None = None
        self.coordinator: Coordinator | None = None

    # -- start-up ---------------------------------------------------------------------------
    def preflight(self) -> int:
        """Run the script once to check its flags, and learn the settings it asks of us."""
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "settings.json")
            env = dict(os.environ, WORLD_SIZE=str(self.world_size))
            env.update(
                {ENV_PREFLIGHT: "1", ENV_PREFLIGHT_OUT: out, ENV_SPARES: str(self.args.spares)}
            )
            done = subprocess.run(
                [sys.executable, self.args.script, *self.args.script_args],
                env=env, capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            if done.returncode != 0:
                sys.stderr.write(done.stderr or done.stdout)
                return done.returncode
            if os.path.exists(out):
                with open(out) as fh:
                    self.settings = LaunchSettings.from_preflight(json.load(fh))
        return 0

    def host_store(self) -> None:
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

    def _env(self, role: str, index: int, local_rank: int, board: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            MASTER_ADDR=self.args.master_addr,
            MASTER_PORT=str(self.port),
            WORLD_SIZE=str(self.world_size),
            LOCAL_WORLD_SIZE=str(self.args.nproc_per_node),
            PYTHONUNBUFFERED="1",
        )
        # Several processes share this node's cores: one intra-op thread each, as torchrun does.
        env.setdefault("OMP_NUM_THREADS", "1")
        env[ENV_ROLE] = role
        env[ENV_JOB_ID] = self.job_id
        env[ENV_FAULT_SCOPE] = self.fault_scope
        env[ENV_PROGRESS_FILE] = board
        if role == ROLE_WORKER:
            env.update(RANK=str(index), LOCAL_RANK=str(local_rank))
        else:
            env[ENV_SPARE_INDEX] = str(index)
            env.pop("RANK", None)
        return env

    def _spawn(self, role: str, index: int, local_rank: int) -> None:
        self._spawned += 1
        board = os.path.join(self.board_dir, f"{self._spawned}-{role}-{index}")
        create_board_file(board)
        proc = subprocess.Popen(
            [sys.executable, "-u", self.args.script, *self.args.script_args, *self.extra_args],
            env=self._env(role, index, local_rank, board),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        child = Child(role, index, proc, ProgressBoard(board, writable=False))
        name = f"worker rank {index}" if role == ROLE_WORKER else child.label
        log.info("started %s (pid %d)", name, proc.pid)
        child.pump = threading.Thread(target=self._pump, args=(child,), daemon=True)
        child.pump.start()
        self.children.append(child)

    def _pump(self, child: Child) -> None:
        prefix = f"[{child.label}] ".encode()
        for line in iter(child.proc.stdout.readline, b""):
            with self._print_lock:
                sys.stdout.buffer.write(prefix + line)
                sys.stdout.buffer.flush()

    def start(self) -> None:
        a = self.args
        for local in range(a.nproc_per_node):
            self._spawn(ROLE_WORKER, a.node_rank * a.nproc_per_node + local, local)
        for s in range(a.spares):
            self._spawn(ROLE_SPARE, a.node_rank * a.spares + s, a.nproc_per_node + s)
        log.info(
            "job %s: %d worker(s) (ranks %d-%d of %d) and %d spare(s) started, store on port %d",
            self.job_id, a.nproc_per_node, a.node_rank * a.nproc_per_node,
            (a.node_rank + 1) * a.nproc_per_node - 1, self.world_size, a.spares, self.port,
        )  # fmt: skip

    # -- watching ---------------------------------------------------------------------------
    def _on_signal(self, signum, frame) -> None:
        self._stop_signal = signum

    def watch(self) -> int:
        workers = {c.index: c for c in self.children if c.role == ROLE_WORKER}
        spares = [c for c in self.children if c.role == ROLE_SPARE]
        p = self.settings.protection
        if self.events.path is None and p.deadpool_event_log:
            self.events = EventLog(p.deadpool_event_log)
        self.monitor = Monitor(
            self.kv, self.job_id, sorted(workers), lambda r: workers[r].proc.poll(),
            p.deadpool_heartbeat_interval, HangPolicy.from_config(p),
            watch_heartbeats=p.deadpool, probe=lambda r: workers[r].probe(),
            on_suspect=self._on_suspect,
        )  # fmt: skip
        spare_kills = list(self.settings.spare_kills())
        topo = Topology(self.world_size, self.settings.tp, self.settings.pp)
        self.coordinator = Coordinator(self.kv, self.job_id, topo, p.deadpool_replicas, self.events)
        chaos = Chaos(p, workers, self.kv, self.job_id, self.events)
        membership_written = self.args.node_rank != 0 or not p.deadpool
        next_membership_check = 0.0
        while True:
            if self._stop_signal is not None:
                name = signal.Signals(self._stop_signal).name
                log.info("received %s: forwarding it to every process", name)
                self.terminate(self._stop_signal)
                return 128 + self._stop_signal
            detection = self.monitor.poll()
            if detection is not None:
                if self.args.restart_policy == "full":
                    self._log_detection(detection)
                    return self.restart(f"failure of rank {detection.classification.rank}")
                if not p.deadpool or not membership_written:
                    return self.on_failure(detection, workers)
                rc = self.hot_swap(detection, workers, spares)
                if rc is not None:
                    return rc
            if self.coordinator.pending is not None:
                self.coordinator.poll_done()
                if self.coordinator.pending is not None and (
                    time.time() - self.coordinator.pending.ordered_at > RECOVERY_TIMEOUT_S
                ):
                    log.error("recovery into generation %d did not finish within %.0f s; "
                              "ending the job", self.coordinator.pending.generation,
                              RECOVERY_TIMEOUT_S)  # fmt: skip
                    self.terminate(signal.SIGTERM)
                    self.events.emit(JOB_ENDED, status=1, reason="recovery timed out")
                    return 1
            self._watch_spares(spares, spare_kills)
            chaos.step(self.monitor.iteration)
            if not membership_written and time.monotonic() >= next_membership_check:
                next_membership_check = time.monotonic() + 0.25  # store reads, not every poll
                membership_written = self._write_membership(spares)
            if all(c.proc.poll() == 0 for c in workers.values()):
                return self.finish(spares)
            time.sleep(POLL_S)

    def _on_suspect(self, rank: int, reason: str) -> None:
        """A late heartbeat from a process that is still progressing: say so, never fence."""
        log.warning("rank %d suspected, not fenced: %s", rank, reason)
        self.events.emit(SUSPECTED, rank=rank, reason=reason)

    def _watch_spares(self, spares: list[Child], spare_kills: list) -> None:
        for fault in list(spare_kills):
            if self.monitor.iteration >= fault.iteration:
                spare_kills.remove(fault)
                for child in spares:
                    if child.index == fault.target and child.proc.poll() is None:
                        log.warning("injecting %s (pid %d)", fault, child.proc.pid)
                        os.killpg(child.proc.pid, signal.SIGKILL)
        for child in spares:
            rc = child.proc.poll()
            if rc is not None and not child.reported:
                child.reported = True
                if rc != 0:
                    log.warning(
                        "spare %d (pid %d) %s; it leaves the pool and the job goes on",
                        child.index, child.proc.pid, describe_exit(rc),
                    )  # fmt: skip
                    self.kv.delete(keys.spare(self.job_id, child.index))  # out of the pool
                    self.events.emit(SPARE_LOST, spare=child.index, pid=child.proc.pid,
                                     how=describe_exit(rc))  # fmt: skip

    def _write_membership(self, spares: list[Child]) -> bool:
        """Generation 0's membership, once every rank has registered its process."""
        holders = [
            self.kv.get(keys.registration(self.job_id, 0, r)) for r in range(self.world_size)
        ]
        if any(h is None for h in holders):
            return False
        topo = Topology(self.world_size, self.settings.tp, self.settings.pp)
        members = tuple(
            Member(r, h.decode(), astuple(topo.coords(r))) for r, h in enumerate(holders)
        )
        ids = tuple(f"spare-{c.index}" for c in spares if c.proc.poll() is None)
        MembershipStore(self.kv, self.job_id).create(Membership(0, members, ids))
        log.info("generation 0: %d ranks and %d spare(s) recorded", len(members), len(ids))
        return True

    def _fence(self, child: Child, rank: int, reason: str) -> None:
        """Kill a process that must not come back (hung, or failing too often) before anything
        is rebuilt: a hung gloo collective cannot be aborted, its peers fail once it is gone."""
        if child.proc.poll() is None:
            os.killpg(child.proc.pid, signal.SIGKILL)
            child.proc.wait()
            self.events.emit(FENCED, rank=rank, pid=child.proc.pid, reason=reason)
            log.warning("fenced rank %d (pid %d): %s", rank, child.proc.pid, reason)
        self.monitor.forget(rank)

    def _log_detection(self, detection: Detection) -> None:
        c = detection.classification
        latency = detection.latency_s
        self.events.emit(
            FAILURE_DETECTED, rank=c.rank, kind=c.kind.value, evidence=type(c.evidence).__name__,
            reason=c.reason, detect_latency_s=latency, heartbeat_iteration=self.monitor.iteration,
        )  # fmt: skip
        log.error(
            "failure of rank %d classified %s: %s%s",
            c.rank, c.kind.value, c.reason,
            "" if latency is None else f" (detected {latency:.3f} s after the injection)",
        )  # fmt: skip

    def on_failure(self, detection: Detection, workers: dict[int, Child]) -> int:
        """Without --deadpool (or before the job is up): log the classified failure, fence a
        hung process, and end the job."""
        c = detection.classification
        child = workers[c.rank]
        if isinstance(c.evidence, HeartbeatStale):
            self._fence(child, c.rank, describe(c.evidence))
        self._log_detection(detection)
        if isinstance(c.evidence, ProcessExited):
            log.error(
                "worker rank %d (pid %d) %s; ending the job",
                c.rank, child.proc.pid, describe_exit(c.evidence.returncode),
            )  # fmt: skip
        else:
            log.error("rank %d failed and the job has no --deadpool protection; ending it", c.rank)
        self.terminate(signal.SIGTERM)
        self.events.emit(JOB_ENDED, status=1, reason=f"failure of rank {c.rank}")
        return 1

    def hot_swap(
        self, detection: Detection, workers: dict[int, Child], spares: list[Child]
    ) -> int | None:
        """Recover from a classified failure without restarting the job: fence, order every
        process to stop, plan from what they hold, seat spares, publish the new generation.
        Returns an exit status only when the job cannot go on."""
        c = detection.classification
        child = workers[c.rank]
        permanent = set() if c.kind is Decision.TRANSIENT else {c.rank}
        fence_s = 0.0
        if permanent:
            t = time.time()
            self._fence(child, c.rank, describe(c.evidence))  # no-op if it exited
            fence_s = time.time() - t
        self._log_detection(detection)
        generation = self.coordinator.membership.current().generation + 1
        failed_at = detection.injected_at or c.evidence.at
        rec = self.coordinator.order(generation, permanent, c.reason, failed_at)
        rec.phases["detect"] = detection.detected_at - failed_at
        rec.phases["fence"] = fence_s
        if not permanent:
            self.monitor.history = self.monitor.history.record(c.rank, c.evidence.at)
        held = self.coordinator.gather(
            rec,
            lost=self.monitor.lost,
            on_lost=lambda r, why: self._fence(workers[r], r, f"lost during the recovery: {why}"),
        )
        free = [s for s in spares if s.proc.poll() is None]
        try:
            plan = self.coordinator.decide(rec, held, [f"spare-{s.index}" for s in free])
        except Unrecoverable as err:
            lost = sorted(rec.permanent) or [c.rank]
            if self.settings.on_unrecoverable == "checkpoint-restart":
                log.error("cannot hot-swap the failure of rank(s) %s: %s; falling back to the "
                          "persistent checkpoint", lost, err)  # fmt: skip
                return self.restart(f"unrecoverable in memory: {err}")
            log.error("cannot recover from the failure of rank(s) %s: %s; ending the job",
                      lost, err)  # fmt: skip
            self.events.emit(JOB_ENDED, status=1, reason=f"unrecoverable: {err}")
            self.terminate(signal.SIGTERM)
            return 1
        for rank, spare_id in plan.replaced.items():
            spare = next(s for s in free if f"spare-{s.index}" == spare_id)
            spares.remove(spare)
            workers[rank] = spare
            log.info("spare %d (pid %d) takes over rank %d", spare.index, spare.proc.pid, rank)
        self.monitor.advance(generation)
        return None

    def restart(self, reason: str) -> int:
        """Checkpoint-restart: stop every process, start the job again under a new job id
        (a fresh key space) with --load, so it resumes from the newest complete checkpoint."""
        save = self.settings.save
        if self.restarts >= self.args.max_restarts or not save:
            why = "no --save directory" if not save else f"--max-restarts {self.args.max_restarts}"
            log.error("cannot restart the job (%s) after %s; ending it", why, reason)
            self.terminate(signal.SIGTERM)
            self.events.emit(JOB_ENDED, status=1, reason=f"{reason}; no restart ({why})")
            return 1
        self.events.emit(JOB_RESTART, reason=reason, restart=self.restarts + 1, load=save)
        log.warning("checkpoint-restart %d: %s; stopping every process", self.restarts + 1, reason)
        self.terminate(signal.SIGTERM)
        self.children.clear()
        self.restarts += 1
        self.job_id = f"{self.fault_scope}-r{self.restarts}"
        if self.settings.load is None:
            self.extra_args = ["--load", save]
        self.start()
        return RESTART

    def finish(self, spares: list[Child]) -> int:
        """Every local worker succeeded: tell the spares once every node is done."""
        finished = keys.job_finished(self.job_id)
        if self.kv.add(keys.nodes_done(self.job_id), 1) >= self.args.nnodes:
            self.kv.set(finished, b"1")
        deadline = time.monotonic() + 600
        while self.kv.get(finished) is None and time.monotonic() < deadline:
            time.sleep(0.2)
        deadline = time.monotonic() + 10
        while any(s.proc.poll() is None for s in spares) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.terminate(signal.SIGTERM)
        self._join_pumps()
        self.events.emit(JOB_ENDED, status=0, reason="all workers succeeded")
        log.info(
            "job %s finished: all %d worker(s) succeeded", self.job_id, self.args.nproc_per_node
        )
        return 0

    def terminate(self, signum: int) -> None:
        """Signal every child's process group (a dead child's helpers, e.g. checkpoint writer
        processes, live on in its group), wait, then SIGKILL whatever is left."""
        alive = [c for c in self.children if c.proc.poll() is None]
        for c in self.children:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(c.proc.pid, signum)
        deadline = time.monotonic() + TERMINATE_GRACE_S
        for c in alive:
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        for c in self.children:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(c.proc.pid, signal.SIGKILL)
            c.proc.wait()
        self._join_pumps()

    def _join_pumps(self) -> None:
        for c in self.children:
            if c.pump is not None:
                c.pump.join(timeout=2)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging("[launcher]")
    try:
        validate_launch_args(args)
    except ConfigError as err:
        print(f"deadpool-launch: error: {err}", file=sys.stderr)
        return ConfigError.exit_code
    launcher = Launcher(args)
    if not args.no_preflight:
        rc = launcher.preflight()
        if rc != 0:
            return rc
    signal.signal(signal.SIGINT, launcher._on_signal)
    signal.signal(signal.SIGTERM, launcher._on_signal)
    try:
        launcher.host_store()
    except StoreUnreachable as err:
        print(f"deadpool-launch: error: {err}", file=sys.stderr)
        return ConfigError.exit_code
    try:
        launcher.start()
        while True:
            rc = launcher.watch()
            if rc != RESTART:
                return rc
    finally:
        shutil.rmtree(launcher.board_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
