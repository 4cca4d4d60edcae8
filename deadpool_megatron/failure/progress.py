"""Progress marks: where a process's training thread is, readable without that process's GIL.

A heartbeat is sent by a thread of the worker, so it stops whenever the training thread holds
the GIL for long (a checkpoint save, a long kernel launch, garbage collection): a late beat
says "busy or hung", never which. The training thread therefore also marks every phase
boundary (iteration, phase) in a small record in shared memory that the agent on the same node
maps and reads directly: a process whose mark keeps changing is progressing, whatever its
heartbeat says (failure/hang.py decides).

The record is 24 bytes, written by one thread with a sequence lock (odd while a write is in
progress), so a reader never mistakes a half-written mark for a new one.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass

# Phases a training loop marks, in the order an iteration passes them. "start": set-up, before
# the first iteration; "evaluate": Megatron-LM's validation after a step; "done": the
# iteration's bookkeeping after the step (metrics, hooks).
PHASES = (
    "start",
    "forward",
    "backward",
    "optimizer",
    "snapshot",
    "save",
    "evaluate",
    "done",
    "recovery",
    "finish",
)
_CODES = {name: i for i, name in enumerate(PHASES)}

_RECORD = struct.Struct("<QqI4x")  # sequence, iteration, phase code, padding
SIZE = _RECORD.size
_READ_TRIES = 100


@dataclass(frozen=True)
class ProgressMark:
    """One reading of the record: `seq` grows by 2 with every mark (0: never marked)."""

    seq: int
    iteration: int
    phase: str


def create_board_file(path: str) -> None:
    """Create (or reset) the record file the launcher hands to one child process."""
    with open(path, "wb") as fh:
        fh.write(b"\0" * SIZE)


class ProgressBoard:
    """The shared record of one process: `mark` from its training thread, `read` from anyone.

    `path` is a file the launcher created (under /dev/shm where it exists, so the mapping is
    memory); without one the board is private to the process (anonymous memory), which still
    serves the process's own stall check.
    """

    def __init__(self, path: str | None = None, writable: bool = True):
        self.path = path
        if path is None:
            self._mm = mmap.mmap(-1, SIZE)
        else:
            flags = os.O_RDWR if writable else os.O_RDONLY
            fd = os.open(path, flags)
            try:
                access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
                self._mm = mmap.mmap(fd, SIZE, access=access)
            finally:
                os.close(fd)
        self._seq = self.read().seq if writable else 0

    def mark(self, iteration: int, phase: str) -> None:
        """Record that the training thread reached `phase` of `iteration` (single writer)."""
        code = _CODES[phase]
        seq = self._seq
        self._mm[0:8] = struct.pack("<Q", seq + 1)  # odd: a write is in progress
        self._mm[0:SIZE] = _RECORD.pack(seq + 1, iteration, code)
        self._mm[0:8] = struct.pack("<Q", seq + 2)
        self._seq = seq + 2

    def read(self) -> ProgressMark:
        """The newest complete mark (retries while a write is in progress)."""
        for _ in range(_READ_TRIES):
            seq, iteration, code = _RECORD.unpack(self._mm[0:SIZE])
            again = struct.unpack("<Q", self._mm[0:8])[0]
            if seq % 2 == 0 and seq == again:
                phase = PHASES[code] if code < len(PHASES) else "start"
                return ProgressMark(seq, iteration, phase)
        # A writer that stopped mid-write (SIGSTOP between two stores): report the last
        # complete sequence number; the fields may be mixed, the "no change" is what matters.
        seq, iteration, code = _RECORD.unpack(self._mm[0:SIZE])
        return ProgressMark(seq - seq % 2, iteration, PHASES[min(code, len(PHASES) - 1)])

    def close(self) -> None:
        self._mm.close()
