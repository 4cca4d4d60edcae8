"""A worker's (or spare's) line to the job's control store: heartbeats and reports.

Each process opens its own connection to the store the launcher hosts (never the one its
process groups use), so a beat or a report never waits behind a collective's rendezvous.
"""

from __future__ import annotations

import json
import os
import socket
import time

from ..config import DeadpoolConfig
from ..failure.heartbeat import HeartbeatSender
from ..failure.inject import Fault
from ..runtime import ProcessEnv
from . import keys
from .connect import control_store


class ControlClient:
    def __init__(
        self,
        env: ProcessEnv,
        settings: DeadpoolConfig,
        generation: int = 0,
        timeout_s: float = 30.0,
    ):
        if env.master_port is None:
            raise RuntimeError("the control store needs MASTER_PORT: start with deadpool-launch")
        self.env = env
        self.job = env.job_id
        self.generation = generation
        self.kv = control_store(
            settings.deadpool_store, settings.deadpool_etcd_endpoints,
            env.master_addr, env.master_port, timeout_s,
        )  # fmt: skip
        self._sender: HeartbeatSender | None = None
        self.iteration = 0
        # Ports of the control plane's connections (never cut when communicators are aborted).
        self.kv_ports = {env.master_port}
        if settings.deadpool_store == "etcd":
            from urllib.parse import urlsplit

            from .etcd_store import parse_endpoints

            urls = parse_endpoints(settings.deadpool_etcd_endpoints or "")
            self.kv_ports |= {urlsplit(u).port or 2379 for u in urls}

    # -- heartbeats -------------------------------------------------------------------------
    def start_heartbeats(self, interval_s: float, key: str | None = None) -> None:
        """Begin beating (after warm-up: imports and the first iteration starve threads)."""
        if self._sender is not None:
            return
        pid = os.getpid()

        def publish(now: float) -> None:
            beat = {"t": time.time(), "iteration": self.iteration, "pid": pid}
            # A recovery moves the process to a new generation (and a spare to a rank).
            where = key or keys.heartbeat(self.job, self.generation, self.env.rank)
            self.kv.set(where, json.dumps(beat).encode())

        self._sender = HeartbeatSender(publish, interval_s)
        self._sender.start()

    def stop_heartbeats(self) -> None:
        if self._sender is not None:
            self._sender.stop()
            self._sender.join(timeout=5)
            self._sender = None

    # -- reports ----------------------------------------------------------------------------
    def report_injection(self, fault: Fault, at: float) -> None:
        record = {"fault": str(fault), "at": at}
        self.kv.set(
            keys.injected(self.job, self.generation, self.env.rank), json.dumps(record).encode()
        )

    def report_failure(self, kind: str, message: str, at: float | None = None) -> None:
        """Evidence this process has about its own failure (an exception it caught)."""
        record = {"kind": kind, "message": message[:2000], "at": time.time() if at is None else at}
        self.kv.set(
            keys.report(self.job, self.generation, self.env.rank), json.dumps(record).encode()
        )

    def register_worker(self) -> None:
        """Tell the launcher which process holds this rank (for the membership view)."""
        key = keys.registration(self.job, self.generation, self.env.rank)
        self.kv.set(key, f"{socket.gethostname()}:{os.getpid()}".encode())

    def claim_fault(self, fault: Fault) -> bool:
        """True for the first process of the job to fire `fault`, False for any later one."""
        ok, _ = self.kv.compare_and_swap(
            keys.fault_fired(self.env.fault_scope, str(fault)), None, str(os.getpid()).encode()
        )
        return ok

    def register_spare(self, index: int) -> None:
        self.kv.set(keys.spare(self.job, index), str(os.getpid()).encode())

    def job_finished(self) -> bool:
        return self.kv.get(keys.job_finished(self.job)) is not None

    def close(self) -> None:
        self.stop_heartbeats()
        self.kv.close()
