"""One process (world 1, gloo) loads a megatron-core DistributedOptimizer on torch's AdamW
from a checkpoint the way Megatron-LM's `--load` does (sharded_state_dict with is_loading,
dist_checkpointing.load, load_state_dict), with `upstream.torch_adam_loads_checkpoints`
installed or (`as-is`) not; prints, as JSON, how the load went and what one more step gives
on the saved optimizer and on the loaded one."""

from __future__ import annotations

import json
import sys
import tempfile

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from deadpool_megatron.megatron import parallel, upstream
from deadpool_megatron.megatron.arguments import parse_job_args
from deadpool_megatron.megatron.checkpointing import fresh_adam_state
from deadpool_megatron.megatron.digest import inner_optimizers
from deadpool_megatron.megatron.model import build_train_state

METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}  # Megatron-LM's default


def torch_optimizers(state) -> list[torch.optim.Optimizer]:
    return [o.optimizer for o in inner_optimizers(state.optimizer)]


def step(state, seed: int) -> None:
    """One AdamW step on every inner torch optimizer, with gradients drawn from `seed`."""
    g = torch.Generator().manual_seed(seed)
    for opt in torch_optimizers(state):
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
        opt.step()
        opt.zero_grad()


def tensors(state) -> list[torch.Tensor]:
    out = []
    for opt in torch_optimizers(state):
        for group in opt.param_groups:
            for p in group["params"]:
                out += [p.detach().clone(), *(v.clone() for v in opt.state[p].values())]
    return out


def sharded(state, is_loading: bool) -> dict:
    sd = {"model": state.model[0].module.sharded_state_dict()}
    sd["optimizer"] = state.optimizer.sharded_state_dict(sd, is_loading=is_loading,
                                                         metadata=METADATA)  # fmt: skip
    return sd


def main(adapted: bool) -> dict:
    cfg = parse_job_args(["--config", "configs/demo.yaml", "--tensor-model-parallel-size", "1",
                          "--pipeline-model-parallel-size", "1"], 1)  # fmt: skip
    parallel.init_distributed(cfg, 0, 1, dist.HashStore())
    saved = build_train_state(cfg, on_gpu=False)
    for opt in torch_optimizers(saved):
        assert fresh_adam_state(opt)
    step(saved, 1)
    step(saved, 2)
    fresh = build_train_state(cfg, on_gpu=False)
    installed = upstream.torch_adam_loads_checkpoints() if adapted else False
    out: dict = {"installed": installed}
    with tempfile.TemporaryDirectory(prefix="upstream_load_") as folder:
        dist_checkpointing.save(sharded(saved, is_loading=False), folder)
        try:
            loaded = dist_checkpointing.load(sharded(fresh, is_loading=True), folder)
            fresh.model[0].module.load_state_dict(loaded["model"])
            fresh.optimizer.load_state_dict(loaded["optimizer"])
        except Exception as err:  # what Megatron-LM's --load meets
            out["error"] = f"{type(err).__name__}: {err}"
            parallel.destroy_distributed()
            return out
    out["loaded_equal"] = all(torch.equal(a, b) for a, b in zip(tensors(saved), tensors(fresh)))
    step(saved, 3)
    step(fresh, 3)
    out["stepped_equal"] = all(torch.equal(a, b) for a, b in zip(tensors(saved), tensors(fresh)))
    out["steps"] = sorted({float(s["step"]) for o in torch_optimizers(fresh)
                           for s in o.state.values()})  # fmt: skip
    out["parameters"] = sum(len(o.state) for o in torch_optimizers(fresh))
    parallel.destroy_distributed()
    return out


if __name__ == "__main__":
    print(json.dumps(main(adapted=sys.argv[1:] != ["as-is"])))
