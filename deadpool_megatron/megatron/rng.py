"""Every RNG a rank draws from, captured and restored as one value.

Python's, numpy's, torch's CPU (and CUDA) generators, and megatron-core's model-parallel RNG
tracker (dropout inside tensor-parallel regions): a rank restored with all of them draws the
same numbers as one that never stopped.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from megatron.core import tensor_parallel


def capture_rng_state() -> dict:
    return {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": {
            name: state.clone()
            for name, state in tensor_parallel.get_cuda_rng_tracker().get_states().items()
        },
    }


def restore_rng_state(state: dict) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


@contextmanager
def rng_kept() -> Iterator[None]:
    """Every generator as it was before the block, whatever the block drew: for set-up work
    that draws but must not move the training's streams (a DataLoader iterator draws its
    workers' base seed from torch's default generator)."""
    state = capture_rng_state()
    try:
        yield
    finally:
        restore_rng_state(state)
