#!/usr/bin/env python
"""How long after SIGKILL a process's exit becomes visible, by the memory it had touched.

A hot-swap's detection of a killed rank starts when its launcher sees the exit, and the kernel
frees the process's memory before that (Linux's do_exit tears the address space down before
it notifies the parent; so do its sockets close only after). A child touches MIB of memory,
kills itself, and the parent times the gap from the kill to waitpid's return: in pages of
4 KiB, and in transparent huge pages (`madvise(MADV_HUGEPAGE)`, what torch does for its CPU
allocations of 2 MiB and more with THP_MEM_ALLOC_ENABLE=1, which deadpool-launch sets for its
workers), in turn. Then the same for memory held the way a rank holds most of its smaller
tensors (a torch child that fills tensors of 0.5 MiB, which torch asks glibc's malloc for:
never advised by torch itself), in glibc's pages of 4 KiB and with glibc advising its own
memory (GLIBC_TUNABLES=glibc.malloc.hugetlb=1; tried as a worker default and not taken: it
cut the gap to 13-19 ms in one run and not at all in another, as the kernel hands out huge
pages only while it has them free, and the agent no longer waits for the reaping). Beside each reaping, when the
parent first saw the exit decided in /proc/<pid>/stat (the exiting flag and a nonzero exit
code, there as soon as the signal lands: what deadpool-launch's agent acts on). Prints one
line per size and, last, one JSON object {"mib": [...], "exit_seen_ms": [...] (4 KiB pages),
"exit_seen_ms_huge": [...], "exit_seen_ms_small": [...] (0.5 MiB tensors, 4 KiB pages),
"exit_seen_ms_small_huge": [...], "exit_decided_ms": [...] (4 KiB pages, seen in /proc),
"exit_decided_ms_huge": [...]}.

    python scripts/bench_teardown.py                 # 50, 300, 1000, 2000 MiB
    python scripts/bench_teardown.py --mib 100,4000
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deadpool_megatron.failure.procstate import exiting_status  # noqa: E402

# A torch child: fill `mib` MiB in tensors of 0.5 MiB, say when (the time), kill itself.
_SMALL_TENSORS = """
import os, signal, sys, time, torch
held = [torch.ones(1 << 17) for _ in range(2 * int(sys.argv[1]))]
print(repr(time.time()), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mib", default="50,300,1000,2000", help="sizes to touch, in MiB")
    p.add_argument("--repeats", type=int, default=3, help="kills per size; the median is kept")
    a = p.parse_args(argv)
    try:
        a.sizes = [int(x) for x in a.mib.split(",")]
    except ValueError:
        p.error(f"--mib {a.mib!r}: give sizes in MiB separated by commas, e.g. 50,1000")
    if any(s < 1 for s in a.sizes) or a.repeats < 1:
        p.error(f"--mib {a.mib} and --repeats {a.repeats} must be at least 1")
    return a


def one_kill(mib: int, huge: bool = False) -> tuple[float, float]:
    """Milliseconds from a child's SIGKILL of itself, with `mib` MiB touched (in huge pages
    where the kernel gives them, with `huge`), to the first sight of its exit in /proc (what
    deadpool-launch's agent acts on, procstate.exiting_status), and to its reaping."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: touch every page, say when, die (and never return)
        try:
            memory = mmap.mmap(-1, mib << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if huge:
                memory.madvise(mmap.MADV_HUGEPAGE)  # before the first touch, as torch does
            for i in range(0, len(memory), 4096):
                memory[i] = 1
            os.write(w, repr(time.time()).encode().ljust(32))
        finally:
            os.kill(os.getpid(), signal.SIGKILL)
            os._exit(1)
    os.close(w)
    killed_at = float(os.read(r, 32).decode())
    decided = None
    while decided is None:
        if exiting_status(pid) is not None:
            decided = time.time()
        elif os.waitpid(pid, os.WNOHANG)[0]:  # reaped before it was seen exiting
            decided = seen = time.time()
            break
    else:
        os.waitpid(pid, 0)
        seen = time.time()
    os.close(r)
    return 1000 * (decided - killed_at), 1000 * (seen - killed_at)


def one_kill_small(mib: int, huge: bool) -> float:
    """Milliseconds from the SIGKILL of a torch child holding `mib` MiB in tensors of 0.5 MiB
    (glibc's memory advised to be huge pages, with `huge`) to its reaping."""
    env = dict(os.environ, THP_MEM_ALLOC_ENABLE="1")
    env.pop("GLIBC_TUNABLES", None)
    if huge:
        env["GLIBC_TUNABLES"] = "glibc.malloc.hugetlb=1"
    child = subprocess.Popen([sys.executable, "-c", _SMALL_TENSORS, str(mib)], env=env,
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    killed_at = float(child.stdout.readline())
    child.wait()
    seen = time.time()
    child.stdout.close()
    return 1000 * (seen - killed_at)


def main(argv=None) -> dict:
    a = parse_args(argv)
    result: dict = {"mib": a.sizes}
    keys = ("exit_seen_ms", "exit_seen_ms_huge", "exit_seen_ms_small", "exit_seen_ms_small_huge",
            "exit_decided_ms", "exit_decided_ms_huge")  # fmt: skip
    for key in keys:
        result[key] = []
    for mib in a.sizes:
        kills = [one_kill(mib) for _ in range(a.repeats)]
        kills_huge = [one_kill(mib, huge=True) for _ in range(a.repeats)]
        small = statistics.median(one_kill_small(mib, huge=False) for _ in range(a.repeats))
        small_huge = statistics.median(one_kill_small(mib, huge=True) for _ in range(a.repeats))
        ms, huge = (statistics.median(k[1] for k in ks) for ks in (kills, kills_huge))
        decided, decided_huge = (statistics.median(k[0] for k in ks) for ks in (kills, kills_huge))
        for key, value in zip(keys, (ms, huge, small, small_huge, decided, decided_huge),
                              strict=True):  # fmt: skip
            result[key].append(round(value, 1))
        print(f"{mib} MiB touched: exit seen {ms:.1f} ms after SIGKILL in pages of 4 KiB, "
              f"{huge:.1f} ms in huge pages; in tensors of 0.5 MiB {small:.1f} ms, "
              f"{small_huge:.1f} ms with glibc.malloc.hugetlb=1; seen exiting in /proc "
              f"{decided:.1f} / {decided_huge:.1f} ms", flush=True)  # fmt: skip
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
