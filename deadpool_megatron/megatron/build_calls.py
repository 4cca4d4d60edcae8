"""The collectives building a model performs, recorded so that a survivor that keeps its model
can perform them again when a spare builds its own.

Building megatron-core's model and optimizer talks to peers: the first and last pipeline
stages all-reduce the shared word embeddings, DDP broadcasts the parameters over the
data-parallel group, and `get_megatron_optimizer` all-gathers every rank's parameter-group keys
(version-dependent). A spare that builds while the survivors keep theirs would wait in the
first of these forever. So every build is recorded (operation, group role, tensor shapes, the
objects this rank contributed), and when a spare builds, each survivor replays its own record
on the new generation's groups: every group then sees the same sequence of collectives as
when the job first built, the spare gets the same parameter-group keys, and the values moved
are thrown away (the restore overwrites every parameter and optimizer tensor).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import gloo_ops
from .groups import WORLD, group_roles, named_groups

log = logging.getLogger(__name__)

RECORDED = (*gloo_ops.COLLECTIVES, "all_gather_object", "broadcast_object_list")


@dataclass(frozen=True)
class Spec:
    """A tensor argument, by shape, dtype and device (its values are not needed)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str


@dataclass(frozen=True)
class Call:
    """One collective of a build: replayed as `name(**arguments)` on the group of `role`."""

    name: str
    role: str | None  # None: a group megatron-core does not name (the record cannot be replayed)
    arguments: dict


def _freeze(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return Spec(tuple(value.shape), value.dtype, str(value.device))
    if isinstance(value, (list, tuple)):
        return type(value)(_freeze(v) for v in value)
    return copy.deepcopy(value)  # an object this rank contributed (parameter-group keys)


def _thaw(value: object) -> object:
    if isinstance(value, Spec):
        return torch.zeros(value.shape, dtype=value.dtype, device=value.device)
    if isinstance(value, (list, tuple)):
        return type(value)(_thaw(v) for v in value)
    return copy.deepcopy(value)


def _modules() -> list:
    """Where megatron-core looks up torch.distributed: the module itself, and on a CPU job
    the interruptible view its modules were given (gloo_ops)."""
    modules = [dist]
    if gloo_ops.distributed_view.cache_info().currsize:
        modules.append(gloo_ops.distributed_view())
    return modules


@contextlib.contextmanager
def recording() -> Iterator[list[Call]]:
    """Record every collective issued in the block (by any code, on the calling thread's
    process); yields the list the calls are appended to."""
    calls: list[Call] = []
    roles = group_roles()
    saved = []
    for module in _modules():
        for name in RECORDED:
            fn = getattr(module, name, None)
            if fn is not None:
                saved.append((module, name, fn))
                setattr(module, name, _recorder(fn, name, calls, roles))
    try:
        yield calls
    finally:
        for module, name, fn in reversed(saved):
            setattr(module, name, fn)


def _recorder(fn, name: str, calls: list[Call], roles: dict):
    signature = inspect.signature(fn)  # a recorder's is its function's (`wraps`): they nest

    @functools.wraps(fn)
    def record(*args, **kwargs):
        try:
            arguments = dict(signature.bind(*args, **kwargs).arguments)
            group = arguments.pop("group", None)
            role = WORLD if group is None else roles.get(id(group), (None,))[0]
            calls.append(Call(name, role, {k: _freeze(v) for k, v in arguments.items()}))
        except Exception:  # recording never breaks a build: the record is only unreplayable
            log.debug("could not record %s", name, exc_info=True)
            calls.append(Call(name, None, {}))
        return fn(*args, **kwargs)

    return record


def unreplayable(calls: list[Call] | None) -> str | None:
    """Why a build's record cannot be replayed (not recorded, a group with no role), or None."""
    if calls is None:
        return "its build was not recorded"
    unnamed = [c.name for c in calls if c.role is None]
    if unnamed:
        return f"its build ran {', '.join(unnamed[:3])} on a group megatron-core does not name"
    return None


def replay(calls: list[Call]) -> int:
    """Perform `calls` again on this generation's groups, with zero tensors and the recorded
    objects; returns how many. The results are dropped."""
    groups = named_groups()
    module = _modules()[-1]  # the interruptible view on a CPU job
    for call in calls:
        arguments = {k: _thaw(v) for k, v in call.arguments.items()}
        work = getattr(module, call.name)(group=groups[call.role], **arguments)
        if work is not None and hasattr(work, "wait"):
            work.wait()
    log.debug("replayed the %d collectives of this rank's model build", len(calls))
    return len(calls)
