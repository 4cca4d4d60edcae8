"""Let unmodified megatron-core train on CPU with gloo, for development and CI.

Active only after `activate()`, which runs without a usable GPU or with `--cpu` (a GPU run
never comes here). What it changes, exactly:

1. Per-module views. In every loaded `megatron.core.*` module whose global `torch` is the real
   module, that global becomes a view of `torch` (the real module is never modified) in which
   - `torch.cuda` stands in for a CPU: `current_device()` is the CPU, `device_count()` 1,
     `synchronize`/`empty_cache` do nothing, `Stream`/`Event`/`current_stream`/
     `default_stream`/`stream`/`device` are no-op objects, `nvtx` no-ops, `get_rng_state`/
     `set_rng_state`/`manual_seed(_all)` use the CPU generator, memory statistics are 0;
   - the tensor factories in `_FACTORIES` put a CUDA device's tensors on the CPU and drop
     `pin_memory`;
   - `torch.distributed` is `gloo_ops.distributed_view()`: collectives and pipeline sends a
     recovery can interrupt.
2. In `megatron.core.tensor_parallel.random`, `_get_cuda_rng_state`/`_set_cuda_rng_state` read
   and write the CPU RNG state.
3. Two methods of `torch.Tensor`, globally, because megatron-core calls them on tensor objects,
   which no module view reaches: `Tensor.type()` without arguments answers 'torch.cuda.*'
   names for CPU tensors (the dtype checks in optimizer/distrib_optimizer.py,
   optimizer/optimizer.py, optimizer/clip_grads.py), and `Tensor.cuda()` returns the tensor
   itself (optimizer/optimizer.py, language_module.py, tensor_parallel/data.py, utils.py);
   both only when the calling frame belongs to a `megatron.*` module: every other caller
   gets torch's own methods.
4. Mixtures of experts: in `megatron.core.transformer.moe.moe_utils`, `te_general_gemm` is
   None where transformer-engine is missing (core_v0.16.1 imports it only with TE, and its
   router then stops on a NameError; core_v0.19.0 sets it None itself); and
   `maybe_move_tensor_to_cpu(t, as_numpy=True)`, wherever it was imported, gives a host
   tensor as numpy too, as it does a GPU one (the alltoall dispatcher's split sizes, which
   torch's all_to_all_single refuses as tensors).
5. Wherever a module bound one of torch.distributed's collectives or its `_coalescing_manager`
   to a name of its own at import (`dist_all_gather_func = torch.distributed.
   all_gather_into_tensor`, `from torch.distributed import _coalescing_manager`: DDP's bucket
   groups, tensor-parallel mappings, the timers Megatron-LM logs), before any view existed,
   that name becomes the view's operation (`gloo_ops.coalescing_manager` for the manager),
   which a recovery can interrupt.
6. Sequence parallelism: `WrappedTorchNorm` (the local layer specs' norm where apex and
   transformer-engine are missing) refuses `sequence_parallel`; here it builds its torch norm
   and marks the norm's parameters `sequence_parallel`, as apex's and transformer-engine's
   norms do on a GPU, so that megatron-core all-reduces their gradients across the
   tensor-parallel group (a norm is per token: on a sequence shard it computes what it
   computes on the whole sequence).

Modules megatron-core imports lazily (`_MODULES_TO_LOAD`) are imported first so they get the
view too; `patch_loaded_modules()` runs again after the model-parallel initialisation.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import logging
import os
import sys
import types

import torch

from . import gloo_ops

log = logging.getLogger(__name__)

_FACTORIES = (
    "tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn",
    "randint", "zeros_like", "ones_like", "empty_like", "full_like", "eye", "linspace",
)  # fmt: skip
_CPU = torch.device("cpu")
# Modules megatron-core imports lazily (checkpointing strategies) must be loaded, then patched.
_MODULES_TO_LOAD = (
    "megatron.core.distributed",
    "megatron.core.models.gpt",
    "megatron.core.optimizer",
    "megatron.core.pipeline_parallel",
    "megatron.core.tensor_parallel",
    "megatron.core.dist_checkpointing",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
)
_ACTIVE = False
# Upstream Megatron-LM's entry-point modules, which sit outside the megatron package.
_EXTRA_MODULES = ("__main__", "gpt_builders", "model_provider")


def _is_cuda(device) -> bool:
    if isinstance(device, int):
        return True
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


def _cpu_factory(fn):
    def factory(*args, **kwargs):
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = _CPU
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    factory.__name__ = fn.__name__
    factory.__doc__ = fn.__doc__
    return factory


class _NullStream:
    """Stands in for a CUDA stream: CPU work is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event if event is not None else _NullEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _NullEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.0


def _cpu_manual_seed(seed: int) -> None:
    # Not torch.manual_seed: it calls torch.cuda.manual_seed_all, which would recurse here.
    torch.default_generator.manual_seed(int(seed))


def _nvtx_namespace() -> types.SimpleNamespace:
    return types.SimpleNamespace(
        range_push=lambda *a, **k: None,
        range_pop=lambda *a, **k: None,
        mark=lambda *a, **k: None,
        range=lambda *a, **k: contextlib.nullcontext(),
    )


def _cpu_properties() -> types.SimpleNamespace:
    """What the CPU view says a device is, where Megatron-LM asks (its argument checks ask
    for the architecture when tensor or context parallel: compute capability 0.0 here, so
    its pre-Blackwell rules apply, CUDA_DEVICE_MAX_CONNECTIONS=1 among them)."""
    return types.SimpleNamespace(
        name="cpu", major=0, minor=0, multi_processor_count=os.cpu_count() or 1,
        total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
    )  # fmt: skip


def _build_cuda_view(claim_available: bool) -> types.ModuleType:
    cuda = types.ModuleType("torch.cuda")
    cuda.__dict__.update(torch.cuda.__dict__)
    cuda.__getattr__ = lambda name: getattr(torch.cuda, name)  # lazy submodules
    cuda.current_device = lambda: _CPU
    if claim_available:
        cuda.is_available = lambda: True
    cuda.set_device = lambda *a, **k: None
    cuda.device_count = lambda: 1
    cuda.get_device_properties = lambda *a, **k: _cpu_properties()
    cuda.get_device_capability = lambda *a, **k: (0, 0)
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    cuda.Stream = _NullStream
    cuda.Event = _NullEvent
    cuda.current_stream = lambda *a, **k: _NullStream()
    cuda.default_stream = lambda *a, **k: _NullStream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.device = lambda *a, **k: contextlib.nullcontext()
    cuda.nvtx = _nvtx_namespace()
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    cuda.manual_seed = _cpu_manual_seed
    cuda.manual_seed_all = _cpu_manual_seed
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0
    cuda.memory_reserved = lambda *a, **k: 0
    cuda.random = types.SimpleNamespace(
        get_rng_state=cuda.get_rng_state, set_rng_state=cuda.set_rng_state
    )
    return cuda


def _build_torch_view(claim_available: bool = False) -> types.ModuleType:
    view = types.ModuleType("torch")
    view.__dict__.update(torch.__dict__)
    view.__getattr__ = lambda name: getattr(torch, name)
    for name in _FACTORIES:
        setattr(view, name, _cpu_factory(getattr(torch, name)))
    view.cuda = _build_cuda_view(claim_available)
    view.distributed = gloo_ops.distributed_view()  # operations a recovery can interrupt
    return view


def _called_from_megatron(depth: int = 2) -> bool:
    """Megatron's code, or its entry-point script's (core_v0.19's get_batch moves the batch
    with `.cuda()` in pretrain_gpt.py itself)."""
    name = sys._getframe(depth).f_globals.get("__name__", "")
    return name.startswith("megatron.") or name in _EXTRA_MODULES


def _patch_tensor_methods() -> None:
    """`Tensor.type()` strings and `.cuda()` as megatron-core (and only it) expects them."""
    original_type = torch.Tensor.type
    original_cuda = torch.Tensor.cuda

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and _called_from_megatron():
            name = original_type(self)
            return name.replace("torch.", "torch.cuda.", 1) if self.device.type == "cpu" else name
        return original_type(self, dtype, non_blocking, **kwargs)

    def cuda_(self, *args, **kwargs):
        if _called_from_megatron():
            return self
        return original_cuda(self, *args, **kwargs)

    original_module_cuda = torch.nn.Module.cuda

    def module_cuda(self, device=None):
        if _called_from_megatron():
            return self
        return original_module_cuda(self, device)

    torch.Tensor.type = type_
    torch.Tensor.cuda = cuda_
    torch.nn.Module.cuda = module_cuda


def _cpu_get_rng_state(device=None, clone=False, graph_safe=False):
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


def _no_fused_kernels(args) -> None:
    pass


@functools.cache
def _bound_operations() -> dict[int, tuple]:
    """id(torch's operation) -> (it, the interruptible view's), for item 5."""
    view = gloo_ops.distributed_view()
    names = [n for n in (*gloo_ops.COLLECTIVES, "_coalescing_manager")
             if hasattr(torch.distributed, n)]  # fmt: skip
    return {id(getattr(torch.distributed, n)): (getattr(torch.distributed, n), getattr(view, n))
            for n in names}  # fmt: skip


def patch_loaded_modules() -> int:
    """Give every loaded megatron.core module the CPU view of torch. Idempotent."""
    if not _ACTIVE:
        return 0
    patched = 0
    for name, module in list(sys.modules.items()):
        if module is None or not (name.startswith("megatron.") or name in _EXTRA_MODULES):
            continue
        if module.__dict__.get("torch") is torch:
            module.torch = _VIEW if name.startswith("megatron.core") else _TRAINING_VIEW
            patched += 1
        if name == "megatron.legacy.fused_kernels":  # CUDA kernels: nothing to build on a CPU
            module.load = _no_fused_kernels
        if name.endswith("tensor_parallel.random"):
            module._get_cuda_rng_state = _cpu_get_rng_state
            module._set_cuda_rng_state = _cpu_set_rng_state
        if name.endswith("transformer.moe.moe_utils") and "te_general_gemm" not in vars(module):
            module.te_general_gemm = None  # see item 4 of this module's docstring
        for key, value in list(vars(module).items()):  # item 5
            swap = _bound_operations().get(id(value))
            if swap is not None and swap[0] is value:
                setattr(module, key, swap[1])
        move = vars(module).get("maybe_move_tensor_to_cpu")
        if move is not None and not getattr(move, "_deadpool_cpu", False):
            module.maybe_move_tensor_to_cpu = _host_tensor_as_numpy(move)  # item 4
    return patched


def _sequence_parallel_norms() -> None:
    """Item 6: WrappedTorchNorm under sequence parallelism, as a GPU's norms behave."""
    try:
        from megatron.core.transformer.torch_norm import WrappedTorchNorm
    except ImportError:  # moved or removed in another megatron-core release
        return
    build = WrappedTorchNorm.__new__
    if getattr(build, "_deadpool_cpu", False):
        return

    @functools.wraps(build)
    def sequence_parallel_norm(cls, config, *args, **kwargs):
        if not config.sequence_parallel:
            return build(cls, config, *args, **kwargs)
        plain = copy.copy(config)  # a shallow copy: TransformerConfig's checks do not run again
        plain.sequence_parallel = False
        norm = build(cls, plain, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    sequence_parallel_norm._deadpool_cpu = True
    WrappedTorchNorm.__new__ = staticmethod(sequence_parallel_norm)


def _host_tensor_as_numpy(move):
    """megatron-core's maybe_move_tensor_to_cpu, for a tensor already in host memory: as the
    numpy array it gives for a GPU tensor when asked."""

    @functools.wraps(move)
    def cpu_move(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    cpu_move._deadpool_cpu = True
    return cpu_move


_VIEW: types.ModuleType | None = None
_TRAINING_VIEW: types.ModuleType | None = None


def should_activate(force_cpu: bool) -> bool:
    """Without a usable CUDA device the CPU backend is required; `--cpu` forces it."""
    return force_cpu or not torch.cuda.is_available()


def activate() -> None:
    """Import the megatron-core modules a training job uses, then route their CUDA to the CPU."""
    global _ACTIVE, _VIEW, _TRAINING_VIEW
    if _ACTIVE:
        patch_loaded_modules()
        return
    for name in _MODULES_TO_LOAD:
        try:
            importlib.import_module(name)
        except ImportError:  # moved or removed in another megatron-core release
            log.debug("megatron-core module %s not present", name)

    _VIEW = _build_torch_view()
    _TRAINING_VIEW = _build_torch_view(claim_available=True)
    _ACTIVE = True
    _patch_tensor_methods()
    _sequence_parallel_norms()
    count = patch_loaded_modules()
    log.debug("CPU backend active: %d megatron-core modules routed to the CPU", count)


def is_active() -> bool:
    return _ACTIVE
