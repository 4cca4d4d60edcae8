#!/usr/bin/env python
"""pretrain_gpt.py with Adam as apex's and transformer-engine's FusedAdam keep it: the step
count in each param group, only exp_avg/exp_avg_sq per parameter. megatron-core picks such an
optimizer whenever apex is installed (its module-level `Adam` and flags, as set below);
neither apex nor transformer-engine runs on CPU, so this script puts the same arithmetic, in
plain torch, where megatron-core looks for apex's. Flags as pretrain_gpt.py's.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


class GroupStepAdam(torch.optim.Optimizer):
    """apex.optimizers.FusedAdam's update (bias correction from the group's step, AdamW or
    L2 weight decay), one tensor at a time."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 adam_w_mode=True, weight_decay=0.0):  # fmt: skip
        super().__init__(params, dict(lr=lr, bias_correction=bias_correction, betas=betas,
                                      eps=eps, weight_decay=weight_decay))  # fmt: skip
        self.adam_w_mode = adam_w_mode

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            if not group["params"]:
                continue  # as FusedAdam: an empty group's step does not advance
            group["step"] = group.get("step", 0) + 1
            beta1, beta2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            bc1 = 1 - beta1 ** group["step"] if group["bias_correction"] else 1.0
            bc2 = 1 - beta2 ** group["step"] if group["bias_correction"] else 1.0
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                grad = p.grad if self.adam_w_mode or wd == 0 else p.grad.add(p, alpha=wd)
                state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                update = (state["exp_avg"] / bc1) / ((state["exp_avg_sq"] / bc2).sqrt() + eps)
                if self.adam_w_mode and wd != 0:
                    update.add_(p, alpha=wd)
                p.add_(update, alpha=-lr)


if __name__ == "__main__":
    import megatron.core.optimizer as megatron_optimizer
    from megatron.core.optimizer import distrib_optimizer

    # What `from apex.optimizers import FusedAdam as Adam` succeeding sets in megatron-core.
    megatron_optimizer.Adam = distrib_optimizer.Adam = GroupStepAdam
    megatron_optimizer.USING_PYTORCH_OPTIMIZER = False
    distrib_optimizer.HAVE_APEX_OR_TE = distrib_optimizer.USING_APEX_OPTIMIZER = True

    import pretrain_gpt

    code = pretrain_gpt.main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
