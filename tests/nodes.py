"""Multi-node jobs on this machine for tests (deadpool_megatron/agent/local.py), read back as
a JobResult like single-node jobs."""

from __future__ import annotations

from pathlib import Path

from deadpool_megatron.agent.local import LocalNodes, start_local_nodes
from deadpool_megatron.metrics import read_metrics
from jobs import ROOT, JobResult


def start_nodes(tmp_path: Path, nnodes: int, spare_nodes: int, nproc: int, args: list[str],
                spares: int = 0, launcher: tuple[str, ...] = (),
                node_args: dict[int, list[str]] | None = None) -> LocalNodes:  # fmt: skip
    return start_local_nodes(tmp_path, str(ROOT / "pretrain_gpt.py"), nnodes, spare_nodes, nproc,
                             args, spares, cwd=str(ROOT), launcher=launcher,
                             node_args=node_args)  # fmt: skip


def result(nodes: LocalNodes, node: int = 0) -> JobResult:
    losses, final = read_metrics(str(nodes.metrics)) if nodes.metrics.exists() else ({}, None)
    rc = nodes.procs[node].returncode
    return JobResult(-1 if rc is None else rc, nodes.all_output(), losses, final)
