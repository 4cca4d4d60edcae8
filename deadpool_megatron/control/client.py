"""A worker's (or spare's) line to the job's control store: heartbeats, reports, registrations.

Each process opens its own connection to the store (never the one its process groups use), so
a beat or a report never waits behind a collective's rendezvous. Every record it writes comes
from `messages.py`; every generation it names is read from the process's `JobContext`.
"""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Callable, Mapping
from functools import partial
from urllib.parse import urlsplit

from ..config import DeadpoolConfig
from ..endpoints import parse_endpoints
from ..failure.heartbeat import HeartbeatSender
from ..runtime import ProcessEnv
from . import keys
from .connect import control_store
from .context import JobContext
from .messages import (
    Claim,
    FailureReport,
    Flag,
    Heartbeat,
    HostFootprint,
    Injection,
    Registration,
    SparePrebuilt,
    SpareRegistration,
    TrainingEnd,
    spare_id,
)
from .store import StoreTimeout
from .wait import wait_until


def connect(env: ProcessEnv, settings: DeadpoolConfig, timeout_s: float = 30.0) -> JobContext:
    """This process's job context, on its own connection to the control store."""
    if env.master_port is None:
        raise RuntimeError("the control store needs MASTER_PORT: start with deadpool-launch")
    kv = control_store(settings, env.master_addr, env.master_port, timeout_s)
    return JobContext(kv, env.job_id)


def control_ports(env: ProcessEnv, settings: DeadpoolConfig) -> set[int]:
    """Ports of the control plane's connections: a communicator abort never cuts them."""
    ports = {env.master_port} if env.master_port is not None else set()
    if settings.deadpool_store == "etcd":
        urls = parse_endpoints(settings.deadpool_etcd_endpoints or "")
        ports |= {urlsplit(u).port or 2379 for u in urls}
    return ports | mpi_ports(os.environ)


def mpi_ports(environ: Mapping[str, str]) -> set[int]:
    """The ports of a process started by Open MPI that MPI itself needs: its PMIx server's
    (Open MPI's daemon on the node; cut, MPI can neither connect nor spawn) and the range its
    TCP transport listens on (mpi_child.py gives it one of its own; a cut connection there
    makes the peer report this process dead, and ULFM aborts it)."""
    ports = set()
    for name, value in environ.items():
        if name.startswith("PMIX_SERVER_URI"):
            ports |= {int(port) for port in re.findall(r"tcp[46]?://.*?:(\d+)(?:;|$)", value)}
    for family in ("v4", "v6"):
        low = environ.get(f"OMPI_MCA_btl_tcp_port_min_{family}", "")
        span = environ.get(f"OMPI_MCA_btl_tcp_port_range_{family}", "")
        if low.isdigit() and span.isdigit():
            ports |= set(range(int(low), int(low) + int(span)))
    return ports


class ControlClient:
    def __init__(self, ctx: JobContext, fault_scope: str):
        self.ctx = ctx
        self.fault_scope = fault_scope  # faults fire once per job, across restarts too
        self._sender: HeartbeatSender | None = None

    # -- heartbeats -------------------------------------------------------------------------
    def start_heartbeats(
        self, interval_s: float, key: Callable[[], str], iteration: Callable[[], int]
    ) -> None:
        """Beat under `key()` (re-read at every beat: a recovery moves the process to a new
        generation, a claimed spare to a rank) until stopped. Start after warm-up: imports and
        the first iteration starve threads of the GIL."""
        if self._sender is not None:
            return
        pid = os.getpid()

        def publish(now: float) -> None:
            self.ctx.put(key(), Heartbeat(time.time(), iteration(), pid))

        self._sender = HeartbeatSender(publish, interval_s)
        self._sender.start()

    def stop_heartbeats(self) -> None:
        if self._sender is not None:
            self._sender.stop()
            self._sender.join(timeout=5)
            self._sender = None

    # -- reports ----------------------------------------------------------------------------
    def report_injection(self, rank: int, fault: str, at: float) -> None:
        self.ctx.put(keys.injected(self.ctx.job, rank), Injection(fault, at, self.ctx.generation))

    def report_failure(
        self, rank: int, kind: str, message: str, at: float | None = None,
        where: tuple[int, str] = (-1, ""), generation: int | None = None,
    ) -> None:  # fmt: skip
        """Evidence this process has about its own failure (an exception it caught), and
        where it was: its progress mark (iteration, phase); in `generation` (default: the
        one it works in; a recovery's failure is of the generation it was recovering into)."""
        report = FailureReport(kind, message[:2000], time.time() if at is None else at, *where)
        generation = self.ctx.generation if generation is None else generation
        self.ctx.put(keys.report(self.ctx.job, generation, rank), report)

    def register_worker(self, rank: int) -> None:
        """Tell the agent which process holds `rank` (for the membership view)."""
        key = keys.registration(self.ctx.job, self.ctx.generation, rank)
        self.ctx.put(key, Registration(socket.gethostname(), os.getpid()))

    def register_spare(self, index: int) -> None:
        self.ctx.put(
            keys.spare(self.ctx.job, spare_id(index)),
            SpareRegistration(socket.gethostname(), os.getpid()),
        )

    def publish_prebuilt(self, index: int, ranks: tuple[int, ...]) -> None:
        """The ranks spare `index` can take over with what it built while idle."""
        self.ctx.put(keys.spare_prebuilt(self.ctx.job, spare_id(index)), SparePrebuilt(ranks))

    def publish_footprint(self, rank: int, footprint: HostFootprint) -> None:
        """The host buffers `rank`'s protection holds, for the spares to reserve ahead."""
        self.ctx.put(keys.footprint(self.ctx.job, rank), footprint)

    def footprint(self, rank: int) -> HostFootprint | None:
        return self.ctx.get(keys.footprint(self.ctx.job, rank), HostFootprint)

    def publish_training_end(self, iteration: int) -> None:
        """Where this job's training stops (every rank of the first generation agrees)."""
        self.ctx.create(keys.training_end(self.ctx.job), TrainingEnd(iteration))

    def training_end(self) -> int | None:
        end = self.ctx.get(keys.training_end(self.ctx.job), TrainingEnd)
        return None if end is None else end.iteration

    def claim_fault(self, fault: str) -> bool:
        """True for the first process of the job to fire `fault`, False for any later one."""
        return self.ctx.create(keys.fault_fired(self.fault_scope, fault), Claim(str(os.getpid())))

    def strike_together(
        self, point: str, rank: int, others: tuple[int, ...], timeout_s: float,
        clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
    ) -> tuple[int, ...]:  # fmt: skip
        """Mark `rank` at fault point `point`, then wait until `others` are there too, at most
        `timeout_s`; returns those that never came (the caller strikes anyway)."""
        self.ctx.create(keys.fault_arrived(self.fault_scope, point, rank), Claim(str(os.getpid())))

        def missing() -> tuple[int, ...]:
            key = partial(keys.fault_arrived, self.fault_scope, point)
            return tuple(r for r in others if self.ctx.get(key(r), Claim) is None)

        try:
            wait_until(lambda: () if not missing() else None, timeout_s, f"ranks {list(others)} "
                       f"at fault point {point}", clock=clock, sleep=sleep)  # fmt: skip
        except StoreTimeout:
            return missing()
        return ()

    def job_finished(self) -> bool:
        return self.ctx.get(keys.job_finished(self.ctx.job), Flag) is not None

    def close(self) -> None:
        self.stop_heartbeats()
        self.ctx.kv.close()
