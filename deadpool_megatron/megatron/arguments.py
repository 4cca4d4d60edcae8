"""The pretrain_gpt.py command line: Megatron-LM's flag names, plus --config FILE.

Importing this module must stay cheap (no torch): arguments are validated before anything
heavy is imported, so a bad flag costs a fraction of a second and is reported once.
"""

from __future__ import annotations

import argparse

from ..config import JobConfig
from ..flags import add_config_flags, build_job_config, load_config_file
from ..validation import validate


def build_parser(prog: str = "pretrain_gpt.py") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Train a GPT with megatron-core (3D parallel, CPU/gloo or GPU/NCCL). "
        "Start it with deadpool-launch (several processes, spares) or plainly for one process.",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="YAML file of flag values (e.g. configs/demo.yaml); flags given on the command "
        "line override it.",
    )
    add_config_flags(parser)
    return parser


def parse_job_args(argv: list[str] | None, world_size: int) -> JobConfig:
    """Parse and validate; raises ConfigError (exit status 2) naming the bad value."""
    ns = build_parser().parse_args(argv)
    file_values = load_config_file(ns.config) if ns.config else {}
    return validate(build_job_config(ns, file_values), world_size)
