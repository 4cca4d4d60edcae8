"""One worker process from start to finish: store, process groups, model, (resume), train,
and, when a failure interrupts training, the hand-off to the recovery and back."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import psutil
import torch.distributed as dist

from ..checkpoint.buffers import HostArena, Reusable
from ..checkpoint.pipeline import ProtectionPipeline
from ..config import JobConfig
from ..control import keys
from ..control.client import ControlClient, connect, control_ports
from ..control.context import JobContext
from ..control.messages import HostFootprint
from ..errors import CheckpointError, ConfigError
from ..events import CHECKPOINT_LOADED, EventLog
from ..failure.hang import HangPolicy
from ..failure.progress import ProgressBoard
from ..megatron import checkpointing, parallel
from ..megatron.model import TrainState, build_train_state
from ..megatron.prebuild import Prebuilt
from ..megatron.training import Trainer
from ..recovery.abort import CommunicatorAbort
from ..recovery.stages import ProcessRecovery, RecoveryFailed
from ..runtime import ProcessEnv, freeze_imports
from .exit_signal import ExitSignal
from .guard import Guard, restart_faults
from .protection import build_pipeline
from .session import ProtectedLoop
from .watcher import OrderWatcher

log = logging.getLogger("deadpool.worker")


@dataclass(frozen=True)
class Takeover:
    """A claimed spare becoming a worker: its job context and client, the generation it
    joins, the host memory it reserved while idle (`SpareReserve`), if any, and the state it
    built while idle for the rank it takes over (`SparePrebuilds`), if any."""

    ctx: JobContext
    client: ControlClient
    generation: int
    reserve: HostArena | None = None
    prebuilt: Prebuilt | None = None


def open_store(env: ProcessEnv, cfg: JobConfig) -> dist.Store:
    """Where the process groups meet: etcd with `--deadpool-store etcd` (no node holds the
    job's state), else the launcher's TCPStore; a private in-memory store for a single plain
    process."""
    dpc = cfg.deadpool
    if dpc.deadpool_store == "etcd" and env.under_launcher:
        from ..control.c10d import EtcdC10dStore
        from ..control.connect import etcd_client

        return EtcdC10dStore(etcd_client(dpc))
    if env.master_port is None:
        if env.world_size != 1:
            raise RuntimeError(
                f"WORLD_SIZE={env.world_size} but MASTER_PORT is unset; start the job with "
                "deadpool-launch (or set MASTER_ADDR/MASTER_PORT)"
            )
        return dist.HashStore()
    return parallel.connect_store(env.master_addr, env.master_port, env.world_size,
                                  host_it=env.hosts_store)  # fmt: skip


def watch(
    cfg: JobConfig,
    env: ProcessEnv,
    store: dist.Store,
    progress: ProgressBoard,
    takeover: Takeover | None = None,
    keep_model: bool = False,
) -> tuple[Guard, ProcessRecovery, OrderWatcher | None]:
    """A worker's guard (registered with the job, or a claimed spare's), its recovery (which
    keeps a survivor's model with `keep_model`), and, with --deadpool, the watcher of
    recovery orders (started)."""
    dpc = cfg.deadpool
    if takeover is not None:
        ctx, client = takeover.ctx, takeover.client
    else:
        ctx = connect(env, dpc)
        client = ControlClient(ctx, env.fault_scope)
    guard = Guard(cfg, env, ctx, client, progress)
    if takeover is None:
        guard.inject(0, "launch")  # kill@RANK:0:launch: a death before the job has met it
        client.register_worker(env.rank)
    recovery = ProcessRecovery(
        cfg, env, ctx, store, progress, CommunicatorAbort(control_ports(env, dpc)),
        protect=partial(_protect, cfg, env, guard), report=guard.report, inject=guard.inject,
        report_recovery=guard.report_recovery,
        keep_model=keep_model, reserve=takeover.reserve if takeover is not None else None,
        prebuilt=takeover.prebuilt if takeover is not None else None,
    )  # fmt: skip
    if takeover is not None:
        recovery.joining(takeover.generation)  # not a new order to its watcher
    watcher = None
    if dpc.deadpool:
        watcher = OrderWatcher(
            ctx, recovery.abort.abort, progress, HangPolicy.from_config(dpc),
            recovering=lambda: recovery.active,
        )  # fmt: skip
        watcher.start()
    return guard, recovery, watcher


def run_worker(
    cfg: JobConfig,
    env: ProcessEnv,
    takeover: Takeover | None = None,
    exit_signal: ExitSignal | None = None,
) -> int:
    """Train as `env.rank`; with `takeover`, as a claimed spare taking a failed rank over.
    `exit_signal`: the handler --exit-signal-handler installed at process start (None
    without the flag); every trainer of this process, across recoveries, asks it."""
    start = time.perf_counter()
    freeze_imports()
    progress = ProgressBoard(env.progress_file)  # private memory without a launcher
    progress.mark(0, "start")
    store = open_store(env, cfg)
    guard = recovery = watcher = None
    dpc = cfg.deadpool
    if takeover is not None or ((dpc.deadpool or dpc.deadpool_inject) and env.under_launcher):
        keep = dpc.deadpool_keep_model
        guard, recovery, watcher = watch(cfg, env, store, progress, takeover, keep)
    events = guard.events if guard is not None else EventLog(dpc.deadpool_event_log, env.rank)
    faults = restart_faults(cfg, env, events) if guard is None and dpc.deadpool_inject else None
    session = ProtectedLoop(
        progress, guard, recovery, partial(_protect, cfg, env, guard) if dpc.deadpool else None,
        faults=faults,
    )  # fmt: skip
    make_trainer = partial(_trainer, cfg, env, session, exit_signal=exit_signal)
    if takeover is not None:
        end = guard.client.training_end()  # the job's, not where this spare starts from
        if end is None:
            log.warning("the job's last iteration is not in the store (its set-up never "
                        "finished); taking it from the flags and where training starts")  # fmt: skip
        try:  # a failed takeover logged why (its own error with the traceback)
            trainer = recovery.take_over(takeover.generation,
                                         partial(make_trainer, end_iteration=end))  # fmt: skip
        except RecoveryFailed as lost:
            return _cannot_recover(guard, lost)
    else:
        try:
            stop = guard.check_stop if guard is not None and dpc.deadpool else None
            trainer = _start(cfg, env, store, make_trainer, events, session.inject, stop)
        except (ConfigError, CheckpointError):
            raise  # bad input: the same again would fail the same way
        except Exception as err:
            if guard is None or not dpc.deadpool:
                raise
            try:  # a failure during the set-up: every rank sets up again, a spare in its place
                trainer = recovery.set_up_again(err, make_trainer)
            except RecoveryFailed as lost:
                return _cannot_recover(guard, lost)
        if guard is not None:
            guard.client.publish_training_end(trainer.end_iteration)
    log.info(
        "ready to train %.1f s after process start (set-up %.1f s), from iteration %d",
        time.time() - psutil.Process().create_time(), time.perf_counter() - start,
        trainer.iteration,
    )  # fmt: skip
    while True:
        try:
            trainer.train()
            break
        except Exception as err:
            if guard is None:
                raise
            if not dpc.deadpool:
                return guard.failed(err)
            try:
                recovery.recover(trainer, err)
            except RecoveryFailed as lost:
                return _cannot_recover(guard, lost)
    progress.mark(trainer.iteration, "finish")
    _finish(cfg, trainer, session.inject)
    session.inject(trainer.iteration, "finish")  # kill@RANK:LAST:finish: a death after the end
    if watcher is not None:
        watcher.stop()
    if guard is not None:
        guard.close()
    log.debug("worker done")
    return 0


def _cannot_recover(guard: Guard, lost: RecoveryFailed) -> int:
    log.error("cannot recover: %s", lost)
    guard.close()
    return 1


def _trainer(
    cfg: JobConfig,
    env: ProcessEnv,
    session: ProtectedLoop,
    state: TrainState,
    on_gpu: bool,
    iteration: int = 0,
    end_iteration: int | None = None,
    exit_signal: ExitSignal | None = None,
) -> Trainer:
    trainer = Trainer(cfg, state, env.world_size, on_gpu, session, iteration,
                      end_iteration=end_iteration, exit_signal=exit_signal)  # fmt: skip
    session.bind(trainer)
    return trainer


def _protect(
    cfg: JobConfig,
    env: ProcessEnv,
    guard: Guard | None,
    state: TrainState,
    on_gpu: bool,
    generation: int,
    reuse: Reusable | None = None,
) -> ProtectionPipeline:
    """A generation's protection pipeline; replication faults and errors go to the guard
    (none for a single process without a launcher)."""
    if guard is None:
        return build_pipeline(cfg, state, env, on_gpu, generation, reuse=reuse)
    pipeline = build_pipeline(cfg, state, env, on_gpu, generation, guard.before_send,
                              guard.report, reuse)  # fmt: skip
    if generation == 0:  # a rank's buffers keep their sizes through every generation
        footprint = HostFootprint(tuple(pipeline.footprint()), on_gpu)
        guard.client.publish_footprint(env.rank, footprint)
    return pipeline


def _start(
    cfg: JobConfig,
    env: ProcessEnv,
    store,
    make_trainer,
    events: EventLog,
    inject: Callable[[int, str], None],
    stop: Callable[[], None] | None = None,
) -> Trainer:
    """Generation 0: process groups, model and optimizer, a checkpoint to resume from, and
    the protection pipeline with --deadpool. `inject`: faults at phases groups and setup.
    `stop`: raises once a recovery is ordered (the groups' rendezvous stops waiting then)."""
    prefix = keys.process_group_prefix(env.job_id, 0)
    inject(0, "groups")  # ACTION@R:0:groups: its peers wait for it in their rendezvous
    on_gpu = parallel.init_distributed(cfg, env.rank, env.world_size, store, prefix=prefix,
                                       stop=stop)  # fmt: skip
    tp, pp, dp = parallel.coordinates()
    log.info(
        "rank %d/%d up: tp=%d pp=%d dp=%d, backend %s",
        env.rank, env.world_size, tp, pp, dp, "nccl" if on_gpu else "gloo (CPU)",
    )  # fmt: skip
    state = build_train_state(cfg, on_gpu)
    inject(0, "setup")
    iteration = 0
    if cfg.checkpoint.load:
        t = time.perf_counter()
        iteration = checkpointing.load(cfg, state)
        if env.rank == 0 and iteration > 0:  # torchrun passes --load to the first attempt too
            events.emit(CHECKPOINT_LOADED, iteration=iteration, load_s=time.perf_counter() - t)
    trainer = make_trainer(state, on_gpu, iteration)
    trainer.hooks.after_setup(state.model, state.optimizer, state.scheduler)  # protection starts
    return trainer


def _finish(cfg: JobConfig, trainer: Trainer, inject: Callable[[int, str], None]) -> None:
    """After training and its final save (Trainer.train): stop protecting, release."""
    if trainer.pipeline is not None:
        trainer.pipeline.close()
        log.info("protection: %s", trainer.protection_summary())
    inject(trainer.iteration, "digest")  # kill@RANK:LAST:digest: a death in the last second
    trainer.finish()
    checkpointing.release_writer_processes()
    parallel.destroy_distributed()
