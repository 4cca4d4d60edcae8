"""Read and write one rank's full state: its distributed-optimizer shard, its local model
parameters, and the metadata that makes a restored rank continue bitwise identically.

This is the single adapter between the snapshot/replication pipeline and megatron-core's
optimizer internals. The state is laid out as one flat byte range: the optimizer shard first
(fp32 main parameters, then each Adam state tensor, per parameter of every inner torch
optimizer), then the model parameters (TP/PP-local; every DP peer holds the same). Only the
first part is replicated; parameters come from a same-coordinate DP peer on recovery.

The layout is planned at start-up from parameter shapes, before the optimizer has state
(torch's AdamW creates it lazily on the first step), so host buffers are allocated once; the
first capture checks the live state against the plan.
"""

from __future__ import annotations

import torch

from ..checkpoint import metadata
from ..checkpoint.layout import Entry, StateLayout, align, itemsize, numel
from ..errors import DeadpoolError
from .digest import inner_optimizers
from .rng import capture_rng_state, restore_rng_state

# torch AdamW keeps `step` per parameter; TE/apex FusedAdam keep it in the param groups.
_ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


def capture_param_groups(optimizer) -> list[list[dict]]:
    """Every inner optimizer's param-group settings and state, without the parameters.

    Fused Adams (transformer-engine's, apex's; megatron-core picks them on GPUs) keep their
    step count here, not per parameter: a restored rank without it would restart bias
    correction. lr and weight decay ride along (the scheduler sets the same values).
    """
    return [
        [_group_state(group) for group in megatron_opt.optimizer.param_groups]
        for megatron_opt in inner_optimizers(optimizer)
    ]


def _group_state(group: dict) -> dict:
    return {
        k: v.detach().cpu().clone() if torch.is_tensor(v) else v
        for k, v in group.items()
        if k != "params"
    }


@torch.no_grad()
def restore_param_groups(optimizer, saved: list[list[dict]]) -> None:
    """Put captured param-group state back (a tensor step in place, where it is one)."""
    inner = inner_optimizers(optimizer)
    shape = [len(m.optimizer.param_groups) for m in inner]
    if [len(groups) for groups in saved] != shape:
        raise DeadpoolError(
            f"the snapshot holds param groups {[len(g) for g in saved]} per optimizer, this "
            f"rank's optimizer has {shape}"
        )
    for megatron_opt, groups in zip(inner, saved, strict=True):
        for live, entries in zip(megatron_opt.optimizer.param_groups, groups, strict=True):
            for key, value in entries.items():
                if torch.is_tensor(value) and torch.is_tensor(live.get(key)):
                    live[key].copy_(value)
                else:
                    live[key] = value


def _has_step_in_state(torch_opt) -> bool:
    return isinstance(torch_opt, (torch.optim.Adam, torch.optim.AdamW))


class RankState:
    """The live tensors of one rank, bound to a fixed StateLayout (a ProtectedState)."""

    def __init__(self, model: list, optimizer, scheduler):
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self._optimizer_specs = self._plan_optimizer()
        self._param_tensors = [
            (f"model{i}.{name}", p)
            for i, chunk in enumerate(model)
            for name, p in sorted(chunk.named_parameters())
        ]
        entries, offset = [], 0
        for name, dtype, shape in self._optimizer_specs:
            nbytes = numel(shape) * itemsize(dtype)
            entries.append(Entry(name, offset, nbytes, dtype, shape))
            offset = align(offset + nbytes)
        optimizer_nbytes = offset
        for name, p in self._param_tensors:
            entries.append(
                Entry(name, offset, p.numel() * p.element_size(), p.dtype, tuple(p.shape))
            )
            offset = align(offset + p.numel() * p.element_size())
        self.layout = StateLayout(tuple(entries), optimizer_nbytes, offset)
        self._bound: list[torch.Tensor] | None = None

    def _plan_optimizer(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        specs = []
        for j, megatron_opt in enumerate(inner_optimizers(self.optimizer)):
            torch_opt = megatron_opt.optimizer
            with_step = _has_step_in_state(torch_opt)
            for g, group in enumerate(torch_opt.param_groups):
                for k, main in enumerate(group["params"]):
                    base = f"opt{j}.g{g}.p{k}"
                    shape = tuple(main.shape)
                    specs.append((f"{base}.param", main.dtype, shape))
                    specs.extend((f"{base}.{m}", main.dtype, shape) for m in _ADAM_MOMENTS)
                    if with_step:
                        specs.append((f"{base}.step", torch.float32, ()))
        return specs

    def _live_optimizer_tensors(self) -> list[torch.Tensor]:
        tensors = []
        for megatron_opt in inner_optimizers(self.optimizer):
            torch_opt = megatron_opt.optimizer
            with_step = _has_step_in_state(torch_opt)
            for group in torch_opt.param_groups:
                for main in group["params"]:
                    state = torch_opt.state.get(main, {})
                    tensors.append(main)
                    keys = [*_ADAM_MOMENTS, "step"] if with_step else list(_ADAM_MOMENTS)
                    missing = [key for key in keys if key not in state]
                    if missing:
                        raise DeadpoolError(
                            f"optimizer state has no {missing} yet: snapshots start after the "
                            f"first optimizer step"
                        )
                    tensors.extend(state[key] for key in keys)
        return tensors

    def tensors(self) -> list[torch.Tensor]:
        """Live tensors in layout order (re-read: load_state_dict may replace state tensors)."""
        live = self._live_optimizer_tensors() + [p for _, p in self._param_tensors]
        for entry, t in zip(self.layout.entries, live, strict=True):
            if t.dtype != entry.dtype or tuple(t.shape) != entry.shape:
                raise DeadpoolError(
                    f"live tensor {entry.name} is {t.dtype}{tuple(t.shape)} but the snapshot "
                    f"layout planned {entry.dtype}{entry.shape}"
                )
        return live

    # -- metadata ---------------------------------------------------------------------------
    def capture_metadata(self, iteration: int, extra: dict) -> bytes:
        """Everything besides tensors that a restored rank needs, as bytes (JSON: a peer's
        replica never unpickles)."""
        grad_scaler = getattr(inner_optimizers(self.optimizer)[0], "grad_scaler", None)
        meta = {
            "iteration": iteration,
            "scheduler": self.scheduler.state_dict(),
            "grad_scaler": grad_scaler.state_dict() if grad_scaler is not None else None,
            "rng": capture_rng_state(),
            "param_groups": capture_param_groups(self.optimizer),
            **extra,
        }
        return metadata.encode(meta)

    def restore_metadata(self, meta: dict) -> None:
        # load_state_dict *advances* the scheduler by the saved step count: start from zero so a
        # surviving rank that rolls back lands on the saved count, not on the sum.
        self.scheduler.num_steps = 0
        self.scheduler.load_state_dict(meta["scheduler"])
        grad_scaler = getattr(inner_optimizers(self.optimizer)[0], "grad_scaler", None)
        if grad_scaler is not None and meta["grad_scaler"] is not None:
            grad_scaler.load_state_dict(meta["grad_scaler"])
        restore_rng_state(meta["rng"])
        restore_param_groups(self.optimizer, meta["param_groups"])

    # -- bulk copies ------------------------------------------------------------------------
    @torch.no_grad()
    def write_from(self, flat: torch.Tensor, optimizer: bool = True, params: bool = True) -> None:
        """Copy bytes of a flat host buffer back into the live tensors: the parameters first,
        then the optimizer shard, whose fp32 main parameters are views of this rank's slice
        of fp32 parameters (megatron-core's distributed optimizer): a peer's parameters,
        older there with an overlapped all-gather (gather_params), must not overwrite them."""
        n_opt = len(self._optimizer_specs)
        pairs = list(zip(self.layout.entries, self.tensors(), strict=True))
        for entry, t in (pairs[n_opt:] if params else []) + (pairs[:n_opt] if optimizer else []):
            src = flat[entry.offset : entry.offset + entry.nbytes]
            t.copy_(src.view(entry.dtype).view(entry.shape), non_blocking=False)

    @torch.no_grad()
    def gather_params(self) -> bool:
        """After a restore, with megatron-core's overlapped parameter all-gather
        (--overlap-param-gather): outside its optimizer shard a rank's parameters are those
        of the iteration before until the next forward gathers them, and so are the
        snapshot's. Gather them now, as that forward would have, from every rank's slice
        updated from its main parameters. A collective of every data-parallel group; False
        (nothing done) without the overlap."""
        chunks = [c for c in self.model if getattr(c, "use_forward_hook", False)]
        if not chunks:
            return False
        for inner in inner_optimizers(self.optimizer):
            copy = getattr(inner, "_copy_main_params_to_model_params", None)
            if copy is not None:
                copy()
        for chunk in chunks:
            chunk.start_param_sync(force_sync=True)
        return True
