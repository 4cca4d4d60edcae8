"""The kinds of evidence that a rank has failed, as plain immutable records.

Each record names the rank it is evidence about (not necessarily the rank that reported it:
see `CollectiveError`) and `at`, the wall-clock time (`time.time()`) it was observed, so the
event log can measure detection latency from an injection or exit time.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass


@dataclass(frozen=True)
class CollectiveError:
    """A collective raised on `rank`. `peer`, when known, is the rank it lost contact with.

    A peer-loss message is evidence about the peer, not about `rank`, which merely survived.
    """

    rank: int
    message: str
    at: float
    peer: int | None = None
    where: tuple[int, str] | None = None  # the rank's progress mark: (iteration, phase)


@dataclass(frozen=True)
class HeartbeatStale:
    """`rank` is hung: its heartbeat is late (`last_seen` None: never beat) AND it shows no
    progress (failure/hang.py); `why` says which evidence showed that."""

    rank: int
    last_seen: float | None
    at: float
    why: str = ""


@dataclass(frozen=True)
class ProcessExited:
    """The launcher saw `rank`'s process exit; a negative `returncode` is the signal number."""

    rank: int
    returncode: int
    at: float


@dataclass(frozen=True)
class InjectedTransient:
    """A `raise@RANK:ITER` fault fired on `rank`: the process is alive and can reset itself."""

    rank: int
    at: float


@dataclass(frozen=True)
class HealthCheckFailed:
    """A health check (device, memory, store reachability) failed on `rank`."""

    rank: int
    reason: str
    at: float


@dataclass(frozen=True)
class CudaError:
    """A CUDA error on `rank`; `recoverable` when the context survives (e.g. out of memory)."""

    rank: int
    message: str
    recoverable: bool
    at: float
    where: tuple[int, str] | None = None  # the rank's progress mark: (iteration, phase)


Evidence = (
    CollectiveError
    | HeartbeatStale
    | ProcessExited
    | InjectedTransient
    | HealthCheckFailed
    | CudaError
)

# gloo (transport/tcp/pair.cc) when a peer's socket closes or resets, and NCCL's errors and
# its watchdog timeouts; a timeout is how survivors of a hung peer fail (FIELD-NOTES). Over
# MPI (--deadpool-transport mpi), ULFM's: a peer's process failed, or a peer revoked the edge.
_PEER_LOSS = re.compile(
    r"Connection closed by peer|Connection reset by peer|Read error|NCCL error"
    r"|Timed out waiting|Watchdog caught collective operation timeout"
    r"|MPI_ERR_PROC_FAILED|MPI_ERR_REVOKED",
    re.IGNORECASE,
)


# torch's CUDA errors, by message (`OutOfMemoryError`, `AcceleratorError` or a RuntimeError
# with CUDA's error string, cuBLAS's and cuDNN's statuses). Out of memory leaves the context
# usable; any other CUDA error may be "sticky" (CUDA's term: the context is corrupted and
# every later call fails, e.g. an illegal memory access, a device-side assert, an
# uncorrectable ECC error), which the message does not always say: not recoverable in place.
_CUDA = re.compile(r"CUDA error|CUDA out of memory|CUDA driver error|CUBLAS_STATUS_|CUDNN_STATUS_")
_CUDA_OUT_OF_MEMORY = re.compile(r"CUDA out of memory|CUDA error: out of memory")


def cuda_error_recoverable(message: str) -> bool | None:
    """None where `message` is no CUDA error; True where the context survives it (out of
    memory), False where it may not."""
    if not _CUDA.search(message):
        return None
    return bool(_CUDA_OUT_OF_MEMORY.search(message))


def is_peer_loss_message(message: str) -> bool:
    """Whether a collective's error message says a peer went away (rather than a local fault)."""
    return bool(_PEER_LOSS.search(message))


# A worker whose training thread stayed blocked in a collective after a recovery order (gloo
# cannot abort every pending operation) exits with this status so that a spare replaces it.
EXIT_BLOCKED = 75


def describe_exit(returncode: int) -> str:
    if returncode == EXIT_BLOCKED:
        return f"exited with status {returncode} (blocked in a collective it could not abort)"
    if returncode < 0:
        try:
            return f"was killed by signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"
