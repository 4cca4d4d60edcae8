"""The training loop: Megatron-LM's pretrain loop on megatron-core, one rank's view.

forward/backward through megatron-core's pipeline schedule (1F1B, or interleaved with virtual
stages), grad sync through Megatron DDP's finalize_model_grads, the optimizer step, the LR
scheduler, Megatron-style iteration lines, metrics, and persistent checkpoints.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func

from ..checkpoint.pipeline import ProtectionPipeline
from ..config import JobConfig
from ..metrics import MetricsWriter, iteration_line
from ..validation import data_parallel_size
from . import checkpointing, gloo_ops
from .data import build_corpus, get_micro_batch, micro_batch_indices
from .digest import final_digest
from .model import TrainState

log = logging.getLogger("deadpool.train")


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask) / mask.sum()
    # The schedule divides the returned loss in place: report a detached copy.
    return loss, {"lm loss": loss.detach().clone()}


def forward_step(data_iterator, model, on_backward=None):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    if on_backward is not None and output.requires_grad:
        output.register_hook(lambda grad: on_backward())  # runs when backward reaches here
    return output, partial(loss_func, batch["loss_mask"])


class LoopHooks:
    """The hook API (deadpool_megatron/hooks.py) as one training loop's object: what the loop
    calls besides training, each a no-op here. Patched Megatron-LM calls `after_setup`,
    `before_step` and `after_step`; our loop calls those too, plus `phase` at its finer
    boundaries (backward, optimizer: progress mark, stop order, fault) and `mark`/`inject`
    around a save (a fault there strikes after the shards are written, before the commit).
    process/session.py's ProtectedLoop is the implementation both loops get."""

    def after_setup(self, model: list, optimizer, scheduler) -> None:
        pass

    def before_step(self, iteration: int) -> None:
        """Iteration `iteration + 1` starts (`iteration` were completed)."""

    def phase(self, iteration: int, name: str) -> None:
        pass

    def after_step(self, iteration: int, loss: float | dict | None) -> None:
        """Iteration `iteration` took its optimizer step."""

    def mark(self, iteration: int, name: str) -> None:
        pass

    def inject(self, iteration: int, name: str) -> None:
        pass

    def after_training(self, iteration: int) -> None:
        """Training ended at `iteration`, its final save written and committed."""


class Trainer:
    """Owns one rank's training: state, data, metrics, and the iteration counter.

    From outside it is driven through a narrow interface: `train()`, `detach()` after a
    failure (gives up the state and hands back the protection pipeline, whose buffers a
    recovery still needs), and `attach(state, iteration, pipeline)` to go on with rebuilt
    state; nobody else writes its fields."""

    def __init__(
        self,
        cfg: JobConfig,
        state: TrainState,
        world_size: int,
        on_gpu: bool,
        hooks: LoopHooks | None = None,
        iteration: int = 0,
        pipeline: ProtectionPipeline | None = None,
        end_iteration: int | None = None,
        exit_signal: Callable[[], bool] | None = None,
    ):
        """`exit_signal()`: whether this process received --exit-signal-handler's signal."""
        self.cfg = cfg
        self.exit_signal = exit_signal
        # Where training stops, fixed by where this job started (a spare that takes a rank
        # over is handed the job's: it starts from the resumed iteration, not the --load's).
        self.end_iteration = (
            cfg.training.end_iteration(iteration) if end_iteration is None else end_iteration
        )
        self.hooks = hooks or LoopHooks()
        self.on_gpu = on_gpu
        self.dp_size = data_parallel_size(cfg, world_size)
        self.dp_rank = parallel_state.get_data_parallel_rank()
        t = cfg.training
        self.num_microbatches = t.global_batch_size // (t.micro_batch_size * self.dp_size)
        self.corpus = build_corpus(
            cfg.data, cfg.model, t.seed, num_samples=t.train_iters * t.global_batch_size
        )
        self.async_queue = checkpointing.new_async_queue(cfg)  # --async-save
        self.is_logging_rank = dist.get_rank() == dist.get_world_size() - 1
        # On gloo, collectives a recovery can interrupt (megatron-core gets the same view).
        self.dist = dist if on_gpu else gloo_ops.distributed_view()
        self.metrics = MetricsWriter(cfg.logging.metrics_jsonl if self.is_logging_rank else None)
        self.attach(state, iteration, pipeline)

    def attach(
        self, state: TrainState, iteration: int, pipeline: ProtectionPipeline | None = None
    ) -> None:
        """Train `state` from `iteration` on, protected by `pipeline` (DeadPool's, with
        --deadpool); after a recovery, the rebuilt model and the generation's pipeline."""
        self.state = state
        self.iteration = iteration
        self.pipeline = pipeline
        tcfg = state.transformer_config
        tcfg.finalize_model_grads_func = finalize_model_grads
        if self.cfg.training.fp16:
            tcfg.grad_scale_func = state.optimizer.scale_loss
        self._fwd_bwd = get_forward_backward_func()

    def _micro_batches(self, iteration: int) -> list[dict]:
        t = self.cfg.training
        device = torch.cuda.current_device() if self.on_gpu else "cpu"
        out = []
        for indices in micro_batch_indices(
            iteration, self.dp_rank, self.dp_size, t.global_batch_size, t.micro_batch_size
        ):
            batch = get_micro_batch(self.corpus, indices)
            out.append({k: v.to(device, non_blocking=True) for k, v in batch.items()})
        return out

    def _forward_step_func(self, iteration: int):
        # megatron-core counts the function's parameters to decide how to call it: keep two.
        def step(data_iterator, model):
            return forward_step(
                data_iterator, model, on_backward=lambda: self.hooks.phase(iteration, "backward")
            )

        return step

    def train_step(self) -> float | None:
        """Run iteration self.iteration + 1; returns the DP-averaged loss on the last stage."""
        s = self.state
        current = self.iteration + 1
        batches = self._micro_batches(self.iteration)
        iterators = [iter(batches) for _ in s.model]
        for chunk in s.model:
            chunk.zero_grad_buffer()
        s.optimizer.zero_grad()
        losses = self._fwd_bwd(
            forward_step_func=self._forward_step_func(current),
            data_iterator=iterators if len(s.model) > 1 else iterators[0],
            model=s.model if len(s.model) > 1 else s.model[0],
            num_microbatches=self.num_microbatches,
            seq_length=self.cfg.model.seq_length,
            micro_batch_size=self.cfg.training.micro_batch_size,
            forward_only=False,
        )
        self.hooks.phase(current, "optimizer")
        update_successful, _grad_norm, _zeros = s.optimizer.step()
        if update_successful:
            s.scheduler.step(increment=1)
        self.iteration += 1
        if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            return None
        loss = torch.stack([x["lm loss"] for x in losses]).mean()
        self.dist.all_reduce(loss, group=parallel_state.get_data_parallel_group())
        return (loss / self.dp_size).item()

    def train(self) -> None:
        """Train to `end_iteration` (--train-iters, or the next multiple of --exit-interval)."""
        c = self.cfg.checkpoint
        while self.iteration < self.end_iteration:
            start = time.perf_counter()
            self.hooks.before_step(self.iteration)
            loss = self.train_step()
            try:
                self.hooks.after_step(self.iteration, loss)  # the snapshot and its ring replica
            finally:  # the step is done: its loss is the iteration's, whatever stops the loop
                self._log_iteration(loss, (time.perf_counter() - start) * 1000.0)
            if self.async_queue is not None and self.async_queue.get_num_unfinalized_calls():
                self.async_queue.maybe_finalize_async_calls(blocking=False)
            if c.save and c.save_interval and self.iteration % c.save_interval == 0:
                self._save()
            if self.exit_signal is not None and self._signalled():
                if self.is_logging_rank:
                    log.info("exit signal received (--exit-signal-handler): every rank stops "
                             "after iteration %d%s", self.iteration,
                             ", saving it" if c.save else " (no --save: nothing is saved)")  # fmt: skip
                break
        # Megatron's save at the end is part of training: a failure during it (or during the
        # last periodic one) is recovered like one during any other save, the survivors rolling
        # back to the last snapshot, and the save runs again unless the tracker shows it done.
        self.finalize_saves()
        if c.save and checkpointing.latest_iteration(c.save) != self.iteration:
            self._save()
            self.finalize_saves()
        self.hooks.after_training(self.iteration)

    def _signalled(self) -> bool:
        """Has any rank received the exit signal? One all-reduce over every rank, so that
        all of them stop after the same iteration."""
        device = torch.cuda.current_device() if self.on_gpu else "cpu"
        flag = torch.tensor([int(self.exit_signal())], dtype=torch.int32, device=device)
        self.dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _log_iteration(self, loss: float | None, elapsed_ms: float) -> None:
        t = self.cfg.training
        if not self.is_logging_rank or loss is None:
            return
        self.metrics.iteration(self.iteration, loss, elapsed_ms)
        if self.iteration % self.cfg.logging.log_interval == 0:
            tokens = t.global_batch_size * self.cfg.model.seq_length
            log.info(
                iteration_line(
                    self.iteration,
                    t.train_iters,
                    self.iteration * t.global_batch_size,
                    elapsed_ms,
                    self.state.optimizer.param_groups[0]["lr"],
                    t.global_batch_size,
                    loss,
                    tokens / (elapsed_ms / 1000.0),
                )
            )

    def _save(self) -> None:
        it = self.iteration
        self.hooks.mark(it, "save")
        checkpointing.save(
            self.cfg, self.state, it, lambda it=it: self.hooks.inject(it, "save"), self.async_queue
        )

    def detach(self) -> ProtectionPipeline | None:
        """After a failure: give up the state (the old model, DDP and optimizer hold the old
        process groups) and saves in flight; returns the protection pipeline, whose committed
        buffers the recovery still serves from."""
        pipeline, self.pipeline, self.state = self.pipeline, None, None
        self.abandon_saves()
        return pipeline

    def finalize_saves(self) -> None:
        """Wait for every asynchronous save to be written and committed (all ranks)."""
        if self.async_queue is not None:
            self.async_queue.maybe_finalize_async_calls(blocking=True)

    def abandon_saves(self) -> None:
        """Saves in flight are never committed (their finalization needs the old generation's
        groups), so --load never sees them; start a fresh queue."""
        if self.async_queue is not None:
            self.async_queue = checkpointing.new_async_queue(self.cfg)

    def protection_summary(self) -> str:
        p = self.pipeline
        r = p.replicator
        return (
            f"{p.stats.snapshots} snapshots (last committed iteration {p.committed_iteration()}), "
            f"{r.stats.sent} replicas sent ({r.stats.bytes_sent / 2**20:.1f} MiB), "
            f"{r.stats.received} received, {r.stats.rejected} rejected, "
            f"replica lag max {p.stats.lag_max}, errors {len(p.errors)}"
        )

    def finish(self) -> str | None:
        digest = final_digest(self.state.model, self.state.optimizer, self.iteration)
        if self.is_logging_rank:
            self.metrics.final(self.iteration, digest)
            log.info("training finished at iteration %d, state_digest %s", self.iteration, digest)
        self.metrics.close()
        return digest
