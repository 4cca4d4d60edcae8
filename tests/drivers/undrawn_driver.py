"""One process (world 1, gloo) builds a real GPT train state twice, drawing its weights and as a
recovery does (`initialize=False`); prints, as JSON, what megatron-core marked on each
parameter, whether the torch RNG moved in the weights' layers, and whether the weights differ."""

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


def main() -> dict:
    cfg = parse_job_args(["--config", "configs/demo.yaml", "--tensor-model-parallel-size", "1",
                          "--pipeline-model-parallel-size", "1"], 1)  # fmt: skip
    parallel.init_distributed(cfg, 0, 1, dist.HashStore())
    drawn = build_train_state(cfg, on_gpu=False)
    undrawn = build_train_state(cfg, on_gpu=False, initialize=False)
    fc1 = "module.decoder.layers.0.mlp.linear_fc1.weight"
    weights = {n: p for n, p in undrawn.model[0].named_parameters()}
    out = {
        "drawn": marks(drawn),
        "undrawn": marks(undrawn),
        "fc1_equal": torch.equal(dict(drawn.model[0].named_parameters())[fc1], weights[fc1]),
    }
    parallel.destroy_distributed()
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
