"""The simulated job, cluster and recovery costs, with where each default comes from."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import ConfigError

# Llama 3 (Meta, "The Llama 3 Herd of Models", 2024, section 3.3.4): 419 unexpected
# interruptions in a 54-day snapshot of pre-training on 16,384 H100 GPUs (2,048 nodes of 8),
# about 78% of them attributed to confirmed or suspected hardware issues.
LLAMA3_INTERRUPTIONS = 419
LLAMA3_DAYS = 54
LLAMA3_NODES = 16_384 // 8
NODE_FAILURES_PER_HOUR = LLAMA3_INTERRUPTIONS / (LLAMA3_DAYS * 24 * LLAMA3_NODES)
HARDWARE_FRACTION = 0.78

# DeadPool (arXiv 2607.01646): hot-swap recovery under 40 s at up to 512 A100 GPUs, versus
# about 150 s for checkpoint-restart (restart + load).
PAPER_SWAP_S = 40.0
PAPER_RESTART_S = 100.0
PAPER_LOAD_S = 50.0


@dataclass(frozen=True)
class SimParams:
    gpus: int = 16_384
    gpus_per_node: int = 8
    node_failures_per_hour: float = NODE_FAILURES_PER_HOUR
    # Software and other non-hardware interruptions are taken as transient (the process can
    # reset in place); hardware ones as permanent (a spare must take over).
    transient_fraction: float = 1.0 - HARDWARE_FRACTION
    # A permanent failure that also takes down the DP-ring neighbour holding the replica
    # (same node, same rack power...): both copies of a shard are lost.
    correlated_fraction: float = 0.0
    iterations: int = 100_000
    iteration_s: float = 8.0
    checkpoint_interval: int = 500  # iterations between persistent checkpoints
    checkpoint_s: float = 30.0  # blocking part of one persistent save
    restart_s: float = PAPER_RESTART_S  # stop everything, reschedule, start, init
    load_s: float = PAPER_LOAD_S  # read the checkpoint back
    swap_s: float = PAPER_SWAP_S  # hot-swap: failure to first resumed iteration
    reset_s: float = PAPER_SWAP_S  # transient reset in place: same rebuild, no transfer
    replay_iterations: int = 1  # re-executed after a hot-swap (the paper's "at most one")
    snapshot_overhead: float = 0.0  # hot-swap's failure-free slowdown (fraction)
    spares: int = 8
    replenish_s: float = 3600.0  # until a used spare is replaced by a repaired node
    # Hot-swap jobs keep persistent checkpoints for the unrecoverable case (0: none).
    hotswap_checkpoint_interval: int = 500
    # How a recovery grows with the job: seconds per GPU beyond the size swap_s, reset_s and
    # restart_s were measured at (bench_recovery_scale.py's fitted line; 0: flat, the paper's).
    # A restart pays it too: it creates the same process groups and model again.
    recovery_s_per_gpu: float = 0.0
    recovery_measured_gpus: int = 1

    def __post_init__(self) -> None:
        for name in ("gpus", "gpus_per_node", "iterations", "checkpoint_interval",
                     "recovery_measured_gpus"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be at least 1")
        for name in ("transient_fraction", "correlated_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"{name}={getattr(self, name)} must lie in [0, 1]")
        for name in ("node_failures_per_hour", "iteration_s", "checkpoint_s", "restart_s",
                     "load_s", "swap_s", "reset_s", "snapshot_overhead", "replenish_s",
                     "spares", "replay_iterations", "hotswap_checkpoint_interval",
                     "recovery_s_per_gpu"):  # fmt: skip
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be 0 or more")

    def at_scale(self, seconds: float) -> float:
        """A recovery cost measured at `recovery_measured_gpus`, projected to `gpus`."""
        return seconds + self.recovery_s_per_gpu * max(0, self.gpus - self.recovery_measured_gpus)

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.gpus_per_node)

    @property
    def failures_per_second(self) -> float:
        return self.nodes * self.node_failures_per_hour / 3600.0

    @property
    def mtbf_s(self) -> float:
        """The whole job's mean time between failures."""
        rate = self.failures_per_second
        return float("inf") if rate == 0 else 1.0 / rate


def with_bench_costs(p: SimParams, path: str | Path, scale_path: str | Path | None = None
                     ) -> SimParams:  # fmt: skip
    """Recovery costs measured by scripts/bench_recovery.py (its first model size) and, when
    `scale_path` names scripts/bench_recovery_scale.py's JSON, their growth per process (its
    least-squares line), so that a projection to `gpus` carries what grows with the job."""
    doc = json.loads(Path(path).read_text())
    size = doc["sizes"][0]
    hs, cr = size["hotswap"], size["ckpt_restart"]
    q = replace(
        p,
        iteration_s=size["iteration_s"],
        swap_s=hs["recovery_total_s"],
        reset_s=hs["recovery_total_s"] - hs.get("transfer_state", 0.0),
        restart_s=cr["detect"] + cr["restart_processes"],
        load_s=cr["load"],
        recovery_measured_gpus=int(doc["summary"].get("nproc", 8)),
    )
    if scale_path is None:
        return q
    fitted = json.loads(Path(scale_path).read_text())["summary"]["recovery_fit"]
    return replace(q, recovery_s_per_gpu=max(0.0, float(fitted["s_per_process"])))
