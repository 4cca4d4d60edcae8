#!/usr/bin/env python
"""Pretrain a GPT with megatron-core, protected by deadpool-megatron.

Start it with `deadpool-launch --nproc-per-node N [--spares S] pretrain_gpt.py ARGS` (or plainly
for one process). `--help` lists every flag; `--config configs/demo.yaml` loads a ready job.
"""

from __future__ import annotations

from deadpool_megatron.megatron.arguments import parse_job_args
from deadpool_megatron.runtime import end_process


def main(argv: list[str] | None = None) -> int:
    from deadpool_megatron.process.entry import run_process

    def train(cfg, env, exit_signal) -> int:
        from deadpool_megatron.process.worker import run_worker

        return run_worker(cfg, env, exit_signal=exit_signal)

    return run_process(lambda env: parse_job_args(argv, env.world_size), train)


if __name__ == "__main__":
    # Everything is written and every process group destroyed; the interpreter's own teardown
    # of torch and megatron-core takes seconds per process and has nothing left to flush.
    end_process(main())
