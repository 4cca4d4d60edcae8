"""Plan a recovery: who replaces whom, which iteration everyone rolls back to, and which
bytes move from where to where. Pure: no I/O, tested as a table.

The paper's reconstruction, no more traffic than needed: every surviving (or transiently
failed) rank rolls back to its own host snapshot of iteration i; a spare that takes a failed
rank's (tp, pp, dp) coordinates receives the parameters from ONE healthy DP peer with the same
(tp, pp) coordinates (all DP peers hold identical parameters; with experts, those holding the
same experts, Topology.parameter_peers) and the optimizer shard +
metadata from ONE surviving DP-ring successor that holds a verified replica. i is the newest
iteration for which all of that exists; when nothing does (both copies of a shard lost, no
spare left), the plan says exactly what was lost instead of resuming on wrong state. Before
any live rank has trained (a failure during the set-up), where nothing can be restored the
plan is from the start instead: every rank sets up again, as at the job's start.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from ..control.membership import replace
from ..control.messages import (
    FROM_START,
    Membership,
    MembershipError,
    RankHoldings,
    RecoveryPlan,
    Transfer,
)
from ..errors import DeadpoolError
from ..topology import Topology

__all__ = ["FROM_START", "RankHoldings", "RecoveryPlan", "TrainingFinished", "Transfer",
           "Unrecoverable", "check_plan", "generation_problems", "plan_recovery"]  # fmt: skip


class Unrecoverable(DeadpoolError):
    """The state of some shard is lost: fall back to a persistent checkpoint, or stop."""


class TrainingFinished(DeadpoolError):
    """Nothing to recover: every rank that did not fail had finished training (exited with
    status 0) before the failure, so the failed ones had passed the job's last collective
    (with --save, the final save's barrier: their part of the last checkpoint is written)."""


def plan_recovery(
    view: Membership,
    topology: Topology,
    permanent: set[int],
    holdings: Mapping[int, RankHoldings],
    replicas: int = 1,
    finished: Collection[int] = (),
    untrained: bool = False,
    arriving: Collection[int] = (),
) -> RecoveryPlan:
    """The next generation after the ranks in `permanent` are lost for good.

    `holdings` has one entry per live rank (survivors and transiently failed ranks alike:
    both keep their process and host buffers); `finished`: ranks that exited with status 0,
    replaced like failed ones unless no rank is live; `untrained`: no live rank has trained
    an iteration yet (a failure during the set-up or the first iteration), so where nothing
    can be restored every rank sets up again instead (`from_start`); `arriving`: ranks whose
    process is a spare an earlier, superseded recovery seated, holding nothing yet: they
    receive their state as replaced ranks do, from the same process (no spare is taken).
    Raises Unrecoverable naming what was lost, TrainingFinished when every rank that did not
    fail had finished.
    """
    live = set(holdings)
    done = set(finished)
    coming = set(arriving)
    if coming & (live | permanent | done):
        raise ValueError(f"arriving ranks {sorted(coming)} are also live, failed or finished")
    missing = set(range(topology.world_size)) - live - permanent - done - coming
    if missing:
        raise ValueError(f"ranks {sorted(missing)} are neither live, failed nor finished")
    if done and not live:
        raise TrainingFinished(
            f"rank(s) {sorted(done)} finished training before rank(s) {sorted(permanent)} "
            "failed: the failure came after the job's last collective; nothing to recover"
        )
    # Some exited 0 while others are still in the job's last steps: their state went with
    # them, so they are replaced like failed ranks (the live ones redo the last steps).
    permanent = permanent | done
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
    for rank in sorted(coming):  # seated already: the process stays, the state comes to it
        replaced[rank] = view.member(rank).process_id
    replaced = dict(sorted(replaced.items()))
    permanent = permanent | coming  # sourced as replaced ranks: from live peers only
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
                arriving=tuple(sorted(coming)),
            )
    if untrained:  # the state training starts from is rebuilt, as it was built the first time
        return RecoveryPlan(new_view, FROM_START, replaced, (), (), from_start=True,
                            arriving=tuple(sorted(coming)))  # fmt: skip
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
        # Parameters: the nearest live peer holding the same ones (ring predecessor first; of
        # a job with experts, one that holds the same experts) with this snapshot.
        same = topology.parameter_peers(failed)
        peers = [p for p in topology.ring_predecessors(failed, topology.dp)
                 if p in holdings and p in same]  # fmt: skip
        peer = next((p for p in peers if iteration in holdings[p].snapshots), None)
        if peer is None:
            whose = "TP/PP and expert" if topology.experts_apart else "TP/PP"
            reasons[iteration] = (
                f"{where}: no live DP peer with the same {whose} coordinates holds its "
                f"parameters at iteration {iteration} (all of them failed: {same})"
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
    restored exactly once, from live sources, all at the same iteration (or, from the start,
    nothing is restored: every rank sets up again)."""
    if plan.from_start:
        if plan.transfers or plan.local_restores or plan.iteration != FROM_START:
            raise DeadpoolError(f"a plan from the start restores nothing: {plan}")
        return
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


def generation_problems(
    plan: RecoveryPlan, view: int, facts: list[tuple[int, ...]], topology: Topology
) -> list[str]:
    """What the ranks' reports after their restore (rank r's at `facts[r]`: generation,
    iteration restored, a hash of its membership view, tp, pp, dp, expert tp, ep) show wrong
    against `plan` and `view`, this rank's hash of the plan's membership; empty when every
    rank holds (megatron-core's coordinates must be the topology's, whose maths the plan's
    sources follow)."""
    problems = []
    # From the start, each rank found where training starts itself: they must agree.
    wanted = facts[0][1] if plan.from_start else plan.iteration
    for rank, (generation, iteration, membership, *coords) in enumerate(facts):
        if generation != plan.generation or membership != view:
            problems.append(f"rank {rank} is in generation {generation} / view {membership:#x}")
        if iteration != wanted:
            problems.append(f"rank {rank} restored iteration {iteration}" + (
                f", rank 0 {wanted}" if plan.from_start else ""))  # fmt: skip
        expected = topology.coords(rank)
        if tuple(coords) != (expected.tp, expected.pp, expected.dp,
                             *topology.expert_coords(rank)):  # fmt: skip
            problems.append(f"rank {rank} holds coordinates {tuple(coords)}")
    return problems


def anyone_builds(plan: RecoveryPlan, keep_model: bool) -> bool:
    """Whether a rank of `plan` builds its model and optimizer anew (a rank that keeps its
    own then performs its build's collectives again, to meet them): a spare that did not
    build while idle, or every survivor when survivors do not keep theirs."""
    spares_build = any(r not in plan.prebuilt for r in plan.replaced)
    survivors_build = not keep_model and len(plan.replaced) < len(plan.membership.ranks)
    return spares_build or survivors_build
