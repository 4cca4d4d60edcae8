"""Ring replication: send this rank's optimizer shard + metadata to its K DP-ring successors,
and keep verified replicas of its K predecessors' shards.

One background thread per rank runs rounds. In a round it sends the newest committed snapshot
it has not sent yet to every successor, and receives one message from every predecessor.
Messages on one edge arrive in order; a message is a fixed-size header, the metadata and the
optimizer part of the snapshot, the last in parts of CHUNK_BYTES exchanged in step with the
neighbours' (`_exchange_payloads`). A replica is committed only when complete and its xxh3
checksum matches; otherwise the previous replica stays and the failure is reported.
Training never waits on this thread: while a slot is being sent, newer snapshots go to the
other slot, superseding each other (the lag is tracked). Termination is agreed, not local:
close() makes the last message on every edge carry a stop flag, and the thread ends once it
has sent its own stop and received every predecessor's.
"""

from __future__ import annotations

import logging
import struct
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import DeadpoolError
from .buffers import MAX_META_BYTES, SAMPLES, CorruptCopy, Slot, SlotPair, checksum
from .transport import Transport

log = logging.getLogger("deadpool.replicate")


class ReplicationAborted(DeadpoolError):
    """The thread found the replication aborted before touching a slot pair."""


HEADER = struct.Struct("<qqqqQ")  # flags, iteration, meta length, payload length, checksum
FLAG_DATA = 1
FLAG_STOP = 2
# A payload goes in parts of this size (`RingReplicator._exchange_payloads`): gloo can leave a
# transfer cut mid-message waiting until the group's timeout, and a recovery's stop then
# leaves this thread behind. scripts/bench_replica_abort.py (64 MiB without pause, then a
# kill or both aborting): left behind after 11 of 20 kills in one message, 5 of 20 in parts;
# 14 of 40 and 9 of 40 when both abort.
CHUNK_BYTES = 4 << 20
# Parts in flight each way. One at a time stalls the link at every part while the thread
# waits for a core busy with training; two in flight (bench_overhead, back to back, 2 runs
# each): replication 159/148 -> 103/112 ms of wall time per iteration, off the training
# thread's path, but the thread left behind after 8 of 20 kills against 3 of 20
# (bench_replica_abort: a second part in flight is a second one to be cut in). Above 1, an
# abort between parts leaves the next ones posted into the slot it frees: safe only because a
# recovery cuts the connections first (`RingReplicator.abort`), as the benchmark does.
WINDOW_PARTS = 1


@dataclass
class ReplicationStats:
    sent: int = 0
    received: int = 0
    rejected: int = 0
    bytes_sent: int = 0
    # The latest SAMPLES timings only: a job runs for months.
    send_s: deque = field(default_factory=lambda: deque(maxlen=SAMPLES))  # posting to all sent
    cpu_s: deque = field(default_factory=lambda: deque(maxlen=SAMPLES))  # this thread's CPU


class RingReplicator:
    def __init__(
        self,
        transport: Transport,
        successors: list[int],
        predecessors: list[int],
        snapshots: SlotPair,
        payload_nbytes: int,
        replica_nbytes: dict[int, int],
        before_send: Callable[[int], bool | None] | None = None,
        on_error: Callable[[BaseException], None] | None = None,
        reuse: dict[int, SlotPair] | None = None,
    ):
        """`reuse`: replica pairs to write into instead of allocating them, by owner."""
        self.transport = transport
        self.successors = successors
        self.predecessors = predecessors
        self.snapshots = snapshots
        self.payload_nbytes = payload_nbytes
        # DP ranks own shards of different sizes (parameter boundaries), so each replica is
        # sized by its owner's layout.
        reuse = reuse or {}
        for src, pair in reuse.items():
            if src not in predecessors or not pair.fits(replica_nbytes[src], False):
                raise ValueError(f"the replica pair offered for rank {src} does not fit its "
                                 f"{replica_nbytes.get(src)}-byte shard")  # fmt: skip
        self.replicas = {
            src: reuse.get(src) or SlotPair(replica_nbytes[src]) for src in predecessors
        }
        self.stats = ReplicationStats()
        self.errors: list[str] = []
        self._cond = threading.Condition()
        self._stop = False
        self._aborted = False
        self._corrupt_next: set[int] = set()
        # Fault injection: the iteration about to be sent; True sends it with bytes flipped.
        self.before_send = before_send
        self.on_error = on_error  # called (from this thread) with the error that stopped it
        self._thread = threading.Thread(target=self._run, name="deadpool-replicate", daemon=True)
        self._thread.start()

    # -- called from the training thread --------------------------------------------------
    def notify(self) -> None:
        """A new snapshot was committed."""
        with self._cond:
            self._cond.notify_all()

    def replica(self, src: int) -> Slot | None:
        """The newest committed replica of predecessor `src`'s shard (None before the first)."""
        return self.replicas[src].committed()

    def committed_iteration(self, src: int) -> int:
        slot = self.replica(src)
        return slot.iteration if slot is not None else -1

    def inject_corruption(self, src: int) -> None:
        """Fault injection: flip bytes of the next replica received from `src`."""
        with self._cond:
            self._corrupt_next.add(src)

    def close(self, timeout: float = 120.0) -> None:
        """Agreed stop: the newest snapshot goes out with the stop flag; joins the thread."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError("the replication thread did not finish its last round")

    def abort(self, timeout: float = 10.0) -> bool:
        """Stop without agreement (a failure: a peer may be gone). A pending send or receive
        raises: the transport's abort ends it (tcp), or the caller has broken the connections
        (gloo, which has no abort of its own); True if the thread ended.
        Committed replicas stay: a recovery serves them."""
        with self._cond:
            self._stop = self._aborted = True
            self._cond.notify_all()
        self.transport.abort()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def stopped(self) -> bool:
        return not self._thread.is_alive()

    def where(self) -> str:
        """Where the replication thread is now (its innermost frames), for a log line."""
        frame = sys._current_frames().get(self._thread.ident)
        if frame is None:
            return "ended"
        return " <- ".join(f"{f.f_code.co_name} ({Path(f.f_code.co_filename).name}:{f.f_lineno})"
                           for f, _ in list(traceback.walk_stack(frame))[:6])  # fmt: skip

    # -- the thread -------------------------------------------------------------------------
    def _unless_aborted(self) -> None:
        """Before the thread touches a slot pair: after an abort it touches none but the one
        it holds a slot of already (a wait gloo woke late), so a recovery can hand the
        others to its new generation while the thread is still left behind."""
        with self._cond:
            if self._aborted:
                raise ReplicationAborted("the replication was aborted")

    def _next_to_send(self, last_sent: int) -> tuple[Slot | None, bool]:
        with self._cond:
            while True:
                self._unless_aborted()  # the condition's lock is reentrant
                slot = self.snapshots.committed()
                newer = slot is not None and slot.iteration > last_sent
                if newer or self._stop:
                    if newer:
                        self.snapshots.hold(slot)
                    return (slot if newer else None), self._stop
                self._cond.wait(timeout=0.5)

    def _run(self) -> None:
        last_sent = -1
        sent_stop = False
        open_preds = list(self.predecessors)
        try:
            while (self.successors and not sent_stop) or open_preds:
                held, cpu, outgoing, sends = None, time.thread_time(), None, []
                try:
                    if self.successors and not sent_stop:
                        held, sent_stop = self._next_to_send(last_sent)
                        flip = False
                        if held is not None and self.before_send is not None:
                            flip = bool(self.before_send(held.iteration))
                        posted = time.perf_counter()
                        outgoing, sends = self._post_headers(held, sent_stop, flip)
                        if held is not None:
                            last_sent = held.iteration
                    incoming = self._receive(outgoing, sends, open_preds)
                    if held is not None:
                        self.stats.send_s.append(time.perf_counter() - posted)
                    for message in incoming:
                        self._commit(message)
                        if message.stop:
                            open_preds.remove(message.src)
                finally:
                    # Released on an error too: a slot left busy would be the only one the
                    # snapshotter could write from then on (the pair may serve a recovery's
                    # next generation), overwriting the newest copy every iteration.
                    if held is not None:
                        self.snapshots.release(held)
                self.stats.cpu_s.append(time.thread_time() - cpu)
        except Exception as err:  # the job's failure handling takes it from here
            if self._aborted:
                return  # the error is the abort's doing
            self.errors.append(str(err))
            log.error("replication stopped: %s", err)
            if self.on_error is not None:
                self.on_error(err)
        finally:
            self.transport.close()

    def _post_headers(
        self, slot: Slot | None, stop: bool, flip: bool = False
    ) -> tuple[torch.Tensor | None, list]:
        """Post the header and metadata to every successor; returns the payload to send (None
        without data) and the posted sends."""
        flags = (FLAG_DATA if slot is not None else 0) | (FLAG_STOP if stop else 0)
        payload = None
        if slot is None:
            tensors = [_bytes_tensor(HEADER.pack(flags, -1, 0, 0, 0))]
        else:
            payload = slot.buffer[: self.payload_nbytes]
            digest = (
                slot.prefix_checksum  # taken with the snapshot's own, in the same pass
                if self.snapshots.prefix_nbytes == self.payload_nbytes
                and slot.prefix_checksum is not None
                else checksum(payload, slot.meta, slot.iteration)
            )
            if flip:  # corrupt@: in flight only, the committed snapshot stays intact
                payload = payload.clone()
                payload[: min(64, self.payload_nbytes)] ^= 0xFF
                log.warning("sending the replica of iteration %d corrupted", slot.iteration)
            header = HEADER.pack(flags, slot.iteration, len(slot.meta), self.payload_nbytes, digest)
            tensors = [_bytes_tensor(header), _bytes_tensor(slot.meta)]
        works = []
        for dst in self.successors:
            works.extend(self.transport.isend(t, dst) for t in tensors if t.numel())
        if slot is not None:
            self.stats.sent += 1
            self.stats.bytes_sent += self.payload_nbytes * len(self.successors)
        return payload, works

    def _receive_header(self, src: int) -> _Incoming:
        """Receive one message's header and metadata from `src`; a message with data gets a
        slot of `src`'s replica pair to receive its payload into."""
        header = torch.empty(HEADER.size, dtype=torch.uint8)
        self.transport.irecv(header, src).wait()
        flags, iteration, meta_len, payload_len, digest = HEADER.unpack(header.numpy().tobytes())
        message = _Incoming(src, bool(flags & FLAG_STOP), iteration, b"", digest)
        if flags & FLAG_DATA:
            if not 0 <= meta_len <= MAX_META_BYTES:
                raise RuntimeError(f"rank {src} announced {meta_len} bytes of metadata: a "
                                   f"corrupt header")  # fmt: skip
            meta = torch.empty(meta_len, dtype=torch.uint8)
            if meta_len:
                self.transport.irecv(meta, src).wait()
            message.meta = meta.numpy().tobytes()
            pair = self.replicas[src]
            self._unless_aborted()
            if payload_len != pair.nbytes:
                raise RuntimeError(
                    f"rank {src} sent a {payload_len}-byte shard; its replica holds {pair.nbytes}"
                )
            message.slot = pair.acquire_for_write()
        return message

    def _receive(
        self, outgoing: torch.Tensor | None, sends: list, sources: list[int]
    ) -> list[_Incoming]:
        """This round's message from every predecessor in `sources`, received while the
        headers in `sends` and then the payload `outgoing` go out. A slot that does not end
        up holding a whole payload is freed for the next one, never committed."""
        incoming: list[_Incoming] = []
        try:
            for src in sources:
                incoming.append(self._receive_header(src))
            for work in sends:
                work.wait()
            self._exchange_payloads(outgoing, [m for m in incoming if m.slot is not None])
        except BaseException:
            for message in incoming:
                if message.slot is not None:
                    self.replicas[message.src].abandon(message.slot)
            raise
        return incoming

    def _exchange_payloads(self, outgoing: torch.Tensor | None, incoming: list[_Incoming]) -> None:
        """Send the payload to every successor and receive every predecessor's, in parts of
        at most CHUNK_BYTES, at most WINDOW_PARTS of them in flight each way: an abort ends
        the exchange at the next part (a message gloo was cut in the middle of can leave its
        send or receive waiting until the group's timeout; a part at a time is less to be cut
        in, and less to wait for). Every rank posts its n-th parts only after its
        (n-WINDOW_PARTS)-th completed, which only needs its neighbours' to be posted: no
        cycle. Receives are waited for first: one from a predecessor that died raises at once
        (its connection is reset), where a send to it can wait out the group's timeout."""
        out = _parts(outgoing)
        ins = [(m.src, _parts(m.slot.buffer)) for m in incoming]
        in_flight: deque[tuple[list, list]] = deque()
        for i in range(max([len(out), *(len(parts) for _, parts in ins)])):
            if i:
                self._unless_aborted()
            receives = [self.transport.irecv(parts[i], src) for src, parts in ins
                        if i < len(parts)]  # fmt: skip
            sends = [self.transport.isend(out[i], dst) for dst in self.successors
                     if i < len(out)]  # fmt: skip
            in_flight.append((receives, sends))
            if len(in_flight) == WINDOW_PARTS:
                _wait_part(*in_flight.popleft())
        while in_flight:
            _wait_part(*in_flight.popleft())

    def _commit(self, message: _Incoming) -> None:
        if message.slot is None:
            return
        src, pair = message.src, self.replicas[message.src]
        with self._cond:
            corrupt = src in self._corrupt_next
            self._corrupt_next.discard(src)
        if corrupt:
            message.slot.buffer[: min(64, pair.nbytes)] ^= 0xFF
        try:
            pair.commit(message.slot, message.iteration, message.meta, message.digest)
            self.stats.received += 1
        except CorruptCopy as err:
            self.stats.rejected += 1
            self.errors.append(f"replica from rank {src}: {err}")
            log.error("rejected replica from rank %d: %s", src, err)


@dataclass
class _Incoming:
    """One message being received from predecessor `src` (`slot`: where its payload goes)."""

    src: int
    stop: bool
    iteration: int
    meta: bytes
    digest: int
    slot: Slot | None = None


def _wait_part(receives: list, sends: list) -> None:
    """Receives first (see `_exchange_payloads`); a stuck one's line tells which it is."""
    for work in receives:
        work.wait()
    for work in sends:
        work.wait()


def _parts(payload: torch.Tensor | None) -> list[torch.Tensor]:
    return [] if payload is None or not payload.numel() else list(payload.split(CHUNK_BYTES))


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.empty(0, dtype=torch.uint8)
    )
