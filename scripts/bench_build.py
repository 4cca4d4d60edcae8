#!/usr/bin/env python
"""The model a recovery builds, by model size: as it was built before, and as it is now.

A recovery that builds its model (a spare taking over, or every rank without
--deadpool-keep-model) overwrites the weights and the optimizer state with the restored ones.
It used to build them as a job's start does (random weights drawn) and then take a
zero-gradient optimizer step to create the optimizer's state; now it draws no weights
(`build_train_state(initialize=False)`) and creates Adam's state as zeros
(`checkpointing.fresh_adam_state`). This times both in one process (TP1 x PP1, the
distributed optimizer, CPU), alternating, and prints the fastest of `--repeats` each; the
last line is one JSON object:
{"sizes": [{"hidden_size", "parameters", "before_s", "now_s", "saved"}]}.

    python scripts/bench_build.py            # hidden 184, 512, 1024 (2-50M parameters)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hidden-sizes", default="184,512,1024")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3, help="builds of each kind per size")
    a = p.parse_args(argv)
    try:
        a.sizes = [int(h) for h in a.hidden_sizes.split(",")]
    except ValueError:
        p.error(f"--hidden-sizes {a.hidden_sizes!r}: expected integers separated by commas")
    bad = [h for h in a.sizes if h <= 0 or h % 8]
    if bad:
        p.error(f"--hidden-sizes {bad}: each must be a positive multiple of 8 (8 heads)")
    if a.repeats < 1 or a.num_layers < 1:
        p.error(f"--repeats {a.repeats} and --num-layers {a.num_layers} must be at least 1")
    return a


def job_args(hidden: int, layers: int) -> list[str]:
    return ["--num-layers", str(layers), "--hidden-size", str(hidden),
            "--num-attention-heads", "8", "--seq-length", "32", "--vocab-size", "128",
            "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1",
            "--lr", "1e-4", "--use-distributed-optimizer"]  # fmt: skip


def first_step(optimizer) -> None:
    """The optimizer's state as recoveries created it before: a zero-gradient step."""
    import torch

    from deadpool_megatron.megatron.digest import inner_optimizers

    for megatron_opt in inner_optimizers(optimizer):
        torch_opt = megatron_opt.optimizer
        for group in torch_opt.param_groups:
            for param in group["params"]:
                param.grad = torch.zeros_like(param)
        torch_opt.step()
        torch_opt.zero_grad()


def main(argv=None) -> int:
    a = parse_args(argv)
    import torch
    import torch.distributed as dist

    from deadpool_megatron.megatron import parallel
    from deadpool_megatron.megatron.arguments import parse_job_args
    from deadpool_megatron.megatron.checkpointing import materialize_optimizer_state
    from deadpool_megatron.megatron.model import build_train_state

    torch.set_num_threads(1)
    cfg = parse_job_args(job_args(a.sizes[0], a.num_layers), 1)
    on_gpu = parallel.init_distributed(cfg, 0, 1, dist.HashStore())
    results = []
    for hidden in a.sizes:
        cfg = parse_job_args(job_args(hidden, a.num_layers), 1)
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(a.repeats):
            for before in (True, False):
                t = time.perf_counter()
                state = build_train_state(cfg, on_gpu, initialize=before)
                if before:
                    first_step(state.optimizer)
                else:
                    materialize_optimizer_state(state.optimizer)
                times[before].append(time.perf_counter() - t)
                params = sum(p.numel() for p in state.model[0].parameters())
                del state
        r = {"hidden_size": hidden, "parameters": params, "before_s": round(min(times[True]), 3),
             "now_s": round(min(times[False]), 3)}  # fmt: skip
        r["saved"] = round(1 - r["now_s"] / r["before_s"], 3)
        results.append(r)
        print(f"hidden {hidden} ({params / 1e6:.1f}M parameters): a recovery's build took "
              f"{r['before_s']:.3f} s, now {r['now_s']:.3f} s ({r['saved']:.0%} less)",
              flush=True)  # fmt: skip
    parallel.destroy_distributed()
    print(json.dumps({"sizes": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
