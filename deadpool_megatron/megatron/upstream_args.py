"""Megatron-LM's command line as DeadPool reads it: the --deadpool* flags its parser gains, and
the flags of its own that DeadPool needs too, checked before any process group exists.

Pure argument parsing: it imports nothing of Megatron-LM, so the checks run (and are tested)
without a checkout.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Ramp:
    """--rampup-batch-size START INCREMENT SAMPLES: the global batch grows from START by
    INCREMENT, one step every SAMPLES / steps samples, up to --global-batch-size."""

    start: int
    increment: int
    samples: int
    final: int

    def batch(self, consumed: int) -> int:
        """The global batch asked for after `consumed` samples, as megatron-core's
        RampupBatchsizeNumMicroBatchesCalculator computes it."""
        if consumed > self.samples:
            return self.final
        per_step = self.samples / ((self.final - self.start) // self.increment)
        return self.start + int(consumed / per_step) * self.increment


def _ramp(ns: argparse.Namespace, dp: int) -> Ramp:
    """The ramp --rampup-batch-size asks for, checked before any process starts (Megatron-LM
    would fail on some of these at its first step of the ramp, or divide by zero)."""
    values = ns.rampup_batch_size
    shown = " ".join(values)
    try:
        start, increment, samples = (int(v) for v in values)
    except ValueError:
        raise ConfigError(
            f"--rampup-batch-size {shown}: give three integers, START INCREMENT SAMPLES (the "
            "first global batch, its increment, the samples the ramp takes)"
        ) from None
    final, unit = ns.global_batch_size, ns.micro_batch_size * dp
    if ns.train_samples is None:
        raise ConfigError(
            f"--rampup-batch-size {shown} needs a sample-based run (--train-samples, not "
            "--train-iters), as Megatron-LM's does"
        )
    if not (0 < start < final and increment > 0 and samples > 0):
        raise ConfigError(
            f"--rampup-batch-size {shown}: the start batch must be positive and less than "
            f"--global-batch-size {final}, the increment and the samples positive"
        )
    if (final - start) % increment:
        raise ConfigError(
            f"--rampup-batch-size {shown}: --global-batch-size {final} minus the start batch "
            f"{start} is not a multiple of the increment {increment}"
        )
    if not ns.decrease_batch_size_if_needed and (start % unit or increment % unit):
        raise ConfigError(
            f"--rampup-batch-size {shown}: every batch of the ramp must be a multiple of "
            f"--micro-batch-size {ns.micro_batch_size} x data-parallel size {dp} = {unit}; "
            f"use a start batch and an increment that are (or --decrease-batch-size-if-needed)"
        )
    return Ramp(start, increment, samples, final)


@dataclass(frozen=True)
class StepSchedule:
    """--step-batch-size-schedule "THRESHOLD:BATCH ...": the global batch is BATCH from
    THRESHOLD on (Megatron-LM core_v0.18 and later), as (samples, batch) pairs, ascending."""

    steps: tuple[tuple[int, int], ...]

    def batch(self, consumed: int) -> int:
        """The global batch after `consumed` samples, as megatron-core's
        StepBatchsizeNumMicroBatchesCalculator gives it: the last step reached."""
        return [b for threshold, b in self.steps if consumed >= threshold][-1]


def _count(text: str) -> int:
    """A schedule's number as megatron-core reads it: K, M, B or T (1e3 ... 1e12) may follow."""
    scale = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}
    text = text.strip().upper()
    return int(float(text[:-1] if text[-1:] in scale else text) * scale.get(text[-1:], 1))


def _step_schedule(ns: argparse.Namespace, argv: list[str], dp: int) -> StepSchedule:
    """The schedule --step-batch-size-schedule asks for, checked before any process starts
    as megatron-core checks it when Megatron-LM sets up (an assertion there), with the
    flags Megatron-LM refuses beside it. Its thresholds are tokens: samples of
    --seq-length tokens, rounded down, as Megatron-LM passes its --seq-length."""
    shown = ns.step_batch_size_schedule
    if ns.rampup_batch_size is not None:
        raise ConfigError(
            f"--rampup-batch-size {' '.join(ns.rampup_batch_size)} with --step-batch-size-"
            f"schedule {shown!r}: this Megatron-LM ignores the first; give the schedule only"
        )
    if _given(argv, "--global-batch-size"):
        raise ConfigError(
            f"--step-batch-size-schedule {shown!r} with --global-batch-size "
            f"{ns.global_batch_size}: Megatron-LM refuses both; the schedule's last batch is "
            "the global batch"
        )
    if ns.decrease_batch_size_if_needed:
        raise ConfigError(
            f"--step-batch-size-schedule {shown!r} with --decrease-batch-size-if-needed: "
            "megatron-core's step schedules refuse it"
        )
    steps = []
    for entry in shown.replace(",", " ").split():
        threshold, _, batch = entry.partition(":")
        try:
            steps.append((_count(threshold), _count(batch)))
        except ValueError:
            raise ConfigError(
                f"--step-batch-size-schedule {shown!r}: entry {entry!r} is not THRESHOLD:BATCH "
                "(numbers, K/M/B/T allowed: '0:256 250B:512')"
            ) from None
    read = "samples"
    if ns.seq_length is not None:
        steps = [(threshold // ns.seq_length, batch) for threshold, batch in steps]
        read = f"samples of --seq-length {ns.seq_length} tokens"
    steps.sort()
    thresholds = [threshold for threshold, _ in steps]
    if not steps or thresholds[0] != 0:
        raise ConfigError(
            f"--step-batch-size-schedule {shown!r}: the first threshold must be 0 (in {read}; "
            f"got {thresholds[:1] or 'no entry'})"
        )
    if len(set(thresholds)) < len(thresholds):
        raise ConfigError(
            f"--step-batch-size-schedule {shown!r}: two thresholds fall on the same sample "
            f"({thresholds}, in {read})"
        )
    unit = ns.micro_batch_size * dp
    # A job from a checkpoint (--load) may be past the schedule's first steps, which
    # Megatron-LM then never trains: it checks the batch it is at only.
    checked = steps[-1:] if ns.load else steps
    wrong = [batch for _, batch in checked if batch <= 0 or batch % unit]
    if wrong:
        raise ConfigError(
            f"--step-batch-size-schedule {shown!r}: every batch must be a positive multiple "
            f"of --micro-batch-size {ns.micro_batch_size} x data-parallel size {dp} = {unit} "
            f"(not {wrong})"
        )
    batches = [batch for _, batch in steps]
    if batches != sorted(batches):
        raise ConfigError(
            f"--step-batch-size-schedule {shown!r}: a batch smaller than the one before "
            f"({batches}); Megatron-LM's loop stops where its micro-batches would decrease"
        )
    return StepSchedule(tuple(steps))


def _train_iters(
    iters: int | None, samples: int | None, global_batch: int, ramp: Ramp | None = None,
    schedule: StepSchedule | None = None,
) -> int:  # fmt: skip
    """The iterations a run trains: --train-iters, or for a sample-based run as Megatron-LM's
    update_train_iters counts them: whole global batches, through the ramp first if any
    (its last partial batch thrown away); by a step schedule, until the samples are
    reached (its last batch may pass them)."""
    if (iters is None) == (samples is None):
        given = "both" if iters is not None else "neither"
        raise ConfigError(
            f"--deadpool with Megatron-LM needs --train-iters or --train-samples (got {given})"
        )
    if samples is None:
        return iters
    if schedule is not None:
        iterations = consumed = 0
        while consumed < samples:
            consumed += schedule.batch(consumed)
            iterations += 1
        return iterations
    first = global_batch if ramp is None else ramp.start
    if samples < first:
        raise ConfigError(
            f"--train-samples {samples} is less than one global batch ({first}): "
            f"use at least {first}"
        )
    if ramp is None:
        return samples // global_batch
    iterations = consumed = 0
    while consumed <= ramp.samples and consumed <= samples:
        consumed += ramp.batch(consumed)
        iterations += 1
    if samples > consumed:
        iterations += (samples - consumed) // global_batch
    return iterations


def parse_job_config(argv: list[str], world_size: int, step_schedule: bool = False) -> JobConfig:
    """DeadPool's view of a Megatron-LM command line; raises ConfigError naming a bad value.
    Megatron-LM parses and checks the rest itself. `step_schedule`: this Megatron-LM's batch
    size follows --step-batch-size-schedule and ignores --rampup-batch-size (core_v0.18 and
    later)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag, kind, default in _SHARED_FLAGS:
        if kind is None:
            parser.add_argument(flag, action="store_true", default=default)
        else:
            parser.add_argument(flag, type=kind, default=default)
    parser.add_argument("--train-samples", type=int, default=None)  # no JobConfig field
    parser.add_argument("--eval-interval", type=int, default=None)  # neither
    parser.add_argument("--rampup-batch-size", nargs="*", default=None)  # neither
    parser.add_argument("--decrease-batch-size-if-needed", action="store_true")  # neither
    parser.add_argument("--step-batch-size-schedule", default=None)  # neither
    parser.add_argument("--seq-length", type=int, default=None)  # neither
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
    ns.metrics_jsonl = ns.deadpool_metrics_jsonl
    dp = check_model_parallel(
        world_size, ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size
    )
    if ns.micro_batch_size is None:
        raise ConfigError("--deadpool with Megatron-LM needs --micro-batch-size")
    schedule = ramp = None
    if step_schedule and ns.deadpool:
        if ns.rampup_batch_size is not None and ns.step_batch_size_schedule is None:
            raise ConfigError(
                f"--rampup-batch-size {' '.join(ns.rampup_batch_size)}: this Megatron-LM "
                "(core_v0.18 and later) ignores it and trains every iteration at "
                "--global-batch-size; its ramp is --step-batch-size-schedule"
            )
        if ns.step_batch_size_schedule is not None:
            schedule = _step_schedule(ns, argv, dp)
            ns.global_batch_size = schedule.steps[-1][1]  # what its calculator reports
    if ns.global_batch_size is None:
        ns.global_batch_size = ns.micro_batch_size * dp
    if ns.rampup_batch_size is not None:
        ramp = _ramp(ns, dp)
    ns.train_iters = _train_iters(ns.train_iters, ns.train_samples, ns.global_batch_size, ramp,
                                  schedule)  # fmt: skip
    cfg = build_job_config(ns)
    validate_deadpool(cfg, dp, eval_interval=ns.eval_interval or 0)
    return cfg
