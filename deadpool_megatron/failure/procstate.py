"""What the operating system says about a process: its state, whether it is exiting, and its
threads' CPU time.

The agent reads a worker's state (a SIGSTOPped process is "stopped" however fresh its last
heartbeat) and whether it has begun to exit (a killed rank's exit is decided the moment the
signal lands, but its parent hears of it only after the kernel has torn its memory down:
tens of milliseconds per GiB, so the detection would grow with the model); a process reads
its own threads' CPU time after a recovery order to tell a training thread that is computing
from one that is blocked. psutil reads /proc on Linux.
"""

from __future__ import annotations

import threading

import psutil

# Threads of the control plane: they keep running (polling, beating) whether or not the
# training makes progress, so their CPU time says nothing about it.
CONTROL_THREAD_PREFIXES = ("deadpool-order", "deadpool-heartbeat", "deadpool-health")


def process_state(pid: int) -> str:
    """psutil's status name ("running", "sleeping", "disk-sleep", "stopped", "zombie", ...);
    "dead" for a process that no longer exists."""
    try:
        return psutil.Process(pid).status()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return "dead"
    except psutil.AccessDenied:
        return "unknown"


PF_EXITING = 0x4  # linux/sched.h: the task is in do_exit


def exit_decided(stat: str) -> int | None:
    """From the text of /proc/<pid>/stat: the exit status, as Popen's returncode gives it (a
    signal as its negated number), of a process that has begun to exit with a nonzero status;
    None while it runs, or when it exits with status 0 (a finished rank is taken as finished
    only once it is reaped) or the kernel shows no exit code (before Linux 3.5)."""
    fields = stat[stat.rindex(")") + 2 :].split()  # field 3 on: the name may hold spaces
    if len(fields) < 50:
        return None
    flags, status = int(fields[6]), int(fields[49])  # fields 9 and 52: flags, exit_code
    if not flags & PF_EXITING or status == 0:
        return None
    return -(status & 0x7F) if status & 0x7F else (status >> 8) & 0xFF


def exiting_status(pid: int) -> int | None:
    """`exit_decided` for process `pid`; None where it cannot be read (gone, not Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return exit_decided(fh.read())
    except (OSError, ValueError, IndexError):
        return None


def working_cpu_seconds() -> float:
    """CPU time (user + system) of this process's threads, the control plane's excluded."""
    control = {
        t.native_id
        for t in threading.enumerate()
        if t.name.startswith(CONTROL_THREAD_PREFIXES) and t.native_id is not None
    }
    return sum(
        t.user_time + t.system_time for t in psutil.Process().threads() if t.id not in control
    )
