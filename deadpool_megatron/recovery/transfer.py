"""Stage 5 of a hot-swap (recovery/stages.py): every rank restores the state of the plan's
iteration. A survivor rolls back to its own host snapshot; a spare receives the parameters
from one DP peer and the optimizer shard from one ring successor, read straight into its live
tensors. Every part a rank serves is posted before it receives anything, so that no two ranks
wait on each other."""

from __future__ import annotations

import logging

import torch.distributed as dist

from ..checkpoint.restore import (
    Expected,
    receive_into,
    restore_from_parts,
    restore_from_snapshot,
    serve_parameters,
    serve_replica,
)
from ..errors import DeadpoolError
from ..megatron.shard import RankState
from ..topology import Topology
from .held import Held
from .plan import RecoveryPlan

log = logging.getLogger("deadpool.recovery")


def transfer_state(
    plan: RecoveryPlan,
    rank_state: RankState,
    held: Held,
    topology: Topology,
    me: int,
    group: dist.ProcessGroup,
    offer: bool,
) -> tuple[int, int]:
    """Restore rank `me` of `plan` into `rank_state` and serve what the plan reads from it;
    returns the iteration restored and the bytes it received. `offer`: post the parts it
    serves to be read from this process's memory too (the tcp transport), where a receiver
    on the same host reads them with one copy (restore.post_part, restore.receive_into)."""
    layout = rank_state.layout
    parts: dict[str, tuple] = {}
    received = 0
    c = topology.coords(me)
    expected = Expected(plan.iteration, (c.tp, c.pp, c.dp))
    # Each transfer's messages go under a tag of its own; a survivor rolls back to its own
    # snapshot while its receivers read, and only then waits for their answers (the served
    # slots are held until then).
    serving = []
    try:
        for tag, tr in enumerate(plan.transfers, start=1):
            if tr.src == me and tr.kind == "parameters":
                pair, _ = held.snapshot(tr.iteration)
                serving.append(serve_parameters(pair, layout.optimizer_nbytes, tr.dst, group,
                                                tr.iteration, offer, tag)[1])  # fmt: skip
            elif tr.src == me:
                pair = held.replica(tr.owner, tr.iteration)
                serving.append(serve_replica({tr.owner: pair}, tr.owner, tr.dst, group,
                                             tr.iteration, offer, tag)[1])  # fmt: skip
        for tag, tr in enumerate(plan.transfers, start=1):
            if tr.dst != me:
                continue
            nbytes = layout.params_nbytes if tr.kind == "parameters" else layout.optimizer_nbytes
            part = receive_into(rank_state, tr.kind, nbytes, tr.src, group, expected, tag)
            if part.iteration != plan.iteration:
                raise DeadpoolError(
                    f"rank {tr.src} sent {tr.kind} of iteration {part.iteration}, the plan "
                    f"needs {plan.iteration}"
                )
            parts[tr.kind] = (part.data, part.meta)
            received += nbytes
            log.info("received the %s of iteration %d from rank %d (%.1f MiB, %s)", tr.kind,
                     part.iteration, tr.src, nbytes / 2**20,
                     ("read from its memory" + (" into place" if part.data is None else ""))
                     if part.pulled else "over the group")  # fmt: skip
        if me in plan.local_restores:
            _, slot = held.snapshot(plan.iteration)
            restored = restore_from_snapshot(rank_state, slot, expected)
        for served in serving:
            served.finish()
    finally:
        for served in serving:  # given up on (an error above): the slots are free again
            served.release()
    if me not in plan.local_restores:
        (optimizer_part, meta), (params_part, _) = parts["replica"], parts["parameters"]
        restored = restore_from_parts(rank_state, optimizer_part, meta, params_part, expected)
    return restored, received
