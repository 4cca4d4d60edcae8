"""Every knob of a job as dataclasses whose fields carry their help text.

Flags are derived mechanically from field names (``num_layers`` -> ``--num-layers``, in
flags.py), the way megatron-core's ``ModelParallelConfig`` is meant to be read, so a flag and
its documentation never drift apart. Validation happens once, in validation.py, before any
process group exists.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


def knob(default: Any, help: str, *, choices: tuple | None = None, nargs: str | None = None):
    """A dataclass field that becomes a command-line flag."""
    meta = {"help": help, "choices": choices, "nargs": nargs}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = knob(1, "Degree of tensor model parallelism.")
    pipeline_model_parallel_size: int = knob(1, "Degree of pipeline model parallelism.")
    num_layers_per_virtual_pipeline_stage: int | None = knob(
        None, "Layers per virtual pipeline stage; enables the interleaved 1F1B schedule."
    )
    use_distributed_optimizer: bool = knob(
        False, "Shard the optimizer state across data-parallel ranks (ZeRO-1)."
    )
    expert_model_parallel_size: int = knob(
        1, "Degree of expert parallelism (Megatron-LM's MoE models; this script has no experts)."
    )
    expert_tensor_parallel_size: int | None = knob(
        None, "Tensor parallelism of the expert layers (default: the tensor-parallel size)."
    )


@dataclass
class ModelConfig:
    num_layers: int = knob(4, "Number of transformer layers.")
    hidden_size: int = knob(64, "Transformer hidden size.")
    num_attention_heads: int = knob(4, "Number of attention heads.")
    ffn_hidden_size: int | None = knob(None, "MLP hidden size (default: 4 x hidden size).")
    seq_length: int = knob(32, "Tokens per sample.")
    max_position_embeddings: int | None = knob(
        None, "Maximum sequence length the position embeddings cover (default: seq length)."
    )
    vocab_size: int = knob(
        128, "Vocabulary size of the synthetic corpus and of the null/byte tokenizers."
    )
    position_embedding_type: str = knob(
        "learned_absolute", "Position embedding type.", choices=("learned_absolute", "rope")
    )
    normalization: str = knob("LayerNorm", "Normalization layer.", choices=("LayerNorm", "RMSNorm"))
    untie_embeddings_and_output_weights: bool = knob(
        False, "Use separate input embedding and output weights."
    )
    hidden_dropout: float = knob(0.0, "Dropout probability after attention and MLP.")
    attention_dropout: float = knob(0.0, "Dropout probability on attention scores.")
    init_method_std: float = knob(0.02, "Standard deviation of the weight initialisation.")
    transformer_impl: str = knob(
        "auto",
        "Layer implementation: transformer_engine needs TE and a GPU; auto picks it when both "
        "are present, local otherwise.",
        choices=("auto", "local", "transformer_engine"),
    )


@dataclass
class TrainingConfig:
    micro_batch_size: int = knob(2, "Samples per micro-batch per data-parallel rank.")
    global_batch_size: int = knob(16, "Samples per iteration across all data-parallel ranks.")
    train_iters: int = knob(50, "Iterations to train.")
    exit_interval: int | None = knob(
        None,
        "Exit after an iteration divisible by this value (Megatron-LM's), saving a checkpoint "
        "first when --save is set; a job that loads it again trains to the next multiple.",
    )

    exit_signal_handler: bool = knob(
        False,
        "On SIGTERM (Slurm's notice of a time limit or a cancel; deadpool-launch forwards it "
        "to the workers), every rank stops after the same iteration, saves a checkpoint "
        "with --save, and exits 0 (Megatron-LM's flag); a second signal to deadpool-launch "
        "stops every process at once.",
    )

    def end_iteration(self, start: int) -> int:
        """The iteration training stops after when it starts from iteration `start` (its
        --load's, or 0): --train-iters, or if sooner the first multiple of --exit-interval
        after `start` (Megatron-LM's condition, checked after each iteration it trains)."""
        if not self.exit_interval:
            return self.train_iters
        return min(self.train_iters, (start // self.exit_interval + 1) * self.exit_interval)

    lr: float = knob(3e-3, "Peak learning rate.")
    min_lr: float = knob(0.0, "Minimum learning rate at the end of decay.")
    lr_decay_style: str = knob(
        "cosine", "Learning-rate decay style.", choices=("constant", "linear", "cosine")
    )
    lr_warmup_iters: int = knob(0, "Iterations of linear warm-up.")
    lr_decay_iters: int | None = knob(None, "Iterations to decay over (default: train iters).")
    weight_decay: float = knob(0.01, "AdamW weight decay.")
    adam_beta1: float = knob(0.9, "AdamW beta1.")
    adam_beta2: float = knob(0.999, "AdamW beta2.")
    adam_eps: float = knob(1e-8, "AdamW epsilon.")
    clip_grad: float = knob(1.0, "Gradient clipping by global norm (0 disables).")
    seed: int = knob(1234, "Random seed for initialisation, data and dropout.")
    bf16: bool = knob(False, "Train in bfloat16 with fp32 main parameters.")
    fp16: bool = knob(False, "Train in float16 with fp32 main parameters and loss scaling.")
    initial_loss_scale: float = knob(2.0**16, "Initial dynamic loss scale for --fp16.")


@dataclass
class DataConfig:
    data_path: list[str] = knob(
        [], "Prefixes of Megatron indexed datasets (.bin/.idx), optionally weighted.", nargs="*"
    )
    mock_data: bool = knob(
        False, "Use the deterministic synthetic corpus (also the default without --data-path)."
    )
    tokenizer_type: str = knob(
        "NullTokenizer",
        "Tokenizer of the indexed dataset: NullTokenizer (token ids as written) or "
        "ByteLevelTokenizer (UTF-8 bytes, no download).",
        choices=("NullTokenizer", "ByteLevelTokenizer"),
    )
    split: str = knob("100,0,0", "Train/valid/test split of --data-path, in weights.")
    data_cache_path: str | None = knob(None, "Where dataset index caches are written.")


@dataclass
class CheckpointConfig:
    save: str | None = knob(None, "Directory to write persistent checkpoints to.")
    load: str | None = knob(
        None,
        "Directory to resume from (the newest complete checkpoint); may be the --save "
        "directory before it exists (resume if present).",
    )
    save_interval: int | None = knob(None, "Iterations between persistent checkpoints.")
    async_save: bool = knob(
        False,
        "Write persistent checkpoints in a background process (megatron-core's asynchronous "
        "save); a checkpoint becomes the one --load uses only once every rank has written it.",
    )


@dataclass
class LoggingConfig:
    log_interval: int = knob(1, "Iterations between iteration log lines.")
    metrics_jsonl: str | None = knob(
        None, "Write one JSON object per iteration, and the final state digest, to this file."
    )


@dataclass
class SystemConfig:
    cpu: bool = knob(
        False, "Force the CPU backend (gloo) even when a GPU is present; automatic without one."
    )
    distributed_timeout_minutes: float = knob(10.0, "Timeout of collectives, in minutes.")


@dataclass
class DeadpoolConfig:
    deadpool: bool = knob(
        False,
        "Turn DeadPool on: every snapshot interval, copy this rank's state to host memory and "
        "replicate its optimizer shard to its DP-ring successors (off: the plain training loop).",
    )
    deadpool_replicas: int = knob(
        1,
        "DP-ring successors holding a replica of each optimizer shard (K adjacent failures). "
        "0: local snapshots only (transient failures are reset in place; a data-parallel size "
        "of 1 allows no more).",
    )
    deadpool_snapshot_interval: int = knob(1, "Iterations between snapshots.")
    deadpool_transport: str = knob(
        "tcp",
        "How replicas travel the DP ring: tcp (a plain TCP connection per ring edge and "
        "direction, on the interface GLOO_SOCKET_IFNAME names or else the one that routes to "
        "MASTER_ADDR, which a recovery's stop ends at once; between two ranks on one host the "
        "receiver reads a replica's parts from the sender's memory itself with one copy, "
        "process_vm_readv, where the kernel allows it), tcp-stream (the same connections, "
        "every byte through them), gloo (a gloo group per ring edge; gloo can leave the "
        "replication thread waiting until --distributed-timeout-minutes after a transfer cut "
        "mid-message) or mpi (an MPI intercommunicator per ring edge, Open MPI 5 with ULFM: "
        "the launcher runs under `mpirun --with-ft ulfm` and starts every worker and spare "
        "through MPI_Comm_spawn; README: the MPI transport).",
        choices=("gloo", "tcp", "tcp-stream", "mpi"),
    )
    deadpool_heartbeat_interval: float = knob(
        0.5, "Seconds between heartbeats (they start after the first iteration)."
    )
    deadpool_heartbeat_timeout: float = knob(
        2.0,
        "Seconds without a heartbeat after which a rank is suspected. A late heartbeat alone "
        "never fences a rank: it is hung only if the OS also reports it stopped for this long "
        "(detected in this time) or it shows no progress for --deadpool-hang-timeout.",
    )
    deadpool_hang_timeout: float = knob(
        60.0,
        "Seconds a rank whose heartbeat is late may go without progress (its training loop "
        "crossing a phase boundary) before it counts as hung and is fenced: the detection time "
        "of a hang that does not stop the process (a deadlock holding the GIL). A phase's limit "
        "grows to --deadpool-hang-timeout-factor x the longest that phase has taken.",
    )
    deadpool_node_timeout: float = knob(
        2.0,
        "Seconds a node agent's lease (renewed every --deadpool-heartbeat-interval by a thread "
        "of the agent, not of a training process) may go unrenewed before the other nodes "
        "count the node lost and hot-swap its ranks onto spares (multi-node jobs). Until the "
        "job is up (every rank registered) a lease may stand still for "
        "--deadpool-slow-phase-timeout instead: a node lost then ends the job.",
    )
    deadpool_hang_timeout_factor: float = knob(
        5.0, "Multiple of the longest observed duration of a phase that the phase may take."
    )
    deadpool_slow_phase_timeout: float = knob(
        600.0,
        "Seconds without progress allowed in phases known to be slow: checkpoint saves, the "
        "first two iterations of a process, and a recovery (also how long a process waits for "
        "a recovery's order, plan and rendezvous; and how long a node's lease may stand still "
        "before the job is up).",
    )
    deadpool_health_check_interval: float = knob(
        5.0,
        "Seconds between device health checks (a fixed computation compared bit for bit with "
        "its start-up result); a failed check makes the rank unfit and a spare replaces it. "
        "0 turns them off.",
    )
    deadpool_inject: str | None = knob(
        None,
        "Faults to inject, SPEC[,SPEC...]: kill@RANK:ITER[:PHASE], hang@RANK:ITER[:PHASE], "
        "raise@RANK:ITER[:PHASE] (transient), unhealthy@RANK:ITER[:PHASE] (its device fails "
        "every health check from then on), slow@RANK:ITER[:PHASE] (healthy but slow: the "
        "training thread computes holding the GIL for 3 x --deadpool-heartbeat-timeout, in "
        "stretches longer than the timeout, as a long save or kernel would), "
        "stall@RANK:ITER[:PHASE] (the training thread blocks for good while the process beats "
        "on: a deadlock, or a collective that never returns), bug@RANK:ITER[:PHASE] (an error "
        "of the training's own, raised every time the process holding RANK gets there, a "
        "replay or a spare included), corrupt@RANK:ITER "
        "(RANK's replica of ITER has bytes flipped in flight: its successors reject it), "
        "kill-spare@INDEX:ITER; PHASE: forward, backward, "
        "optimizer, snapshot, replicate, recovery (in whichever process holds RANK while it "
        "recovers from a failure in ITER), save (after writing the checkpoint of ITER, before "
        "it is marked complete; the save at the end too), evaluate (Megatron-LM's "
        "pretrain_gpt.py only, ITER a multiple of --eval-interval: as the evaluation after ITER "
        "starts), finish (kill only, ITER the last "
        "iteration: after RANK finished training, its final save and the replication's agreed "
        "stop, once every rank got there), digest (kill only, ITER the last iteration: after "
        "the final save, as the final state digest is about to be gathered), setup (ITER 0, "
        "and only there: during RANK's set-up, its groups up and its model built), launch (kill or hang, ITER 0: connected to the job's store, before RANK "
        "registers with it, as a death in its imports), groups (ITER 0: registered, as RANK's "
        "process groups are about to be created, its peers waiting for it in their rendezvous; "
        "in Megatron-LM's, just before pretrain()). Each fault fires once per job.",
    )
    deadpool_store: str = knob(
        "tcp",
        "Coordination store for heartbeats, reports, membership and node leases: tcp (the "
        "TCPStore node 0's deadpool-launch hosts; losing node 0 ends the job) or etcd (every "
        "generation's process groups meet there too, so no node's loss ends the job).",
        choices=("tcp", "etcd"),
    )
    deadpool_etcd_endpoints: str | None = knob(
        None, "Comma-separated etcd v3 endpoints for --deadpool-store etcd, e.g. http://h:2379."
    )
    deadpool_etcd_cacert: str | None = knob(
        None, "CA bundle that signed the etcd servers' certificates (https endpoints)."
    )
    deadpool_etcd_cert: str | None = knob(
        None, "Client certificate for etcd's --client-cert-auth (with --deadpool-etcd-key)."
    )
    deadpool_etcd_key: str | None = knob(None, "Private key of --deadpool-etcd-cert.")
    deadpool_etcd_user: str | None = knob(
        None, "etcd user (etcd auth enabled); its password is read from $DEADPOOL_ETCD_PASSWORD."
    )
    deadpool_chaos_mtbf: float | None = knob(
        None,
        "Chaos mode: kill (80%%) or hang (20%%) random ranks with this mean time between "
        "failures, in seconds of training (the clock stands still during a recovery).",
    )
    deadpool_chaos_seed: int = knob(0, "Seed of the chaos schedule (reproducible per seed).")
    deadpool_event_log: str | None = knob(
        None, "Append one JSON line per failure, fencing, spare and recovery event to this file."
    )
    deadpool_on_unrecoverable: str | None = knob(
        None,
        "When a hot-swap cannot recover (both copies of a shard lost, no spare left, a "
        "recovery that fails with the same error on a spare too): "
        "checkpoint-restart (restart every process from the newest complete persistent "
        "checkpoint under --save; the default when --save is set) or stop (end the job, saying "
        "what was lost; the default without --save).",
        choices=("checkpoint-restart", "stop"),
    )
    deadpool_replenish_spares: bool = knob(
        True,
        "When a process is lost on a node that is still healthy (a worker replaced by a spare, "
        "or an idle spare that died), its agent starts a fresh spare there once the recovery "
        "is through, so the pool refills (--no-deadpool-replenish-spares: the pool only "
        "drains). Not after a health-check failure on that node, nor after 3 fresh spares in a "
        "row died before they were ready.",
    )
    deadpool_keep_model: bool = knob(
        False,
        "At a recovery, survivors keep their model, DDP and optimizer and only swap the "
        "process groups they hold for the new generation's (a spare builds its own, unless "
        "it built it while idle, --deadpool-spare-prebuild; survivors repeat their build's "
        "collectives to meet a build). Experimental: on the 2-core "
        "development machine it did not shorten recoveries of 4-16 processes (see the "
        "README). Without it every process builds them again; patched Megatron-LM's "
        "pretrain() always does.",
    )
    deadpool_spare_prebuild: int = knob(
        0,
        "Each idle spare builds the model, DDP and optimizer of N ranks (0: none) while it "
        "waits, on stand-in process groups, and the agent seats a spare on a rank it built "
        "for when one is free; claimed, it swaps the groups for the new generation's instead "
        "of building (survivors then repeat no build collectives for it, with "
        "--deadpool-keep-model). Each build holds one rank's model and optimizer in the "
        "spare's memory. The ranks it would be seated on: a worker node's spares share out "
        "that node's ranks in turn; a spare node's spare in slot i takes local rank i of "
        "each node in turn. Not with patched Megatron-LM, whose pretrain() builds the model.",
    )
    deadpool_verify_groups: bool = knob(
        False,
        "After each recovery, walk every object reachable from training and megatron-core's "
        "globals, and fail the recovery if one still holds a process group from before it "
        "(slow; for tests and debugging).",
    )


CONFIG_GROUPS: dict[str, type] = {
    "parallel": ParallelConfig,
    "model": ModelConfig,
    "training": TrainingConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
    "system": SystemConfig,
    "deadpool": DeadpoolConfig,
}


@dataclass
class JobConfig:
    """The whole job: one instance per process, built from flags and validated once."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    system: SystemConfig = field(default_factory=SystemConfig)
    deadpool: DeadpoolConfig = field(default_factory=DeadpoolConfig)

    def flat(self) -> dict[str, Any]:
        """Every knob by its field name, for logging and checkpoint metadata."""
        out: dict[str, Any] = {}
        for group in CONFIG_GROUPS:
            out.update(dataclasses.asdict(getattr(self, group)))
        return out
