"""One of the two processes of `bench_replica_abort.py`: a ring of two that replicates a
shard through the protection pipeline without pause (a snapshot every 20 ms: the ring
lags, so a transfer is always under way), until one of
them is SIGKILLed or both abort as a recovery does; the survivor(s) print, as JSON, whether
the replication thread stopped within the pipeline's stop limit.

usage: replica_abort_driver.py RANK STORE_FILE CHUNK_BYTES WINDOW_PARTS MODE MIB SEED TRANSPORT
  MODE: kill (the rank SEED % 2 dies: the other one's sole successor and predecessor),
  both (both abort, rank 1 up to 50 ms after rank 0); TRANSPORT: gloo or tcp
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402

from deadpool_megatron.checkpoint import pipeline as pipeline_module  # noqa: E402
from deadpool_megatron.checkpoint import replicator  # noqa: E402
from deadpool_megatron.checkpoint.layout import Entry, StateLayout  # noqa: E402
from deadpool_megatron.checkpoint.pipeline import ProtectionPipeline  # noqa: E402
from deadpool_megatron.checkpoint.transport import GlooTransport  # noqa: E402
from deadpool_megatron.megatron import gloo_ops, parallel  # noqa: E402
from deadpool_megatron.process.protection import tcp_ring  # noqa: E402
from deadpool_megatron.recovery.abort import CommunicatorAbort  # noqa: E402
from deadpool_megatron.topology import Topology  # noqa: E402


class Shard:
    def __init__(self, nbytes: int):
        n = nbytes // 4
        self.t = torch.ones(n, dtype=torch.float32)
        self.layout = StateLayout((Entry("opt", 0, 4 * n, torch.float32, (n,)),), 4 * n, 4 * n)

    def tensors(self):
        return [self.t]

    def capture_metadata(self, iteration, extra):
        return b"{}"


def main(rank: int, store_file: str, chunk: int, window: int, mode: str, mib: int,
         seed: int, transport: str) -> None:  # fmt: skip
    logging.basicConfig(level=logging.CRITICAL)  # the lag and the stop are expected here
    replicator.CHUNK_BYTES, replicator.WINDOW_PARTS = chunk, window
    dist.init_process_group("gloo", store=dist.FileStore(store_file, 2), rank=rank,
                            world_size=2)  # fmt: skip
    parallel_state.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    nbytes = mib << 20
    topo = Topology(2, 1, 1)
    if transport in ("tcp", "tcp-stream"):
        ring = tcp_ring(topo, 1, parallel.dp_group(), "127.0.0.1", 0, 600.0,
                        pull=transport == "tcp")  # fmt: skip
    else:
        ring = GlooTransport(parallel.ring_pairs(topo, 1), gloo_ops.OpenWork)
    pipeline = ProtectionPipeline(Shard(nbytes), ring, [1 - rank], [1 - rank], {1 - rank: nbytes},
                                  use_cuda=False)  # fmt: skip
    rng = random.Random(seed)
    until = time.monotonic() + 0.4 + rng.random() * 0.4  # the same moment in both processes
    late = rng.random() * 0.05
    iteration = 0
    while time.monotonic() < until:
        iteration += 1
        pipeline.after_step(iteration)
        time.sleep(0.02)
    victim = seed % 2 if mode == "kill" else None
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.1 if victim is not None else late * rank)  # detection; the order's lag
    CommunicatorAbort().abort()
    start = time.monotonic()
    pipeline.abort(timeout=30.0)
    stopped = pipeline.replicator.stopped
    print(json.dumps({"rank": rank, "mode": mode, "chunk": chunk, "window": window,
                      "transport": transport,
                      "stopped": stopped,
                      "stop_s": round(time.monotonic() - start, 3),
                      "limit_s": pipeline_module.REPLICATION_STOP_S,
                      "replicated": pipeline.replicator.stats.received,
                      "where": pipeline.replicator.where()}), flush=True)  # fmt: skip
    os._exit(0)  # a thread left behind would hold the interpreter's exit


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5],
         int(sys.argv[6]), int(sys.argv[7]), sys.argv[8])  # fmt: skip
