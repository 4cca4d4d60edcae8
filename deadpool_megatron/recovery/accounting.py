"""What a recovery cost one process, phase by phase, in wall and CPU seconds: timed as its
stages run (`Lap`), held while the first resumed iteration runs (`Resumed`), then written to
the store as its `Recovered` record, which the agent's "recovered in" line, the event log and
the benchmarks read."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from ..control.messages import Recovered


class Lap:
    """Wall and CPU seconds (this process, every thread) of one phase after another: what a
    phase costs, apart from how long it waited for cores or for its peers."""

    def __init__(self, cpu_clock: Callable[[], float]):
        self._cpu_clock = cpu_clock
        self._wall, self._cpu = time.perf_counter(), cpu_clock()

    def record(self, phases: dict[str, float], phase_cpu: dict[str, float], name: str) -> None:
        """Phase `name` ends now (its wall and CPU seconds go into the two); the next starts."""
        wall, cpu = time.perf_counter(), self._cpu_clock()
        phases[name] = wall - self._wall
        phase_cpu[name] = cpu - self._cpu
        self._wall, self._cpu = wall, cpu


@dataclass(frozen=True)
class Resumed:
    """A recovery's phases up to its resume, while its first resumed iteration runs."""

    phases: dict[str, float]
    phase_cpu: dict[str, float]
    groups_checked: int | None  # process groups verified reachable, None: not verified
    at: float  # wall time of the resume
    cpu_at: float  # the CPU clock then

    def recovered(
        self, iteration: int, bytes_moved: int, began_cpu: float, now: float, cpu_now: float
    ) -> Recovered:
        """The record once the first resumed iteration ended at `now` (`cpu_now` on the CPU
        clock, which read `began_cpu` as the recovery began): that iteration is a phase too.
        CPU seconds apart from wall time: on a machine with fewer cores than processes, wall
        time grows with the job for want of cores; CPU per process does not."""
        phases = {**self.phases, "first_iteration": now - self.at}
        phase_cpu = {**self.phase_cpu, "first_iteration": cpu_now - self.cpu_at}
        return Recovered(phases, now, iteration, bytes_moved, self.groups_checked,
                         cpu_now - began_cpu, phase_cpu)  # fmt: skip
