"""Several node agents of one job on this machine, each in its own session as on its own node;
a whole node is lost by SIGKILLing its agent and every process it started at once."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from etcd_server import free_port

from deadpool_megatron.metrics import read_metrics
from jobs import ROOT, JobResult


@dataclass
class Nodes:
    procs: list[subprocess.Popen]
    logs: list[Path]
    metrics: Path
    killed: dict[int, float] = field(default_factory=dict)  # node -> wall time of the kill

    def output(self, node: int) -> str:
        return self.logs[node].read_text(errors="replace")

    def all_output(self) -> str:
        return "\n".join(f"== node {n} ==\n{self.output(n)}" for n in range(len(self.procs)))

    def kill_node(self, node: int) -> float:
        """SIGKILL the node's agent and every process under it, as one node's power loss."""
        agent = psutil.Process(self.procs[node].pid)
        victims = [agent, *agent.children(recursive=True)]
        at = time.time()
        for p in victims:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGKILL)
        self.killed[node] = at
        return at

    def kill_agent(self, node: int) -> list[int]:
        """SIGKILL the agent alone; the pids of the processes it had started."""
        agent = psutil.Process(self.procs[node].pid)
        pids = [c.pid for c in agent.children()]
        agent.send_signal(signal.SIGKILL)
        self.killed[node] = time.time()
        return pids

    def wait(self, timeout_s: float) -> list[int | None]:
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
        return [p.poll() for p in self.procs]

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def result(self, node: int = 0) -> JobResult:
        losses, final = read_metrics(str(self.metrics)) if self.metrics.exists() else ({}, None)
        rc = self.procs[node].returncode
        return JobResult(-1 if rc is None else rc, self.all_output(), losses, final)


def start_nodes(
    tmp_path: Path,
    nnodes: int,
    spare_nodes: int,
    nproc: int,
    args: list[str],
    spares: int = 0,
    launcher: list[str] | None = None,
) -> Nodes:
    """Start one agent per node, each in its own session, logging to its own file."""
    port = free_port()
    metrics = tmp_path / "metrics.jsonl"
    procs, logs = [], []
    for node in range(nnodes + spare_nodes):
        log = tmp_path / f"node{node}.log"
        cmd = [
            sys.executable, "-m", "deadpool_megatron.launch",
            "--nproc-per-node", str(nproc), "--spares", str(spares),
            "--nnodes", str(nnodes), "--spare-nodes", str(spare_nodes),
            "--node-rank", str(node), "--master-addr", "127.0.0.1",
            "--master-port", str(port), *(launcher or []),
            str(ROOT / "pretrain_gpt.py"), *args, "--metrics-jsonl", str(metrics),
        ]  # fmt: skip
        with open(log, "w") as fh:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT,
                                          start_new_session=True))  # fmt: skip
        logs.append(log)
    return Nodes(procs, logs, metrics)


def wait_for_iteration(nodes: Nodes, iteration: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if nodes.metrics.exists() and iteration in read_metrics(str(nodes.metrics))[0]:
            return
        if any(p.poll() is not None for p in nodes.procs):
            raise AssertionError(f"an agent ended early:\n{nodes.all_output()[-6000:]}")
        time.sleep(0.05)
    raise AssertionError(f"iteration {iteration} never came:\n{nodes.all_output()[-6000:]}")
