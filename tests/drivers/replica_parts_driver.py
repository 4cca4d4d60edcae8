"""One of several processes of a DP ring that replicate shards spanning several parts
(`replicator.CHUNK_BYTES` set small here) through the protection pipeline on real gloo edge
groups; every rank's shard has its own size, none a whole number of parts. Prints JSON: for
each iteration, whether each predecessor's replica equals, byte for byte, what it held.

usage: replica_parts_driver.py RANK WORLD REPLICAS CHUNK_BYTES STORE_FILE
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from deadpool_megatron.checkpoint import replicator
from deadpool_megatron.checkpoint.layout import Entry, StateLayout
from deadpool_megatron.checkpoint.pipeline import ProtectionPipeline
from deadpool_megatron.checkpoint.transport import GlooTransport
from deadpool_megatron.megatron import parallel
from deadpool_megatron.topology import Topology

ITERATIONS = 3


def shard_floats(rank: int, chunk: int) -> int:
    return (3 * chunk) // 4 + 7 * rank + 1  # 3 parts and a bit; a different size per rank


class Shard:
    """A ProtectedState of one float32 tensor, all of it optimizer state (replicated)."""

    def __init__(self, rank: int, chunk: int):
        n = shard_floats(rank, chunk)
        self.t = torch.zeros(n, dtype=torch.float32)
        self.layout = StateLayout((Entry("opt", 0, 4 * n, torch.float32, (n,)),), 4 * n, 4 * n)

    def tensors(self):
        return [self.t]

    def capture_metadata(self, iteration, extra):
        return json.dumps({"iteration": iteration}).encode()


def values(rank: int, iteration: int, n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) + rank * 1000.0 + iteration * 0.5


def main(rank: int, world: int, replicas: int, chunk: int, store_file: str) -> None:
    replicator.CHUNK_BYTES = chunk
    dist.init_process_group("gloo", store=dist.FileStore(store_file, world), rank=rank,
                            world_size=world)  # fmt: skip
    parallel_state.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    topo = Topology(world, 1, 1)
    predecessors = topo.ring_predecessors(rank, replicas)
    state = Shard(rank, chunk)
    pipeline = ProtectionPipeline(
        state, GlooTransport(parallel.ring_pairs(topo, replicas)),
        topo.ring_successors(rank, replicas), predecessors,
        {p: 4 * shard_floats(p, chunk) for p in predecessors}, use_cuda=False,
    )  # fmt: skip
    equal = {}
    for it in range(1, ITERATIONS + 1):
        state.t.copy_(values(rank, it, state.t.numel()))
        pipeline.after_step(it)
        pipeline.wait_for_replicas(it, timeout=60)
        equal[it] = {}
        for p in predecessors:
            slot = pipeline.replicator.replica(p)
            expected = values(p, it, shard_floats(p, chunk))
            equal[it][str(p)] = slot.iteration == it and torch.equal(
                slot.buffer.view(torch.float32)[: expected.numel()], expected
            )
        dist.barrier()  # nobody overwrites a shard before every replica of it was checked
    pipeline.close()
    stats = pipeline.replicator.stats
    print(json.dumps({"rank": rank, "equal": equal, "received": stats.received,
                      "rejected": stats.rejected, "errors": pipeline.errors}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main(*map(int, sys.argv[1:5]), sys.argv[5])
