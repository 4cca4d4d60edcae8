#!/usr/bin/env python
"""How long after SIGKILL a process's exit becomes visible, by the memory it had touched.

A hot-swap's detection of a killed rank starts when its launcher sees the exit, and the kernel
frees the process's memory before that (Linux's do_exit tears the address space down before
it notifies the parent; so do its sockets close only after). A child touches MIB of memory,
kills itself, and the parent times the gap from the kill to waitpid's return: in pages of
4 KiB, and in transparent huge pages (`madvise(MADV_HUGEPAGE)`, what torch does for its CPU
allocations of 2 MiB and more with THP_MEM_ALLOC_ENABLE=1, which deadpool-launch sets for its
workers), in turn. Prints one line per size and, last, one JSON object {"mib": [...],
"exit_seen_ms": [...] (4 KiB pages), "exit_seen_ms_huge": [...]}.

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
import time


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


def one_kill(mib: int, huge: bool = False) -> float:
    """Milliseconds from a child's SIGKILL of itself, with `mib` MiB touched (in huge pages
    where the kernel gives them, with `huge`), to its reaping."""
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
    os.waitpid(pid, 0)
    seen = time.time()
    os.close(r)
    return 1000 * (seen - killed_at)


def main(argv=None) -> dict:
    a = parse_args(argv)
    seen, seen_huge = [], []
    for mib in a.sizes:
        ms = statistics.median(one_kill(mib) for _ in range(a.repeats))
        huge = statistics.median(one_kill(mib, huge=True) for _ in range(a.repeats))
        seen.append(round(ms, 1))
        seen_huge.append(round(huge, 1))
        print(f"{mib} MiB touched: exit seen {ms:.1f} ms after SIGKILL in pages of 4 KiB, "
              f"{huge:.1f} ms in huge pages", flush=True)  # fmt: skip
    result = {"mib": a.sizes, "exit_seen_ms": seen, "exit_seen_ms_huge": seen_huge}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
