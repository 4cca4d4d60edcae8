"""megatron-core imported with torch.compile deferred to each compiled function's first call.

megatron-core wraps its fused kernels (bias-GeLU, bias-dropout-add, ...) in torch.compile as
its modules load (megatron/core/jit.py: `jit_fuser = torch.compile` on torch >= 2.2), and
torch.compile imports Inductor's compiler to do so (torch._inductor.compile_fx, its lowerings
and autotuning: about 1.1 s of the 4.3 s that importing megatron-core took here), paid at every
job start by the fork server and by every process started without it. torch.compile compiles
at a function's first call anyway; wrapping at that call instead changes nothing else. Our
model turns every fusion off (model.py), so a job here never imports Inductor's compiler;
settings that call a fused kernel pay the import at its first call (once per process).
TorchDynamo itself is imported all the same: torch.optim's optimizers import it when the first
one is built, so it is loaded here, once for a fork server's children.
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable


def deferred(compile_fn: Callable) -> Callable:
    """A stand-in for torch.compile: each function it wraps is compiled by `compile_fn`, with
    the same options, at its first call."""

    def compile(model=None, **options):
        if model is None:  # @torch.compile(...) with options
            return lambda fn: compile(fn, **options)
        compiled = None

        @functools.wraps(model)
        def first_call_compiles(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = compile_fn(model, **options)
            return compiled(*args, **kwargs)

        return first_call_compiles

    return compile


def import_megatron_core() -> None:
    """Import megatron.core (if not yet) with torch.compile deferred while its modules load,
    and TorchDynamo; torch.compile is itself again afterwards. Call before anything else
    imports megatron.core."""
    if "megatron.core" in sys.modules:
        return
    import torch

    eager = torch.compile
    torch.compile = deferred(eager)
    try:
        importlib.import_module("megatron.core")
    finally:
        torch.compile = eager
    importlib.import_module("torch._dynamo")  # what the first optimizer built imports
