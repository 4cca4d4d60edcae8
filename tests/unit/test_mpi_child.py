"""An MPI-spawned child's own machinery without MPI: it starts as `python script` would with its
output on the agent's socket and its own place in MPI, dies with its agent, and finalises MPI
within a bound (a fake MPI and a fake timer: the deadline fires by hand, not by waiting)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from deadpool_megatron.agent.mpi_child import die_with_agent
from deadpool_megatron.runtime import finalize_mpi


class FakeTimer:
    """threading.Timer's surface; the test fires it (the deadline passing) or not."""

    made: list[FakeTimer] = []

    def __init__(self, interval, function, args=()):
        self.interval, self.function, self.args = interval, function, args
        self.daemon = False
        self.started = self.cancelled = False
        FakeTimer.made.append(self)

    def start(self):
        self.started = True

    def cancel(self):
        self.cancelled = True

    def fire(self):
        if not self.cancelled:
            self.function(*self.args)


class FakeMPI:
    def __init__(self, initialized=True, finalized=False, on_finalize=None):
        self.initialized, self.finalized, self.on_finalize = initialized, finalized, on_finalize
        self.calls = 0

    def Is_initialized(self):  # noqa: N802 (mpi4py's names)
        return self.initialized

    def Is_finalized(self):  # noqa: N802
        return self.finalized

    def Finalize(self):  # noqa: N802
        self.calls += 1
        if self.on_finalize:
            self.on_finalize()
        self.finalized = True


@pytest.fixture(autouse=True)
def _fresh_timers():
    FakeTimer.made.clear()


def test_finalize_runs_under_a_deadline_that_exits_with_the_status_and_is_cancelled_after():
    mpi = FakeMPI()
    finalize_mpi(3, timeout_s=7.5, mpi=mpi, timer=FakeTimer)
    (deadline,) = FakeTimer.made
    assert mpi.calls == 1 and deadline.started and deadline.daemon and deadline.cancelled
    assert (deadline.interval, deadline.function, deadline.args) == (7.5, os._exit, (3,))


def test_a_finalize_that_hangs_past_the_deadline_exits_with_the_status():
    exits = []

    def hang():  # the deadline passes while Finalize waits on a dead peer
        deadline = FakeTimer.made[0]
        deadline.function = exits.append  # os._exit, caught
        deadline.fire()

    finalize_mpi(9, mpi=FakeMPI(on_finalize=hang), timer=FakeTimer)
    assert exits == [9]


@pytest.mark.parametrize("state", [dict(initialized=False), dict(finalized=True)])
def test_nothing_to_finalize_without_mpi_or_after_it(state):
    mpi = FakeMPI(**state)
    finalize_mpi(0, mpi=mpi, timer=FakeTimer)
    assert mpi.calls == 0 and FakeTimer.made == []


def test_a_child_ends_when_its_agent_does_and_not_before():
    agent = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)  # fmt: skip
    ended = threading.Event()
    try:
        watcher = die_with_agent(agent.pid, end=ended.set)
        assert not ended.wait(0.3) and watcher.is_alive()
        agent.stdin.close()  # the agent ends
        assert ended.wait(30)
        watcher.join(5)
        assert not watcher.is_alive()
    finally:
        agent.kill()
        agent.wait()


def test_a_child_dies_by_sigkill_with_its_agent(tmp_path):
    code = (
        "import os, sys, time, subprocess\n"
        "from deadpool_megatron.agent.mpi_child import die_with_agent\n"
        "agent = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(0.5)'])\n"
        "die_with_agent(agent.pid)\n"
        "agent.wait()\n"
        "time.sleep(30)\n"
    )
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert done.returncode == -9 and time.monotonic() - started < 25


CHILD = """
import json, os, sys
from deadpool_megatron.agent.mpi_child import become
script = become(sys.argv[1], json.loads(sys.argv[2]))
print("stdout", script, sys.argv, os.getcwd(), sys.path[0])
print("stderr", os.environ.get("OMPI_COMM_WORLD_RANK"), os.environ.get("FROM_AGENT"),
      os.environ.get("OMPI_AGENTS_OWN"), "KEPT" in os.environ, file=sys.stderr)
print("stdin", repr(sys.stdin.read()), os.getsid(0) == os.getpid())
"""


def test_a_spawned_child_writes_to_the_agent_s_socket_with_its_own_place_in_mpi(tmp_path):
    sock_path = str(tmp_path / "out.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path)
    listener.listen(1)
    work = tmp_path / "work"
    work.mkdir()
    request = {"argv": ["train.py", "--lr", "1"], "cwd": str(work),
               "env": {"FROM_AGENT": "yes", "OMPI_AGENTS_OWN": "agent", "PATH": os.environ["PATH"],
                       "PYTHONPATH": os.pathsep.join(sys.path)}}  # fmt: skip
    env = {**os.environ, "OMPI_COMM_WORLD_RANK": "0", "KEPT": "no"}
    child = subprocess.Popen([sys.executable, "-c", CHILD, sock_path, json.dumps(request)],
                             env=env, stdin=subprocess.PIPE)  # fmt: skip
    listener.settimeout(60)
    conn, _ = listener.accept()
    with conn, conn.makefile() as lines:
        hello = json.loads(lines.readline())
        rest = lines.read()
    assert child.wait(60) == 0 and hello == {"pid": child.pid}
    script = str(work / "train.py")
    assert f"stdout {script} {[script, '--lr', '1']} {work} {work}" in rest
    # MPI's variables are the child's own (the agent's OMPI_* dropped), the rest the agent's
    assert "stderr 0 yes None False" in rest
    assert "stdin '' True" in rest
