"""Build the GPT model, Megatron DDP, the (distributed) optimizer and the LR scheduler.

The same construction Megatron-LM's pretrain_gpt.py performs, with megatron-core's public API:
GPTModel with the local layer spec (or transformer-engine's, on a GPU with TE installed),
one model chunk per virtual pipeline stage, each wrapped in DistributedDataParallel, and
`get_megatron_optimizer` (a ChainedOptimizer over DistributedOptimizers when
--use-distributed-optimizer is set).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import Float16Module

from ..config import JobConfig
from . import parallel
from .build_calls import Call, recording

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """What one rank trains: model chunks, optimizer, scheduler, and the precision dtype."""

    model: list[DistributedDataParallel]
    optimizer: object
    scheduler: OptimizerParamScheduler
    transformer_config: TransformerConfig
    hook_tables: list[dict] = field(default_factory=list)  # see `unhook`
    build_calls: list[Call] | None = None  # the collectives its build performed (build_calls)


def train_state(model: list, optimizer, scheduler) -> TrainState:
    """The state of a model built elsewhere (by Megatron-LM's set-up, say), before its first
    iteration."""
    from megatron.core.utils import get_model_config

    model = list(model)
    return TrainState(model, optimizer, scheduler, get_model_config(model[0]), hook_tables(model))


def params_dtype(cfg: JobConfig) -> torch.dtype:
    if cfg.training.bf16:
        return torch.bfloat16
    if cfg.training.fp16:
        return torch.float16
    return torch.float32


INIT_METHODS = ("init_method", "output_layer_init_method", "embedding_init_method")


def leave_undrawn(weight: torch.Tensor) -> None:
    """An init method that draws nothing (see `transformer_config`)."""


def transformer_config(cfg: JobConfig, on_gpu: bool, initialize: bool = True) -> TransformerConfig:
    """`initialize=False`: weights are left as allocated, for a recovery's build, which the
    restore overwrites entirely (drawing them costs time that grows with the model). Through
    init methods that draw nothing, not `perform_initialization=False`: megatron-core's
    tensor-parallel layers then also skip marking their weights as tensor-parallel
    (`set_tensor_model_parallel_attributes`), and the gradient norm counts each shard as if
    every TP rank held a copy (measured: a TP2 hot-swap diverged from its first optimizer
    step on)."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    vp = virtual_pipeline_size(cfg)
    dtype = params_dtype(cfg)
    fields = TransformerConfig.__dataclass_fields__
    undrawn = {} if initialize else {k: leave_undrawn for k in INIT_METHODS if k in fields}
    return TransformerConfig(
        **undrawn,
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        ffn_hidden_size=m.ffn_hidden_size,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        normalization=m.normalization,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=vp,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=t.bf16,
        fp16=t.fp16,
        use_cpu_initialization=not on_gpu,
        perform_initialization=True,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        deallocate_pipeline_outputs=on_gpu,
        # gloo matches point-to-point messages by peer and posting order, and the batched
        # path posts them in an order that, with the interleaved schedule on two stages, pairs
        # an activation with a gradient of the same shape; the unbatched path orders
        # even/odd ranks so they match.
        batch_p2p_comm=on_gpu,
    )


def virtual_pipeline_size(cfg: JobConfig) -> int | None:
    vp_layers = cfg.parallel.num_layers_per_virtual_pipeline_stage
    if vp_layers is None:
        return None
    return cfg.model.num_layers // (cfg.parallel.pipeline_model_parallel_size * vp_layers)


def _layer_spec(cfg: JobConfig, on_gpu: bool):
    impl = cfg.model.transformer_impl
    if impl != "local" and on_gpu:
        try:
            import transformer_engine  # noqa: F401
            from megatron.core.models.gpt.gpt_layer_specs import (
                get_gpt_layer_with_transformer_engine_spec,
            )

            return get_gpt_layer_with_transformer_engine_spec(), "transformer_engine"
        except ImportError:
            if impl == "transformer_engine":
                raise
    return get_gpt_layer_local_spec(normalization=cfg.model.normalization), "local"


def build_model(
    cfg: JobConfig, tcfg: TransformerConfig, on_gpu: bool
) -> list[DistributedDataParallel]:
    """One GPTModel chunk per virtual stage, each wrapped in Megatron's DDP."""
    spec, impl = _layer_spec(cfg, on_gpu)
    vp = virtual_pipeline_size(cfg)
    chunks = []
    for vp_stage in range(vp or 1):
        stage = vp_stage if vp else None
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=vp is None, vp_stage=stage)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=vp is None, vp_stage=stage)
        kwargs = {"vp_stage": stage} if vp else {}
        model = GPTModel(
            config=tcfg,
            transformer_layer_spec=spec,
            vocab_size=cfg.model.vocab_size,
            max_sequence_length=cfg.model.max_position_embeddings,
            pre_process=pre,
            post_process=post,
            share_embeddings_and_output_weights=not cfg.model.untie_embeddings_and_output_weights,
            position_embedding_type=cfg.model.position_embedding_type,
            **kwargs,
        )
        if on_gpu:
            model.cuda(torch.cuda.current_device())
        if cfg.training.bf16 or cfg.training.fp16:
            model = Float16Module(tcfg, model)  # casts inputs and fp32 outputs, as Megatron-LM
        chunks.append(model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=cfg.training.bf16 or cfg.training.fp16,
        overlap_grad_reduce=False,
        overlap_param_gather=False,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
    )
    wrapped = [
        DistributedDataParallel(
            config=tcfg, ddp_config=ddp_config, module=chunk, disable_bucketing=i > 0
        )
        for i, chunk in enumerate(chunks)
    ]
    log.info("built %d model chunk(s) with the %s layer spec", len(wrapped), impl)
    return wrapped


def build_optimizer(cfg: JobConfig, model: list[DistributedDataParallel]):
    t = cfg.training
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=t.lr,
        min_lr=t.min_lr,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        adam_eps=t.adam_eps,
        clip_grad=t.clip_grad,
        bf16=t.bf16,
        fp16=t.fp16,
        params_dtype=params_dtype(cfg),
        initial_loss_scale=t.initial_loss_scale if t.fp16 else None,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
    )
    twins = parallel.supported_kwargs(
        get_megatron_optimizer, use_gloo_process_groups=parallel.gloo_twins()
    )
    optimizer = get_megatron_optimizer(opt_config, model, **twins)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if t.lr_warmup_iters > 0 else t.lr,
        max_lr=t.lr,
        min_lr=t.min_lr,
        lr_warmup_steps=t.lr_warmup_iters,
        lr_decay_steps=t.lr_decay_iters,
        lr_decay_style=t.lr_decay_style,
        start_wd=t.weight_decay,
        end_wd=t.weight_decay,
        wd_incr_steps=t.train_iters,
        wd_incr_style="constant",
    )
    return optimizer, scheduler


def build_train_state(cfg: JobConfig, on_gpu: bool, initialize: bool = True) -> TrainState:
    """With `initialize`, DDP's parameter broadcast over the data-parallel group follows the
    model's construction, as in Megatron-LM's get_model. A recovery's build skips it (the
    restore overwrites every parameter; one broadcast per parameter was a quarter of a spare's
    build at 12.7M parameters), and it is left out of the record, so that a survivor replaying
    its record for a spare skips it too."""
    tcfg = transformer_config(cfg, on_gpu, initialize)
    with recording() as calls:
        model = build_model(cfg, tcfg, on_gpu)
    if initialize:
        for chunk in model:
            chunk.broadcast_params()
    with recording() as optimizer_calls:
        optimizer, scheduler = build_optimizer(cfg, model)
    calls.extend(optimizer_calls)
    return TrainState(model, optimizer, scheduler, tcfg, hook_tables(model), calls)


def hook_tables(model: list) -> list[dict]:
    """The tables holding megatron-core DDP's gradient hooks, one per parameter's gradient
    accumulator (megatron-core keeps no handle to them).

    Asked of torch by registering a probe hook and removing it: the probe's handle names the
    accumulator's table. The collector cannot be asked: torch shows an accumulator's hooks to
    it only while nothing else holds the accumulator, and the distributed optimizer's shard
    views of fp32 parameters (`model_param.view(-1)[start:end]`, no detach) hold theirs from
    the moment it is built (measured: the collector found 13 of a stage's 27 tables)."""
    tables = []
    for chunk in model:
        for accumulator in getattr(chunk, "grad_accs", ()):
            probe = accumulator.register_hook(_probe)
            table = probe.hooks_dict_ref()
            probe.remove()
            if table:
                tables.append(table)
    return tables


def _probe(*unused) -> None:
    """Registered and removed at once by `hook_tables`; never called."""


def unhook(state: TrainState) -> list[dict]:
    """Cut a model's gradient hooks off its parameters' gradient accumulators while it does
    not run; returns what was removed, for `rehook`.

    Each hook's closure holds the DDP, and so every process group of its generation. An
    operation gloo never woke after the abort keeps the failed iteration's tensors until the
    group's timeout (minutes), and their autograd graph reaches those accumulators from
    outside Python: with the hooks in place that kept an abandoned model and its groups open
    past its recovery's collection (measured in the soak); without them the graph reaches the
    parameters only. A survivor that keeps its model puts them back once it is rebound."""
    removed = []
    for table in state.hook_tables:
        removed.append(dict(table))
        table.clear()
    return removed


# What Megatron-LM's train() binds to the model's config at each start, all of the generation:
# the optimizer's loss scaling and the model chunks' gradient and parameter synchronization.
_GENERATION_BOUND = ("grad_scale_func", "no_sync_func", "grad_sync_func", "param_sync_func",
                     "finalize_model_grads_func", "timers")  # fmt: skip


def unbind_config(state: TrainState) -> int:
    """Cut a left model's config loose from its generation; returns the fields cleared.

    Megatron-LM core_v0.19's pretrain_gpt.py builds the model's TransformerConfig before
    pretrain(), so it is frozen with what the JIT warm-up leaves (runtime.freeze_survivors),
    and a frozen object is never collected nor seen as a referrer: the optimizer and model
    chunks that train() binds to it kept the left model and its groups alive for good
    (measured: every survivor's generation-0 model outlived its collection). The next
    generation's train() binds its own."""
    cleared = 0
    for name in _GENERATION_BOUND:
        if getattr(state.transformer_config, name, None) is not None:
            setattr(state.transformer_config, name, None)
            cleared += 1
    return cleared


def rehook(state: TrainState, removed: list[dict]) -> None:
    """Put back the hooks `unhook` removed from `state` (its DDP rebound to new groups)."""
    for table, hooks in zip(state.hook_tables, removed, strict=True):
        table.update(hooks)
