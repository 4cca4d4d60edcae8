"""One of two processes whose default process group cannot carry host tensors, as in an NCCL
job: torch's "fake" backend stands in for NCCL (it completes every operation and moves no
bytes). Rank 0 serves a committed replica and the parameter part of a committed snapshot to
rank 1 through `parallel.host_group()`, exactly as a recovery's restore stage does; rank 1
prints what arrived as JSON. Were the transfer on the default group, nothing would arrive.
With "offer", rank 0 offers both parts to be read from its memory (restore.send_part); with
"decayed", a byte of its committed replica changes after the commit (memory gone bad while
it was held), and only the replica is sent: rank 1 prints the error it raised.

usage: transfer_driver.py RANK STORE_FILE [offer] [decayed]
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch
import torch.distributed as dist
import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")

from deadpool_megatron.checkpoint.buffers import SlotPair
from deadpool_megatron.checkpoint.restore import recv_part, send_parameters, send_replica
from deadpool_megatron.errors import DeadpoolError
from deadpool_megatron.megatron import parallel

OPTIMIZER_NBYTES, PARAMS_NBYTES, ITERATION = 4096 + 64, 1024 * 1024, 7


def committed(nbytes: int, seed: int, meta: bytes) -> SlotPair:
    pair = SlotPair(nbytes)
    slot = pair.acquire_for_write()
    slot.buffer.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                                    generator=torch.Generator().manual_seed(seed)))  # fmt: skip
    pair.commit(slot, ITERATION, meta)
    return pair


def main(rank: int, store_file: str, offer: bool, decayed: bool) -> None:
    store = dist.FileStore(store_file, 2)
    dist.init_process_group("fake", store=store, rank=rank, world_size=2)
    group = parallel.host_group()
    out = {"default_backend": dist.get_backend(), "group_backend": dist.get_backend(group)}
    replica = committed(OPTIMIZER_NBYTES, 1, b'{"iteration": 7}')
    snapshot = committed(OPTIMIZER_NBYTES + PARAMS_NBYTES, 2, b"")
    if decayed:
        if rank == 0:
            replica.committed().buffer[100] ^= 0x01
            send_replica({0: replica}, 0, 1, group, ITERATION, offer)
        else:
            try:
                recv_part(OPTIMIZER_NBYTES, 0, group)
            except DeadpoolError as err:
                out["error"] = str(err)
    elif rank == 0:
        out["sent"] = [
            send_replica({0: replica}, 0, 1, group, ITERATION, offer),
            send_parameters(snapshot, OPTIMIZER_NBYTES, 1, group, ITERATION, offer),
        ]
    else:
        data, meta, iteration, pulled = recv_part(OPTIMIZER_NBYTES, 0, group)
        params, _, params_iteration, params_pulled = recv_part(PARAMS_NBYTES, 0, group)
        out["pulled"] = [pulled, params_pulled]
        expected = replica.committed()
        out["replica_equal"] = bool(torch.equal(data, expected.buffer)) and meta == expected.meta
        out["params_equal"] = bool(
            torch.equal(params, snapshot.committed().buffer[OPTIMIZER_NBYTES:])
        )
        out["iterations"] = [iteration, params_iteration]
        out["sha"] = hashlib.sha256(params.numpy().tobytes()).hexdigest()
    dist.barrier(group=group)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], "offer" in sys.argv[3:], "decayed" in sys.argv[3:])
