"""Evidence -> decision: does the failed rank reset locally (transient) or get hot-swapped?

A pure function, so the rules below are tested as a table. Precedence, strongest first, and why:

1. `ProcessExited`: the operating system's word; the process is gone, nothing can reset it.
   Any collective error or heartbeat evidence about the same rank is a symptom of the exit.
2. `HeartbeatStale`: the process is hung: stopped, or its heartbeat is late AND it has made no
   progress for its phase's limit (failure/hang.py; a late beat alone is only a suspicion); a
   process that cannot beat cannot be trusted to reset itself (and a hung gloo collective cannot be aborted from another thread,
   so the launcher fences it), even if the same rank also reported a transient error.
3. `HealthCheckFailed`: alive but unfit (device, memory); resetting in place would fail again.
4. `CudaError` that is not recoverable: the CUDA context is lost, only a new process helps.
5. Transient evidence the rank reports about itself: `InjectedTransient`, a recoverable
   `CudaError`, a `CollectiveError` whose message is a local fault. Earliest wins.
6. Hearsay: a `CollectiveError` that merely reports a peer's loss ("Connection closed by
   peer", NCCL timeouts). It is NOT evidence against the survivor that reports it: it is
   attributed to the peer (`suspect_rank`) and, with no exit or stale heartbeat for that
   peer (every heartbeat fresh), it is transient.

A transient decision escalates to permanent when the same rank has failed transiently more than
`policy.max_transient` times within `policy.window_s` (this failure included): a rank that keeps
resetting costs more than one hot-swap.

A rank's own error (first-hand, not a peer's loss) that comes again with the same message
(`error_shape`: but for addresses, process ids and an allocator's byte counts) at the same
iteration and phase, after the recovery from it replayed that iteration bitwise, is
the training's own doing, not a fault: the replay computes what it computed. The first time
again it is escalated to permanent all the same (a device at fault would fail the same way in
place; a spare's does not); a third time, on any rank, it is `REPEATED`: the job ends with it,
since a spare or a restart from a checkpoint would meet it again. A CUDA error that may have
corrupted its context is replaced the first time already (rule 4), so the second time is
`REPEATED`. A process that reported its own error and then exited (a spare whose takeover
failed holds nothing to stay for) failed of that error: the exit decides (rule 1), the error is
what the rule matches and records (`Classification.cause`), and a second time it is `REPEATED`.
An error inside a recovery has its place as (the iteration recovered from, "recovery"), the
same in every process that holds the rank.

Across ranks, the strongest kind wins and, within a kind, the earliest `at` (then the lowest
rank): `classify` returns the one decision to act on first. A permanent recovery re-plans the
whole membership and rolls every rank back, which subsumes any local reset; the caller then
classifies what evidence is left about other ranks.
"""

from __future__ import annotations

import enum
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..errors import ConfigError, DeadpoolError
from .evidence import (
    CollectiveError,
    CudaError,
    Evidence,
    HealthCheckFailed,
    HeartbeatStale,
    ProcessExited,
    describe_exit,
    is_peer_loss_message,
)


class Decision(enum.Enum):
    TRANSIENT = "transient"  # the same rank resets locally and rejoins
    PERMANENT = "permanent"  # a spare replaces the rank (hot-swap)
    REPEATED = "repeated"  # the same own error at the same place, twice replayed: end the job


class InconclusiveEvidence(DeadpoolError):
    """Only survivors' peer-loss reports, naming no peer: wait for exit or stale evidence."""


@dataclass(frozen=True)
class ClassifyPolicy:
    """How many transient failures of one rank are tolerated within a sliding window."""

    max_transient: int = 3
    window_s: float = 600.0

    def __post_init__(self) -> None:
        if self.max_transient < 0:
            raise ConfigError(f"max_transient must be >= 0, got {self.max_transient}")
        if not self.window_s > 0:
            raise ConfigError(f"window_s must be > 0 seconds, got {self.window_s}")


@dataclass(frozen=True)
class FailureHistory:
    """Past transient failures as (rank, at) pairs; immutable, `record` returns a new one.

    Record a failure after classifying it: `classify` already counts the failure it is given.
    """

    transients: tuple[tuple[int, float], ...] = ()
    # own errors acted on, as (error_shape, iteration, phase): the newest ERRORS_KEPT, at any age
    errors: tuple[tuple[str, int, str], ...] = ()

    def record(self, rank: int, at: float) -> FailureHistory:
        return FailureHistory((*self.transients, (rank, at)), self.errors)

    def record_error(self, evidence: Evidence) -> FailureHistory:
        """An own error with its place was acted on (`error_signature`); else unchanged."""
        signature = error_signature(evidence)
        if signature is None:
            return self
        return FailureHistory(self.transients, (*self.errors, signature)[-ERRORS_KEPT:])

    def repeats(self, evidence: Evidence) -> int:
        """How often the error of `evidence` was acted on before, at the same place."""
        signature = error_signature(evidence)
        return 0 if signature is None else self.errors.count(signature)

    def count(self, rank: int, now: float, window_s: float) -> int:
        """Transient failures of `rank` with `now - window_s <= at <= now` (edges included)."""
        return sum(1 for r, at in self.transients if r == rank and now - window_s <= at <= now)

    def prune(self, now: float, window_s: float) -> FailureHistory:
        """Drop transients older than the window, so a long job's history stays small."""
        kept = tuple((r, at) for r, at in self.transients if at >= now - window_s)
        return FailureHistory(kept, self.errors)


ERRORS_KEPT = 16


def error_signature(evidence: Evidence) -> tuple[str, int, str] | None:
    """(message, iteration, phase) of a rank's own error (a CUDA error too) whose place is
    known; None for anything else (a peer's loss, an exit, a hang, a fault injected as
    transient)."""
    if not isinstance(evidence, (CollectiveError, CudaError)) or evidence.where is None:
        return None
    if _is_hearsay(evidence):
        return None
    return (error_shape(evidence.message), *evidence.where)


# What differs from run to run in the message of the same error, on a bitwise replay: a
# device address, a process id, a network address, and the memory an allocator had (CUDA's
# out-of-memory message names the free and reserved bytes, which a spare's allocator does not
# share). Any other number stays: a deterministic error computes the same ones again, so a
# number that changed says the error is not the training's.
_RUN_SPECIFIC = (
    (re.compile(r"\b0x[0-9a-fA-F]+\b"), "0x?"),
    (re.compile(r"\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b"), "<address>"),
    (re.compile(r"\b(pid|PID|process) \d+\b"), r"\1 ?"),
    (re.compile(r"\b\d+(?:\.\d+)? ?(?:bytes|[KMGT]i?B)\b"), "? B"),
)


def error_shape(message: str) -> str:
    """`message` with what a replay of the same error changes left out (_RUN_SPECIFIC)."""
    for pattern, stand_in in _RUN_SPECIFIC:
        message = pattern.sub(stand_in, message)
    return message


@dataclass(frozen=True)
class Classification:
    rank: int
    kind: Decision
    reason: str  # starts with the class name of the evidence that won
    evidence: Evidence
    # the rank's own error behind an exit (it reported one first); None: `evidence` itself
    error: Evidence | None = None

    @property
    def cause(self) -> Evidence:
        """What the replay rule matches and records (FailureHistory.record_error)."""
        return self.evidence if self.error is None else self.error


def describe(e: Evidence) -> str:
    """One line naming the evidence kind, for the reason and the event log."""
    name = type(e).__name__
    if isinstance(e, ProcessExited):
        return f"{name}: rank {e.rank} {describe_exit(e.returncode)}"
    if isinstance(e, HeartbeatStale):
        seen = "never beat" if e.last_seen is None else f"last beat {e.at - e.last_seen:.2f} s ago"
        return f"{name}: rank {e.rank} {seen}" + (f"; {e.why}" if e.why else "")
    if isinstance(e, HealthCheckFailed):
        return f"{name}: rank {e.rank}: {e.reason}"
    if isinstance(e, CudaError):
        what = "recoverable" if e.recoverable else "unrecoverable"
        return f"{name}: rank {e.rank} ({what}): {e.message}"
    if isinstance(e, CollectiveError):
        if is_peer_loss_message(e.message):
            peer = "" if e.peer is None else f" peer {e.peer}"
            return f"{name}: rank {e.rank} lost{peer}: {e.message}"
        return f"{name}: rank {e.rank}: {e.message}"
    return f"{name}: rank {e.rank}"


def _earliest(items: Iterable[Evidence]) -> Evidence | None:
    return min(items, key=lambda e: (e.at, e.rank), default=None)


def _is_hearsay(e: Evidence) -> bool:
    return isinstance(e, CollectiveError) and is_peer_loss_message(e.message)


def suspect_rank(evidence: Sequence[Evidence], ranks: Sequence[int] | None = None) -> int:
    """The rank that failed, when several ranks report collective errors.

    In order: a rank with direct evidence (exited, then stale heartbeat); a rank whose own
    collective failed locally (first-hand beats hearsay); the peer most survivors name
    (`CollectiveError.peer`; ties go to the earliest named, then the lowest rank); with `ranks`
    (the generation's members), the one member that did not report a peer loss when all others
    did. A reporter of a peer loss is never the suspect. Raises `InconclusiveEvidence`
    otherwise: the caller waits for the launcher's exit or the heartbeat detector.
    """
    for kind in (ProcessExited, HeartbeatStale):
        direct = _earliest(e for e in evidence if isinstance(e, kind))
        if direct is not None:
            return direct.rank
    collective = [e for e in evidence if isinstance(e, CollectiveError)]
    local = _earliest(e for e in collective if not _is_hearsay(e))
    if local is not None:
        return local.rank
    reports = [e for e in collective if e.peer is not None and e.peer != e.rank]
    if reports:
        votes = Counter(e.peer for e in reports)
        first_named = {}
        for e in sorted(reports, key=lambda e: e.at):
            first_named.setdefault(e.peer, e.at)
        return min(votes, key=lambda r: (-votes[r], first_named[r], r))
    if ranks is not None:
        silent = set(ranks) - {e.rank for e in collective}
        if collective and len(silent) == 1:
            return silent.pop()
    reporters = sorted({e.rank for e in collective})
    raise InconclusiveEvidence(
        f"collective errors on ranks {reporters} report a lost peer but name none, and no rank "
        "exited or went stale; wait for the launcher or the heartbeat detector"
    )


def classify(
    evidence: Sequence[Evidence],
    history: FailureHistory,
    policy: ClassifyPolicy | None = None,
    ranks: Sequence[int] | None = None,
    stalled: bool = False,
) -> Classification:
    """Decide transient or permanent for the rank the evidence points at (rules: module doc).

    `ranks`, the generation's members, only helps `suspect_rank` attribute anonymous peer-loss
    reports. Raises ValueError on no evidence, `InconclusiveEvidence` when only anonymous
    peer-loss reports exist, unless `stalled` (the caller has waited past the heartbeat
    timeout and nothing more came): then no process is lost and the job cannot go on by
    itself, so the failure is a transient one of the whole generation, attributed to the
    earliest reporter (everyone resets from its own snapshot).
    """
    if not evidence:
        raise ValueError("classify needs at least one piece of evidence")
    policy = policy or ClassifyPolicy()

    # 1-4: permanent by nature, strongest kind first.
    for permanent in (
        lambda e: isinstance(e, ProcessExited),
        lambda e: isinstance(e, HeartbeatStale),
        lambda e: isinstance(e, HealthCheckFailed),
        lambda e: isinstance(e, CudaError) and not e.recoverable,
    ):
        won = _earliest(e for e in evidence if permanent(e))
        if won is None:
            continue
        error = _error_before_exit(evidence, won)
        reason = describe(won) if error is None else f"{describe(won)} after {describe(error)}"
        if repeats := history.repeats(error or won):  # replaced already: on a spare again
            return _repeated(won.rank, reason, won, repeats, error)
        return Classification(won.rank, Decision.PERMANENT, reason, won, error)

    # 5: first-hand transient evidence; 6: hearsay, attributed to the suspect peer.
    won = _earliest(e for e in evidence if not _is_hearsay(e))
    if won is not None:
        rank = won.rank
        reason = describe(won)
    else:
        try:
            rank = suspect_rank(evidence, ranks)
        except InconclusiveEvidence:
            if not stalled:
                raise
            won = _earliest(evidence)
            rank = won.rank
            reason = (f"{describe(won)} (no rank is lost and none is named: a transient failure "
                      f"of the whole generation, attributed to the earliest reporter)")  # fmt: skip
        else:
            won = _earliest(e for e in evidence if getattr(e, "peer", None) == rank)
            won = won or _earliest(evidence)
            reason = f"{describe(won)} (attributed to rank {rank}, whose heartbeat is fresh)"

    repeats = history.repeats(won)
    if repeats >= 2:
        return _repeated(rank, reason, won, repeats)
    if repeats:
        return Classification(rank, Decision.PERMANENT, f"{_again(reason, won, repeats)}: "
                              "replaced, in case its device is at fault", won)  # fmt: skip
    times = history.count(rank, won.at, policy.window_s) + 1
    if times > policy.max_transient:
        return Classification(
            rank,
            Decision.PERMANENT,
            f"{reason}; escalated: rank {rank} failed transiently {times} times within "
            f"{policy.window_s:g} s (max {policy.max_transient})",
            won,
        )
    return Classification(rank, Decision.TRANSIENT, reason, won)


def in_recovery(e: Evidence) -> bool:
    """`e` is an error of a recovery (its place is phase recovery), not of training."""
    where = getattr(e, "where", None)
    return where is not None and where[1] == "recovery"


def _error_before_exit(evidence: Sequence[Evidence], won: Evidence) -> Evidence | None:
    """The own error (one with a place) the exited rank of `won` reported before it exited."""
    if not isinstance(won, ProcessExited):
        return None
    return _earliest(e for e in evidence if e.rank == won.rank and error_signature(e) is not None)


def _again(reason: str, error: Evidence, repeats: int) -> str:
    iteration, phase = error.where
    if phase == "recovery":
        return (f"{reason}; the same error as {repeats} time(s) before in the recovery from a "
                f"failure in iteration {iteration}, which started over")  # fmt: skip
    return (f"{reason}; the same error as {repeats} time(s) before at iteration {iteration} "
            f"(phase {phase}), which the recovery replayed as it ran")  # fmt: skip


def _repeated(
    rank: int, reason: str, won: Evidence, repeats: int, error: Evidence | None = None
) -> Classification:
    """The same own error at the same place, met again where a spare took the rank over."""
    cause = error or won
    what = "recovery" if in_recovery(cause) else "training"
    return Classification(rank, Decision.REPEATED, f"{_again(reason, cause, repeats)}: a "
                          f"deterministic error in the {what}, not a fault", won, error)  # fmt: skip
