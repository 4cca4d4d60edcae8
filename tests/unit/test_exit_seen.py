"""A killed rank is seen exiting the moment the signal lands, not only once the kernel has
torn its memory down and it can be reaped (procstate.exit_decided, children.exit_seen)."""

from __future__ import annotations

import mmap
import os
import signal
import time

import pytest

from deadpool_megatron.agent.children import exit_seen
from deadpool_megatron.failure.procstate import PF_EXITING, exit_decided, exiting_status


def _stat(name: str, flags: int, exit_code: int, fields: int = 52) -> str:
    """A /proc/<pid>/stat line: pid, (name), then fields 3 to `fields`."""
    rest = ["0"] * (fields - 2)
    rest[0] = "R"
    rest[6] = str(flags)  # field 9
    if fields >= 52:
        rest[49] = str(exit_code)  # field 52
    return f"4242 ({name}) " + " ".join(rest) + "\n"


@pytest.mark.parametrize(
    "flags, exit_code, seen",
    [(0, 0, None), (0x400040, 9, None),  # running: whatever the field holds
     (PF_EXITING, signal.SIGKILL, -signal.SIGKILL), (PF_EXITING | 0x40, 0x80 | 6, -6),
     (PF_EXITING, 3 << 8, 3), (PF_EXITING, 0, None)],
)  # fmt: skip
def test_the_exit_status_is_read_once_the_process_is_exiting(flags, exit_code, seen):
    assert exit_decided(_stat("python", flags, exit_code)) == seen


def test_a_name_with_spaces_and_parentheses_does_not_shift_the_fields():
    assert exit_decided(_stat("a) b (c", PF_EXITING, 9)) == -9


def test_a_kernel_that_shows_no_exit_code_says_nothing():
    assert exit_decided(_stat("python", PF_EXITING, 9, fields=44)) is None


def _child(mib: int, then) -> int:
    """A forked child that touches `mib` MiB in pages of 4 KiB, says so, then runs `then`."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            memory = mmap.mmap(-1, mib << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            for i in range(0, len(memory), 4096):
                memory[i] = 1
            os.write(w, b"x")
            then()
        finally:
            os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"x"
    os.close(r)
    return pid


def _first_status(pid: int, timeout_s: float = 10.0) -> int | None:
    """Poll exiting_status until it says something or the child is a zombie."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = exiting_status(pid)
        if status is not None:
            return status
        with open(f"/proc/{pid}/stat") as fh:
            if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                return exiting_status(pid)
        time.sleep(0.0005)
    raise AssertionError(f"child {pid} neither exited nor showed it within {timeout_s} s")


class _Unreaped:
    """A Popen-like view of a child nobody has reaped yet: poll() knows nothing."""

    def __init__(self, pid: int):
        self.pid = pid

    def poll(self):
        return None


def test_a_killed_child_is_seen_killed_before_anyone_reaps_it():
    pid = _child(256, lambda: time.sleep(60))
    os.kill(pid, signal.SIGKILL)
    try:
        assert _first_status(pid) == -signal.SIGKILL
        assert exit_seen(_Unreaped(pid)) == -signal.SIGKILL
    finally:
        os.waitpid(pid, 0)


def test_a_failing_exit_status_is_seen_and_a_clean_exit_only_once_reaped():
    failing = _child(8, lambda: os._exit(3))
    clean = _child(8, lambda: os._exit(0))
    try:
        assert _first_status(failing) == 3
        assert _first_status(clean) is None  # a zombie with status 0: nothing early
        assert exit_seen(_Unreaped(clean)) is None
    finally:
        os.waitpid(failing, 0)
        os.waitpid(clean, 0)


def test_a_process_that_is_gone_says_nothing():
    pid = _child(1, lambda: os._exit(5))
    os.waitpid(pid, 0)
    assert exiting_status(pid) is None
