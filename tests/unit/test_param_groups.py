"""Param-group state (where fused Adams keep their step) is part of a rank's state: the digest
sees it, and a snapshot's metadata brings it back after an optimizer was built anew."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from drivers.fused_adam_gpt import GroupStepAdam

from deadpool_megatron.errors import DeadpoolError
from deadpool_megatron.megatron.digest import local_digest
from deadpool_megatron.megatron.shard import capture_param_groups, restore_param_groups


def _trained(steps: int) -> SimpleNamespace:
    """A megatron-style wrapper (`.optimizer`) around a group-step Adam after `steps` steps."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    opt = GroupStepAdam([{"params": params[:1]}, {"params": params[1:], "weight_decay": 0.1}])
    for _ in range(steps):
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
    return SimpleNamespace(optimizer=opt)


def test_the_digest_sees_a_step_count_kept_in_the_param_groups():
    a, b = _trained(3), _trained(3)
    assert local_digest([], a) == local_digest([], b)
    b.optimizer.param_groups[1]["step"] = 1  # what building a fresh optimizer leaves there
    assert local_digest([], a) != local_digest([], b)


def test_captured_param_groups_restore_a_rebuilt_optimizers_step():
    trained, fresh = _trained(5), _trained(1)
    saved = capture_param_groups(trained)
    assert [g["step"] for g in saved[0]] == [5, 5]
    assert all("params" not in g for g in saved[0])
    for live, src in zip(fresh.optimizer.param_groups, trained.optimizer.param_groups):
        for p, q in zip(live["params"], src["params"]):
            p.data.copy_(q)
            for key in ("exp_avg", "exp_avg_sq"):
                fresh.optimizer.state[p][key].copy_(trained.optimizer.state[q][key])
    assert local_digest([], fresh) != local_digest([], trained)
    restore_param_groups(fresh, saved)
    assert local_digest([], fresh) == local_digest([], trained)


def test_param_groups_of_another_shape_are_refused():
    saved = capture_param_groups(_trained(2))
    with pytest.raises(DeadpoolError, match=r"param groups \[2\] per optimizer.*\[1\]"):
        restore_param_groups(SimpleNamespace(optimizer=GroupStepAdam([torch.zeros(1)])), saved)
