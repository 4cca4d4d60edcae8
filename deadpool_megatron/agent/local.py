"""Several node agents of one job on one machine, each in its own session as if on its own
node: how the tests and scripts/bench_node_loss.py run multi-node jobs without a cluster, and
how a whole node is lost there (its agent and every process under it SIGKILLed at once)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from ..control.signed import ENV_JOB_SECRET, new_secret
from ..metrics import read_metrics

FORK_SERVER_READY = re.compile(r"fork server ready \(pid (\d+)")  # the agent's log line


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LocalNodes:
    procs: list[subprocess.Popen]
    logs: list[Path]
    metrics: Path
    killed: dict[int, float] = field(default_factory=dict)  # node -> wall time of the kill
    agent_command: list[str] = field(default_factory=list)  # every node's, less --node-rank
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None

    def join(self, extra: list[str] | None = None) -> int:
        """Start one more agent that joins the running job (`--join`), launched as every
        node was (`extra`: more script arguments, to launch it unlike them); returns its
        position in `procs` and `logs`, `joinN.log` (its node index is the job's to give)."""
        position = len(self.procs)
        log = self.logs[0].with_name(f"join{position}.log")
        cmd = [*self.agent_command[:3], "--join", *self.agent_command[3:], *(extra or [])]
        self.start_agent(cmd, log)
        return position

    def start_agent(self, cmd: list[str], log: Path) -> None:
        with open(log, "w") as fh:
            self.procs.append(subprocess.Popen(cmd, cwd=self.cwd, env=self.env, stdout=fh,
                                               stderr=subprocess.STDOUT,
                                               start_new_session=True))  # fmt: skip
        self.logs.append(log)

    def output(self, node: int) -> str:
        return self.logs[node].read_text(errors="replace")

    def all_output(self) -> str:
        return "\n".join(f"== node {n} ==\n{self.output(n)}" for n in range(len(self.procs)))

    def kill_node(self, node: int) -> float:
        """SIGKILL the node's agent and every process under it, as one node's power loss."""
        victims = self.node_processes(node)
        at = time.time()
        for p in victims:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGKILL)
        self.killed[node] = at
        return at

    def kill_agent(self, node: int) -> list[int]:
        """SIGKILL the agent alone; the pids of the processes it had started."""
        agent, *started = self.node_processes(node)
        agent.send_signal(signal.SIGKILL)
        self.killed[node] = time.time()
        return [p.pid for p in started]

    def node_processes(self, node: int) -> list[psutil.Process]:
        """The node's agent, then every process under it: its children and theirs, and its
        fork server's when a zygote forked that server outside the agent's tree."""
        agent = psutil.Process(self.procs[node].pid)
        found = [agent, *agent.children(recursive=True)]
        for pid in FORK_SERVER_READY.findall(self.output(node)):
            with contextlib.suppress(psutil.NoSuchProcess):
                server = psutil.Process(int(pid))
                if server not in found and "deadpool_megatron.agent" in " ".join(
                    server.cmdline()
                ):  # the server, not a process that took its pid since
                    found += [server, *server.children(recursive=True)]
        return found

    def iteration(self) -> int:
        """The newest iteration the job's metrics hold (0 before the first)."""
        done = read_metrics(str(self.metrics))[0] if self.metrics.exists() else {}
        return max(done, default=0)

    def wait_for_iteration(self, iteration: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.metrics.exists() and iteration in read_metrics(str(self.metrics))[0]:
                return
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"an agent ended early:\n{self.all_output()[-6000:]}")
            time.sleep(0.05)
        raise RuntimeError(f"iteration {iteration} never came:\n{self.all_output()[-6000:]}")

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


def start_local_nodes(
    workdir: Path,
    script: str,
    nnodes: int,
    spare_nodes: int,
    nproc: int,
    args: list[str],
    spares: int = 0,
    cwd: str | None = None,
    launcher: tuple[str, ...] = (),
    node_args: Mapping[int, list[str]] | None = None,
) -> LocalNodes:
    """Start one deadpool-launch agent per node, each in its own session, logging to
    workdir/nodeN.log; the job's metrics go to workdir/metrics.jsonl. `node_args`: more
    script arguments for some nodes (a node launched unlike the others)."""
    port = free_port()
    metrics = workdir / "metrics.jsonl"
    env = {**os.environ, ENV_JOB_SECRET: os.environ.get(ENV_JOB_SECRET) or new_secret()}
    command = [
        sys.executable, "-m", "deadpool_megatron.launch",
        "--nproc-per-node", str(nproc), "--spares", str(spares),
        "--nnodes", str(nnodes), "--spare-nodes", str(spare_nodes),
        "--master-addr", "127.0.0.1", "--master-port", str(port), *launcher, script, *args,
        "--metrics-jsonl", str(metrics),
    ]  # fmt: skip
    nodes = LocalNodes([], [], metrics, agent_command=command, env=env, cwd=cwd)
    for node in range(nnodes + spare_nodes):
        cmd = [*command[:3], "--node-rank", str(node), *command[3:],
               *(node_args or {}).get(node, [])]  # fmt: skip
        nodes.start_agent(cmd, workdir / f"node{node}.log")
    return nodes
