"""Plan a recovery: who replaces whom, which iteration everyone rolls back to, and which
bytes move from where to where. Pure: no I/O, tested as a table.

The paper's reconstruction, no more traffic than needed: every surviving (or transiently
failed) rank rolls back to its own host snapshot of iteration i; a spare that takes a failed
rank's (tp, pp, dp) coordinates receives the parameters from ONE healthy DP peer with the same
(tp, pp) coordinates (all DP peers hold identical parameters) and the optimizer shard +
metadata from ONE surviving DP-ring successor that holds a verified replica. i is the newest
iteration for which all of that exists; when nothing does (both copies of a shard lost, no
spare left), the plan says exactly what was lost instead of resuming on wrong state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ..control.membership import Membership, MembershipError, replace
from ..errors import DeadpoolError
from ..topology import Topology


class Unrecoverable(DeadpoolError):
    """The state of some shard is lost: fall back to a persistent checkpoint, or stop."""


@dataclass(frozen=True)
class RankHoldings:
    """What one live rank can serve: committed snapshot iterations, and replicas it holds."""

    snapshots: frozenset[int]
    replicas: Mapping[int, frozenset[int]] = field(default_factory=dict)  # owner -> iterations


@dataclass(frozen=True)
class Transfer:
    kind: str  # "parameters" (a DP peer's snapshot) or "replica" (the owner's optimizer shard)
    src: int
    dst: int
    owner: int  # the rank whose state this is (the failed rank)
    iteration: int


@dataclass(frozen=True)
class RecoveryPlan:
    membership: Membership  # the new generation
    iteration: int  # every rank resumes from this committed iteration
    replaced: Mapping[int, str]  # failed rank -> spare process id taking it over
    local_restores: tuple[int, ...]  # ranks that roll back to their own snapshot
    transfers: tuple[Transfer, ...]

    @property
    def generation(self) -> int:
        return self.membership.generation


def plan_recovery(
    view: Membership,
    topology: Topology,
    permanent: set[int],
    holdings: Mapping[int, RankHoldings],
    replicas: int = 1,
) -> RecoveryPlan:
    """The next generation after the ranks in `permanent` are lost for good.

    `holdings` has one entry per live rank (survivors and transiently failed ranks alike:
    both keep their process and host buffers). Raises Unrecoverable naming what was lost.
    """
    live = set(holdings)
    missing = set(range(topology.world_size)) - live - permanent
    if missing:
        raise ValueError(f"ranks {sorted(missing)} are neither live nor failed")
    if not live:
        raise Unrecoverable("every rank failed: no state survives in memory")
    new_view = view
    replaced: dict[int, str] = {}
    for rank in sorted(permanent):
        try:
            new_view = replace(new_view, rank)
        except MembershipError as err:
            raise Unrecoverable(str(err)) from err
        replaced[rank] = new_view.member(rank).process_id
    # One recovery is one new generation (a transient one too: every communicator is rebuilt
    # on a fresh store prefix), however many ranks it replaces.
    new_view = Membership(view.generation + 1, new_view.ranks, new_view.spares)
    candidates = set.intersection(*(set(h.snapshots) for h in holdings.values()))
    reasons: dict[int, str] = {}
    for iteration in sorted(candidates, reverse=True):
        transfers = _sources(topology, permanent, holdings, replicas, iteration, reasons)
        if transfers is not None:
            return RecoveryPlan(
                membership=new_view,
                iteration=iteration,
                replaced=replaced,
                local_restores=tuple(sorted(live)),
                transfers=tuple(transfers),
            )
    if not candidates:
        raise Unrecoverable(
            "the live ranks share no committed snapshot iteration: "
            + ", ".join(f"rank {r}: {sorted(h.snapshots)}" for r, h in sorted(holdings.items()))
        )
    # Report why the newest candidate iteration could not be restored.
    raise Unrecoverable(reasons[max(reasons)])


def _sources(topology, permanent, holdings, replicas, iteration, reasons) -> list | None:
    transfers = []
    for failed in sorted(permanent):
        c = topology.coords(failed)
        where = f"rank {failed} (tp {c.tp}, pp {c.pp}, dp {c.dp})"
        # Parameters: the nearest live DP peer (ring predecessor first) with this snapshot.
        peers = [p for p in topology.ring_predecessors(failed, topology.dp) if p in holdings]
        peer = next((p for p in peers if iteration in holdings[p].snapshots), None)
        if peer is None:
            reasons[iteration] = (
                f"{where}: no live DP peer with the same TP/PP coordinates holds its parameters "
                f"at iteration {iteration} (its whole DP group failed)"
            )
            return None
        # Optimizer shard: the nearest live ring successor holding a verified replica.
        successors = topology.ring_successors(failed, replicas)
        holder = next(
            (
                s
                for s in successors
                if s in holdings and iteration in holdings[s].replicas.get(failed, ())
            ),
            None,
        )
        if holder is None:
            lost = [s for s in successors if s in permanent]
            reasons[iteration] = (
                f"{where}: its optimizer shard at iteration {iteration} was replicated on "
                f"ranks {successors} only"
                + (f", and {lost} failed too" if lost else ", and none of them holds it")
                + f" (--deadpool-replicas {replicas})"
            )
            return None
        transfers.append(Transfer("parameters", peer, failed, failed, iteration))
        transfers.append(Transfer("replica", holder, failed, failed, iteration))
    return transfers


def check_plan(plan: RecoveryPlan, topology: Topology) -> None:
    """The invariants every rank verifies before resuming: every (tp, pp, dp) shard is
    restored exactly once, from live sources, all at the same iteration."""
    restored: dict[int, list[str]] = {r: ["local"] for r in plan.local_restores}
    for t in plan.transfers:
        if t.iteration != plan.iteration:
            raise DeadpoolError(f"{t} is not at the plan's iteration {plan.iteration}")
        if t.src in plan.replaced:
            raise DeadpoolError(f"{t} reads from failed rank {t.src}")
        restored.setdefault(t.dst, []).append(t.kind)
    for rank in range(topology.world_size):
        got = sorted(restored.get(rank, []))
        if got not in (["local"], ["parameters", "replica"]):
            raise DeadpoolError(
                f"rank {rank} would be restored from {got or 'nothing'}; expected its own "
                f"snapshot, or a peer's parameters plus its ring replica"
            )


# -- wire format: the launcher publishes plans and ranks publish holdings through the store --
def encode_holdings(h: RankHoldings, completed: int) -> dict:
    """`completed`: the last iteration whose optimizer step this rank finished."""
    return {
        "snapshots": sorted(h.snapshots),
        "replicas": {str(o): sorted(its) for o, its in h.replicas.items()},
        "completed": completed,
    }


def decode_holdings(doc: dict) -> tuple[RankHoldings, int]:
    replicas = {int(o): frozenset(its) for o, its in doc["replicas"].items()}
    return RankHoldings(frozenset(doc["snapshots"]), replicas), int(doc["completed"])


def encode_plan(plan: RecoveryPlan) -> dict:
    return {
        "membership": plan.membership.to_json().decode(),
        "iteration": plan.iteration,
        "replaced": {str(r): s for r, s in plan.replaced.items()},
        "local_restores": list(plan.local_restores),
        "transfers": [[t.kind, t.src, t.dst, t.owner, t.iteration] for t in plan.transfers],
    }


def decode_plan(doc: dict) -> RecoveryPlan:
    return RecoveryPlan(
        membership=Membership.from_json(doc["membership"].encode()),
        iteration=int(doc["iteration"]),
        replaced={int(r): s for r, s in doc["replaced"].items()},
        local_restores=tuple(doc["local_restores"]),
        transfers=tuple(Transfer(*t) for t in doc["transfers"]),
    )
