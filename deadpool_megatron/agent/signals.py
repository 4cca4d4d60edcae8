"""The signals the launcher received, handed from its handler to its watch loop.

Python runs a handler between two bytecodes of the main thread, the loop's own included, and
a second signal may come while the loop takes the first (Slurm's SIGTERM, then an operator's
second one, which means "stop every process now"). The handler only appends to a list and the
loop swaps the list for an empty one: a signal noted while the loop takes the others lands in
the list it took or in the new one, never in neither. Before, the loop read one remembered
signal and cleared it, and a signal noted between the two was dropped."""

from __future__ import annotations


class ReceivedSignals:
    """`note` is the handler (signal.signal(signum, signals.note)); `take` the loop's side."""

    def __init__(self) -> None:
        self._pending: list[int] = []

    def note(self, signum: int, frame=None) -> None:
        self._pending.append(signum)  # no lock: a handler may run inside any bytecode

    def take(self) -> list[int]:
        """Every signal noted since the last take, oldest first."""
        taken, self._pending = self._pending, []
        return taken
