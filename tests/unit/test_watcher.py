"""The order watcher, driven one look at a time with a fake clock, fake CPU readings and an
in-process store: it sees an order, cuts the communicators once, waits for a training thread
that computes, and makes a blocked one leave (naming where it is)."""

import pytest

from deadpool_megatron.control import keys
from deadpool_megatron.control.context import JobContext
from deadpool_megatron.control.messages import RecoveryOrder
from deadpool_megatron.failure.hang import HangPolicy
from deadpool_megatron.failure.progress import ProgressBoard
from deadpool_megatron.process.watcher import OrderWatcher

JOB = "watcher-test"
POLICY = HangPolicy(heartbeat_timeout_s=2.0, floor_s=10.0, factor=5.0, slow_phase_s=100.0)


class Rig:
    def __init__(self, kv):
        self.kv = kv
        self.t = 0.0
        self.cpu = 1.0
        self.aborts = 0
        self.left: list[str] = []
        self.recovering = False
        self.ctx = JobContext(kv, JOB)
        self.board = ProgressBoard()
        self.watcher = OrderWatcher(
            self.ctx, self._abort, self.board, POLICY, lambda: self.recovering,
            leave=self.left.append, cpu=lambda: self.cpu, clock=lambda: self.t,
        )  # fmt: skip

    def _abort(self):
        self.aborts += 1

    def look(self, dt=0.1, cpu=0.0):
        self.t += dt
        self.cpu += cpu
        self.watcher.poll_once()

    def order(self, generation):
        key = keys.recovery_order(JOB, generation)
        self.kv.set(key, RecoveryOrder("rank 3 exited", (3,)).encode())


@pytest.fixture
def rig(kv):
    return Rig(kv)


def test_an_order_is_recorded_once_and_cuts_the_communicators(rig):
    for it in range(1, 6):
        rig.board.mark(it, "forward")
        rig.look()
    assert not rig.ctx.stopping and rig.aborts == 0
    rig.order(1)
    rig.look()
    assert rig.ctx.ordered == 1 and rig.ctx.stopping and rig.aborts == 1
    rig.look()
    assert rig.aborts == 1  # the same order is not acted on twice
    rig.order(2)  # a newer one (a failure during the recovery) is
    rig.look()
    assert rig.ctx.ordered == 2 and rig.aborts == 2


def test_a_computing_training_thread_is_waited_for(rig):
    for it in range(1, 6):
        rig.board.mark(it, "forward")
        rig.look(0.5)
    rig.order(1)
    for _ in range(80):  # 8 s without a mark, but computing: not left
        rig.look(0.1, cpu=0.05)
    assert rig.left == []
    rig.recovering = True  # it reached a phase boundary and joined the recovery
    for _ in range(50):
        rig.look(0.1)
    assert rig.left == []


def test_a_blocked_training_thread_leaves_and_says_where_it_is(rig):
    for it in range(1, 6):
        rig.board.mark(it, "forward")
        rig.look(0.5)
    rig.board.mark(6, "backward")
    rig.look(0.5, cpu=0.1)
    rig.order(1)
    rig.look(0.1)
    for _ in range(19):  # blocked: no mark, no CPU time, for 1.9 s
        rig.look(0.1)
    assert rig.left == []
    rig.look(0.2)
    (why,) = rig.left
    assert why.startswith("blocked at iteration 6, phase backward: no progress mark and no CPU")


def test_a_thread_computing_past_its_phase_limit_leaves(rig):
    for it in range(1, 6):
        rig.board.mark(it, "forward")
        rig.look(0.5)
    rig.order(1)
    while not rig.left and rig.t < 30:
        rig.look(0.5, cpu=0.4)  # busy, never reaching a boundary (a GIL-held loop)
    assert rig.left and "computing without progress" in rig.left[0]
    assert 10.0 < rig.t - 2.5 <= 11.0  # the phase's limit: the 10 s floor
