"""One process: a save that a recovery interrupts after its write and before its finalization
(megatron-core's barrier between them, here made to raise as an aborted one does), then the
next save, then a load of that one. With each save's results queue fresh
(checkpointing.install_results_queue, as our saves do), and, to show what it prevents, with
megatron-core's single queue kept across both. Prints as JSON what each load found.

usage: interrupted_save_driver.py STORE_FILE FOLDER
"""

from __future__ import annotations

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from deadpool_megatron.megatron import checkpointing, cpu_backend

cpu_backend.activate()

from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor  # noqa: E402
from megatron.core.dist_checkpointing.strategies import async_utils  # noqa: E402
from megatron.core.dist_checkpointing.strategies.torch import (  # noqa: E402
    TorchDistSaveShardedStrategy,
)


def state(value: float, note: str) -> dict:
    # An object that grows between the saves moves the tensor's bytes in the file (as the
    # pickled parts of a real checkpoint may): results of the first save do not fit the next.
    return {"w": ShardedTensor.from_rank_offsets("w", torch.full((1000,), value), replica_id=0),
            "note": ShardedObject("note", note, (1,), (0,), replica_id=0)}  # fmt: skip


def save(folder: str, sd: dict) -> None:
    os.makedirs(folder)
    dist_checkpointing.save(sd, folder, sharded_strategy=TorchDistSaveShardedStrategy(
        "torch_dist", 1, thread_count=1))  # fmt: skip


def interrupted_then_next(folder: str, fresh_each: bool) -> str:
    checkpointing.install_results_queue(async_save=False)
    whole = async_utils.AsyncRequest.execute_sync

    def write_then_abort(self):
        self.async_fn(*self.async_fn_args)  # written, its results queued
        raise RuntimeError("communication aborted: a recovery was ordered")

    async_utils.AsyncRequest.execute_sync = write_then_abort
    try:
        save(os.path.join(folder, "first"), state(1.0, "x"))
    except RuntimeError:
        pass
    finally:
        async_utils.AsyncRequest.execute_sync = whole
    if fresh_each:
        checkpointing.install_results_queue(async_save=False)
    save(os.path.join(folder, "next"), state(2.0, "y" * 100_000))
    try:
        got = dist_checkpointing.load(state(0.0, ""), os.path.join(folder, "next"))
    except (Exception, CheckpointException) as e:  # the latter is a BaseException
        return f"load failed: {type(e).__name__}"
    whole_again = got["note"] == "y" * 100_000 and bool((got["w"] == 2.0).all())
    return "loaded whole" if whole_again else "loaded wrong values"


def main(store_file: str, folder: str) -> None:
    store = dist.FileStore(store_file, 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))  # fmt: skip
    out = {"fresh": interrupted_then_next(os.path.join(folder, "fresh"), True),
           "single": interrupted_then_next(os.path.join(folder, "single"), False)}  # fmt: skip
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
