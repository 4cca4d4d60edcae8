"""state_digest: one sha256 over every rank's parameters and full optimizer state.

Two runs are the same run only if this digest matches: it covers the model parameters of
every chunk, and for every torch optimizer inside Megatron's (chained, distributed) optimizer
its param-group settings and state (where fused Adams keep their step), its fp32 main
parameters and every state tensor (step, exp_avg, exp_avg_sq), in rank order.
"""

from __future__ import annotations

import hashlib
import logging

import torch

from .exchange import all_gather_bytes

log = logging.getLogger("deadpool.training")


def inner_optimizers(optimizer) -> list:
    """The megatron optimizers inside a ChainedOptimizer (or the optimizer itself)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _update(h, tensor: torch.Tensor) -> None:
    t = tensor.detach().contiguous().cpu()
    h.update(str((t.dtype, tuple(t.shape))).encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def _update_entry(h, key: str, value) -> None:
    h.update(key.encode())
    if torch.is_tensor(value):
        _update(h, value)
    else:
        h.update(repr(value).encode())


def local_digest(model: list, optimizer) -> str:
    h = hashlib.sha256()
    for i, chunk in enumerate(model):
        for name, param in sorted(chunk.named_parameters()):
            h.update(f"model{i}.{name}".encode())
            _update(h, param)
    for j, megatron_opt in enumerate(inner_optimizers(optimizer)):
        torch_opt = megatron_opt.optimizer
        for g, group in enumerate(torch_opt.param_groups):
            h.update(f"opt{j}.group{g}".encode())
            for key in sorted(k for k in group if k != "params"):
                _update_entry(h, key, group[key])
            for k, main_param in enumerate(group["params"]):
                h.update(f"opt{j}.group{g}.param{k}".encode())
                _update(h, main_param)
                for key, value in sorted(torch_opt.state.get(main_param, {}).items()):
                    _update_entry(h, key, value)
    return h.hexdigest()


def state_digest(model: list, optimizer) -> str:
    """Collective over the default group: every rank gets the same job-wide digest."""
    return _of_job(all_gather_bytes(local_digest(model, optimizer).encode()))


def _of_job(everyone: list[bytes]) -> str:
    """The job-wide digest of every rank's local one, in rank order."""
    return hashlib.sha256(b"".join(everyone)).hexdigest()


def final_digest(model: list, optimizer, iteration: int) -> str | None:
    """`state_digest` once training has ended, its final save committed (its last barrier
    comes after the tracker's write); None when the gather fails because a rank was lost
    since (or a recovery that loss ordered cut it): nothing of the training is lost, so the
    job ends as finished, without the check, rather than as failed."""
    mine = local_digest(model, optimizer).encode()
    try:
        everyone = all_gather_bytes(mine)
    except RuntimeError as err:  # gloo's and NCCL's errors, a peer's loss or a cut
        log.warning("training finished at iteration %d, but a rank was lost before the final "
                    "state digest was gathered: no digest (%s)", iteration,
                    (str(err).splitlines() or [type(err).__name__])[0][:200])  # fmt: skip
        return None
    return _of_job(everyone)
