"""Our Slurm script's jobs on a test Slurm (slurm_cluster.py): submitting
scripts/slurm/pretrain_gpt.sbatch on CPU, waiting for an iteration, finding a node's agent,
reading the agents' logs. Shared by the multi-node tests and the Megatron-LM file."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import psutil
from etcd_server import free_port
from slurm_cluster import SlurmCluster

from deadpool_megatron.agent.zygote import ENV_FORK_ZYGOTE
from deadpool_megatron.metrics import read_metrics
from jobs import ROOT

SBATCH = ROOT / "scripts" / "slurm" / "pretrain_gpt.sbatch"
JOIN_SBATCH = ROOT / "scripts" / "slurm" / "join.sbatch"


def submit(slurm: SlurmCluster, tmp_path: Path, run_dir: Path, nodes: int, spare_nodes: int,
           args: list[str], *, zygote: bool, nproc: int, sbatch_args: tuple[str, ...] = (),
           env: dict[str, str] | None = None) -> str:  # fmt: skip
    """Submit the Slurm script on CPU, its batch output in tmp_path/batch.out; returns the job
    id. It runs our pretrain_gpt.py unless `env` names another script (TRAIN_SCRIPT, or
    MEGATRON_LM_DIR with TRAIN_SCRIPT unset). Without `zygote` each agent starts its own fork
    server, in its process tree and its step."""
    # slurm.env copied the session's environment, the zygote's socket with it: dropped, and
    # unset, without one (the socket only made no difference while the zygote refused these
    # agents for PYTHON, which it no longer does)
    base = {k: v for k, v in slurm.env.items() if zygote or k != ENV_FORK_ZYGOTE}
    ours = (
        {} if env and "MEGATRON_LM_DIR" in env else {"TRAIN_SCRIPT": str(ROOT / "pretrain_gpt.py")}
    )
    full = dict(base, NPROC_PER_NODE=str(nproc), SPARE_NODES=str(spare_nodes),
                DEADPOOL_GPU="0", PYTHON=sys.executable, DEADPOOL_HOME=str(ROOT),
                DEADPOOL_RUN_DIR=str(run_dir), MASTER_PORT=str(free_port()),
                **ours, **(env or {}))  # fmt: skip
    done = slurm.run(
        "env", *(() if zygote else ("-u", ENV_FORK_ZYGOTE)),
        *(f"{k}={v}" for k, v in full.items() if k != "SLURM_CONF"),
        "sbatch", "--parsable", *sbatch_args, "--constraint=", "--gpus-per-node=0",
        f"--nodes={nodes}", f"--output={tmp_path}/batch.out", str(SBATCH), *args,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def submit_join(slurm: SlurmCluster, tmp_path: Path, run_dir: Path, job: str,
                nodes: int = 1, env: dict[str, str] | None = None) -> str:  # fmt: skip
    """Submit scripts/slurm/join.sbatch on CPU for `nodes` node(s) joining Slurm job `job`
    (whose run directory is `run_dir`), its batch output in tmp_path/join.out; returns its id.
    Without the session's zygote, as `submit` without one; `env`: more of its environment."""
    full = dict({k: v for k, v in slurm.env.items() if k != ENV_FORK_ZYGOTE}, DEADPOOL_GPU="0",
                DEADPOOL_HOME=str(ROOT), DEADPOOL_RUN_DIR=str(run_dir), **(env or {}))  # fmt: skip
    done = slurm.run(
        "env", "-u", ENV_FORK_ZYGOTE, *(f"{k}={v}" for k, v in full.items() if k != "SLURM_CONF"),
        "sbatch", "--parsable", "--constraint=", "--gpus-per-node=0", f"--nodes={nodes}",
        f"--output={tmp_path}/join.out", str(JOIN_SBATCH), job,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def wait_for_iteration(tmp_path: Path, metrics: Path, iteration: int,
                       timeout_s: float = 300) -> None:  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while not (metrics.exists() and iteration in read_metrics(str(metrics))[0]):
        assert time.monotonic() < deadline, (tmp_path / "batch.out").read_text()
        time.sleep(0.05)


def agent_of(job_id: str, node: int) -> psutil.Process | None:
    """Node `node`'s agent of Slurm job `job_id`."""
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        ours = "deadpool_megatron.launch" in cmd and f"slurm-{job_id}" in cmd
        if ours and cmd[cmd.index("--node-rank") + 1] == str(node):
            return p
    return None


def lose_node(job_id: str, node: int) -> list[psutil.Process]:
    """Kill node `node` whole, at once: its task (the shell around its agent), the agent and
    every process under it; returns them."""
    agent = agent_of(job_id, node)
    assert agent is not None, f"no agent of node {node} in job {job_id}"
    victims = [agent.parent(), agent, *agent.children(recursive=True)]
    for p in victims:
        p.kill()
    return victims


def node_logs(run_dir: Path) -> str:
    """Every node agent's log under the Slurm script's run directory, in node order."""
    return "\n".join(f.read_text(errors="replace") for f in sorted(run_dir.glob("node-*.log")))


def join_logs(run_dir: Path) -> str:
    """What the agents of join.sbatch jobs logged in `run_dir`."""
    return "\n".join(f.read_text(errors="replace") for f in sorted(run_dir.glob("join-*.log")))
