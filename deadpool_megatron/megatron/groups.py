"""Process groups reachable from the training objects: found (after a recovery none may be one
from before it: model modules, DDP buffers and buckets, the distributed optimizer, the pipeline
schedule's p2p state, the replication ring and megatron-core's own globals) and replaced (a
survivor's kept model rebound to its new generation's groups, recovery/stages.py)."""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

Setter = Callable[[object], None] | None  # puts a new value where a child was; None: immutable

_OPAQUE = (types.ModuleType, torch.Tensor, str, bytes, int, float, type)


WORLD = "WORLD"  # the role of the default group


def live_groups() -> list[object]:
    """Every process group torch.distributed knows now (keep the list to keep ids unique)."""
    return list(dist.distributed_c10d._world.pg_map)


def named_groups() -> dict[str, dist.ProcessGroup]:
    """Every role megatron-core and torch hold a process group for now -> that group. Several
    roles may share one group (`parallel.one_group_per_rank_list`): each keeps its name."""
    from megatron.core import parallel_state

    named: dict[str, dist.ProcessGroup] = {}
    for name, value in sorted(vars(parallel_state).items()):
        values = value if isinstance(value, (list, tuple)) else [value]
        for i, group in enumerate(values):
            if isinstance(group, dist.ProcessGroup):
                named[name if values is not value else f"{name}[{i}]"] = group
    if dist.is_initialized():
        named[WORLD] = dist.group.WORLD
    return named


def group_roles() -> dict[int, tuple[str, dist.ProcessGroup]]:
    """id of every process group megatron-core and torch hold now -> (a role, the group): the
    default group's is WORLD, a group shared by several roles has the first of their names.

    Taken before a generation's groups are torn down (the caller keeps the groups, so their
    ids stay unique), and again after the new ones are built. A role found here names, in the
    next generation, the group of the same ranks (`named_groups`)."""
    roles: dict[int, tuple[str, dist.ProcessGroup]] = {}
    named = named_groups()
    world = named.pop(WORLD, None)
    for role, group in named.items():
        roles.setdefault(id(group), (role, group))
    if world is not None:
        roles[id(world)] = (WORLD, world)
    return roles


def children(path: str, obj: object) -> list[tuple[str, object, Setter]]:
    """What `obj` refers to that a walk looks into: (path, value, how to replace it)."""
    if isinstance(obj, dict):
        return [(f"{path}[{_key(k)}]", v, functools.partial(obj.__setitem__, k)) for k, v in
                list(obj.items())]  # fmt: skip
    if isinstance(obj, list):
        return [(f"{path}[{i}]", v, functools.partial(obj.__setitem__, i)) for i, v in
                enumerate(obj)]  # fmt: skip
    if isinstance(obj, (tuple, set, frozenset)):
        return [(f"{path}[{i}]", v, None) for i, v in enumerate(obj)]
    if isinstance(obj, functools.partial):
        return [(f"{path}.func", obj.func, None), (f"{path}.args", obj.args, None),
                (f"{path}.keywords", obj.keywords, None)]  # fmt: skip
    if isinstance(obj, types.MethodType):
        return [(f"{path}.__self__", obj.__self__, None)]
    if isinstance(obj, types.FunctionType):
        return [(f"{path}.<closure {i}>", c.cell_contents, functools.partial(_set_cell, c))
                for i, c in enumerate(obj.__closure__ or ()) if c.cell_contents is not None]  # fmt: skip
    if hasattr(obj, "__dict__"):
        attrs = vars(obj)
        return [(f"{path}.{k}", v, functools.partial(attrs.__setitem__, k)) for k, v in
                list(attrs.items())]  # fmt: skip
    return []


def _key(key: object) -> str:
    """A dict key in a path: its repr if short to make (names, numbers), else its type (the
    repr of a tensor key, as in an optimizer's state, formats its values: 0.1 ms each)."""
    if isinstance(key, (str, int, float, bool)) or key is None:
        return repr(key)
    return f"<{type(key).__name__}>"


def _set_cell(cell: types.CellType, value: object) -> None:
    cell.cell_contents = value


def walk(
    roots: dict[str, object], max_depth: int | None = None, skip: tuple = ()
) -> Iterator[tuple[str, dist.ProcessGroup, Setter]]:
    """(path, group, setter) for every reference to a process group reachable from `roots`,
    each object looked into once, not looking into the objects in `skip`."""
    seen = {id(o) for o in skip}
    stack: list[tuple[str, object, Setter, int]] = [(n, o, None, 0) for n, o in roots.items()]
    while stack:
        path, obj, setter, depth = stack.pop()
        if max_depth is not None and depth > max_depth:
            continue
        if isinstance(obj, dist.ProcessGroup):
            yield path, obj, setter  # every reference, not once per group
            continue
        if id(obj) in seen or isinstance(obj, _OPAQUE):
            continue
        seen.add(id(obj))
        stack.extend((p, v, s, depth + 1) for p, v, s in children(path, obj))


def reachable_groups(
    *roots: object, max_depth: int = 14, skip: tuple = ()
) -> list[tuple[str, object]]:
    """(path, group) for every ProcessGroup reachable from `roots` and parallel_state, not
    looking into the objects in `skip` (what holds old groups on purpose)."""
    from megatron.core import parallel_state

    named = {f"root{i}": r for i, r in enumerate(roots)}
    named["parallel_state"] = dict(vars(parallel_state))
    found, seen = [], set()
    for path, group, _ in walk(named, max_depth, skip):
        if id(group) not in seen:
            seen.add(id(group))
            found.append((path, group))
    return found


def stale_groups(old: list[object], *roots: object, skip: tuple = ()) -> tuple[int, list[str]]:
    """(groups reachable, paths of those that are in `old`), not looking into `skip`."""
    old_ids = {id(g) for g in old}
    reachable = reachable_groups(*roots, skip=skip)
    return len(reachable), [path for path, g in reachable if id(g) in old_ids]
