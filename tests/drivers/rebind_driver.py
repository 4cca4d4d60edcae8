"""One process (world 1, gloo) builds generation 0's groups and a real GPT train state, keeps
the state through a teardown, builds generation 1's groups, rebinds the state to them and
replays its build's collectives on them; prints what it found as JSON. With `unknown`, the
state also holds a group megatron-core does not know (no role): the rebind must refuse and
leave the state as it was. Every role has a group of its own (DEADPOOL_GROUP_PER_ROLE=1: in
a world of one every role's ranks are [0]), or with `shared`, as a job has them by default:
every role then has the default group."""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist
from megatron.core import parallel_state

from deadpool_megatron.megatron import parallel
from deadpool_megatron.megatron.arguments import parse_job_args
from deadpool_megatron.megatron.build_calls import recording, replay, unreplayable
from deadpool_megatron.megatron.groups import group_roles, live_groups, named_groups, stale_groups
from deadpool_megatron.megatron.model import build_train_state, rehook, unhook
from deadpool_megatron.megatron.rebind import CannotRebind, rebind
from deadpool_megatron.runtime import ENV_GROUP_PER_ROLE


def main(unknown: bool, shared: bool) -> dict:
    if not shared:
        os.environ[ENV_GROUP_PER_ROLE] = "1"
    cfg = parse_job_args(["--config", "configs/demo.yaml", "--tensor-model-parallel-size", "1",
                          "--pipeline-model-parallel-size", "1"], 1)  # fmt: skip
    store = dist.HashStore()
    parallel.init_distributed(cfg, 0, 1, store, prefix="gen0")
    with recording() as performed:  # everything the build did, recorded or not
        state = build_train_state(cfg, on_gpu=False)
    with recording() as performed_in_recovery:
        build_train_state(cfg, on_gpu=False, initialize=False)
    if unknown:
        state.model[0].stray_group = dist.new_group([0], backend="gloo")
    layer = state.model[0].module.decoder.layers[0].mlp.linear_fc1
    before = layer.tp_group
    old = live_groups()
    roles = group_roles()
    hooks = unhook(state)
    parallel.destroy_distributed()
    parallel.init_distributed(cfg, 0, 1, store, prefix="gen1")
    out = {"roles": sorted(r for r, _ in roles.values())}
    try:
        out["swapped"] = rebind(state, roles)
    except CannotRebind as why:
        out["refused"] = str(why)
    rehook(state, hooks)
    out["reachable"], out["stale"] = stale_groups(old, state)
    out["distinct_groups"] = len({id(g) for g in named_groups().values()})
    out["layer_group_is_new"] = layer.tp_group is parallel_state.get_tensor_model_parallel_group()
    out["layer_group_unchanged"] = layer.tp_group is before
    out["hooks"] = sum(map(len, state.hook_tables))
    out["build_calls"] = [(c.name, c.role) for c in state.build_calls]
    out["performed"] = [(c.name, c.role) for c in performed]
    out["performed_in_recovery"] = [(c.name, c.role) for c in performed_in_recovery]
    out["unreplayable"] = unreplayable(state.build_calls)
    if "swapped" in out:  # the new generation's groups meet the build's collectives again
        out["replayed"] = replay(state.build_calls)
    return out


if __name__ == "__main__":
    print(json.dumps(main("unknown" in sys.argv[1:], "shared" in sys.argv[1:])))
