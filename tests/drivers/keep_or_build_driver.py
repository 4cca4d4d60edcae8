"""Rank RANK of a 2-process gloo job (DP2, the demo GPT) builds generation 0's groups and train
state, keeps the state through a teardown, and in generation 1 keeps or builds it as a
recovery does when the plan counts on nobody building (recovery/kept.py). With STRAY, rank
STRAY's model also holds a group megatron-core does not know (no role): its rebind refuses
and it builds, which its peer must learn in time to meet the build's collectives. Prints JSON."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from deadpool_megatron.megatron import parallel
from deadpool_megatron.megatron.arguments import parse_job_args
from deadpool_megatron.megatron.build_calls import recording
from deadpool_megatron.megatron.groups import group_roles
from deadpool_megatron.megatron.model import build_train_state, unhook
from deadpool_megatron.recovery.kept import Kept, keep_or_build


def main(rank: int, store_path: str, stray: int) -> dict:
    cfg = parse_job_args(["--config", "configs/demo.yaml", "--tensor-model-parallel-size", "1",
                          "--pipeline-model-parallel-size", "1"], 2)  # fmt: skip
    store = dist.FileStore(store_path, 2)
    parallel.init_distributed(cfg, rank, 2, store, prefix="gen0")
    state = build_train_state(cfg, on_gpu=False)
    extra = dist.new_group([0, 1], backend="gloo")  # created by both, held by one
    if rank == stray:
        state.model[0].stray_group = extra
    roles = group_roles()
    hooks = unhook(state)
    parallel.destroy_distributed()
    parallel.init_distributed(cfg, rank, 2, store, prefix="gen1")
    host = parallel.host_group()
    with recording() as agreed:  # the agreement, and any replay
        kept = keep_or_build(Kept(state, hooks), roles, plan_builds=False, host=host)
    with recording() as built:
        if kept is None:  # as stages.rebuild does
            build_train_state(cfg, on_gpu=False, initialize=False)
    # The generation's groups are in step: the next collective meets its peer's.
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    parallel.destroy_distributed()
    names = lambda calls: [c.name for c in calls]  # noqa: E731
    return {"kept": kept is not None, "agreed": names(agreed), "built": names(built),
            "sum": total.item()}  # fmt: skip


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]))))
