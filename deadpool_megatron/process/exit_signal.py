"""--exit-signal-handler: SIGTERM is noted, not obeyed at once. The training loop asks after
each iteration whether any rank has received it (one all-reduce), so every rank stops after
the same iteration, saves, and exits 0: a Slurm time limit or cancel (SIGTERM first, SIGKILL
after its KillWait) costs nothing that was trained."""

from __future__ import annotations

import signal
import threading


class ExitSignal:
    """The handler of one signal in this process (install from the main thread); calling the
    object says whether the signal has arrived."""

    def __init__(self, signum: int = signal.SIGTERM):
        self.signum = signum
        self._received = threading.Event()
        self._previous = signal.signal(signum, self._note)

    def _note(self, signum: int, frame) -> None:
        self._received.set()  # no logging here: the loop says so when the ranks agree

    def __call__(self) -> bool:
        return self._received.is_set()

    def restore(self) -> None:
        """Put the previous handler back (tests)."""
        signal.signal(self.signum, self._previous)
