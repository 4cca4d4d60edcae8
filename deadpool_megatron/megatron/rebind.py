"""A survivor keeps its model, DDP, optimizer and scheduler through a recovery
(--deadpool-keep-model): only the process groups they hold are swapped for the new
generation's.

Building them again cost every survivor the model's construction, DDP's buffers and the
optimizer's (0.22 s a process at 8 processes, 4.3 s at 32 on this machine, where every
process builds at once), and the first resumed iteration its warm-up; the survivor's state is
rolled back from its own snapshot either way. megatron-core's objects hold its groups as
attributes (a layer's `tp_group`, DDP's and its bucket groups' data-parallel groups, the
distributed optimizer's), so each reference is replaced by the group of the same role in the
new generation: the role is the parallel_state global that held it (the default group is
"WORLD"). The ranks of every group are the same in every generation (a spare takes over the
failed rank's number), so nothing computed from them changes. A reference to a group with no
role, or one that cannot be replaced in place, makes the rebind refuse (`CannotRebind`); the
caller then builds the state again.
"""

from __future__ import annotations

import logging

import torch.distributed as dist

from ..errors import DeadpoolError
from .groups import named_groups, walk
from .model import TrainState

log = logging.getLogger(__name__)


class CannotRebind(DeadpoolError):
    """The kept state holds a process group the new generation has no counterpart for."""


def rebind(state: TrainState, old: dict[int, tuple[str, dist.ProcessGroup]]) -> int:
    """Replace, in `state`, every reference to a group in `old` (roles from before the
    teardown) with the new generation's group of the same role; returns how many references
    were replaced. Raises CannotRebind, before changing anything, if one cannot be."""
    new = named_groups()
    current = {id(g) for g in new.values()}
    swaps, problems = [], []
    for path, group, setter in walk({"state": state}):
        if id(group) in current:
            continue  # already the new generation's (a reference met twice, say)
        role = old.get(id(group), (None, None))[0]
        if role is None or role not in new:
            problems.append(f"{path} (role {role})")
        elif setter is None:
            problems.append(f"{path} (immutable)")
        else:
            swaps.append((setter, new[role]))
    if problems:
        raise CannotRebind(f"{len(problems)} process group reference(s) cannot be rebound: "
                           + "; ".join(problems[:5]))  # fmt: skip
    for setter, group in swaps:
        setter(group)
    log.debug("rebound %d process group reference(s) to the new generation", len(swaps))
    return len(swaps)


def unrebindable(state: TrainState, roles: dict[int, tuple[str, dist.ProcessGroup]]) -> str | None:
    """Why `state`, holding the groups of `roles` now, could not be rebound later (a group
    with no role, or one held where it cannot be replaced), or None. Asked before a state is
    set aside to be rebound (an idle spare's)."""
    problems = [
        f"{path} ({'immutable' if setter is None else 'no role'})"
        for path, group, setter in walk({"state": state})
        if id(group) not in roles or setter is None
    ]
    return "; ".join(problems[:5]) if problems else None
