"""Letting a left generation go: its models collected and its process groups closed without a
group's destructor running inside a collection, and without a stuck group holding back the
others."""

from __future__ import annotations

import gc
import logging
import sys
import threading
import time
from collections.abc import Callable

from ..megatron import gloo_ops
from .leftovers import LeftBehind, referrer_chain

log = logging.getLogger("deadpool.recovery")


def collect_left_behind(generation: int, retired: list[object], models: LeftBehind) -> None:
    """Free what the generations before `generation` left, now, not at some later collection.

    The replaced model is a reference cycle (megatron-core's DDP registers gradient hooks
    whose closures hold the DDP, which holds its process groups), so dropping it frees
    nothing until the garbage collector's oldest generation runs, which may be many
    recoveries later; until then each old gloo group keeps its listener, connections and
    three threads. Collected once per recovery, after the first resumed iteration, on a
    thread of its own. The old groups (`retired`) are held outside the cycle meanwhile and
    released one by one between collections (`free_generation`): destroying a gloo group
    waits for an operation gloo never woke after the abort until the group's timeout
    (minutes), and inside a collection that wait would stop every later collection of the
    process with it (measured: a soak's process grew by 68 descriptors and 51 threads per
    generation). The collection walks only what the job built: the imports were frozen out
    of it (runtime.freeze_imports; some 430,000 objects under Megatron-LM, 0.23 s a walk).
    Nothing here counts the frozen objects: `gc.get_freeze_count()` walks them all, 30 ms
    holding the interpreter, which each rank's next iteration waited for (measured, patched
    Megatron-LM on 4 processes: the two iterations after the first resumed one took 177-279
    and 123-207 ms, against 80-87 and 69-76 ms without it). A left model still alive after
    that is logged with what holds it."""

    def collect() -> None:
        t = time.perf_counter()
        walked = len(gc.get_objects())  # what a collection walks: the frozen imports are not
        found = free_generation(retired, gc.collect,
                                lambda: bool(models.survivors(before=generation)))  # fmt: skip
        log.info("generation %d: freed the previous generation (%d objects found of %d "
                 "walked) in %.3f s", generation, found, walked,
                 time.perf_counter() - t)  # fmt: skip
        for older, ref in models.survivors(before=generation).items():
            log.warning("generation %d: the model of generation %d outlived its collection "
                        "(its process groups stay open); held by: %s", generation, older,
                        " -> ".join(referrer_chain(ref)) or "nothing now")  # fmt: skip

    threading.Thread(target=collect, name="deadpool-collect", daemon=True).start()


def free_generation(
    retired: list[object],
    collect: Callable[[], int],
    alive: Callable[[], bool],
    slow_s: float = 1.0,
) -> int:
    """Collect what a left generation left behind, never running a group's destructor inside a
    collection; returns the objects the collections found.

    Part of an old model's cycle can be held from outside Python through one of its
    generation's groups (an operation still pending on it holds tensors whose autograd graph
    reaches the gradient hooks, which hold the DDP): a collection frees that model only once
    the group is gone (measured: each recovery freed the model of the generation before the
    previous one). So while a left model is alive (`alive`), the groups that nothing but
    `retired` holds are released (their destructors run here, between collections) and the
    collection repeated; the groups the freed models held are released last."""
    found = collect()
    while alive():
        sole = [i for i in reversed(range(len(retired))) if sys.getrefcount(retired[i]) <= 2]
        if not sole:
            break
        release_groups([retired.pop(i) for i in sole], slow_s)
        found += collect()
    release_groups(retired, slow_s)
    return found


def release_groups(groups: list[object], slow_s: float = 1.0) -> int:
    """Drop the last references to old process groups, one at a time, each on a short-lived
    thread waited for up to `slow_s`; returns how many were still closing then (each logged:
    a collective on it that gloo never woke keeps its destructor waiting until the group's
    timeout). Such a group is left to its thread and the rest go on: closed in turn on one
    thread, it held back every group after it (measured in the soak: +24 fds, +19 threads in
    a process whose collection never finished). All at once, each on its own thread, was
    tried before the gradient hooks were all cut and made things worse; in turn stays the
    rule, only a stuck group is let go."""
    stuck = 0
    while groups:
        name = getattr(groups[-1], "group_name", "?")
        desc = getattr(groups[-1], "group_desc", "")
        holder = [groups.pop()]  # the closing thread drops the last reference
        closer = threading.Thread(target=holder.clear, name="deadpool-close", daemon=True)
        del holder
        closer.start()
        closer.join(slow_s)
        if closer.is_alive():
            stuck += 1
            log.warning("closing old process group %s (%s) waits for an operation gloo never "
                        "woke (%s; it closes at the group's timeout); closing the others "
                        "meanwhile", name, desc,
                        ", ".join(gloo_ops.waiting_on(name)) or "none posted here")  # fmt: skip
    return stuck
