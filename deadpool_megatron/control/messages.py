"""Every record that goes through the coordination store, with its encoding, in one place.

Writers build a record and `put` it under a key from `keys.py`; readers `get` the typed record
back (or None). The wire format is compact JSON with sorted keys (never pickle: the store can
be reached by every host of the cluster), so equal records encode to equal bytes, which
compare-and-swap on the membership relies on. A malformed value raises `MessageError` naming
the record type and the first bytes.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

from ..errors import DeadpoolError
from .store import KVStore

R = TypeVar("R", bound="Record")


class MessageError(DeadpoolError):
    """A store value that does not decode as the record its key holds."""


class MembershipError(DeadpoolError):
    """A membership that is malformed, missing, or cannot be changed as asked."""


class Record:
    """Base of every store record: `encode` to bytes, `decode` from them."""

    def to_doc(self) -> Any:
        return dataclasses.asdict(self)

    @classmethod
    def from_doc(cls: type[R], doc: Any) -> R:
        return cls(**doc)

    def encode(self) -> bytes:
        return json.dumps(self.to_doc(), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def decode(cls: type[R], raw: bytes) -> R:
        try:
            return cls.from_doc(json.loads(raw))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise MessageError(f"malformed {cls.__name__} {bytes(raw[:200])!r}: {err}") from err


def put(kv: KVStore, key: str, record: Record) -> None:
    kv.set(key, record.encode())


def get(kv: KVStore, key: str, cls: type[R]) -> R | None:
    raw = kv.get(key)
    return None if raw is None else cls.decode(raw)


def create(kv: KVStore, key: str, record: Record) -> bool:
    """Write `record` only if `key` does not exist yet: True for the one writer that did."""
    ok, _ = kv.compare_and_swap(key, None, record.encode())
    return ok


# -- processes ---------------------------------------------------------------------------------
def spare_id(index: int) -> str:
    """The process id a spare has in the membership (and in its keys) before it holds a rank."""
    return f"spare-{index}"


@dataclass(frozen=True)
class Registration(Record):
    """The process that holds a rank in a generation (written by itself)."""

    host: str
    pid: int

    @property
    def process_id(self) -> str:
        return f"{self.host}:{self.pid}"


@dataclass(frozen=True)
class SpareRegistration(Record):
    """An idle spare in the pool (written by itself; deleted when it dies or is claimed)."""

    host: str
    pid: int


@dataclass(frozen=True)
class Heartbeat(Record):
    time: float
    iteration: int
    pid: int


# Kinds of failure a process reports about itself.
INJECTED_TRANSIENT = "injected_transient"
HEALTH_CHECK = "health_check"
COLLECTIVE_ERROR = "collective_error"
CUDA_ERROR = "cuda_error"  # a CUDA error the process caught (evidence.cuda_error_recoverable)


@dataclass(frozen=True)
class FailureReport(Record):
    """Evidence a process has about its own failure (an exception it caught)."""

    kind: str  # INJECTED_TRANSIENT, HEALTH_CHECK, COLLECTIVE_ERROR or CUDA_ERROR
    message: str
    at: float
    iteration: int = -1  # where the rank was, its progress mark (-1: not known)
    phase: str = ""


@dataclass(frozen=True)
class Injection(Record):
    """A fault was injected into a rank at `at` (detection latency is measured from it)."""

    fault: str
    at: float
    generation: int


@dataclass(frozen=True)
class Claim(Record):
    """Who won a first-writer-wins key (a spare claim, a fired fault): `by` and when."""

    by: str
    generation: int = 0


@dataclass(frozen=True)
class Flag(Record):
    """A key whose existence is the message (a rank arrived, the job finished)."""

    by: str = ""


# -- membership --------------------------------------------------------------------------------
class Member(NamedTuple):
    rank: int
    process_id: str
    coords: tuple[int, int, int]  # (tp, pp, dp)


@dataclass(frozen=True)
class Membership(Record):
    """The generation-numbered view of who holds each rank, and the spares left."""

    generation: int
    ranks: tuple[Member, ...]
    spares: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        members = tuple(
            sorted((Member(int(r), str(p), tuple(int(c) for c in xyz)) for r, p, xyz in self.ranks))
        )
        object.__setattr__(self, "ranks", members)
        object.__setattr__(self, "spares", tuple(str(s) for s in self.spares))
        if self.generation < 0:
            raise MembershipError(f"generation {self.generation} must be 0 or more")
        rank_list = [m.rank for m in members]
        if len(set(rank_list)) != len(rank_list):
            raise MembershipError(f"ranks {rank_list} are not unique")
        holders = [m.process_id for m in members] + list(self.spares)
        if len(set(holders)) != len(holders):
            raise MembershipError(f"process ids {holders} (ranks, then spares) are not unique")

    def member(self, rank: int) -> Member:
        for m in self.ranks:
            if m.rank == rank:
                return m
        known = [m.rank for m in self.ranks]
        raise MembershipError(f"rank {rank} is not in generation {self.generation} (ranks {known})")

    def to_doc(self) -> dict:
        return {
            "generation": self.generation,
            "ranks": [[m.rank, m.process_id, list(m.coords)] for m in self.ranks],
            "spares": list(self.spares),
        }

    @classmethod
    def from_doc(cls, doc: dict) -> Membership:
        return cls(doc["generation"], tuple(doc["ranks"]), tuple(doc.get("spares", ())))

    @classmethod
    def decode(cls, raw: bytes) -> Membership:
        try:
            return super().decode(raw)
        except MessageError as err:
            raise MembershipError(str(err)) from err


# -- a recovery --------------------------------------------------------------------------------
@dataclass(frozen=True)
class RecoveryOrder(Record):
    """The order to stop and recover into the generation of its key."""

    reason: str
    permanent: tuple[int, ...] = ()
    by: int = 0  # the node whose agent coordinates the recovery

    def __post_init__(self) -> None:
        object.__setattr__(self, "permanent", tuple(sorted(int(r) for r in self.permanent)))


@dataclass(frozen=True)
class RankHoldings:
    """What one live rank can serve: committed snapshot iterations, and replicas it holds."""

    snapshots: frozenset[int]
    replicas: Mapping[int, frozenset[int]] = field(default_factory=dict)  # owner -> iterations


@dataclass(frozen=True)
class HoldingsReport(Record):
    """A live rank's holdings for a recovery, the last iteration whose step it finished, and
    whether it has trained at all in this launch (False: it is still where training starts,
    in its set-up or its first iteration, and could set up again instead). `arriving`: the
    rank's process is a spare that an earlier recovery seated and a newer order cut short: it
    holds nothing of the rank yet and stays, to receive its state as a replaced rank would."""

    holdings: RankHoldings
    completed: int
    trained: bool = True
    arriving: bool = False

    def to_doc(self) -> dict:
        h = self.holdings
        return {
            "snapshots": sorted(h.snapshots),
            "replicas": {str(o): sorted(its) for o, its in h.replicas.items()},
            "completed": self.completed,
            "trained": self.trained,
            "arriving": self.arriving,
        }

    @classmethod
    def from_doc(cls, doc: dict) -> HoldingsReport:
        replicas = {int(o): frozenset(its) for o, its in doc["replicas"].items()}
        holdings = RankHoldings(frozenset(doc["snapshots"]), replicas)
        return cls(holdings, int(doc["completed"]), bool(doc.get("trained", True)),
                   bool(doc.get("arriving", False)))  # fmt: skip


FROM_START = -1  # a plan's iteration when every rank sets up again (RecoveryPlan.from_start)


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
    # Replaced ranks whose spare built their model and optimizer while idle (SparePrebuilt):
    # it rebinds them instead of building, and builds nothing its peers must meet.
    prebuilt: tuple[int, ...] = ()
    # Nothing trained yet and nothing to restore: every rank sets up again, as at the job's
    # start (the seeded model, or --load's checkpoint), and `iteration` is FROM_START.
    from_start: bool = False
    # Replaced ranks whose spare an earlier, superseded recovery seated (HoldingsReport
    # .arriving): the same process receives their state; no spare is claimed for them.
    arriving: tuple[int, ...] = ()

    @property
    def generation(self) -> int:
        return self.membership.generation


@dataclass(frozen=True)
class PlanDecision(Record):
    """The launcher's answer for a generation: the plan (and the iteration that failed), why
    nothing can be recovered (every process then stops), or why nothing needs to be: the
    failure came after training had finished (`finished`; the job ends as succeeded)."""

    plan: RecoveryPlan | None = None
    failed_iteration: int = 0
    unrecoverable: str | None = None
    finished: str | None = None

    def to_doc(self) -> dict:
        if self.finished is not None:
            return {"finished": self.finished}
        if self.plan is None:
            return {"unrecoverable": self.unrecoverable}
        p = self.plan
        return {
            "membership": p.membership.to_doc(),
            "iteration": p.iteration,
            "replaced": {str(r): s for r, s in p.replaced.items()},
            "local_restores": list(p.local_restores),
            "transfers": [[t.kind, t.src, t.dst, t.owner, t.iteration] for t in p.transfers],
            "prebuilt": list(p.prebuilt),
            "from_start": p.from_start,
            "arriving": list(p.arriving),
            "failed_iteration": self.failed_iteration,
        }

    @classmethod
    def from_doc(cls, doc: dict) -> PlanDecision:
        if "finished" in doc:
            return cls(finished=str(doc["finished"]))
        if "unrecoverable" in doc:
            return cls(unrecoverable=str(doc["unrecoverable"]))
        plan = RecoveryPlan(
            membership=Membership.from_doc(doc["membership"]),
            iteration=int(doc["iteration"]),
            replaced={int(r): s for r, s in doc["replaced"].items()},
            local_restores=tuple(doc["local_restores"]),
            transfers=tuple(Transfer(*t) for t in doc["transfers"]),
            prebuilt=tuple(int(r) for r in doc.get("prebuilt", ())),
            from_start=bool(doc.get("from_start", False)),
            arriving=tuple(int(r) for r in doc.get("arriving", ())),
        )
        return cls(plan, int(doc["failed_iteration"]))


@dataclass(frozen=True)
class HostFootprint(Record):
    """The host buffers a rank's protection pipeline allocates (bytes each: its two snapshot
    slots, then two per replica it keeps), written once at start-up; an idle spare reserves
    the largest rank's before it is claimed."""

    buffers: tuple[int, ...]
    pin: bool

    @classmethod
    def from_doc(cls, doc: dict) -> HostFootprint:
        return cls(tuple(int(n) for n in doc["buffers"]), bool(doc["pin"]))


@dataclass(frozen=True)
class TrainingEnd(Record):
    """The iteration this job's training stops after: --train-iters, or the multiple of
    --exit-interval after the iteration it started from (its --load's). The first generation
    writes it; a spare that takes a rank over starts from the resumed iteration and reads it,
    so that its loop ends where the survivors' do."""

    iteration: int


@dataclass(frozen=True)
class SparePrebuilt(Record):
    """The ranks an idle spare can take over without building (it built their model and
    optimizer while idle, `--deadpool-spare-prebuild`), written once its builds are done; the
    agent seats it on one of them when it can."""

    ranks: tuple[int, ...]

    @classmethod
    def from_doc(cls, doc: dict) -> SparePrebuilt:
        return cls(tuple(int(r) for r in doc["ranks"]))


@dataclass(frozen=True)
class SpareAssignment(Record):
    """The rank and generation a claimed spare takes over (written after the claim)."""

    rank: int
    generation: int


@dataclass(frozen=True)
class Recovered(Record):
    """A rank's account of a recovery, written after its first resumed iteration."""

    phases: dict[str, float]
    finished_at: float
    iteration: int
    bytes_moved: int
    groups_checked: int | None = None
    cpu_s: float | None = None  # this process's CPU (all threads) from failure to resumed
    phase_cpu_s: dict[str, float] | None = None  # that CPU by phase (before_rebuild, ...)


# -- nodes and their agents --------------------------------------------------------------------
@dataclass(frozen=True)
class JobIdentity(Record):
    """The job id every agent of a launch uses (agreed through the store: first writer wins)."""

    job: str


@dataclass(frozen=True)
class JobLaunch(Record):
    """The launch that owns a job id's keys: written by its first agent, signed like every
    record, so an agent of another launch (another secret) reads it as absent."""

    host: str
    node: int
    at: float  # wall-clock time it was written


@dataclass(frozen=True)
class NodeLaunch(Record):
    """What one node's agent was launched with: deadpool-launch's flags that shape the job
    (`agreement.LAUNCH_SHAPE`, the script by its file name) and the training script's flags as
    its preflight parsed them (None: not told). Every agent compares every node's."""

    node: int
    host: str
    shape: dict[str, Any]
    flags: dict[str, Any] | None

    def as_compared(self) -> dict[str, Any]:
        return {**self.shape, "flags": self.flags}


@dataclass(frozen=True)
class AgentBeat(Record):
    """A node agent's lease on its node: what it hosts, renewed every heartbeat interval.

    Other agents declare the node lost when its beats stop (`seq` no longer moves); the ranks
    and spares listed in its last beat are what the job loses with it."""

    node: int
    host: str
    pid: int
    seq: int
    at: float  # wall time of this renewal (a lost node failed after its last one)
    generation: int
    ranks: tuple[int, ...] = ()
    spares: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))
        object.__setattr__(self, "spares", tuple(str(s) for s in self.spares))

    @property
    def holder(self) -> str:
        """The node and its agent, as the logs name them."""
        return f"node {self.node} (agent pid {self.pid} on {self.host})"


@dataclass(frozen=True)
class RankLost(Record):
    """During a recovery: the agent hosting a rank says it will never report (it exited, is
    stopped, or stopped progressing), so the recovery's coordinator replaces it too; or,
    `finished`, that it exited with status 0: it had finished training before the failure."""

    reason: str
    finished: bool = False


@dataclass(frozen=True)
class RestartOrder(Record):
    """Checkpoint-restart number `count` of the job: every node's agent stops its processes
    and starts them again under the job id `job`, loading the newest checkpoint."""

    job: str
    reason: str
    count: int
