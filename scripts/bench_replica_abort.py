#!/usr/bin/env python
"""Does a recovery's stop find the replication thread stuck? One replica message against parts.

gloo can leave a send or receive that a failure cut in the middle of its message waiting until
the group's timeout; the replication thread waiting on it is then left behind by the
recovery's stop (`ProtectionPipeline.abort`, after REPLICATION_STOP_S), holding a slot pair
that the recovery must allocate anew. The replicator sends a payload in parts of
`replicator.CHUNK_BYTES` (4 MiB), `replicator.WINDOW_PARTS` (1) in flight each way. This
runs two processes that replicate a shard to each other without pause (the real pipeline on
real gloo ring groups), then kills one of them (`kill`: rank 0 and rank 1 by turns; each is
the other's successor and predecessor) or has both abort 0-50 ms apart (`both`); the
survivors abort as a recovery does (cut the connections, then stop the pipeline) and report
whether the replication thread stopped within the limit. Each round runs once per variant,
in turn, with the same timing: over gloo, the payload in one message, in parts one at a time,
and in parts two in flight each way; over tcp connections (a connection per ring edge and
direction that the stop shuts down), in parts one at a time: streamed (`tcp-stream`) and read
from the sender's memory by the receiver (`tcp`, what `--deadpool-transport tcp` does between
two ranks on one host). `--variants` picks some. Prints a table and, last, one JSON object:
{"mib", "rounds", "chunk_bytes", "window_parts", "left_behind": {mode: {variant: n}},
"processes": {mode: n}}.

    python scripts/bench_replica_abort.py                 # 64 MiB, 20 rounds per mode
    python scripts/bench_replica_abort.py --rounds 3 --mib 16
    python scripts/bench_replica_abort.py --variants gloo-parts,tcp   # the two transports
    python scripts/bench_replica_abort.py --variants tcp-stream,tcp   # streamed or read
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DRIVER = ROOT / "scripts" / "replica_abort_driver.py"
MODES = ("kill", "both")
ONE_MESSAGE = 1 << 40  # a part larger than any payload
# name -> (transport, part size (None: replicator.CHUNK_BYTES), parts in flight each way)
VARIANTS = {"gloo-one-message": ("gloo", ONE_MESSAGE, 1), "gloo-parts": ("gloo", None, 1),
            "gloo-parts-two-in-flight": ("gloo", None, 2), "tcp-stream": ("tcp-stream", None, 1),
            "tcp": ("tcp", None, 1)}  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=20, help="rounds per mode and variant")
    p.add_argument("--mib", type=int, default=64, help="the shard each process replicates")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"which of {', '.join(VARIANTS)} (default all)")  # fmt: skip
    a = p.parse_args(argv)
    a.variant_list = a.variants.split(",")
    unknown = [v for v in a.variant_list if v not in VARIANTS]
    if unknown:
        p.error(f"--variants {unknown}: each must be one of {', '.join(VARIANTS)}")
    a.mode_list = a.modes.split(",")
    bad = [m for m in a.mode_list if m not in MODES]
    if bad:
        p.error(f"--modes {bad}: each must be one of {', '.join(MODES)}")
    if a.rounds < 1 or a.mib < 1:
        p.error(f"--rounds {a.rounds} and --mib {a.mib} must be at least 1")
    return a


def one_round(
    transport: str, chunk: int, window: int, mode: str, mib: int, seed: int
) -> list[dict]:
    """Both processes of one round; the JSON of each survivor."""
    with tempfile.TemporaryDirectory() as tmp:
        store = str(Path(tmp) / "store")
        procs = [subprocess.Popen([sys.executable, str(DRIVER), str(rank), store, str(chunk),
                                   str(window), mode, str(mib), str(seed), transport], cwd=ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for rank in range(2)]  # fmt: skip
        outs = []
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            lines = [ln for ln in out.splitlines() if ln.startswith("{")]
            if lines:
                outs.append(json.loads(lines[-1]))
            elif proc.returncode != -9:  # the victim ends by SIGKILL and prints nothing
                raise RuntimeError(f"driver exited {proc.returncode}: {err[-2000:]}")
    return outs


def main(argv=None) -> dict:
    from deadpool_megatron.checkpoint.replicator import CHUNK_BYTES, WINDOW_PARTS

    a = parse_args(argv)
    variants = {v: VARIANTS[v] for v in a.variant_list}
    left = {m: dict.fromkeys(variants, 0) for m in a.mode_list}
    survivors = {m: 0 for m in a.mode_list}
    for mode in a.mode_list:
        for r in range(a.rounds):
            for name, (transport, chunk, window) in variants.items():
                outs = one_round(transport, chunk or CHUNK_BYTES, window, mode, a.mib, seed=r)
                left[mode][name] += sum(not o["stopped"] for o in outs)
                print(f"{mode} round {r + 1}/{a.rounds} {name}: "
                      + ", ".join(f"rank {o['rank']} {'stopped' if o['stopped'] else 'LEFT BEHIND'}"
                                  f" in {o['stop_s']:.3f} s" for o in outs), flush=True)  # fmt: skip
            survivors[mode] += len(outs)  # the same number in every variant
    print(f"\n{a.mib} MiB replicated without pause, {a.rounds} rounds per mode; replication "
          f"threads left behind (of the survivors' threads):")  # fmt: skip
    for mode in a.mode_list:
        print(f"  {mode:17s} " + "   ".join(f"{name}: {left[mode][name]} of {survivors[mode]}"
                                            for name in variants))  # fmt: skip
    result = {"mib": a.mib, "rounds": a.rounds, "chunk_bytes": CHUNK_BYTES,
              "window_parts": WINDOW_PARTS, "left_behind": left, "processes": survivors}  # fmt: skip
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
