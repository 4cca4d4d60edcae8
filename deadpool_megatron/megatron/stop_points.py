"""Stop points inside a micro-batch: where a CPU rank that is computing obeys a recovery order.

A rank stops for a recovery at the training loop's phase boundaries (an iteration's start,
each micro-batch's backward, the optimizer step) or when a collective it waits in is cut. A
survivor that is computing when the order comes finishes its forward or backward pass of a
micro-batch first, and that pass grows with the model (the recovery's plan phase, which waits
for every rank to stop and report: 0.045-0.055 s at 0.81M parameters, 0.054-0.089 s at 12.7M
in scripts/bench_recovery.py runs here). With a stop point before each transformer layer's
forward, a rank computing a forward pass stops after the layer it is in.

Not in backward: a hook there is Python that the autograd engine calls with the GIL released,
so each call must take it back from the process's other threads (the replication's, the
order watcher's). Failure-free iterations of the 0.81M model, jobs alternating over 11
rounds, did not tell the three apart (median 190 ms without stop points, 197 ms with them in
forward and backward, 184 ms in forward only), and forward alone cut the plan phase as much
in the recovery benchmark here (12.7M: 0.083 -> 0.059 s, 4 alternating rounds; with backward
too 0.095 -> 0.067 s in 4 others), so backward keeps the engine to itself.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable

import torch


class StopPoints:
    """Calls `check` (which raises to stop) before each covered layer runs forward. The hook
    only reads: the loss, gradients and every byte of the state are what they are without it."""

    def __init__(self, check: Callable[[], None]):
        self._check = check
        self._covered: weakref.WeakSet = weakref.WeakSet()

    def cover(self, chunks: Iterable[torch.nn.Module]) -> int:
        """Hook every layer of the model chunks not covered yet; returns how many were."""
        from megatron.core.transformer.transformer_layer import TransformerLayer

        added = 0
        for chunk in chunks:
            if chunk in self._covered:
                continue
            for module in chunk.modules():
                if isinstance(module, TransformerLayer):
                    module.register_forward_pre_hook(self._before_forward)
                    added += 1
            self._covered.add(chunk)
        return added

    def _before_forward(self, module, args) -> None:
        self._check()
