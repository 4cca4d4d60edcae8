"""--exit-signal-handler: SIGTERM is noted, not obeyed at once. The training loop asks after
each iteration whether any rank has received it (one all-reduce), so every rank stops after
the same iteration, saves, and exits 0: a Slurm time limit or cancel (SIGTERM first, SIGKILL
after its KillWait) costs nothing that was trained."""

from __future__ import annotations

import signal


class ExitSignal:
    """The handler of one signal in this process (install from the main thread); calling the
    object says whether the signal has arrived.

    The handler only stores a bool: it takes no lock and logs nothing. Python runs a handler
    between two bytecodes of whatever the main thread does, the handler's own included, and
    Slurm's SIGTERM to every process of a step is followed at once by the agent's forwarded
    one: a handler that set a `threading.Event` was entered again while it held the event's
    lock and waited for itself forever (the training thread silent, its heartbeats still on
    time; measured, 5 of 10 processes sent two signals at a time for 2 s)."""

    def __init__(self, signum: int = signal.SIGTERM):
        self.signum = signum
        self._received = False
        self._previous = signal.signal(signum, self._note)

    def _note(self, signum: int, frame) -> None:
        self._received = True  # no lock, no logging: the loop says so when the ranks agree

    def __call__(self) -> bool:
        return self._received

    def restore(self) -> None:
        """Put the previous handler back (tests)."""
        signal.signal(self.signum, self._previous)
