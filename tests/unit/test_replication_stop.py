"""A recovery's stop does not wait for a replica receive that can never end: a peer that
aborted in the middle of sending a large replica leaves the receive pending (gloo wakes it
only at the group's timeout; seen in 4 of 12 jobs with a 60 MB replica, each stopping 10 s).
The replication thread is left behind holding only the slot it was writing; the committed
replicas are what the recovery reports. The transport here is an in-process stand-in whose
payload receive never completes until the test releases it."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from waiting import until

from deadpool_megatron.checkpoint import replicator
from deadpool_megatron.checkpoint.layout import Entry, StateLayout
from deadpool_megatron.checkpoint.pipeline import ProtectionPipeline
from deadpool_megatron.checkpoint.replicator import FLAG_DATA, HEADER
from deadpool_megatron.checkpoint.transport import Transport

NBYTES = 4096


class OneTensor:
    """A ProtectedState of one float32 tensor: the optimizer part is all of it."""

    def __init__(self):
        self.t = torch.arange(NBYTES // 4, dtype=torch.float32)
        entry = Entry("opt", 0, NBYTES, torch.float32, (NBYTES // 4,))
        self.layout = StateLayout((entry,), NBYTES, NBYTES)

    def tensors(self):
        return [self.t]

    def capture_metadata(self, iteration, extra):
        return b"{}"

    def restore_metadata(self, meta):
        pass

    def write_from(self, flat):
        self.t.copy_(flat.view(torch.float32))


class Done:
    def wait(self, timeout=None):
        return True


class Pending:
    """A receive whose sender stopped mid-message: it ends only when released."""

    def __init__(self, released: threading.Event, started: threading.Event):
        self._released = released
        started.set()

    def wait(self, timeout=None):
        self._released.wait()
        raise RuntimeError("Connection closed by peer (released by the test)")


class Announced(Transport):
    """Predecessor 0 announces a replica of iteration 5; `payload` answers the receives of its
    payload (or of its parts)."""

    def isend(self, tensor, dst):
        return Done()

    def irecv(self, tensor, src):
        if tensor.numel() == HEADER.size:
            tensor.copy_(torch.frombuffer(bytearray(HEADER.pack(FLAG_DATA, 5, 0, NBYTES, 0)),
                                          dtype=torch.uint8))  # fmt: skip
            return Done()
        return self.payload(tensor)

    def payload(self, tensor):
        raise NotImplementedError


class MidMessage(Announced):
    """The payload never arrives."""

    def __init__(self):
        self.released, self.payload_posted = threading.Event(), threading.Event()

    def payload(self, tensor):
        return Pending(self.released, self.payload_posted)


def test_a_receive_that_can_never_end_does_not_hold_the_stop(caplog):
    transport = MidMessage()
    pipeline = ProtectionPipeline(OneTensor(), transport, successors=[], predecessors=[0],
                                  replica_nbytes={0: NBYTES}, use_cuda=False)  # fmt: skip
    try:
        assert transport.payload_posted.wait(30)
        with caplog.at_level(logging.WARNING, logger="deadpool.pipeline"):
            pipeline.abort(timeout=600.0)  # the stop's own limit: not waited out
        assert not transport.released.is_set()  # returned while the receive still waits
        assert "left the replication thread behind" in caplog.text
        assert "_exchange_payloads" in caplog.text  # and says where it waits
        pair = pipeline.replicator.replicas[0]
        assert pair.iterations() == []  # the slot being written is no holding
        assert sum(s.busy for s in pair.slots) == 1
    finally:
        transport.released.set()
    assert until(lambda: pipeline.replicator.where() == "ended", 30)  # once its receive ends


class SlowParts(Announced):
    """The payload comes in parts; the second arrives only when the test lets it."""

    def __init__(self):
        self.parts: list[int] = []  # the sizes of the payload parts posted
        self.released = threading.Event()

    def payload(self, tensor):
        self.parts.append(tensor.numel())
        return Released(self.released) if len(self.parts) == 2 else Done()


class Released:
    def __init__(self, released: threading.Event):
        self._released = released

    def wait(self, timeout=None):
        self._released.wait()
        return True


@pytest.mark.parametrize("window", [1, 2])
def test_an_abort_ends_a_payload_at_its_next_part(monkeypatch, window):
    monkeypatch.setattr(replicator, "CHUNK_BYTES", 1000)  # 4096 bytes: parts of 1000, ..., 96
    monkeypatch.setattr(replicator, "WINDOW_PARTS", window)
    transport = SlowParts()
    pipeline = ProtectionPipeline(OneTensor(), transport, successors=[], predecessors=[0],
                                  replica_nbytes={0: NBYTES}, use_cuda=False)  # fmt: skip
    # The thread waits for the second part with the window's next parts posted.
    posted = [1000] * (1 + window)
    assert until(lambda: transport.parts == posted, 30)
    aborting = threading.Thread(target=pipeline.abort, kwargs={"timeout": 30.0})
    aborting.start()
    assert until(lambda: pipeline.replicator._aborted, 10)
    transport.released.set()  # the part in flight ends normally
    aborting.join(30)
    assert pipeline.stopped
    assert transport.parts == posted  # none posted after the abort
    pair = pipeline.replicator.replicas[0]
    assert pair.iterations() == [] and not any(s.busy for s in pair.slots)  # never committed
