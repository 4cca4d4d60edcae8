#!/usr/bin/env python
"""What generation 0's stoppable rendezvous costs: the creation of the default group and
megatron-core's groups with torch's blocking store gets, and with the polling gets of
control/c10d.StoppableStore (which a recovery order can interrupt), in ONE run.

N processes (the demo shape by default: TP2 x PP2 x DP2) meet on a TCPStore this script
hosts, and each builds the groups --rounds times per way, the two ways in turns
(parallel.init_distributed, then destroy_distributed), each round on a fresh store prefix.
A round's time is the slowest rank's (its groups are up when the last rank's are).

    python scripts/bench_rendezvous.py                   # 8 processes, 8 rounds per way
    python scripts/bench_rendezvous.py --nproc 4 --tp 1 --pp 2

The last line printed is one JSON object: {"blocking_s", "stoppable_s" (medians of the
rounds), "added_s" (their difference), "ratio", "rounds", "nproc"}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WAYS = ("blocking", "stoppable")


def worker(rank: int, nproc: int, port: int, rounds: int, tp: int, pp: int) -> None:
    """One rank: build and tear down the groups `rounds` times each way, in turns; print
    each round's seconds as JSON."""
    import torch.distributed as dist

    from deadpool_megatron.megatron import parallel
    from deadpool_megatron.megatron.arguments import parse_job_args

    cfg = parse_job_args(["--config", os.path.join(ROOT, "configs", "demo.yaml"),
                          "--tensor-model-parallel-size", str(tp),
                          "--pipeline-model-parallel-size", str(pp)], nproc)  # fmt: skip
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))  # fmt: skip
    times: dict[str, list[float]] = {w: [] for w in WAYS}
    for r in range(rounds):
        for way in WAYS if r % 2 == 0 else reversed(WAYS):
            store.add(f"ready/{r}/{way}", 1)  # start together: each round waits for all
            while int(store.add(f"ready/{r}/{way}", 0)) < nproc:
                time.sleep(0.001)
            t = time.perf_counter()
            parallel.init_distributed(cfg, rank, nproc, store, prefix=f"bench/{r}/{way}",
                                      stop=(lambda: None) if way == "stoppable" else None)  # fmt: skip
            times[way].append(time.perf_counter() - t)
            parallel.destroy_distributed()
    print(json.dumps(times), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=8)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--rounds", type=int, default=8, help="builds per way and process")
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rounds < 1 or args.tp < 1 or args.pp < 1:
        p.error(f"--rounds {args.rounds}, --tp {args.tp} and --pp {args.pp} must be 1 or more")
    if args.nproc < 2 or args.nproc % (args.tp * args.pp):
        p.error(f"--nproc {args.nproc} must be 2 or more and divisible by --tp {args.tp} x "
                f"--pp {args.pp}")  # fmt: skip
    if args.worker is not None:
        worker(args.worker, args.nproc, args.port, args.rounds, args.tp, args.pp)
        return 0
    import torch.distributed as dist

    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=60))  # fmt: skip
    shape = ["--nproc", str(args.nproc), "--tp", str(args.tp), "--pp", str(args.pp),
             "--rounds", str(args.rounds), "--port", str(host.port)]  # fmt: skip
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", str(rank), *shape],
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for rank in range(args.nproc)
    ]
    per_rank = []
    for proc in procs:
        out, _ = proc.communicate(timeout=900)
        if proc.returncode != 0:
            print(f"a worker exited with status {proc.returncode}", file=sys.stderr)
            return 1
        per_rank.append(json.loads(out.strip().splitlines()[-1]))
    result = {"rounds": args.rounds, "nproc": args.nproc}
    for way in WAYS:
        slowest = [max(r[way][i] for r in per_rank) for i in range(args.rounds)]
        print(f"{way:>9}: " + " ".join(f"{s:.3f}" for s in slowest) + " s")
        result[f"{way}_s"] = round(statistics.median(slowest), 4)
    result["added_s"] = round(result["stoppable_s"] - result["blocking_s"], 4)
    result["ratio"] = round(result["stoppable_s"] / result["blocking_s"], 3)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
