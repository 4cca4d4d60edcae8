"""What the operating system says about a process: its state, and its threads' CPU time.

The agent reads a worker's state (a SIGSTOPped process is "stopped" however fresh its last
heartbeat); a process reads its own threads' CPU time after a recovery order to tell a training
thread that is computing from one that is blocked. psutil reads /proc on Linux.
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
