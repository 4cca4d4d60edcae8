"""Find every process group reachable from the training objects: after a recovery, none may
be one from before it (model modules, DDP buffers and buckets, the distributed optimizer, the
pipeline schedule's p2p state, the replication ring and megatron-core's own globals)."""

from __future__ import annotations

import functools
import types

import torch
import torch.distributed as dist


def live_groups() -> list[object]:
    """Every process group torch.distributed knows now (keep the list to keep ids unique)."""
    return list(dist.distributed_c10d._world.pg_map)


def reachable_groups(
    *roots: object, max_depth: int = 14, skip: tuple = ()
) -> list[tuple[str, object]]:
    """(path, group) for every ProcessGroup reachable from `roots` and parallel_state, not
    looking into the objects in `skip` (what holds old groups on purpose)."""
    from megatron.core import parallel_state

    named = {f"root{i}": r for i, r in enumerate(roots)}
    named["parallel_state"] = dict(vars(parallel_state))
    found, seen = [], {id(o) for o in skip}
    stack = [(name, obj, 0) for name, obj in named.items()]
    while stack:
        path, obj, depth = stack.pop()
        skip = (types.ModuleType, torch.Tensor, str, bytes, int, float, type)
        if id(obj) in seen or depth > max_depth or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        if isinstance(obj, dist.ProcessGroup):
            found.append((path, obj))
            continue
        if isinstance(obj, dict):
            items = [(f"{path}[{k!r}]", v) for k, v in obj.items()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            items = [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
        elif isinstance(obj, functools.partial):
            items = [(f"{path}.func", obj.func), (f"{path}.args", obj.args),
                     (f"{path}.keywords", obj.keywords)]  # fmt: skip
        elif isinstance(obj, types.MethodType):
            items = [(f"{path}.__self__", obj.__self__)]
        elif isinstance(obj, types.FunctionType):
            cells = obj.__closure__ or ()
            items = [(f"{path}.<closure {i}>", c.cell_contents) for i, c in enumerate(cells)
                     if c.cell_contents is not None]  # fmt: skip
        elif hasattr(obj, "__dict__"):
            items = [(f"{path}.{k}", v) for k, v in vars(obj).items()]
        else:
            items = []
        stack.extend((p, v, depth + 1) for p, v in items)
    return found


def stale_groups(old: list[object], *roots: object, skip: tuple = ()) -> tuple[int, list[str]]:
    """(groups reachable, paths of those that are in `old`), not looking into `skip`."""
    old_ids = {id(g) for g in old}
    reachable = reachable_groups(*roots, skip=skip)
    return len(reachable), [path for path, g in reachable if id(g) in old_ids]
