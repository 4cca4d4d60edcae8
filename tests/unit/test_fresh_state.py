"""An optimizer's state made without its first step (what a restore or a checkpoint load is
written into) is the state torch's own first step creates, and trains on identically."""

import pytest
import torch

from deadpool_megatron.megatron.checkpointing import fresh_adam_state


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in ((4, 3), (5,), ())]


def _optimizer(cls, params, **kw):
    return cls([{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}], lr=0.1, **kw)


def _layout(opt) -> list:
    return [
        (k, v.dtype, tuple(v.shape), v.device.type)
        for group in opt.param_groups
        for p in group["params"]
        for k, v in sorted(opt.state[p].items())
    ]


@pytest.mark.parametrize(
    ("cls", "kw"),
    [(torch.optim.Adam, {}), (torch.optim.AdamW, {}), (torch.optim.AdamW, {"amsgrad": True}),
     (torch.optim.Adam, {"foreach": True})],
)  # fmt: skip
def test_the_fresh_state_is_the_first_steps_and_trains_on_alike(cls, kw):
    stepped = _optimizer(cls, _params(), **kw)
    for group in stepped.param_groups:
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    stepped.step()
    fresh = _optimizer(cls, _params(), **kw)
    assert fresh_adam_state(fresh)
    assert _layout(fresh) == _layout(stepped)
    # from the fresh state, a real step is exactly a new optimizer's first step
    never = _optimizer(cls, _params(), **kw)
    for opt in (fresh, never):
        for group in opt.param_groups:
            for i, p in enumerate(group["params"]):
                p.grad = torch.full_like(p, 0.5 + i)
        opt.step()
    for a, b in zip(fresh.param_groups, never.param_groups, strict=True):
        for p, q in zip(a["params"], b["params"], strict=True):
            assert torch.equal(p, q)
            assert all(torch.equal(fresh.state[p][k], never.state[q][k]) for k in never.state[q])


def test_other_optimizers_are_left_to_their_own_first_step():
    sgd = torch.optim.SGD(_params(), lr=0.1, momentum=0.9)
    assert not fresh_adam_state(sgd)
    assert not sgd.state
