"""The MPI transport's edges between processes spawned apart, as the agent spawns workers
(run under `mpirun --with-ft ulfm -n 1`; tests/multiproc/test_mpi_transport.py).

The parent spawns three children, each an MPI job of its own. They open ports, exchange them
through files in DIR, join a ring 0 -> 1 -> 2 -> 0 in `connect_plan`'s order and pass a 1 MiB
tensor along it (checked on arrival). Then the parent kills child 0: child 1, waiting on a
receive from it, must fail with MPI_ERR_PROC_FAILED; child 2, waiting on a receive from
child 1 (which never sends), is released by its own transport's abort from another thread
(MPI_ERR_REVOKED). Each child writes what it saw to DIR/result-I.json.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from mpi4py import MPI

from deadpool_megatron.checkpoint import mpi_transport as mt

N = 3
MIB = 1 << 20


def _wait_for(path: Path, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.02)


def _publish(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.rename(path)


def parent(folder: Path) -> None:
    for i in range(N):
        MPI.COMM_SELF.Spawn(sys.executable, args=[__file__, "child", str(i), str(folder)],
                            maxprocs=1).Free()  # fmt: skip
    for i in range(N):
        _wait_for(folder / f"ready-{i}")
    os.kill(int((folder / "ready-0").read_text()), signal.SIGKILL)
    for i in (1, 2):
        _wait_for(folder / f"result-{i}.json")
    MPI.Finalize()


def child(i: int, folder: Path) -> None:
    import torch

    own = {1: MPI.Open_port()}
    _publish(folder / f"port-{i}", own[1])
    ports = {}
    for r in range(N):
        _wait_for(folder / f"port-{r}")
        ports[r] = {1: (folder / f"port-{r}").read_text()}
    transport = mt.connect_ring(i, 0, mt.connect_plan(list(range(N)), i, 1), ports, own)
    MPI.Close_port(own[1])
    succ, pred = (i + 1) % N, (i - 1) % N
    out = torch.full((MIB,), i, dtype=torch.uint8)
    got = torch.zeros(MIB, dtype=torch.uint8)
    sent = transport.isend(out, succ)
    transport.irecv(got, pred).wait()
    sent.wait()
    result = {"bytes_ok": bool((got == pred).all())}
    if i == 0:
        _publish(folder / f"ready-{i}", str(os.getpid()))
        time.sleep(120)  # killed by the parent
        return
    pending = transport.irecv(torch.zeros(MIB, dtype=torch.uint8), pred)
    if i == 2:  # child 1 never sends again: only the abort ends this wait
        threading.Timer(1.0, transport.abort).start()
    _publish(folder / f"ready-{i}", str(os.getpid()))
    start = time.monotonic()
    try:
        pending.wait()
        result["error"] = None
    except RuntimeError as err:
        result["error"] = str(err)
    result["waited_s"] = round(time.monotonic() - start, 3)
    transport.close()
    _publish(folder / f"result-{i}.json", json.dumps(result))
    MPI.Finalize()


if __name__ == "__main__":
    if sys.argv[1] == "parent":
        parent(Path(sys.argv[2]))
    else:
        child(int(sys.argv[2]), Path(sys.argv[3]))
