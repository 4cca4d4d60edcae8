"""Before any process starts, the agents of a multi-node job compare what each node was
launched with, through the store: each writes its own `NodeLaunch`, waits for every node's,
and refuses the same differences (`agreement.refuse_unlike_launches`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

from ..agreement import refuse_unlike_launches
from ..control import keys
from ..control.context import JobContext
from ..control.messages import NodeLaunch
from ..control.store import StoreTimeout
from ..control.wait import wait_until
from ..errors import ConfigError, LaunchError

# How long node 0's agent, which may host the store, waits after refusing for the other
# agents to have read every launch (they would find the store gone, not the reason).
COMPARED_WAIT_S = 10.0


def compare_launches(
    ctx: JobContext,
    mine: NodeLaunch,
    node_count: int,
    timeout_s: float,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Write this node's launch, wait up to `timeout_s` for every node's, and compare them.
    Returns how many nodes were compared; raises ConfigError naming every difference (the
    same on every agent), LaunchError naming the nodes that did not start."""
    ctx.put(keys.node_launch(ctx.job, mine.node), mine)
    nodes = range(node_count)

    def read() -> dict[int, NodeLaunch | None]:
        return {n: ctx.get(keys.node_launch(ctx.job, n), NodeLaunch) for n in nodes}

    def poll() -> dict[int, NodeLaunch] | None:
        got = read()
        return None if any(v is None for v in got.values()) else got

    try:
        launches = wait_until(poll, timeout_s, "every node's agent", interval_s=0.1,
                              clock=clock, sleep=sleep)  # fmt: skip
    except StoreTimeout:
        missing = [n for n, launch in read().items() if launch is None]
        raise LaunchError(
            f"node(s) {missing} of {node_count} did not start their agent within "
            f"{timeout_s:g} s (--deadpool-slow-phase-timeout)"
        ) from None
    compared = keys.launches_compared(ctx.job)
    ctx.kv.add(compared, 1)
    try:
        refuse_unlike_launches({n: launch.as_compared() for n, launch in launches.items()})
    except ConfigError:
        if mine.node == 0:
            with contextlib.suppress(StoreTimeout):
                wait_until(lambda: True if ctx.kv.add(compared, 0) >= node_count else None,
                           COMPARED_WAIT_S, "every agent to compare", interval_s=0.05,
                           clock=clock, sleep=sleep)  # fmt: skip
        raise
    return len(launches)
