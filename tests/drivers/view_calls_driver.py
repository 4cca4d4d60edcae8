"""One of two processes: collectives through the interruptible view (what megatron-core and
Megatron-LM call on gloo), with `async_op` and `group` given by name and by position, as
torch.distributed accepts them. Prints each result as JSON.

usage: view_calls_driver.py RANK STORE_FILE
"""

from __future__ import annotations

import datetime
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed import _coalescing_manager

from deadpool_megatron.megatron import gloo_ops


def main(rank: int, store_file: str) -> None:
    store = dist.FileStore(store_file, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))  # fmt: skip
    view = gloo_ops.distributed_view()
    group = dist.new_group([0, 1])
    out: dict = {}
    # Megatron-LM's dist_signal_handler.all_gather_item: all_gather(outs, t, group, async_op)
    gathered = [torch.zeros(1) for _ in range(2)]
    out["positional_sync"] = view.all_gather(gathered, torch.tensor([rank + 1.0]), group, False)
    out["gathered"] = [t.item() for t in gathered]
    work = view.all_gather(gathered, torch.tensor([rank + 10.0]), None, True)
    work.wait()
    out["positional_async"] = [t.item() for t in gathered]
    summed = torch.tensor([rank + 1.0])
    view.all_reduce(summed, op=dist.ReduceOp.SUM, group=group, async_op=False)
    out["keyword_sync"] = summed.item()
    peak = torch.tensor([float(rank)])
    view.all_reduce(peak, dist.ReduceOp.MAX)
    out["default_group"] = peak.item()
    # megatron-core's grads across distributed-optimizer instances: all_reduce recorded inside
    # torch's coalescing manager (a placeholder work each), posted as one at its exit
    for async_op in (False, True):
        parts = [torch.tensor([rank + 1.0]), torch.tensor([10.0 * (rank + 1)])]
        with _coalescing_manager(group, async_ops=async_op) as cm:
            for part in parts:
                view.all_reduce(part, group=group, async_op=async_op)
        if async_op:
            cm.wait()
        out[f"coalesced_{'async' if async_op else 'sync'}"] = [p.item() for p in parts]
    dist.destroy_process_group()
    print(json.dumps(out))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
