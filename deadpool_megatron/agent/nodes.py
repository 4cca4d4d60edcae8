"""Nodes watching nodes: each agent renews a lease on its node in the store (what it hosts, a
sequence number moving every heartbeat interval), and reads every other agent's.

A node whose lease stops moving for the node timeout is lost, with everything its last lease
listed: that is how a whole node (agent and processes gone at once) is seen from the others,
where no child exit or progress board can be. The lease comes from a thread of the agent, a
light process that never holds the GIL for long, so a late lease is not the false accusation a
training process's late heartbeat would be; and the node itself, if it was only cut off, stops
its processes when it sees itself declared lost, so a node counted lost never comes back as a
zombie holding ranks.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..control import keys
from ..control.context import JobContext
from ..control.messages import AgentBeat, Flag, Heartbeat, RankLost
from ..control.signed import job_secret, signed
from ..control.tcp_store import TcpKVStore
from ..events import NODE_LOST, EventLog
from ..failure.heartbeat import HeartbeatSender

log = logging.getLogger("deadpool.launch")


@dataclass(frozen=True)
class Hosted:
    """What an agent hosts now: the generation it follows, its ranks and its idle spares."""

    generation: int
    ranks: tuple[int, ...]
    spares: tuple[str, ...]


def lease_context(ctx: JobContext, hosted_tcp_store: tuple[str, int] | None) -> JobContext:
    """The lease thread's own line to the store: a connection of its own to the TCPStore
    this agent hosts at `hosted_tcp_store` (the agent's main thread keeps the hosting one to
    itself); etcd's client opens one per request anyway."""
    if hosted_tcp_store is None:
        return ctx
    kv = TcpKVStore(*hosted_tcp_store, timeout_s=30.0)
    return JobContext(signed(kv, job_secret()), ctx.job)


def count_node_lost(
    ctx: JobContext,
    node: int,
    beat: AgentBeat,
    replaced_in: dict[int, int],
    timeout_s: float,
    events: EventLog,
) -> list[int]:
    """Count the node of `beat`, whose lease lapsed, lost, if this agent (of `node`) is the
    first to (its flag's first writer): its spares leave the pool, and the ranks it still
    held are returned; ranks a recovery has moved since its lease was written (`replaced_in`:
    rank -> generation) are not its anymore. Counted by another agent: none, that agent
    hot-swaps them."""
    what = beat.holder
    if not ctx.create(keys.node_lost(ctx.job, beat.node), Flag(f"node {node}")):
        log.info("%s is lost (counted by another node's agent)", what)
        return []
    ranks = [r for r in beat.ranks if replaced_in.get(r, -1) <= beat.generation]
    log.error("%s is lost: no lease renewal for %.1f s; it held rank(s) %s and spare(s) %s",
              what, timeout_s, ranks, list(beat.spares))  # fmt: skip
    events.emit(NODE_LOST, node=beat.node, ranks=ranks, spares=list(beat.spares),
                last_lease=beat.at)  # fmt: skip
    for sid in beat.spares:
        ctx.kv.delete(keys.spare(ctx.job, sid))
    return ranks


class Lease:
    """Renews this node's lease every `interval_s` from a thread; `hosted()` is read at each
    renewal (it must be cheap and thread-safe: the agent hands a snapshot)."""

    def __init__(self, ctx: JobContext, node: int, hosted: Callable[[], Hosted],
                 interval_s: float):  # fmt: skip
        self.ctx = ctx
        self.node = node
        self._hosted = hosted
        self._seq = 0
        self.renewed = 0  # renewals the store took: a NodeWatch's yardstick for its own node
        self._lock = threading.Lock()
        self._sender = HeartbeatSender(self.renew, interval_s, name="deadpool-lease")

    def renew(self, now: float = 0.0) -> None:
        h = self._hosted()
        with self._lock:
            self._seq += 1
            beat = AgentBeat(self.node, socket.gethostname(), os.getpid(), self._seq,
                             time.time(), h.generation, h.ranks, h.spares)  # fmt: skip
        self.ctx.put(keys.agent(self.ctx.job, self.node), beat)
        with self._lock:
            self.renewed += 1

    def start(self) -> None:
        self.renew()
        self._sender.start()

    def stop(self) -> None:
        """Stop renewing and wait for a renewal in flight: the store may close next (node 0's
        agent hosts it), and a renewal caught by that would wait out the store's timeout."""
        self._sender.stop()
        if self._sender.is_alive():
            self._sender.join(timeout=10)


@dataclass
class _Seen:
    beat: AgentBeat
    moved_at: float  # when this agent saw its sequence number move last
    own_at: int  # this agent's own renewals by then
    beats: tuple = ()  # the last heartbeats seen of the processes its lease lists
    beats_moved_at: float = 0.0


class NodeWatch:
    """Every other node's lease, as this agent sees it. `poll()` returns nodes newly lost;
    a node is watched from its first lease on (one that never renewed is the start-up's
    business, not a failure).

    A node is lost when its lease has not moved for `timeout_s` while this agent's own lease
    was renewed at least `own_needed` times through the same store in that time (a store that
    stalls, an etcd cluster electing a new leader, stalls every lease alike and accuses
    nobody), and none of the processes its lease lists (its ranks, its spares) has beaten in
    that time either: a late lease alone, like a late heartbeat, proves nothing while the
    node's processes are still beating; a lost node's processes are gone with it.

    A store election (a new `term`) restarts every node's timeout from when this agent first
    sees the new term: requests a node sent to a follower can hang through the election and
    out past it while this agent's, through a member that answered, went on (CI: a node never
    killed was counted lost at an etcd leader's kill). A node lost at the election itself is
    found one timeout after it, not sooner.

    Before the job is up (`poll(up=False)`) a lease may stand still for `startup_timeout_s`
    instead: no process beats yet, every node's processes are importing and building their
    models at once (a loaded machine can starve an agent's thread for seconds; seen on CI),
    and a node lost then ends the whole job, so a false accusation costs the job, not a
    hot-swap. A node really lost at start-up only ends the job later."""

    def __init__(
        self,
        ctx: JobContext,
        me: int,
        nodes: list[int],
        timeout_s: float,
        own: Callable[[], int],
        own_needed: int,
        startup_timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        term: Callable[[], int] | None = None,
    ):
        self.ctx = ctx
        self.me = me
        self.nodes = [n for n in nodes if n != me]
        self.timeout_s = timeout_s
        self.startup_timeout_s = timeout_s if startup_timeout_s is None else startup_timeout_s
        self._own = own  # this agent's own lease renewals that reached the store
        self._own_needed = own_needed
        self._clock = clock
        self._term = term if term is not None else (lambda: ctx.kv.term)
        self._last_term: int | None = None
        self._term_seen_at = -math.inf  # when this agent first saw the store's newest term
        self._seen: dict[int, _Seen] = {}
        self._lost: dict[int, AgentBeat] = {}

    def poll(self, up: bool = True) -> list[AgentBeat]:
        """Read every lease; the last lease of each node lost since the previous poll
        (`up`: whether the job is up, which picks the timeout)."""
        beats = {
            node: self.ctx.get(keys.agent(self.ctx.job, node), AgentBeat)
            for node in self.nodes
            if node not in self._lost
        }
        now = self._clock()
        own = self._own()
        term = self._term()
        if term != self._last_term:
            if self._last_term is not None:
                self._term_seen_at = now
                log.info("the store elected a new leader (term %d): node timeouts restart",
                         term)  # fmt: skip
            self._last_term = term
        timeout_s = self.timeout_s if up else self.startup_timeout_s
        newly = []
        for node, beat in beats.items():
            seen = self._seen.get(node)
            if beat is not None and (seen is None or beat.seq != seen.beat.seq):
                self._seen[node] = _Seen(beat, now, own, self._beats(beat), now)
                continue
            if seen is None:
                continue
            # followed from the lease's first miss
            beating = self._still_beating(seen, now, timeout_s)
            if (
                now - max(seen.moved_at, self._term_seen_at) > timeout_s
                and own - seen.own_at >= self._own_needed
                and not beating
            ):
                self._lost[node] = seen.beat
                newly.append(seen.beat)
        return newly

    def _beats(self, beat: AgentBeat) -> tuple:
        """The heartbeats of the processes a lease lists, as they stand in the store."""
        job = self.ctx.job
        found = [self.ctx.get(keys.heartbeat(job, beat.generation, r), Heartbeat)
                 for r in beat.ranks]  # fmt: skip
        found += [self.ctx.get(keys.spare_heartbeat(job, s), Heartbeat) for s in beat.spares]
        return tuple(found)

    def _still_beating(self, seen: _Seen, now: float, timeout_s: float) -> bool:
        beats = self._beats(seen.beat)
        if beats != seen.beats:
            seen.beats, seen.beats_moved_at = beats, now
        return now - seen.beats_moved_at <= timeout_s

    def watch(self, node: int) -> bool:
        """Watch `node` too (one that joined the running job) from its first lease on; False
        if it was watched already."""
        if node == self.me or node in self.nodes:
            return False
        self.nodes.append(node)
        return True

    def members(self, launched: int) -> int:
        """How many nodes are in the job now: the `launched` ones, every other node whose lease
        was seen (nodes that joined), this one, less those lost. A node that joined but never
        renewed its lease is not counted: the job's end does not wait for it."""
        nodes = set(range(launched)) | set(self._seen) | {self.me}
        return len(nodes - set(self._lost))

    def last(self, node: int) -> AgentBeat | None:
        """The newest lease seen of `node` (its last one, if it is lost)."""
        seen = self._seen.get(node)
        return None if seen is None else seen.beat

    def is_lost(self, node: int) -> bool:
        return node in self._lost

    def seen(self, node: int) -> bool:
        """Whether a lease of `node` has been read yet."""
        return node in self._seen

    def declare_lost(self, beat: AgentBeat) -> None:
        """Another agent's recovery counted this node lost: stop watching it."""
        self._lost.setdefault(beat.node, beat)

    def host_of(self, rank: int) -> int | None:
        """The node whose newest lease lists `rank` (None if none does)."""
        for node, seen in self._seen.items():
            if rank in seen.beat.ranks:
                return node
        return None

    def busy(self) -> set[int]:
        """Other live nodes that run ranks."""
        return {n for n, s in self._seen.items() if s.beat.ranks and n not in self._lost}

    def lost_nodes(self) -> set[int]:
        return set(self._lost)

    def node_of_spare(self, spare: str) -> int | None:
        for node, seen in self._seen.items():
            if spare in seen.beat.spares:
                return node
        return None

    def hosted_spares(self) -> list[str]:
        """The spares the newest leases of the live nodes list."""
        return [s for n, seen in sorted(self._seen.items()) if n not in self._lost
                for s in seen.beat.spares]  # fmt: skip

    def finished_rank(self, rank: int, generation: int) -> bool:
        """For a recovery's coordinator: the agent hosting `rank` elsewhere said its process
        exited with status 0 (it had finished training)."""
        said = self.ctx.get(keys.rank_lost(self.ctx.job, generation, rank), RankLost)
        return said is not None and said.finished

    def lost_rank(self, rank: int, generation: int) -> str | None:
        """For a recovery's coordinator: why a rank hosted elsewhere will never report (its
        node is lost, or its agent said so), else None."""
        lost = self.ctx.get(keys.rank_lost(self.ctx.job, generation, rank), RankLost)
        if lost is not None and not lost.finished:
            return lost.reason
        for beat in self._lost.values():
            if rank in beat.ranks:
                return f"{beat.holder} is lost"
        return None
