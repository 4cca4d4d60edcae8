"""A recovery builds its model without drawing weights (the restore overwrites them), and
megatron-core marks every parameter exactly as in a normal build: with
`perform_initialization=False` it skipped marking tensor-parallel weights, and a TP2 hot-swap
diverged from its first optimizer step on (the gradient norm counted each shard as a copy)."""

from __future__ import annotations

import pytest

from jobs import ROOT

pytestmark = pytest.mark.timeout(180)


def test_an_undrawn_build_marks_every_parameter_as_a_drawn_one(run_drivers):
    # A process of its own: torch.distributed and megatron-core's globals are per process.
    (out,) = run_drivers(ROOT / "tests" / "drivers" / "undrawn_driver.py", [[]], timeout_s=150)
    assert out["undrawn"] == out["drawn"]
    tp_marked = [n for n, m in out["drawn"].items() if m[2]]
    assert len(tp_marked) > 4  # the check sees the marks that went missing
    # The layers' weights are not drawn (fc1 is [4h, h] = [256, 64] in the demo's shape). Only
    # the learned position embeddings ([seq, h]) are, which megatron-core draws itself
    # whatever the init method; the restore overwrites them with the rest.
    assert [256, 64] in out["drawn_draws"] and len(out["drawn_draws"]) > 4
    assert all(shape == [32, 64] for shape in out["undrawn_draws"]), out["undrawn_draws"]
