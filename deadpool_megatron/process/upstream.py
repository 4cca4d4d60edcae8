"""One process of a patched Megatron-LM job (its own `pretrain_gpt.py`) under DeadPool.

Megatron-LM's `pretrain()` builds everything itself: arguments, torch.distributed and the
model-parallel groups, model, optimizer, data iterators, then its training loop. A hot-swap
therefore runs `pretrain()` again in the same process (Megatron-LM's in-process restart does
the same), on the new generation's store prefix: every rank of the generation, survivors and
the claimed spare alike, takes the same path through it, so their collectives match. Between
set-up and the loop, `after_setup` restores the state of the plan's iteration (own snapshot,
or parameters from a DP peer and the optimizer shard from the ring replica) and sets the
loop's position, so training goes on from the last completed iteration with the same data.

Stages 1-3 and 5-7 of a recovery are recovery/stages.py's, shared with our own loop; only
building the groups and the model (stage 4) is Megatron-LM's.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..checkpoint.pipeline import ProtectionPipeline
from ..config import JobConfig
from ..control.c10d import StoppableStore, poll_cap
from ..control.context import JobContext
from ..events import CHECKPOINT_LOADED
from ..failure.progress import ProgressBoard
from ..megatron import (
    checkpointing,
    cpu_backend,
    parallel,
    upstream,
    upstream_args,
    upstream_counts,
    wandb_run,
)
from ..megatron.checkpointing import materialize_optimizer_state
from ..megatron.digest import final_digest
from ..megatron.loaders import KeptLoaders
from ..megatron.log_flush import Flusher
from ..megatron.model import TrainState, train_state
from ..megatron.upstream_loop import (
    Counts,
    EvaluationRecord,
    LoggedSums,
    LoopCounts,
    ends_after,
    evaluate_again,
    loss_value,
    redo_start,
    slow_work_after,
)
from ..metrics import MetricsWriter
from ..recovery.plan import RecoveryPlan
from ..recovery.stages import Rebuilt, RecoveryFailed, Superseded
from ..runtime import ProcessEnv, freeze_imports, freeze_survivors
from .exit_signal import ExitSignal
from .session import ProtectedLoop, current, serving
from .worker import Takeover, open_store, watch

log = logging.getLogger("deadpool.upstream")


@dataclass
class LoopPosition:
    """What the recovery stages need of a training loop (the Trainer's narrow interface):
    the newest completed iteration, the state it trains and the protection pipeline."""

    on_gpu: bool
    iteration: int = 0
    state: TrainState | None = None
    pipeline: ProtectionPipeline | None = None

    def detach(self) -> ProtectionPipeline | None:
        pipeline, self.pipeline, self.state = self.pipeline, None, None
        return pipeline

    def completed(self, iteration: int) -> None:
        """Megatron-LM's loop finished `iteration` (it keeps the count itself)."""
        self.iteration = iteration

    def attach(
        self, state: TrainState, iteration: int, pipeline: ProtectionPipeline | None = None
    ) -> None:
        self.state, self.iteration, self.pipeline = state, iteration, pipeline
        upstream_counts.set_position(iteration)


@dataclass
class _Pending:
    """A recovery whose groups and model Megatron-LM's pretrain() is building."""

    plan: RecoveryPlan
    old_groups: list
    reset_s: float  # old groups and Megatron-LM's globals gone, the generation met
    started: float = field(default_factory=time.perf_counter)


class UpstreamSession(ProtectedLoop):
    """Drives pretrain() through failures and answers the hooks of patched Megatron-LM."""

    def __init__(
        self,
        cfg: JobConfig,
        env: ProcessEnv,
        takeover: Takeover | None = None,
        exit_signal: ExitSignal | None = None,
    ):
        freeze_imports()  # Megatron-LM's pretrain_gpt.py has imported everything by now
        self.cfg = cfg
        self.env = env
        progress = ProgressBoard(env.progress_file)
        progress.mark(0, "start")
        position = LoopPosition(on_gpu=not cpu_backend.should_activate(False))
        if not position.on_gpu:
            cpu_backend.activate()
        self.store = open_store(env, cfg)
        guard, recovery, self.watcher = watch(cfg, env, self.store, progress, takeover)
        self.ctx: JobContext = recovery.ctx
        super().__init__(
            progress, guard, recovery, recovery.protect if cfg.deadpool.deadpool else None
        )
        self.bind(position)
        self.takeover = takeover
        self.pending: _Pending | None = None
        self.metrics: MetricsWriter | None = None
        self._step_started = 0.0
        # Handlers that may have noted --exit-signal-handler's signal where Megatron-LM's loop
        # does not ask: ours from process start, and the dropped ones of earlier pretrain()s.
        self._early_signal = exit_signal
        self._exit_notes: list[Callable[[], bool]] = [exit_signal] if exit_signal else []
        # Megatron-LM's counts where this process's loop last started (a claimed spare
        # learns them from the others), and whether this set-up's loop has started
        self._counts: LoopCounts | None = None
        self._loop_started = False
        self._evaluations = EvaluationRecord()
        self._evaluate_again: int | None = None  # the iteration whose evaluation runs again
        self.counts_carried = False  # this set-up's counts are a hot-swap's (exact)
        self._carried_before = 0  # their samples consumed before the restored iteration
        # training_log's sums after the last iterations, and those a resumed loop starts from
        self._logged = LoggedSums(upstream_counts.copy_sums)
        self._resumed_sums: dict | None = None
        # this set-up's loop goes on after a restored iteration (not the job's start)
        self.loop_resumed = False
        # the iteration the job's training began at (0, or what --load brought): a claimed
        # spare learns it from the others, as its counts
        self._began: int | None = None
        self._log_flush = Flusher(upstream.flush_tensorboard)
        upstream.restores_skip_load(self._restoring)

    # -- the process ---------------------------------------------------------------------------
    def run(self, pretrain: Callable, args: tuple, kwargs: dict) -> int:
        plan = None
        if self.takeover is not None:
            plan = self.recovery.takeover_plan(self.takeover.generation)
        else:  # what generation 0's JIT warm-up compiles lives as long as the process
            upstream.jit_warmup(restoring=False, then=freeze_survivors)
        while True:
            try:
                if plan is not None:
                    started = time.perf_counter()
                    note = upstream.exit_signal_noted()
                    if note is not None:
                        self._exit_notes.append(note)
                    upstream.reset_global_state()
                    upstream.jit_warmup(restoring=not plan.from_start)
                    old_groups = self.recovery.reset_communicators(plan)
                    self.pending = _Pending(plan, old_groups, time.perf_counter() - started)
                generation = plan.generation if plan is not None else 0
                if plan is None and self.takeover is None:
                    self.inject(0, "groups")  # ACTION@R:0:groups: pretrain() creates them next
                store = dist.PrefixStore(self.ctx.store_prefix(generation), self.store)
                if plan is None:  # a recovery's groups meet after its own rendezvous instead
                    store = StoppableStore(store, self._stop_meeting,
                                           60.0 * self.cfg.system.distributed_timeout_minutes,
                                           poll_cap(self.env.world_size))  # fmt: skip
                try:
                    pretrain(*args, **{**kwargs, "store": store})
                except SystemExit as ended:
                    if ended.code not in (None, 0):
                        raise
                    # Megatron-LM's train() leaves through sys.exit(0) when an exit condition
                    # of its own is met (--exit-interval, --exit-duration-in-mins, a signal):
                    # the end of training, its save done, as when pretrain() returns.
                break
            except RecoveryFailed as lost:
                return self._lost(lost)
            except Exception as err:
                if not self.cfg.deadpool.deadpool:
                    return self.guard.failed(err)
                try:
                    plan = self._next_plan(err, plan)
                except RecoveryFailed as lost:
                    return self._lost(lost)
        self._finish()
        return 0

    def _restoring(self) -> bool:
        """Whether the pretrain() running now is a hot-swap's that restores a snapshot."""
        return self.pending is not None and not self.pending.plan.from_start

    def _stop_meeting(self) -> None:
        """Raise once a recovery is ordered while generation 0's groups meet: a peer died
        there, and the set-up stops as on any order."""
        self.guard.check_stop()

    def _next_plan(self, err: Exception, plan: RecoveryPlan | None) -> RecoveryPlan:
        if self.takeover is not None:  # a claimed spare, not seated yet (takeover_again)
            self.pending = None
            return self.recovery.takeover_again(plan.generation, err)
        if isinstance(err, Superseded):  # met in the rendezvous: that generation is spent
            log.info("%s; recovering into the newer generation", err)
        elif self.pending is not None:  # it failed before the state was restored
            self.recovery.failed_attempt(self.pending.plan.generation, err, self.position)
        else:
            self.recovery.interrupted(self.position, err)
        self.pending = None
        return self.recovery.next_plan()

    def _lost(self, lost: RecoveryFailed) -> int:
        log.error("cannot recover: %s", lost)
        self._close()
        return 1

    def _finish(self) -> None:
        p = self.position
        self.after_training(p.iteration)  # pretrain() ended, its final save included
        self.inject(p.iteration, "digest")  # kill@RANK:LAST:digest: a death in the last second
        digest = final_digest(p.state.model, p.state.optimizer, p.iteration)
        if self.metrics is not None:
            self.metrics.final(p.iteration, digest)
            self.metrics.close()
        if dist.get_rank() == dist.get_world_size() - 1:
            log.info("training finished at iteration %d, state_digest %s", p.iteration, digest)
        if p.pipeline is not None:
            p.pipeline.close()
        self.inject(p.iteration, "finish")  # kill@RANK:LAST:finish: a death after the end
        self._close()
        upstream.reset_global_state()

    def _close(self) -> None:
        self._log_flush.close()
        if self.watcher is not None:
            self.watcher.stop()
        self.guard.close()

    # -- hooks -----------------------------------------------------------------------------------
    def after_setup(self, model: list, optimizer, scheduler) -> None:
        """Model and optimizer are built: restore the plan's state (after a failure) or start
        from what Megatron-LM loaded; protect it from here on."""
        if not self.position.on_gpu:
            cpu_backend.patch_loaded_modules()  # modules Megatron-LM imported lazily
        self._carry_exit_signal()
        from megatron.training.global_vars import get_args

        # a fresh one in each generation, before its first save: a save the failure cut short
        # leaves its results in the one before
        checkpointing.install_results_queue(get_args().async_save)
        state = train_state(model, optimizer, scheduler)
        if self.metrics is None and dist.get_rank() == dist.get_world_size() - 1:
            self.metrics = MetricsWriter(self.cfg.logging.metrics_jsonl)
        pending, self.pending = self.pending, None
        self._loop_started = self.counts_carried = self.loop_resumed = False
        self._resumed_sums = None
        self._evaluate_again = None
        if pending is None:
            loaded = upstream.checkpoint_loaded()
            if loaded is not None and self.env.rank == 0:  # a restart, or a job resumed
                self.guard.events.emit(CHECKPOINT_LOADED, iteration=loaded[0], load_s=loaded[1])
            self.inject(0, "setup")  # ACTION@R:0:setup, here after Megatron-LM's --load
            self._began = get_args().iteration
            self.start(state, self._began)  # generation 0, from what Megatron-LM loaded
            return
        phases = {  # the model's share: Megatron-LM's set-up run again, groups included
            "rebuild_communicators": pending.reset_s,
            "rebuild_model": time.perf_counter() - pending.started,
        }
        try:
            t = time.perf_counter()
            host = parallel.host_group()  # before any fault can strike: creation can't be aborted
            phases["rebuild_communicators"] += time.perf_counter() - t
            start = None
            if pending.plan.from_start:  # pretrain() set everything up again, --load included
                start = self._began = get_args().iteration
            else:
                materialize_optimizer_state(optimizer)  # the restore overwrites it entirely
            self.recovery.inject_recovery_fault()
            rebuilt = Rebuilt(self.position, state, self.position.on_gpu, phases,
                              pending.old_groups, host, start=start)  # fmt: skip
            self.recovery.complete(pending.plan, rebuilt)
            if start is None:
                self._carry_counts(host)
                # restored to where the job's training began (0, or the iteration --load
                # brought), the loop starts as the job's did
                self.loop_resumed = self.position.iteration > self._began
        except Exception:
            self.pending = pending  # still this attempt's: a failed attempt, not a new failure
            raise
        self.takeover = None  # seated: from here on a failure is recovered like any other

    def _carry_counts(self, host: dist.ProcessGroup) -> None:
        """Megatron-LM's counts at the restored iteration (LoopCounts), as the ranks that kept
        where their loop started count them (a claimed spare has none), for the set-up and
        the loop to go on from (float64: the operations are one already, the samples are
        far below 2**53); and which of them had not finished the evaluation after that
        iteration, which may then run again (upstream_loop.evaluate_again), its samples not
        yet consumed; and the iteration the job's training began at."""
        iteration, counts = self.position.iteration, self._counts
        fields = (*Counts._fields, "per_evaluation", "cut", "last_kept", "last_cut", "began",
                  "sums_from")  # fmt: skip
        mine = dict.fromkeys(fields, -1.0)
        mine.update(cut=0.0, last_kept=0.0, last_cut=0.0)
        if self._began is not None:
            mine["began"] = float(self._began)
        sums = self._logged.after(iteration)
        # a last-stage rank's sums are those of the rank that prints
        if sums is not None and upstream_counts.on_last_stage():
            mine["sums_from"] = float(dist.get_rank())
        if counts is not None:
            cut = float(self._evaluations.cut_short(iteration))
            last = float(dist.get_rank() == dist.get_world_size() - 1)
            mine.update(counts.at(iteration)._asdict(), per_evaluation=counts.valid_per_evaluation,
                        cut=cut, last_kept=last, last_cut=last * cut)  # fmt: skip
        carried = torch.tensor([float(mine[f]) for f in fields], dtype=torch.float64)
        dist.all_reduce(carried, op=dist.ReduceOp.MAX, group=host)
        got = dict(zip(fields, carried.tolist(), strict=True))
        at = Counts(max(got["flops"], 0.0), *(max(int(got[f]), 0) for f in Counts._fields[1:]))
        self._began = max(int(got["began"]), 0)
        if iteration > self._began and got["sums_from"] >= 0:  # a claimed spare gets them
            sent = [upstream_counts.sums_to_host(sums) if sums is not None else None]
            dist.broadcast_object_list(sent, src=int(got["sums_from"]), group=host)
            self._resumed_sums = (
                sums if sums is not None else upstream_counts.sums_from_host(sent[0])
            )
        if evaluate_again(*(bool(got[f]) for f in ("cut", "last_kept", "last_cut"))):
            valid = self._evaluate_after(iteration, at.valid_samples, int(got["per_evaluation"]))
            at = at._replace(valid_samples=valid)
        # the calculator as the loop without the failure had it after `iteration` (a ramp
        # step before the next is met as that loop met it); at the job's start as it began
        upstream_counts.set_counts(at, resumed=iteration > self._began)
        self._carried_before = at.before
        self.counts_carried = True

    def resumed_sums(self) -> dict | None:
        """What this set-up's first training_log starts from: after a restored iteration,
        its sums (LoggedSums; none where no rank on the last stage kept them); at the job's
        start, None (logged as Megatron-LM logs its start)."""
        return (self._resumed_sums or {}) if self.loop_resumed else None

    def logged(self, iteration: int, sums: dict) -> None:
        self._logged.logged(iteration, sums)

    def _evaluate_after(self, iteration: int, valid_samples: int, per_evaluation: int) -> int:
        """The evaluation after `iteration` was cut short: it runs again before the loop
        (before_loop), from where it started. The validation samples to go on from."""
        from megatron.training.global_vars import get_args

        start = redo_start(valid_samples, per_evaluation)
        why = None
        if start is None:
            why = (f"{valid_samples} validation samples consumed cannot hold one evaluation of "
                   f"{per_evaluation}")  # fmt: skip
        elif start == 0 and upstream.phase_transitions(get_args()):
            why = "with --phase-transition-iterations its first samples cannot be given"
        if why is not None:
            log.warning("the evaluation after iteration %d was cut short by the failure and "
                        "is not run again: %s", iteration, why)  # fmt: skip
            return valid_samples
        self._evaluate_again = iteration
        return start

    def _carry_exit_signal(self) -> None:
        """pretrain() has installed its signal handler (--exit-signal-handler): a signal noted
        before, by ours at process start or by the handler of a pretrain() that a recovery
        ended, is raised again for it, so that every rank still stops after the same
        iteration. Those handlers are no longer installed, so they note nothing more."""
        early, self._early_signal = self._early_signal, None
        number = upstream.exit_signal_number()
        if early is not None and number != early.signum:
            early.restore()  # Megatron-LM waits for another signal (--exit-signal)
        notes, self._exit_notes = self._exit_notes, []
        if any(noted() for noted in notes) and upstream.resend_exit_signal():
            log.info("the exit signal received before this set-up is raised again for "
                     "Megatron-LM's handler")  # fmt: skip

    def after_final_save(self, iteration: int, save: Callable[[], object]) -> None:
        """The last periodic save was lost with a failure during it and the recovery rolled
        back to its iteration, so Megatron-LM's loop had nothing left to run and pretrain()
        skipped its save at the end (on the interval): save, since the tracker of --save does
        not name `iteration`. With --async-save the tracker moves later: not looked at."""
        from megatron.training.global_vars import get_args

        args = get_args()
        if not args.save or args.async_save or iteration == 0:
            return
        if checkpointing.tracked_iteration(args.save) != iteration:
            log.warning("the checkpoint of iteration %d is missing (its save was lost with a "
                        "failure); saving it", iteration)  # fmt: skip
            save()

    def before_loop(self, iteration: int, evaluate: Callable[[], object]) -> None:
        """Megatron-LM's loop is about to start from `iteration`: it evaluates first where
        the evaluation after `iteration` was cut short by the failure this set-up recovers
        from (`evaluate`: its own call, the iteration's timer stopped as its loop stops it)."""
        if self._evaluate_again is None or self._evaluate_again != iteration:
            return
        self._evaluate_again = None
        self.progress.mark(iteration, "evaluate")
        log.info("the evaluation after iteration %d was cut short by the failure: it runs "
                 "again before iteration %d", iteration, iteration + 1)  # fmt: skip
        upstream.evaluate_as_the_loop_does(evaluate)

    def evaluation_starts(self, iteration: int) -> None:
        """One of Megatron-LM's evaluations begins (a fault at phase evaluate strikes here)."""
        self._inject_protected(iteration, "evaluate")

    def _inject_protected(self, iteration: int, phase: str) -> None:
        """A fault due at `phase`, which Megatron-LM runs with no hook inside (a save, an
        evaluation), strikes as it starts, once `iteration` is protected (its snapshot
        committed, the replicas held): the recovery then restores `iteration` itself."""
        pipeline = self.position.pipeline
        if pipeline is not None and self.guard.fault_due(iteration, phase):
            pipeline.wait_for_replicas(iteration)
            self.inject(iteration, phase)

    def evaluation_ended(self, iteration: int) -> None:
        self._evaluations.finished(iteration)

    def before_step(self, iteration: int) -> None:
        self._step_started = time.perf_counter()
        if not self._loop_started:  # this set-up's loop starts: what it counts from
            before = self._carried_before if self.counts_carried else None
            self._counts, self._loop_started = upstream_counts.loop_counts(before), True
            self.counts_carried = False
        self._log_flush.request()  # the previous iteration's scalars (log_flush.py says why)
        super().before_step(iteration)

    def after_step(self, iteration: int, loss_dict: dict) -> None:
        self.position.completed(iteration)
        try:
            super().after_step(iteration, loss_dict)
        finally:  # the step is done: its loss is the iteration's, whatever stops the loop
            loss = loss_value(loss_dict)
            if self.metrics is not None and loss is not None:
                elapsed_ms = (time.perf_counter() - self._step_started) * 1e3
                self.metrics.iteration(iteration, loss, elapsed_ms)
        from megatron.training.global_vars import get_args

        args = get_args()
        slow = slow_work_after(
            args, iteration, upstream_counts.batch_changes_after(args, self._counts.batches)
        )
        last = ends_after(args, iteration)  # what pretrain() does next is its end
        self._evaluations.after_step(iteration, slow == "evaluate")
        if last or slow is not None:
            self.progress.mark(iteration, "finish" if last else slow)
        if slow == "save":
            self._inject_protected(iteration, "save")


def _serving() -> UpstreamSession:
    """The session patched Megatron-LM's calls reach (process-wide: see session.py)."""
    session = current()
    if not isinstance(session, UpstreamSession):
        raise RuntimeError(f"Megatron-LM called into DeadPool outside a session: {session!r}")
    return session


def become_worker(
    pretrain: Callable, args: tuple, kwargs: dict, cfg: JobConfig
) -> Callable[[ProcessEnv, Takeover, ExitSignal | None], int]:
    """A claimed spare's way into pretrain(): as the rank it replaces (Megatron-LM reads RANK).
    Built as the spare starts, which builds Megatron-LM's parser meanwhile, before it idles."""
    upstream.warm_argument_parser()

    def become(env: ProcessEnv, takeover: Takeover, exit_signal: ExitSignal | None) -> int:
        import os

        os.environ["RANK"] = str(env.rank)
        session = UpstreamSession(cfg, env, takeover, exit_signal)
        with serving(session):
            return session.run(pretrain, args, kwargs)

    return become


def main(pretrain: Callable, args: tuple, kwargs: dict, argv: list[str]) -> int:
    """`pretrain(*args, **kwargs)` as this process's role asks: answer the launcher's
    preflight, wait as a spare, or train as a worker; returns the exit status."""
    from ..errors import ConfigError
    from .entry import run_process

    # the last rank's W&B run goes on in the spare that replaces it (megatron/wandb_run.py)
    os.environ.update(wandb_run.run_env(os.environ, argv))
    upstream.cache_field_docstrings()  # every pretrain() of this process parses its flags twice
    upstream.print_arguments_once()
    upstream.torch_adam_loads_checkpoints()  # --load, where megatron-core has no Apex or TE
    # a hot-swap's resumed iteration draws what it drew; a survivor keeps its data loaders
    upstream.data_iterators_for_hot_swaps(KeptLoaders(), lambda: _serving().counts_carried)
    upstream.logs_resumed_loops_as_one(lambda: _serving().resumed_sums(),
                                       lambda i, sums: _serving().logged(i, sums))  # fmt: skip
    upstream.evaluations_reported(lambda i: _serving().evaluation_starts(i),
                                  lambda i: _serving().evaluation_ended(i))  # fmt: skip

    def parse(env: ProcessEnv) -> JobConfig:
        if not (env.under_launcher or env.preflight):
            raise ConfigError(
                "--deadpool with Megatron-LM's pretrain_gpt.py needs deadpool-launch: start it "
                "with `deadpool-launch --nproc-per-node N [--spares S] pretrain_gpt.py ...`"
            )
        return upstream_args.parse_job_config(argv, env.world_size,
                                              upstream.batch_size_by_step_schedule())  # fmt: skip

    def train(cfg: JobConfig, env: ProcessEnv, exit_signal: ExitSignal | None) -> int:
        session = UpstreamSession(cfg, env, exit_signal=exit_signal)
        with serving(session):
            return session.run(pretrain, args, kwargs)

    return run_process(parse, train, lambda cfg: become_worker(pretrain, args, kwargs, cfg))
