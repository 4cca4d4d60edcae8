"""One of two processes: each round builds a gloo group, all-reduces on it without pause on a
thread (as a training step's tensor-parallel all-reduces), and aborts it as a recovery does,
rank 1 up to 50 ms after rank 0 (its order watcher sees the order later); every other
round's tensor (4 MB) is written in parts. Prints as JSON how
many rounds left an all-reduce pending 3 s after both aborted: gloo never fails a
collective's send it had queued when its pair closes, and cutting both directions of the
connections queued one in about one round in ten (measured with the previous abort).

usage: abort_race_driver.py RANK STORE_FILE ROUNDS
"""

from __future__ import annotations

import datetime
import json
import random
import sys
import threading
import time

import torch
import torch.distributed as dist

from deadpool_megatron.megatron import gloo_ops
from deadpool_megatron.recovery.abort import CommunicatorAbort

TIMEOUT = datetime.timedelta(seconds=60)  # a send gloo never fails waits this long


def main(rank: int, store_file: str, rounds: int) -> None:
    store = dist.FileStore(store_file, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=TIMEOUT)

    def barrier(name: str) -> None:  # through the store: the groups' connections are cut
        store.add(name, 1)
        while store.add(name, 0) < 2:
            time.sleep(0.005)

    abort = CommunicatorAbort()
    rng = random.Random(rank)
    stuck, cut, kept = 0, 0, []
    for r in range(rounds):
        group = dist.new_group([0, 1], timeout=TIMEOUT)
        kept.append(group)  # never destroyed here: a stuck one's destructor would wait
        gloo_ops.reset()
        tensor = torch.ones(4096 if r % 2 else 1 << 20)  # 16 KB, or 4 MB: sent in parts
        ended = threading.Event()

        def all_reduces(group=group, tensor=tensor, ended=ended) -> None:
            try:
                while True:
                    dist.all_reduce(tensor, group=group)
            except RuntimeError:
                ended.set()

        threading.Thread(target=all_reduces, daemon=True).start()
        barrier(f"start {r}")
        time.sleep(0.05 + rng.random() * 0.1 + (rng.random() * 0.05 if rank == 1 else 0.0))
        cut += abort.abort()
        barrier(f"aborted {r}")
        stuck += not ended.wait(3.0)
        barrier(f"checked {r}")
        abort.release()  # the next generation is up
    print(json.dumps({"rank": rank, "rounds": rounds, "stuck": stuck, "cut": cut}), flush=True)
    barrier("done")


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
    sys.stdout.flush()
