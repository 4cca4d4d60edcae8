#!/usr/bin/env python
"""How long a connection to a TCPStore takes on this machine, and how often it stalls.

torch's TCPStore looks up the peer name of every connection it makes or accepts; on one
machine the peer is the v4-mapped loopback `::ffff:127.0.0.1`, and where `/etc/hosts` does
not list it the lookup goes to the DNS resolver (`scripts/setup_env.sh` lists it where it
may). This hosts a store, connects to it N times (connect, set a key, close) and prints the
stalls over 1 s, the worst and the total, then one JSON line: {"connections", "over_1s",
"worst_s", "total_s", "hosts_lists_v4_mapped_loopback"}.

    python scripts/bench_store_connect.py                 # 300 connections
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import time


def hosts_lists_v4_mapped_loopback(path: str = "/etc/hosts") -> bool:
    try:
        with open(path) as fh:
            return any(re.match(r"::ffff:127\.0\.0\.1\s", line) for line in fh)
    except OSError:
        return False


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--connections", type=int, default=300)
    a = p.parse_args(argv)
    if a.connections < 1:
        p.error(f"--connections {a.connections} must be at least 1")
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=60)
    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
    times = []
    start = time.perf_counter()
    for i in range(a.connections):
        t = time.perf_counter()
        client = dist.TCPStore("127.0.0.1", host.port, is_master=False, wait_for_workers=False,
                               timeout=timeout)  # fmt: skip
        client.set(f"k{i}", "v")
        del client
        times.append(time.perf_counter() - t)
    result = {
        "connections": a.connections,
        "over_1s": sum(t > 1.0 for t in times),
        "worst_s": round(max(times), 3),
        "total_s": round(time.perf_counter() - start, 2),
        "hosts_lists_v4_mapped_loopback": hosts_lists_v4_mapped_loopback(),
    }
    print(f"{result['connections']} store connections: {result['over_1s']} over 1 s, worst "
          f"{result['worst_s']} s, {result['total_s']} s in all (/etc/hosts lists "
          f"::ffff:127.0.0.1: {result['hosts_lists_v4_mapped_loopback']})")  # fmt: skip
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
