"""Megatron-LM's command line as DeadPool reads it: the --deadpool* flags its parser gains, and
the flags of its own that DeadPool needs too, checked before any process group exists.

Pure argument parsing: it imports nothing of Megatron-LM, so the checks run (and are tested)
without a checkout.
"""

from __future__ import annotations

import argparse

from ..config import JobConfig
from ..errors import ConfigError
from ..flags import add_config_flags, build_job_config
from ..validation import check_model_parallel, validate_deadpool

# Megatron-LM's flags DeadPool reads too, under their JobConfig field names (same spelling).
_SHARED_FLAGS: tuple[tuple[str, type | None, object], ...] = (
    ("--tensor-model-parallel-size", int, 1),
    ("--pipeline-model-parallel-size", int, 1),
    ("--expert-model-parallel-size", int, 1),
    ("--expert-tensor-parallel-size", int, None),
    ("--micro-batch-size", int, None),
    ("--global-batch-size", int, None),
    ("--train-iters", int, None),
    ("--exit-interval", int, None),
    ("--exit-signal-handler", None, False),
    ("--seed", int, 1234),
    ("--save", str, None),
    ("--load", str, None),
    ("--save-interval", int, None),
    ("--distributed-timeout-minutes", int, 10),
    ("--use-distributed-optimizer", None, False),
)
METRICS_FLAG = "--deadpool-metrics-jsonl"


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM's extra-arguments hook: the --deadpool* flags, help text included."""
    add_config_flags(parser, groups=("deadpool",))
    parser.add_argument(
        METRICS_FLAG,
        default=None,
        metavar="FILE",
        help="Write each iteration's exact loss and the final state digest as JSON lines.",
    )
    return parser


def _given(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def _train_iters(iters: int | None, samples: int | None, global_batch: int) -> int:
    """The iterations a run trains: --train-iters, or for a sample-based run as Megatron-LM's
    update_train_iters counts them without a batch-size ramp (whole global batches)."""
    if (iters is None) == (samples is None):
        given = "both" if iters is not None else "neither"
        raise ConfigError(
            f"--deadpool with Megatron-LM needs --train-iters or --train-samples (got {given})"
        )
    if samples is None:
        return iters
    if samples < global_batch:
        raise ConfigError(
            f"--train-samples {samples} is less than one global batch ({global_batch}): "
            f"use at least {global_batch}"
        )
    return samples // global_batch


def parse_job_config(argv: list[str], world_size: int) -> JobConfig:
    """DeadPool's view of a Megatron-LM command line; raises ConfigError naming a bad value.
    Megatron-LM parses and checks the rest itself."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag, kind, default in _SHARED_FLAGS:
        if kind is None:
            parser.add_argument(flag, action="store_true", default=default)
        else:
            parser.add_argument(flag, type=kind, default=default)
    parser.add_argument("--train-samples", type=int, default=None)  # no JobConfig field
    parser.add_argument("--eval-interval", type=int, default=None)  # neither
    add_arguments(parser)
    ns, _ = parser.parse_known_args(argv)
    if _given(argv, "--inprocess-restart"):
        raise ConfigError(
            "--inprocess-restart and --deadpool both recover a failed job in-process; use one"
        )
    for fsdp in ("--use-megatron-fsdp", "--use-torch-fsdp2"):
        if ns.deadpool and _given(argv, fsdp):
            raise ConfigError(
                f"{fsdp} is not supported with --deadpool: it shards the parameters over the "
                "data-parallel ranks, so no peer holds a lost rank's parameters to give a spare; "
                "use --use-distributed-optimizer (the optimizer state sharded, the parameters "
                "whole on every data-parallel rank)"
            )
    if _given(argv, "--rampup-batch-size"):
        raise ConfigError(
            "--rampup-batch-size is not supported with --deadpool: the samples consumed by "
            "an iteration must not depend on where the batch size ramp stood"
        )
    ns.metrics_jsonl = ns.deadpool_metrics_jsonl
    dp = check_model_parallel(
        world_size, ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size
    )
    if ns.micro_batch_size is None:
        raise ConfigError("--deadpool with Megatron-LM needs --micro-batch-size")
    if ns.global_batch_size is None:
        ns.global_batch_size = ns.micro_batch_size * dp
    ns.train_iters = _train_iters(ns.train_iters, ns.train_samples, ns.global_batch_size)
    cfg = build_job_config(ns)
    validate_deadpool(cfg, dp, eval_interval=ns.eval_interval or 0)
    return cfg
