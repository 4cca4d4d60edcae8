"""One process with no peers builds two ranks' states of the 8-process demo shape (TP2 x PP2
x DP2) on stand-in groups, as an idle spare does, and prints as JSON what each was built for
(its embedding shard's vocabulary range, its pipeline stage's ends, the optimizer's shard of
its data-parallel rank) and what is left of torch.distributed afterwards."""

from __future__ import annotations

import json

import torch.distributed as dist

from deadpool_megatron.megatron.arguments import parse_job_args
from deadpool_megatron.megatron.prebuild import prebuild


def describe(built) -> dict:
    model = built.state.model[0].module
    embedding = getattr(model, "embedding", None)
    words = embedding.word_embeddings if embedding is not None else None
    shard_numel = sum(p.numel() for group in built.state.optimizer.param_groups
                      for p in group["params"])  # fmt: skip
    return {
        "vocab_range": [words.vocab_start_index, words.vocab_end_index] if words else None,
        "pre_process": model.pre_process,
        "post_process": model.post_process,
        "optimizer_shard_numel": shard_numel,
        "stage_numel": sum(p.numel() for p in model.parameters()),
        "roles": sorted({role for role, _ in built.roles.values()}),
        "build_calls": [c.name for c in built.state.build_calls],
        "hooks_cut": sum(map(len, built.hooks)),
        "hooks_left": sum(map(len, built.state.hook_tables)),
    }


def main() -> dict:
    cfg = parse_job_args(["--config", "configs/demo.yaml"], 8)
    out = {}
    for rank in (3, 5):  # (tp 1, dp 1, pp 0) and (tp 1, dp 0, pp 1)
        out[rank] = describe(prebuild(cfg, rank, 8))
        out[rank]["initialized_after"] = dist.is_initialized()
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
