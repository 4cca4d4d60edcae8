"""Megatron-LM's `--load` of a megatron-core DistributedOptimizer on torch's AdamW (no Apex or
Transformer Engine, as on CPU): megatron-core alone fails it, and with
`upstream.torch_adam_loads_checkpoints` the loaded optimizer equals the saved one and steps
as it does. Runs without a Megatron-LM checkout (the adaptation touches megatron-core only);
the Megatron-LM file's checkpoint-restart test runs the same through pretrain_gpt.py."""

from __future__ import annotations

import pytest

from jobs import ROOT

pytestmark = pytest.mark.timeout(300)

DRIVER = ROOT / "tests" / "drivers" / "upstream_load_driver.py"


def test_megatron_cores_own_load_of_a_fresh_torch_adamw_fails(run_drivers):
    # A process of its own: torch.distributed and megatron-core's globals are per process.
    (out,) = run_drivers(DRIVER, [["as-is"]], timeout_s=240)
    # DistributedOptimizer.state_dict() asserts one Adam step; a fresh optimizer has none
    assert not out["installed"] and out["error"].startswith("AssertionError"), out


def test_the_adapted_load_equals_the_saved_optimizer_and_steps_as_it_does(run_drivers):
    (out,) = run_drivers(DRIVER, [[]], timeout_s=240)
    assert out["installed"] and "error" not in out, out
    assert out["loaded_equal"] and out["stepped_equal"]
    # two steps saved, one after the load: each parameter's own step, not one shared tensor
    # that AdamW advances once per parameter (52 here)
    assert out["steps"] == [3.0] and out["parameters"] > 1
