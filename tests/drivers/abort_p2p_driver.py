"""One of two processes: rank 1 posts a pipeline receive (and a send) that rank 0 never matches,
as a stage does when its peer died, waits for it through the interruptible view the training
loop uses, and is aborted as a recovery would abort it. Prints what happened as JSON: whether
the training thread gave up, whether the helper thread that waited on gloo's operation ended,
whether a replication receive waited for directly ended (and one posted after the abort), what
each group waits on before and after the abort (a collective is not ended: rank 0 joins it
late), likewise a collective coalesced as megatron-core's DDP does it, and whether the group could be destroyed without waiting for its timeout.

usage: abort_p2p_driver.py RANK STORE_FILE
"""

from __future__ import annotations

import datetime
import json
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch.distributed import _coalescing_manager

from deadpool_megatron.checkpoint.transport import GlooTransport
from deadpool_megatron.megatron import gloo_ops

TIMEOUT = datetime.timedelta(seconds=120)  # the group's: what a wait gloo never woke waits for


def helpers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("deadpool-gloo-wait")]


def main(rank: int, store_file: str) -> None:
    store = dist.FileStore(store_file, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=TIMEOUT)
    if rank == 0:
        dist.new_group([0, 1])  # every rank creates every group
        late = dist.new_group([0, 1], group_desc="LATE")
        dist.new_group([0, 1])
        coalesced = dist.new_group([0, 1], group_desc="COALESCED")
        store.wait(["checked"], TIMEOUT)  # rank 1 asked what its groups still wait on
        dist.all_reduce(torch.zeros(1), group=late)  # ends rank 1's left-behind collective
        with _coalescing_manager(coalesced):  # and its coalesced one
            dist.all_reduce(torch.zeros(1), group=coalesced)
        store.wait(["done"], TIMEOUT)  # posts nothing else: rank 1's operations never complete
        print(json.dumps({"rank": 0}))
        return
    view = gloo_ops.distributed_view()
    recv, send = view.irecv(torch.zeros(4), 0), view.isend(torch.ones(1 << 20), 0)
    edge = dist.new_group([0, 1], group_desc="DEADPOOL_RING_EDGE_0_1")
    ring = GlooTransport({0: edge}, gloo_ops.OpenWork)  # as the replicator's
    late = dist.new_group([0, 1], group_desc="LATE")
    # an edge nothing timed out yet (its connection open): what the thread posts after the abort
    fresh = GlooTransport({0: dist.new_group([0, 1])}, gloo_ops.OpenWork)
    coalesced_group = dist.new_group([0, 1], group_desc="COALESCED")
    outcome: dict = {}

    def waiting() -> dict:
        return {g.group_desc: gloo_ops.waiting_on(g.group_name) for g in (world, edge, late)}

    world = dist.group.WORLD

    def collective() -> None:  # a collective the abort cannot end: rank 0 joins it later
        try:
            view.all_reduce(torch.ones(1), group=late)
        except gloo_ops.AbortedByRecovery:
            outcome["collective"] = "aborted"

    collecting = threading.Thread(target=collective)
    collecting.start()

    def coalesced() -> None:  # megatron-core's DDP: torch's own all-reduce, recorded, in the
        try:  # manager the view puts in its modules, synchronous (posted and waited at exit)
            with view._coalescing_manager(coalesced_group, async_ops=False):
                dist.all_reduce(torch.ones(1), group=coalesced_group)
            outcome["coalesced"] = "returned"
        except gloo_ops.AbortedByRecovery:
            outcome["coalesced"] = "aborted"

    coalescing = threading.Thread(target=coalesced)
    coalescing.start()

    def replication(key: str = "replication", on=ring) -> None:  # waits as that thread does
        try:
            on.irecv(torch.zeros(8, dtype=torch.uint8), 0).wait()
            outcome[key] = "returned"
        except RuntimeError:
            outcome[key] = "ended"

    replicating = threading.Thread(target=replication)
    replicating.start()

    def training() -> None:
        try:
            recv.wait()
            outcome["training"] = "returned"
        except gloo_ops.AbortedByRecovery:
            outcome["training"] = "aborted"

    thread = threading.Thread(target=training)
    thread.start()
    time.sleep(0.5)  # waiting on a helper thread by now
    outcome["helpers_waiting"] = len(helpers())
    outcome["waiting_before"] = waiting()
    gloo_ops.abort_pending()  # what CommunicatorAbort.abort does first
    thread.join(10)
    replicating.join(10)
    collecting.join(10)
    coalescing.join(10)
    again = threading.Thread(target=replication, args=("late_replication", fresh))
    again.start()  # the replication thread posts once more after the abort: ended at once
    again.join(10)
    gloo_ops.reset()  # the next generation's groups are built
    time.sleep(0.2)  # the ended operations' helper threads return
    outcome["waiting_after"] = waiting()
    store.set("checked", "1")
    deadline = time.monotonic() + 10
    while helpers() and time.monotonic() < deadline:
        time.sleep(0.05)
    outcome["helpers_left"] = len(helpers())
    destroy = threading.Thread(target=dist.destroy_process_group)
    destroy.start()
    destroy.join(TIMEOUT.total_seconds() / 4)
    outcome["destroyed"] = not destroy.is_alive()
    print(json.dumps({"rank": 1, **outcome, "send_done": send._work.is_completed()}), flush=True)
    store.set("done", "1")


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
    sys.stdout.flush()
