"""An idle spare's prebuilt states: the model, DDP and optimizer of the ranks it may take
over, built one per poll of its idle loop (a claim is seen between two builds), and the ranks
they fit published after each, for the agent to seat it on one of them.

Measured at 12.7M parameters on this machine (TP1 x PP2 x DP2): a spare's build took 0.11 to
0.18 s of a recovery, and the survivors waited for it in the build's collectives.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # megatron-core is imported by the spare's warm-up, after its CPU routing
    from ..megatron.prebuild import Prebuilt

log = logging.getLogger("deadpool.spare")


class SparePrebuilds:
    """`build(rank)` builds a rank's state (megatron/prebuild.py); `fits(rank)` names the
    ranks a state built for `rank` fits; `publish(ranks)` tells the agent which it can take."""

    def __init__(
        self,
        targets: list[int],
        build: Callable[[int], Prebuilt],
        fits: Callable[[int], tuple[int, ...]],
        publish: Callable[[tuple[int, ...]], None],
    ):
        self.targets = tuple(targets)  # what it was asked to build, in order
        self._todo = list(targets)
        self._build = build
        self._fits = fits
        self._publish = publish
        self.built: dict[int, Prebuilt] = {}

    def poll(self) -> None:
        """Build the next target, if any; an error stops the builds (they are an optimisation:
        the spare then builds once claimed, as without them)."""
        if not self._todo:
            return
        rank = self._todo.pop(0)
        try:
            self.built[rank] = self._build(rank)
        except Exception as err:
            log.warning("no more builds while idle: building rank %d's model failed: %s: %s",
                        rank, type(err).__name__, err)  # fmt: skip
            self._todo.clear()
            return
        covered = tuple(sorted({r for b in self.built for r in self._fits(b)}))
        self._publish(covered)
        log.info("built rank %d's model and optimizer while idle in %.2f s (ranks it can take "
                 "over without building: %s)", rank, self.built[rank].build_s, list(covered))  # fmt: skip

    def take(self, rank: int) -> Prebuilt | None:
        """The state that fits `rank`, if one was built; every other is let go."""
        chosen = next((b for r, b in self.built.items() if rank in self._fits(r)), None)
        self.built.clear()
        self._todo.clear()
        return chosen
