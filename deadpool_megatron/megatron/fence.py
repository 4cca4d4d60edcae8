"""Hooks into megatron-core's optimizer that the in-memory checkpoint needs.

The snapshot copies the live optimizer state off the critical path; the only wait the training
loop may see is a fence right before the next optimizer step modifies that state. megatron-core
steps each inner torch optimizer of its (chained) distributed optimizer, so the fence is a
pre-step hook on every one of them.
"""

from __future__ import annotations

from collections.abc import Callable


def step_fence_installer(optimizer) -> Callable[[Callable[[], None]], Callable[[], None]]:
    """`install(fence)` for `optimizer`: calls `fence()` before every step of each inner torch
    optimizer and returns the function that removes the hooks again."""

    def install(fence: Callable[[], None]) -> Callable[[], None]:
        handles = [
            megatron_opt.optimizer.register_step_pre_hook(lambda opt, args, kwargs: fence())
            for megatron_opt in getattr(optimizer, "chained_optimizers", [optimizer])
        ]

        def remove() -> None:
            for handle in handles:
                handle.remove()

        return remove

    return install
