"""A survivor's model kept through a recovery: rebound to the new generation's groups, or built
anew, with every rank of the generation agreeing on whether anyone builds.

A rank that builds its model and optimizer performs collectives (the optimizer gathers its
parameter-group keys over every rank); a rank that keeps its own meets them by performing its
build's collectives again (`replay`), and only when some rank builds. The plan says which
spares build. A kept state that cannot be rebound (a group with no role, `CannotRebind`), or a
spare whose build the plan counted on but that has none, builds all the same, which the plan
could not foresee: so when the plan counts on nobody building, the ranks tell each other (one
all-gather of a flag over the host group, before any build collective) and meet that build
rather than leave it waiting in its collectives until the timeout.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..megatron.build_calls import replay, unreplayable
from ..megatron.exchange import all_gather_ints
from ..megatron.model import TrainState, rehook
from ..megatron.prebuild import Prebuilt
from ..megatron.rebind import CannotRebind, rebind

log = logging.getLogger("deadpool.recovery")


@dataclass
class Kept:
    """A model, DDP, optimizer and scheduler kept through a recovery (a survivor's, or a spare's
    built while idle), and the gradient hooks cut off them meanwhile."""

    state: TrainState
    hooks: list[dict]


def keep_or_build(
    kept: Kept | None, roles: dict, plan_builds: bool, host, prebuilt: bool = False
) -> TrainState | None:
    """`kept`'s state with its groups swapped for the new generation's (`roles`: what each old
    group was for) and its hooks back, its build's collectives performed again if any rank
    builds; None if this rank must build (nothing kept, or it cannot be rebound or replayed).

    `plan_builds`: the plan has a rank build (`plan.anyone_builds`); if it has none, the
    ranks agree over `host`, so every rank of the generation calls this, in the same place.
    `prebuilt`: the state is a spare's built while idle (for the log)."""
    state = None
    if kept is not None:
        try:
            swapped = rebind(kept.state, roles)
            state = kept.state
        except CannotRebind as why:
            log.warning("building the model again: %s", why)
    others_build = plan_builds or anyone_builds_here(state is None, host)
    if state is not None and others_build:
        why_not = unreplayable(state.build_calls)
        if why_not:  # building performs what a replay would have: the others meet it the same
            log.warning("building the model again: another rank builds, and %s", why_not)
            state = None
    if state is None:
        return None
    rehook(state, kept.hooks)
    replayed = replay(state.build_calls) if others_build else 0
    log.info("kept the model%s: %d process group references swapped, %d build collectives "
             "performed again for the ranks that build", " built while idle" if prebuilt else "",
             swapped, replayed)  # fmt: skip
    return state


def adopt_prebuilt(prebuilt: Prebuilt | None, rank: int, counted: bool) -> tuple[Kept, dict] | None:
    """A claimed spare's state built while idle, kept as a survivor keeps its own, with the
    roles of the groups it holds, if the plan counts on it (`counted`: its peers then replay
    nothing for it); None: it builds."""
    if prebuilt is None:
        if counted:  # it builds; its peers learn so in keep_or_build
            log.warning("building the model: the plan counts on one built while idle for "
                        "rank %d, and this spare has none", rank)  # fmt: skip
        return None
    if not counted:
        log.info("building the model: the plan does not count on the one built while "
                 "idle (for rank %d)", prebuilt.rank)  # fmt: skip
        return None
    return Kept(prebuilt.state, prebuilt.hooks), dict(prebuilt.roles)


def anyone_builds_here(builds: bool, host) -> bool:
    """Whether any rank of `host`'s group builds (`builds`: this one does)."""
    votes = all_gather_ints([int(builds)], group=host)
    builders = [rank for rank, (vote,) in enumerate(votes) if vote]
    if builders:
        log.warning("rank(s) %s build their model, which the plan did not foresee: every rank "
                    "that keeps its own performs its build's collectives again", builders)  # fmt: skip
    return bool(builders)
