"""One process (TP1 x PP1 x DP1, the demo GPT: 4 layers, 8 micro-batches) trains two iterations
with our Trainer from a fresh build once per mode given (comma-separated; each in groups of its
own, seeded alike): "plain" without stop points, "covered" with them (never stopping), or
"stop:K" with a check that raises on its K-th call. Prints JSON by mode: the losses as hex, the
state digest, the calls per iteration, and where a stop struck."""

from __future__ import annotations

import json
import sys

import torch.distributed as dist

from deadpool_megatron.megatron import parallel
from deadpool_megatron.megatron.arguments import parse_job_args
from deadpool_megatron.megatron.digest import state_digest
from deadpool_megatron.megatron.model import build_train_state
from deadpool_megatron.megatron.stop_points import StopPoints
from deadpool_megatron.megatron.training import Trainer


class Stop(Exception):
    pass


def main(modes: str, store_path: str) -> dict:
    cfg = parse_job_args(["--config", "configs/demo.yaml", "--tensor-model-parallel-size", "1",
                          "--pipeline-model-parallel-size", "1"], 1)  # fmt: skip
    store = dist.FileStore(store_path, 1)
    return {m: train(cfg, m, store, f"gen{i}") for i, m in enumerate(modes.split(","))}


def train(cfg, mode: str, store, prefix: str) -> dict:
    parallel.init_distributed(cfg, 0, 1, store, prefix=prefix)
    state = build_train_state(cfg, on_gpu=False)
    trainer = Trainer(cfg, state, 1, on_gpu=False)
    calls: list[int] = []
    stop_at = int(mode.split(":")[1]) if mode.startswith("stop:") else None

    def check() -> None:
        calls.append(trainer.iteration + 1)
        if len(calls) == stop_at:
            raise Stop(f"call {len(calls)}")

    out: dict = {"covered": 0}
    if mode != "plain":
        points = StopPoints(check)
        out["covered"] = points.cover(state.model)
        out["covered_again"] = points.cover(state.model)  # once per layer, however often asked
    losses = []
    try:
        for _ in range(2):
            losses.append(trainer.train_step().hex())
    except Stop as err:
        out["stopped"] = str(err)
        out["completed"] = trainer.iteration
    out["losses"] = losses
    out["calls_per_iteration"] = [calls.count(i) for i in (1, 2)]
    if "stopped" not in out:
        out["digest"] = state_digest(state.model, state.optimizer)
    parallel.destroy_distributed()
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
