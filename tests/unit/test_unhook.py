"""An abandoned model whose failed iteration's autograd graph is still held from outside
(an operation gloo never woke keeps its tensors) is freed once its gradient hooks are cut."""

from __future__ import annotations

import gc
import weakref

import torch

from deadpool_megatron.megatron.model import TrainState, hook_tables, rehook, unhook


class _DDP(torch.nn.Module):
    """Registers its gradient hooks as megatron-core's DistributedDataParallel does: on each
    parameter's gradient accumulator, a closure holding the DDP, no handle kept."""

    def __init__(self):
        super().__init__()
        self.module = torch.nn.Linear(4, 4)
        self.group = object()  # stands for the generation's process groups
        self.grad_accs = []
        for param in self.module.parameters():
            accumulator = param.expand_as(param).grad_fn.next_functions[0][0]
            accumulator.register_hook(self._make_backward_post_hook(param))
            self.grad_accs.append(accumulator)

    def _make_backward_post_hook(self, param):
        def hook(*unused):
            self.last = param

        return hook


def _optimizer(model: _DDP) -> list:
    """What megatron-core's DistributedOptimizer keeps of an fp32 parameter: a view of its
    shard, no detach, so it holds the parameter's accumulator too."""
    return [model.module.weight.view(-1)[2:6]]


def _abandon(cut: bool) -> tuple[weakref.ref, list]:
    model = _DDP()
    state = TrainState([model], _optimizer(model), None, None, hook_tables([model]))
    pending = [model.module(torch.ones(2, 4))]  # the failed iteration's output, its graph held
    if cut:
        assert sum(map(len, unhook(state))) == 2  # weight and bias
    return weakref.ref(model), pending


def test_the_hooks_are_found_while_something_else_holds_the_accumulators():
    """The distributed optimizer keeps views of fp32 parameters (no detach) from the moment
    it is built, and a running iteration holds its graph: either hides an accumulator's
    hooks from the collector, not from `hook_tables`."""
    model = _DDP()
    optimizer = _optimizer(model)
    assert len(hook_tables([model])) == 2
    out = model.module(torch.ones(2, 4))
    tables = hook_tables([model])
    assert len(tables) == 2 and all(len(t) == 1 for t in tables)  # the probe is gone again
    del out, optimizer


def test_a_held_graph_keeps_the_model_alive_until_its_hooks_are_cut():
    kept, pending = _abandon(cut=False)
    gc.collect()
    assert kept() is not None  # what the soak saw: the model outlived its collection
    cut, still_pending = _abandon(cut=True)
    gc.collect()
    assert cut() is None and still_pending[0].grad_fn is not None
    pending.clear()
    gc.collect()
    assert kept() is None


def test_a_kept_model_gets_its_hooks_back_and_they_run_again():
    """A survivor keeps its model through a recovery: the hooks cut while it stood still are
    the same ones put back, and a backward pass calls them."""
    model = _DDP()
    state = TrainState([model], _optimizer(model), None, None, hook_tables([model]))
    removed = unhook(state)
    model.module(torch.ones(2, 4)).sum().backward()
    assert not hasattr(model, "last")  # cut: not called
    rehook(state, removed)
    assert [len(t) for t in state.hook_tables] == [1, 1]
    model.module(torch.ones(2, 4)).sum().backward()
    assert model.last is not None


class _Optimizer:
    def __init__(self, model: _DDP):
        self.model = model

    def scale_loss(self, loss):
        return loss


def test_a_frozen_config_keeps_the_model_alive_until_it_is_unbound():
    """core_v0.19 builds the model's config before pretrain(), so it is frozen with the JIT
    warm-up's caches (runtime.freeze_survivors); train() then binds the generation's optimizer
    (which holds the model) to it. A frozen object is never collected: the model outlived its
    collection until the recovery's stop cut those fields."""
    from types import SimpleNamespace

    from deadpool_megatron.megatron.model import unbind_config

    config = SimpleNamespace(hidden_size=4, grad_scale_func=None, timers=None)
    gc.collect()
    gc.freeze()
    try:

        def generation() -> tuple[weakref.ref, TrainState]:
            model = _DDP()
            config.grad_scale_func = _Optimizer(model).scale_loss
            config.no_sync_func = [model.module.zero_grad]
            return weakref.ref(model), TrainState([model], None, None, config)

        kept, state = generation()
        del state
        gc.collect()
        assert kept() is not None
        cut, state = generation()
        assert unbind_config(state) == 2
        del state
        gc.collect()
        assert cut() is None and config.grad_scale_func is None and config.no_sync_func is None
        assert config.hidden_size == 4  # the model's own settings stay
    finally:
        gc.unfreeze()
