#!/usr/bin/env python
"""Pretrain a GPT with megatron-core, protected by deadpool-megatron.

Start it with `deadpool-launch --nproc-per-node N [--spares S] pretrain_gpt.py ARGS` (or plainly
for one process). `--help` lists every flag; `--config configs/demo.yaml` loads a ready job.
"""

from __future__ import annotations

import logging
import os
import sys

from deadpool_megatron.errors import ConfigError
from deadpool_megatron.logging_setup import setup_logging
from deadpool_megatron.megatron.arguments import parse_job_args
from deadpool_megatron.runtime import ROLE_SPARE, ProcessEnv, write_preflight


def main(argv: list[str] | None = None) -> int:
    env = ProcessEnv.from_environ()
    try:
        cfg = parse_job_args(argv, env.world_size)
    except ConfigError as err:
        print(f"pretrain_gpt.py: error: {err}", file=sys.stderr)
        return ConfigError.exit_code
    if env.preflight:
        write_preflight(cfg)
        return 0
    setup_logging("" if env.under_launcher else f"rank {env.rank}")
    if env.role == ROLE_SPARE:
        from deadpool_megatron.process.spare import run_spare

        return run_spare(env, cfg)
    from deadpool_megatron.process.worker import run_worker

    return run_worker(cfg, env)


if __name__ == "__main__":
    code = main()
    # Everything is written and every process group destroyed; the interpreter's own teardown
    # of torch and megatron-core takes seconds per process and has nothing left to flush.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
