"""Stage 6 of a hot-swap: what every rank checks about the new generation before it resumes.

Training on a generation whose ranks disagree (about the generation, the membership or the
iteration restored) or whose shards are missing or doubled would diverge silently; training
on a process group from before the failure would wait on a dead peer. Both are checked here
and are `RecoveryFailed` if they do not hold.
"""

from __future__ import annotations

import hashlib
import logging

import torch.distributed as dist

from ..megatron import parallel
from ..megatron.exchange import all_gather_ints
from ..megatron.groups import stale_groups
from ..topology import Topology
from .exchange import RecoveryFailed
from .plan import RecoveryPlan, check_plan, generation_problems

log = logging.getLogger("deadpool.recovery")


def verify_generation(
    plan: RecoveryPlan, restored: int, topology: Topology, group: dist.ProcessGroup
) -> None:
    """Every rank checks the same facts about everyone (a collective over `group`)."""
    check_plan(plan, topology)
    view = int.from_bytes(hashlib.sha1(plan.membership.encode()).digest()[:8], "little",
                          signed=True)  # fmt: skip
    mine = (plan.generation, restored, view, *parallel.coordinates(),
            *parallel.expert_coordinates())  # fmt: skip
    facts = all_gather_ints(mine, group)
    problems = generation_problems(plan, view, facts, topology)
    if problems:
        raise RecoveryFailed(
            f"generation {plan.generation} does not hold at iteration {plan.iteration}: "
            + "; ".join(problems)
        )


def verify_groups_replaced(old_groups: list, *roots: object, skip: tuple = ()) -> int:
    """No process group from before the recovery is reachable from `roots` (what training
    holds), `skip` aside (the retired groups, held on purpose until their collection);
    returns how many groups are reachable (--deadpool-verify-groups)."""
    reachable, stale = stale_groups(old_groups, *roots, skip=skip)
    if stale:
        raise RecoveryFailed(
            f"{len(stale)} reference(s) to process groups from before the recovery "
            f"remain: {stale[:5]}"
        )
    log.info("verified: %d process groups reachable, none from before", reachable)
    return reachable
