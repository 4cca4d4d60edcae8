"""One of several processes that build the replication ring's edge groups as a generation
does (`parallel.ring_pairs`), on gloo with megatron-core's groups, then pass a tensor to each
successor and receive one from each predecessor on them; prints JSON: the peers it has edges
to, what each predecessor sent, and how many process groups exist beside megatron-core's.

With ranks_per_node set, the ring interleaves nodes (so the edges are not DP neighbours):
creation order must still never deadlock.

Several jobs run one after the other in the same processes, each with process groups of its
own (a rank beyond a job's world sits it out), which saves each its interpreters and imports.
A job is WORLD,TP,PP,REPLICAS,RANKS_PER_NODE. Prints one JSON object: job -> what RANK saw.

usage: ring_pairs_driver.py RANK STORE_FILE JOB [JOB ...]
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from deadpool_megatron.checkpoint.transport import GlooTransport
from deadpool_megatron.megatron import parallel
from deadpool_megatron.topology import Topology


def run(rank, world, tp, pp, replicas, per_node) -> dict:
    parallel_state.initialize_model_parallel(tp, pp, create_gloo_process_groups=False)
    before = len(dist.distributed_c10d._world.pg_map)
    topo = Topology(world, tp, pp, per_node or None)
    edges = parallel.ring_pairs(topo, replicas)
    transport = GlooTransport(edges)
    successors = topo.ring_successors(rank, replicas)
    predecessors = topo.ring_predecessors(rank, replicas)
    sends = [transport.isend(torch.tensor([rank * 100 + s]), s) for s in successors]
    got = {}
    for p in predecessors:
        t = torch.zeros(1, dtype=torch.int64)
        transport.irecv(t, p).wait()
        got[p] = int(t.item())
    for w in sends:
        w.wait()
    out = {
        "rank": rank,
        "edges": sorted(edges),
        "edge_sizes": sorted({dist.get_world_size(g) for g in edges.values()}),
        "received": {str(p): v for p, v in got.items()},
        "groups_added": len(dist.distributed_c10d._world.pg_map) - before,
    }
    dist.barrier()
    return out


def main(rank: int, store_file: str, jobs: list[str]) -> None:
    worlds = [int(job.split(",")[0]) for job in jobs]
    store = dist.FileStore(store_file, max(worlds))
    outs = {}
    for i, job in enumerate(jobs):
        world, tp, pp, replicas, per_node = map(int, job.split(","))
        if rank >= world:
            continue
        dist.init_process_group(
            "gloo", store=dist.PrefixStore(f"job{i}", store), rank=rank, world_size=world
        )
        outs[job] = run(rank, world, tp, pp, replicas, per_node)
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    print(json.dumps(outs), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3:])
