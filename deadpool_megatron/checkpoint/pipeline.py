"""The protection pipeline one training loop calls once per iteration, after the optimizer
step: snapshot (device-to-host) into ping-pong host buffers, then ring replication of the
optimizer shard + metadata to the DP-ring successors, both off the critical path.

The only wait the training loop can see is the fence the caller installs before each
optimizer step (`install_fence`, megatron/fence.py for megatron-core): the next step must not
modify the state while it is still being copied.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil
import torch

from ..errors import ConfigError
from .buffers import SAMPLES, Reusable, SlotPair
from .layout import ProtectedState, view_of
from .replicator import RingReplicator
from .snapshot import Snapshotter
from .transport import Transport

log = logging.getLogger("deadpool.pipeline")

MiB = 1024 * 1024
# After the communicators' abort the replication thread's waits end within milliseconds (a
# payload goes in parts of 4 MiB, and the thread stops at the next part: within 11 ms in
# scripts/bench_replica_abort.py), except a transfer cut in the middle of a message, which
# gloo may wake only at the group's timeout (a part being received from, or sent to, a peer
# that died or cut its connections). Seen with a 60 MB replica in one message: the stop waited its whole
# 10 s limit in 4 of 12 jobs with a peer killed while the ring was sending. The thread is left
# behind then: it holds only the slot it was writing or sending (never committed, or already
# among the holdings), touches no other pair (`RingReplicator._unless_aborted`), and its
# operation ends at the group's timeout; the recovery allocates anew what it holds.
REPLICATION_STOP_S = 0.1


@dataclass
class PipelineStats:
    snapshots: int = 0
    lag_max: int = 0
    lag_last: int = 0
    # (iteration, lag) for the latest SAMPLES snapshots
    lag_history: deque = field(default_factory=lambda: deque(maxlen=SAMPLES))
    # Per protected iteration: the time the training thread spent on protection (waiting at
    # the fence for the previous copy, capturing metadata, starting the snapshot).
    stall_s: deque = field(default_factory=lambda: deque(maxlen=SAMPLES))


def check_host_memory(needed_per_rank: int, local_ranks: int) -> None:
    available = psutil.virtual_memory().available
    if needed_per_rank * local_ranks > available:
        raise ConfigError(
            f"DeadPool needs {needed_per_rank / MiB:.1f} MiB of host memory per rank x "
            f"{local_ranks} ranks on this node = {needed_per_rank * local_ranks / MiB:.1f} MiB, "
            f"but only {available / MiB:.1f} MiB is available; lower --deadpool-replicas or "
            f"use fewer ranks per node"
        )


class ProtectionPipeline:
    def __init__(
        self,
        state: ProtectedState,
        transport: Transport,
        successors: list[int],
        predecessors: list[int],
        replica_nbytes: dict[int, int],
        use_cuda: bool,
        snapshot_interval: int = 1,
        local_ranks: int = 1,
        metadata: dict | None = None,
        install_fence: Callable[[Callable[[], None]], Callable[[], None]] | None = None,
        before_send: Callable[[int], bool | None] | None = None,
        on_error: Callable[[BaseException], None] | None = None,
        reuse: Reusable | None = None,
    ):
        """`install_fence(fence)` makes the training loop call `fence()` before every optimizer
        step and returns the function that removes it; `before_send(iteration)` runs in the
        replication thread before each send (fault injection), `on_error(err)` there when
        replication fails (the training thread may never notice); `reuse`: a recovery's slot
        pairs, written into instead of new ones where they fit."""
        self.state = state
        layout = state.layout
        self.interval = snapshot_interval
        self.metadata = dict(metadata or {})
        reuse = reuse or Reusable()
        own = reuse.snapshot(layout.total_nbytes, use_cuda, layout.optimizer_nbytes)
        kept = {p: reuse.replica(p, replica_nbytes[p]) for p in predecessors}
        kept = {p: pair for p, pair in kept.items() if pair is not None}
        replicas_total = sum(replica_nbytes[p] for p in predecessors)
        needed = 2 * layout.total_nbytes + 2 * replicas_total
        reused = 2 * (own.nbytes if own else 0) + 2 * sum(p.nbytes for p in kept.values())
        reserved = min(reuse.arena.free, needed - reused) if reuse.arena is not None else 0
        check_host_memory(needed - reused - reserved, local_ranks)
        log.info(
            "reserving %.1f MiB of host memory: snapshot 2 x %.1f MiB (optimizer shard %.1f + "
            "parameters %.1f) + 2 x %.1f MiB of replicas from %d predecessor(s)%s%s",
            needed / MiB, layout.total_nbytes / MiB, layout.optimizer_nbytes / MiB,
            layout.params_nbytes / MiB, replicas_total / MiB, len(predecessors),
            f"; {reused / MiB:.1f} MiB of it kept from before the failure" if reused else "",
            f"; {reserved / MiB:.1f} MiB of it reserved while the spare was idle"
            if reserved else "",
        )  # fmt: skip
        if own is None:
            own = reuse.new_pair(layout.total_nbytes, use_cuda, layout.optimizer_nbytes)
        for p in predecessors:
            if p not in kept:
                kept[p] = reuse.new_pair(replica_nbytes[p])
        self._views: dict[int, list[torch.Tensor]] = {}
        self.snapshotter = Snapshotter(
            state.tensors, self._views_of, layout.total_nbytes, use_cuda, self._on_commit,
            replicated_nbytes=layout.optimizer_nbytes, slots=own,
        )  # fmt: skip
        self.replicator = RingReplicator(
            transport,
            successors,
            predecessors,
            self.snapshotter.slots,
            layout.optimizer_nbytes,
            replica_nbytes,
            before_send=before_send,
            on_error=on_error,
            reuse=kept,
        )
        self.stats = PipelineStats()
        self._previous: int | None = None  # iteration of the last snapshot started
        self._enabled = True
        self._fenced_s = 0.0  # fence waits since the last protected iteration
        self._remove_fence = install_fence(self._fence) if install_fence else _nothing

    @property
    def enabled(self) -> bool:
        return self._enabled

    @enabled.setter
    def enabled(self, on: bool) -> None:
        """Switch protection on or off between iterations (the overhead benchmark does)."""
        if on and not self._enabled:
            self._previous = None  # the lag restarts with the next snapshot
        self._enabled = on

    def _views_of(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        key = buffer.data_ptr()
        if key not in self._views:
            self._views[key] = [view_of(buffer, e) for e in self.state.layout.entries]
        return self._views[key]

    def _fence(self) -> None:
        t = time.perf_counter()
        self.snapshotter.fence()
        self._fenced_s += time.perf_counter() - t

    def _on_commit(self, slot) -> None:
        self.replicator.notify()

    def after_step(self, iteration: int) -> None:
        """Called once per iteration after the optimizer step: start protecting `iteration`."""
        if not self.enabled or iteration % self.interval:
            return
        started = time.perf_counter()
        if self._previous is not None:
            # The previous snapshot has been on its way for one iteration of compute: how many
            # snapshots does the newest verified replica of each predecessor trail it by?
            replicated = [
                self.replicator.committed_iteration(p) for p in self.replicator.predecessors
            ]
            if replicated:
                behind = max(0, self._previous - min(replicated))
                self.stats.lag_last = -(-behind // self.interval)
                self.stats.lag_max = max(self.stats.lag_max, self.stats.lag_last)
                self.stats.lag_history.append((iteration, self.stats.lag_last))
                if self.stats.lag_last > 1:
                    log.warning(
                        "replica lag %d at iteration %d: the ring has not replicated snapshot "
                        "%d yet (newest replica: %d)",
                        self.stats.lag_last, iteration, self._previous, min(replicated),
                    )  # fmt: skip
        self.protect_start(iteration)
        self.stats.stall_s.append(self._fenced_s + time.perf_counter() - started)
        self._fenced_s = 0.0

    def protect_start(self, iteration: int) -> None:
        """Start the snapshot of `iteration`, regardless of the interval: `after_step`'s for
        an iteration it protects, and the loop's for the state training starts from (before
        its first step), so that a failure in the first iteration rolls back to it like any
        later one. The copy overlaps the next iteration's compute, and the fence holds that
        iteration's optimizer step until the copy is done."""
        self._previous = iteration
        self.snapshotter.start(iteration, self.state.capture_metadata(iteration, self.metadata))
        self.stats.snapshots += 1

    def committed_iteration(self) -> int:
        slot = self.snapshotter.slots.committed()
        return slot.iteration if slot is not None else -1

    def replicated(self, iteration: int) -> bool:
        """This rank's snapshot of `iteration` is committed and it holds every predecessor's
        replica of it (or a newer one)."""
        return self.committed_iteration() >= iteration and all(
            self.replicator.committed_iteration(p) >= iteration
            for p in self.replicator.predecessors
        )

    def wait_for_replicas(
        self, iteration: int, sources: list[int] | None = None, timeout: float = 60.0
    ) -> None:
        """Block until this rank holds the replica of `iteration` from each of `sources`
        (default: every predecessor)."""
        self.snapshotter.wait_committed(timeout)
        deadline = time.monotonic() + timeout
        for src in self.replicator.predecessors if sources is None else sources:
            while self.replicator.committed_iteration(src) < iteration:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no replica of iteration {iteration} from rank {src}")
                time.sleep(0.002)

    def close(self) -> None:
        """Commit the last snapshot, replicate it, and stop both threads (agreed stop)."""
        self.snapshotter.wait_committed()
        self.replicator.close()
        self.snapshotter.close()
        self._remove_fence()

    def abort(self, timeout: float = 10.0) -> None:
        """Stop after a failure, keeping every committed snapshot and replica for the recovery.
        The snapshot in flight is local, so it is finished (a transient rank rolls back to
        it); the replication thread is stopped without its peers, and left behind if it has
        not ended within REPLICATION_STOP_S (see there)."""
        try:
            self.snapshotter.wait_committed(timeout)
        finally:
            wait_s = min(timeout, REPLICATION_STOP_S)
            if not self.replicator.abort(wait_s):
                log.warning("left the replication thread behind (not stopped within %.1f s); it "
                            "waits in %s", wait_s, self.replicator.where())  # fmt: skip
            self.snapshotter.close()
            self._remove_fence()

    @property
    def stopped(self) -> bool:
        """Neither of its threads runs any more (after `abort` or `close`): nothing writes
        into its slot pairs but a new owner."""
        return self.snapshotter.stopped and self.replicator.stopped

    def slot_pairs(self) -> list[SlotPair]:
        return [self.snapshotter.slots, *self.replicator.replicas.values()]

    def footprint(self) -> list[int]:
        """The size of each host buffer it holds (two per pair): what a spare reserves."""
        return [s.buffer.numel() for p in self.slot_pairs() for s in p.slots]

    @property
    def errors(self) -> list[str]:
        return self.snapshotter.errors + self.replicator.errors


def _nothing() -> None:
    pass
