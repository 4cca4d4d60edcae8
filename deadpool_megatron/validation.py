"""A job's configuration checked once, before any process group exists: every value and
combination, with derived defaults filled in. Pure (no I/O but file checks); a bad value raises
:class:`ConfigError` whose message names it and what would be valid."""

from __future__ import annotations

import math
import os

from .config import JobConfig
from .endpoints import etcd_security
from .errors import ConfigError
from .failure.hang import HangPolicy
from .failure.heartbeat import check_heartbeat_times
from .failure.inject import parse_faults
from .runtime import ENV_SPARES


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def validate(cfg: JobConfig, world_size: int) -> JobConfig:
    """Check every value and combination; fill derived defaults. Pure: no I/O but file checks."""
    p, m, t, d, c, lg = cfg.parallel, cfg.model, cfg.training, cfg.data, cfg.checkpoint, cfg.logging
    for name, value in cfg.flat().items():  # nan passes every range check below: refuse it first
        _require(
            not isinstance(value, float) or math.isfinite(value),
            f"--{name.replace('_', '-')}={value} must be a finite number",
        )
    for name, value in (
        ("world size", world_size),
        ("--tensor-model-parallel-size", p.tensor_model_parallel_size),
        ("--pipeline-model-parallel-size", p.pipeline_model_parallel_size),
        ("--num-layers", m.num_layers),
        ("--hidden-size", m.hidden_size),
        ("--num-attention-heads", m.num_attention_heads),
        ("--seq-length", m.seq_length),
        ("--vocab-size", m.vocab_size),
        ("--micro-batch-size", t.micro_batch_size),
        ("--global-batch-size", t.global_batch_size),
        ("--train-iters", t.train_iters),
        ("--log-interval", lg.log_interval),
    ):
        _require(value >= 1, f"{name}={value} is invalid: it must be a positive integer")
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    dp = check_model_parallel(world_size, tp, pp)
    _require(
        t.global_batch_size % (t.micro_batch_size * dp) == 0,
        f"--global-batch-size {t.global_batch_size} is not divisible by --micro-batch-size "
        f"{t.micro_batch_size} x data-parallel size {dp} = {t.micro_batch_size * dp}; use a "
        f"multiple of {t.micro_batch_size * dp}",
    )
    _require(
        p.expert_model_parallel_size == 1 and p.expert_tensor_parallel_size in (None, tp),
        f"--expert-model-parallel-size {p.expert_model_parallel_size} / "
        f"--expert-tensor-parallel-size {p.expert_tensor_parallel_size}: this pretrain_gpt.py "
        "builds no experts (Megatron-LM's does, with --num-experts: run its pretrain_gpt.py "
        "under deadpool-launch); leave them out",
    )
    _require(
        m.num_attention_heads % tp == 0,
        f"--num-attention-heads {m.num_attention_heads} is not divisible by "
        f"--tensor-model-parallel-size {tp}; use a multiple of {tp}",
    )
    _require(
        m.hidden_size % m.num_attention_heads == 0,
        f"--hidden-size {m.hidden_size} is not divisible by --num-attention-heads "
        f"{m.num_attention_heads}",
    )
    _require(
        m.num_layers % pp == 0,
        f"--num-layers {m.num_layers} is not divisible by --pipeline-model-parallel-size {pp}; "
        f"use a multiple of {pp}",
    )
    if m.ffn_hidden_size is None:
        m.ffn_hidden_size = 4 * m.hidden_size
    _require(
        m.ffn_hidden_size % tp == 0,
        f"--ffn-hidden-size {m.ffn_hidden_size} is not divisible by "
        f"--tensor-model-parallel-size {tp}",
    )
    if m.max_position_embeddings is None:
        m.max_position_embeddings = m.seq_length
    _require(
        m.max_position_embeddings >= m.seq_length,
        f"--max-position-embeddings {m.max_position_embeddings} is smaller than --seq-length "
        f"{m.seq_length}",
    )
    _require(
        m.vocab_size % tp == 0,
        f"--vocab-size {m.vocab_size} is not divisible by --tensor-model-parallel-size {tp}",
    )
    vp = p.num_layers_per_virtual_pipeline_stage
    if vp is not None:
        _require(vp >= 1, f"--num-layers-per-virtual-pipeline-stage={vp} must be positive")
        _require(
            pp > 1 and m.num_layers % (pp * vp) == 0,
            f"--num-layers-per-virtual-pipeline-stage {vp} needs "
            f"--pipeline-model-parallel-size > 1 and --num-layers {m.num_layers} divisible by "
            f"pipeline size x layers per virtual stage = {pp * vp}",
        )
        micro_batches = t.global_batch_size // (t.micro_batch_size * dp)
        _require(
            micro_batches % pp == 0,
            f"the interleaved schedule needs micro-batches per iteration ({micro_batches}) to "
            f"be a multiple of --pipeline-model-parallel-size {pp}",
        )
    _require(
        not (t.bf16 and t.fp16), "--bf16 and --fp16 are both set; choose at most one precision"
    )
    _require(t.lr > 0, f"--lr={t.lr} must be positive")
    timeout = cfg.system.distributed_timeout_minutes
    _require(timeout > 0, f"--distributed-timeout-minutes={timeout} must be positive")
    _require(0 <= t.min_lr <= t.lr, f"--min-lr={t.min_lr} must lie between 0 and --lr={t.lr}")
    _require(t.lr_warmup_iters >= 0, f"--lr-warmup-iters={t.lr_warmup_iters} must be >= 0")
    _require(t.clip_grad >= 0, f"--clip-grad={t.clip_grad} must be >= 0")
    _require(
        0.0 <= m.hidden_dropout < 1.0 and 0.0 <= m.attention_dropout < 1.0,
        "--hidden-dropout and --attention-dropout must lie in [0, 1)",
    )
    if t.exit_interval is not None:
        _require(t.exit_interval >= 1, f"--exit-interval={t.exit_interval} must be positive")
    if t.lr_decay_iters is None:
        t.lr_decay_iters = t.train_iters
    for prefix in d.data_path:
        if _is_weight(prefix):
            continue
        for ext in (".bin", ".idx"):
            _require(
                os.path.isfile(prefix + ext),
                f"--data-path {prefix!r}: {prefix + ext} does not exist; pass the prefix of a "
                f"Megatron indexed dataset (PREFIX.bin and PREFIX.idx), e.g. one written by "
                f"scripts/preprocess_data.py",
            )
    _require(not c.async_save or bool(c.save), "--async-save needs --save DIR")
    if c.save_interval is not None:
        _require(
            c.save_interval >= 1, f"--save-interval={c.save_interval} must be a positive integer"
        )
        _require(c.save is not None, "--save-interval is set but --save is not; pass --save DIR")
    if c.load is not None:
        # --save DIR --load DIR before DIR exists is Megatron's resume-if-present pattern (a
        # restarted attempt loads what the first one saved); any other missing --load is a typo.
        _require(
            os.path.isdir(c.load) or _same_path(c.load, c.save),
            f"--load {c.load!r} is not a directory; pass a directory written by --save (or the "
            "same directory as --save, to resume from it once it exists)",
        )
    validate_deadpool(cfg, dp)
    return cfg


def _same_path(a: str, b: str | None) -> bool:
    return b is not None and os.path.abspath(a) == os.path.abspath(b)


def check_model_parallel(world_size: int, tp: int, pp: int) -> int:
    """The data-parallel size, once TP x PP is known to divide the world size."""
    _require(
        tp >= 1 and pp >= 1 and world_size % (tp * pp) == 0,
        f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
        f"--pipeline-model-parallel-size {pp} = {tp * pp}; use a world size that is a multiple "
        f"of {tp * pp}",
    )
    return world_size // (tp * pp)


def validate_deadpool(cfg: JobConfig, dp: int, eval_interval: int | None = None) -> None:
    """The --deadpool* flags. `eval_interval`: Megatron-LM's --eval-interval (0 where it
    does not evaluate); None for our pretrain_gpt.py, which never evaluates."""
    dpc = cfg.deadpool
    _require(
        dpc.deadpool_snapshot_interval >= 1,
        f"--deadpool-snapshot-interval={dpc.deadpool_snapshot_interval} must be a positive integer",
    )

    check_heartbeat_times(dpc.deadpool_heartbeat_interval, dpc.deadpool_heartbeat_timeout)
    HangPolicy.from_config(dpc)  # raises ConfigError naming the flag
    _require(
        dpc.deadpool_node_timeout > dpc.deadpool_heartbeat_interval,
        f"--deadpool-node-timeout={dpc.deadpool_node_timeout} must be longer than "
        f"--deadpool-heartbeat-interval={dpc.deadpool_heartbeat_interval} (the lease's renewal)",
    )
    _require(
        dpc.deadpool_health_check_interval >= 0,
        f"--deadpool-health-check-interval={dpc.deadpool_health_check_interval} must be 0 (off) "
        "or a positive number of seconds",
    )
    if dpc.deadpool_store == "etcd":
        _require(
            bool(dpc.deadpool_etcd_endpoints),
            "--deadpool-store etcd needs --deadpool-etcd-endpoints http://HOST:PORT[,...]",
        )
        etcd_security(dpc.deadpool_etcd_cacert, dpc.deadpool_etcd_cert, dpc.deadpool_etcd_key,
                      dpc.deadpool_etcd_user, dpc.deadpool_etcd_endpoints)  # fmt: skip
    if dpc.deadpool_on_unrecoverable is None:
        dpc.deadpool_on_unrecoverable = "checkpoint-restart" if cfg.checkpoint.save else "stop"
    _require(
        dpc.deadpool_on_unrecoverable == "stop" or bool(cfg.checkpoint.save),
        "--deadpool-on-unrecoverable checkpoint-restart needs --save DIR (and --save-interval) "
        "to restart from; use --deadpool-on-unrecoverable stop without persistent checkpoints",
    )
    if dpc.deadpool_chaos_mtbf is not None:
        _require(
            dpc.deadpool_chaos_mtbf > 0,
            f"--deadpool-chaos-mtbf={dpc.deadpool_chaos_mtbf} must be a positive number of seconds",
        )
    if dpc.deadpool_inject:
        spares = os.environ.get(ENV_SPARES)  # set by deadpool-launch's preflight
        faults = parse_faults(dpc.deadpool_inject, world_size=cfg_world_size(cfg, dp),
                              spares=int(spares) if spares is not None else None,
                              last_iteration=_known_end(cfg))  # fmt: skip
        for fault in faults:
            if fault.phase == "evaluate":
                _check_evaluate_fault(str(fault), fault.iteration, eval_interval)
            _require(
                eval_interval is None or fault.phase not in OUR_STEP_PHASES,
                f"--deadpool-inject {fault}: phase {fault.phase} strikes inside our "
                "pretrain_gpt.py's training step; Megatron-LM's train_step has no hook there, so "
                "the fault would never fire: use forward (the iteration's start), snapshot, "
                "replicate, save, evaluate, digest or finish",
            )
    _require(
        dpc.deadpool_spare_prebuild >= 0,
        f"--deadpool-spare-prebuild={dpc.deadpool_spare_prebuild} must be 0 (off) or the "
        "number of ranks each spare builds a model for while idle",
    )
    if not dpc.deadpool:
        return
    _require(
        cfg.parallel.use_distributed_optimizer,
        "--deadpool needs --use-distributed-optimizer: the optimizer shard each DP rank owns is "
        "what the ring replicates",
    )
    _require(
        0 <= dpc.deadpool_replicas <= dp - 1,
        f"--deadpool-replicas {dpc.deadpool_replicas} needs 0 <= K <= data-parallel size - 1 "
        f"(data-parallel size is {dp}; a replica lives on another DP rank of the same TP/PP "
        f"coordinates; 0 keeps local snapshots only: transient failures are reset in place, "
        f"a lost process is not recoverable in memory)",
    )
    _check_expert_parallel(cfg, dp)


def _check_expert_parallel(cfg: JobConfig, dp: int) -> None:
    """A spare restores a lost rank's parameters from a rank holding the same ones: with
    expert parallelism, one holding the same experts. Where expert parallelism is as wide as
    data parallelism, each expert lives on one rank only and nobody could give them."""
    from .topology import job_topology

    p = cfg.parallel
    try:
        topo = job_topology(cfg_world_size(cfg, dp), p)
    except ConfigError as err:
        raise ConfigError(
            f"--expert-model-parallel-size {p.expert_model_parallel_size}: {err}"
        ) from None
    if not topo.experts_apart:
        return  # every DP peer holds the same parameters
    alone = topo.sole_parameter_holders()
    if alone:
        widest = dp * p.tensor_model_parallel_size // (2 * topo.expert_tp)
        raise ConfigError(
            f"--expert-model-parallel-size {p.expert_model_parallel_size} with --deadpool: "
            f"rank {alone[0]}'s experts ({len(alone)} of {topo.world_size} ranks alike) are held "
            "by no other rank, so a spare could not be given them; use an expert-parallel size "
            f"of at most {max(widest, 1)} (data-parallel size {dp} x tensor-parallel size "
            f"{p.tensor_model_parallel_size} / 2 / expert tensor-parallel size {topo.expert_tp}), "
            "so that every expert is on two ranks"
        )


# Fault phases only our own training step (megatron/training.py) reaches.
OUR_STEP_PHASES = ("backward", "optimizer")


def _check_evaluate_fault(spec: str, iteration: int, eval_interval: int | None) -> None:
    """A fault at phase evaluate needs an evaluation after its iteration."""
    _require(
        eval_interval is not None,
        f"--deadpool-inject {spec}: phase evaluate strikes in Megatron-LM's evaluations, and "
        "this pretrain_gpt.py does not evaluate; pick another phase",
    )
    _require(
        bool(eval_interval) and iteration % eval_interval == 0,
        f"--deadpool-inject {spec}: Megatron-LM evaluates after every multiple of "
        f"--eval-interval ({eval_interval or 'not given: never'}), not after iteration "
        f"{iteration}",
    )


def _known_end(cfg: JobConfig) -> int | None:
    """The iteration training stops after, when the flags alone say (not after a --load with
    --exit-interval: that end depends on the checkpoint's iteration)."""
    t = cfg.training
    if cfg.checkpoint.load and t.exit_interval:
        return None
    return t.end_iteration(0)


def cfg_world_size(cfg: JobConfig, dp: int) -> int:
    return dp * cfg.parallel.tensor_model_parallel_size * cfg.parallel.pipeline_model_parallel_size


def _is_weight(token: str) -> bool:
    try:
        value = float(token)
    except ValueError:
        return False
    return math.isfinite(value)


def data_parallel_size(cfg: JobConfig, world_size: int) -> int:
    return world_size // (
        cfg.parallel.tensor_model_parallel_size * cfg.parallel.pipeline_model_parallel_size
    )
