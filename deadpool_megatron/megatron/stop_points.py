"""Stop points inside a micro-batch: where a CPU rank that is computing obeys a recovery order.

A rank stops for a recovery at the training loop's phase boundaries (an iteration's start,
each micro-batch's backward, the optimizer step) or when a collective it waits in is cut. A
survivor that is computing when the order comes finishes its forward or backward pass of a
micro-batch first, and that pass grows with the model (the recovery's plan phase, which waits
for every rank to stop and report: 0.045-0.055 s at 0.81M parameters, 0.054-0.089 s at 12.7M
in scripts/bench_recovery.py runs here). With a stop point before each transformer layer's
forward and where backward reaches each layer's output, the wait is one layer's work.

Only on CPU: a GPU rank's training thread queues kernels and blocks in a collective or a
synchronisation, which the order's cut already breaks.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable

import torch


def transformer_layer_type() -> type:
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return TransformerLayer


class StopPoints:
    """Calls `check` (which raises to stop) before each covered layer runs forward and when
    backward reaches each covered layer's output. The hooks only read: the loss, gradients
    and every byte of the state are what they are without them."""

    def __init__(self, check: Callable[[], None], layer_type: type | None = None):
        self._check = check
        self._layer_type = layer_type
        self._covered: weakref.WeakSet = weakref.WeakSet()

    def cover(self, chunks: Iterable[torch.nn.Module]) -> int:
        """Hook every layer of the model chunks not covered yet; returns how many were."""
        layer_type = self._layer_type or transformer_layer_type()
        added = 0
        for chunk in chunks:
            if chunk in self._covered:
                continue
            for module in chunk.modules():
                if isinstance(module, layer_type):
                    module.register_forward_pre_hook(self._before_forward)
                    module.register_forward_hook(self._after_forward)
                    added += 1
            self._covered.add(chunk)
        return added

    def _before_forward(self, module, args) -> None:
        self._check()

    def _after_forward(self, module, args, output) -> None:
        out = output[0] if isinstance(output, tuple) else output
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(self._in_backward)

    def _in_backward(self, grad: torch.Tensor) -> None:
        self._check()  # returns None: the gradient passes unchanged
