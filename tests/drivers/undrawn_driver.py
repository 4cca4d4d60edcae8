"""One process (world 1, gloo) builds a real GPT train state twice, drawing its weights and as a
recovery does (`initialize=False`); prints, as JSON, what megatron-core marked on each
parameter, and whether each build drew from torch's generator."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from deadpool_megatron.megatron import parallel
from deadpool_megatron.megatron.arguments import parse_job_args
from deadpool_megatron.megatron.model import build_train_state

ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride", "allreduce",
         "sequence_parallel", "shared", "shared_embedding")  # fmt: skip


def marks(state) -> dict:
    return {
        name: [str(p.dtype), list(p.shape), *(getattr(p, a, None) for a in ATTRS)]
        for name, p in state.model[0].named_parameters()
    }


def counting_draws(build):
    """`build()` and the shapes of the tensors it filled by torch.nn.init.normal_,
    megatron-core's init methods' draw (bound when the build makes its config, so seen here)."""
    own, draws = torch.nn.init.normal_, []

    def normal_(tensor, *args, **kwargs):
        draws.append(tuple(tensor.shape))
        return own(tensor, *args, **kwargs)

    torch.nn.init.normal_ = normal_
    try:
        return build(), draws
    finally:
        torch.nn.init.normal_ = own


def main() -> dict:
    cfg = parse_job_args(["--config", "configs/demo.yaml", "--tensor-model-parallel-size", "1",
                          "--pipeline-model-parallel-size", "1"], 1)  # fmt: skip
    parallel.init_distributed(cfg, 0, 1, dist.HashStore())
    drawn, drawn_draws = counting_draws(lambda: build_train_state(cfg, on_gpu=False))
    undrawn, undrawn_draws = counting_draws(
        lambda: build_train_state(cfg, on_gpu=False, initialize=False)
    )
    out = {
        "drawn": marks(drawn),
        "undrawn": marks(undrawn),
        # weights drawn by each build (comparing the weights instead failed once: the undrawn
        # build's uninitialized memory was the drawn build's freed master weights)
        "drawn_draws": drawn_draws,
        "undrawn_draws": undrawn_draws,
    }
    parallel.destroy_distributed()
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
