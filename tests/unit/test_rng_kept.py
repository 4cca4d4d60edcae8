"""Building a DataLoader's iterator draws from torch's default generator (its workers' base
seed); under `rng_kept` the numbers drawn after it are those drawn without it. Megatron-LM's
pretrain() builds its data iterators after a hot-swap's restore, so without this the resumed
iteration's dropout masks differed on CPU (upstream.data_iterators_for_hot_swaps)."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch.utils.data import DataLoader

from deadpool_megatron.megatron.rng import rng_kept


def _draws() -> tuple:
    return torch.rand(4).tolist(), random.random(), float(np.random.rand())


def _seed() -> None:
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)


def test_a_dataloader_iterator_moves_the_default_generator():
    # what the adapter guards against: without it the stream after the build differs
    _seed()
    expected = _draws()
    _seed()
    iter(DataLoader(list(range(8)), batch_size=2))
    assert _draws() != expected


def test_under_rng_kept_the_streams_go_on_as_if_nothing_was_built():
    _seed()
    expected = _draws()
    _seed()
    with rng_kept():
        batches = list(DataLoader(list(range(8)), batch_size=2, shuffle=True))
        random.random()
        np.random.rand()
    assert sorted(torch.cat(batches).tolist()) == list(range(8))
    assert _draws() == expected


def test_rng_kept_restores_after_an_error_too():
    _seed()
    expected = _draws()
    _seed()
    try:
        with rng_kept():
            torch.rand(3)
            raise ValueError("set-up failed")
    except ValueError:
        pass
    assert _draws() == expected
