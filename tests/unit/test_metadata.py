"""Snapshot metadata travels as JSON: everything a restored rank needs round-trips bit for
bit, and bytes that are not what encode() writes are refused with a clear error, never run."""

from __future__ import annotations

import pickle
import random

import numpy as np
import pytest
import torch

from deadpool_megatron.checkpoint.metadata import MetadataError, decode, encode


def test_rng_states_scheduler_and_param_groups_round_trip_exactly():
    random.seed(3)
    np.random.seed(3)
    value = {
        "iteration": 12,
        "coordinates": (1, 0, 1),
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "scheduler": {"max_lr": 0.1 / 3, "num_steps": 96, "decay_style": "cosine"},
        "param_groups": [
            [
                {"step": 12, "betas": (0.9, 0.999), "lr": 2.9e-4, "foreach": None},
                {"step": torch.tensor(12.0), "weight_decay": 0.0},
            ]
        ],  # fmt: skip
        "bf16": torch.tensor([1.5, -0.0078125], dtype=torch.bfloat16),
        "nan": float("nan"),
        "int_keys": {3: "a", (1, 2): "b"},
    }
    back = decode(encode(value))
    assert back["coordinates"] == (1, 0, 1) and back["iteration"] == 12
    random.setstate(back["random"])
    np.random.set_state(back["numpy"])
    torch.set_rng_state(back["torch"])
    state = random.random(), np.random.rand(), torch.rand(1).item()
    random.seed(3)
    np.random.seed(3)
    torch.set_rng_state(value["torch"])
    assert state == (random.random(), np.random.rand(), torch.rand(1).item())
    assert back["scheduler"] == value["scheduler"]
    assert back["param_groups"][0][0] == value["param_groups"][0][0]
    step = back["param_groups"][0][1]["step"]
    assert step.dtype == torch.float32 and step.item() == 12.0
    assert torch.equal(back["bf16"].view(torch.int16), value["bf16"].view(torch.int16))
    assert back["nan"] != back["nan"] and back["int_keys"] == {3: "a", (1, 2): "b"}


@pytest.mark.parametrize(
    "blob, message",
    [
        (pickle.dumps({"iteration": 1}), "not JSON"),
        (b'{"x": {"__t": "tensor", "dtype": "float32", "shape": [4], "data": "AAAA"}}',
         "needs 16 bytes, has 3"),
        (b'{"__t": "tensor", "dtype": "object", "shape": [1], "data": ""}', "dtype 'object'"),
        (b'{"__t": "ndarray", "dtype": "|O", "shape": [1], "data": ""}', "not a number type"),
        (b'{"__t": "tensor", "dtype": "uint8", "shape": [-1], "data": ""}', "not a list of sizes"),
        (b'{"__t": "module", "name": "os"}', "unknown tag 'module'"),
    ],
)  # fmt: skip
def test_bytes_that_encode_did_not_write_are_refused(blob, message):
    with pytest.raises(MetadataError, match=message):
        decode(blob)


def test_values_metadata_cannot_hold_are_refused_when_encoding():
    with pytest.raises(MetadataError, match="cannot hold a object"):
        encode({"x": object()})
