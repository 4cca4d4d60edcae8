"""One worker process from start to finish: store, process groups, model, (resume), train."""

from __future__ import annotations

import logging
import time

import psutil
import torch
import torch.distributed as dist

from ..config import JobConfig
from ..events import CHECKPOINT_LOADED, FAULT_INJECTED, EventLog
from ..failure.progress import ProgressBoard
from ..recovery.hotswap import RecoveryFailed
from ..runtime import ProcessEnv
from . import checkpointing, parallel
from .model import build_train_state
from .training import Trainer

log = logging.getLogger("deadpool.worker")


def open_store(env: ProcessEnv) -> dist.Store:
    """The launcher's TCPStore; a private in-memory store for a single plain process."""
    if env.master_port is None:
        if env.world_size != 1:
            raise RuntimeError(
                f"WORLD_SIZE={env.world_size} but MASTER_PORT is unset; start the job with "
                "deadpool-launch (or set MASTER_ADDR/MASTER_PORT)"
            )
        return dist.HashStore()
    return parallel.connect_store(env.master_addr, env.master_port, env.world_size)


def run_worker(cfg: JobConfig, env: ProcessEnv, takeover=None) -> int:
    """Train as `env.rank`. `takeover` (a spare's ControlClient and the generation it joins)
    makes this a claimed spare taking over a failed rank in a running job."""
    start = time.perf_counter()
    progress = ProgressBoard(env.progress_file)  # private memory without a launcher
    progress.mark(0, "start")
    store = open_store(env)
    control = _attach_control(cfg, env, store, progress, takeover)
    if takeover is None:
        on_gpu = parallel.init_distributed(
            cfg, env.rank, env.world_size, store, prefix=parallel.store_prefix(env.job_id, 0)
        )
        tp, pp, dp = parallel.coordinates()
        log.info(
            "rank %d/%d up: tp=%d pp=%d dp=%d, backend %s",
            env.rank, env.world_size, tp, pp, dp, "nccl" if on_gpu else "gloo (CPU)",
        )  # fmt: skip
        state = build_train_state(cfg, on_gpu)
        trainer = Trainer(cfg, state, env.world_size, on_gpu, progress)
        if cfg.checkpoint.load:
            t = time.perf_counter()
            trainer.iteration = checkpointing.load(cfg, state)
            if control is not None and env.rank == 0:
                control.events.emit(CHECKPOINT_LOADED, iteration=trainer.iteration,
                                    load_s=time.perf_counter() - t)  # fmt: skip
        if cfg.deadpool.deadpool:
            from .hooks import build_pipeline

            trainer.pipeline = build_pipeline(cfg, state, env, on_gpu)
    else:
        _, generation = takeover
        trainer = control.hotswap.take_over(
            generation,
            lambda state, on_gpu: Trainer(cfg, state, env.world_size, on_gpu, progress),
        )
    if control is not None:
        control.wire(trainer)
    log.info(
        "ready to train %.1f s after process start (set-up %.1f s), from iteration %d",
        time.time() - psutil.Process().create_time(), time.perf_counter() - start,
        trainer.iteration,
    )  # fmt: skip
    while True:
        try:
            trainer.train(on_iteration=control.on_iteration if control else None)
            break
        except Exception as err:
            if control is None:
                raise
            if not cfg.deadpool.deadpool:
                return control.failed(err)
            try:
                control.hotswap.recover(trainer, err)
            except RecoveryFailed as lost:
                log.error("cannot recover: %s", lost)
                control.close()
                return 1
            control.wire(trainer)
    progress.mark(trainer.iteration, "finish")
    trainer.finalize_saves()
    c = cfg.checkpoint
    if c.save and (not c.save_interval or trainer.iteration % c.save_interval):
        checkpointing.save(cfg, trainer.state, trainer.iteration)
    if trainer.pipeline is not None:
        trainer.pipeline.close()
        log.info("protection: %s", trainer.protection_summary())
    trainer.finish()
    checkpointing.release_writer_processes()
    parallel.destroy_distributed()
    if control is not None:
        control.close()
    log.debug("worker done")
    return 0


class WorkerControl:
    """Heartbeats after warm-up, fault injection, reporting a caught failure, and this
    process's part in hot-swap recoveries."""

    def __init__(
        self,
        cfg: JobConfig,
        env: ProcessEnv,
        store: dist.Store,
        progress: ProgressBoard,
        client=None,
    ):
        from ..control.client import ControlClient
        from ..failure.inject import parse_faults
        from ..failure.injector import FaultInjector
        from ..recovery.hotswap import HotSwap

        self.cfg = cfg
        self.client = client or ControlClient(env, cfg.deadpool)
        if client is None:
            self.client.register_worker()
        else:
            self.client.stop_heartbeats()  # a spare's beats: it beats as its rank from now on
            self.client.env = env
        self.events = EventLog(cfg.deadpool.deadpool_event_log, rank=env.rank)
        faults = parse_faults(cfg.deadpool.deadpool_inject or "")
        self.injector = FaultInjector(
            faults, env.rank, self._injected, self.client.claim_fault,
            slow_s=3 * cfg.deadpool.deadpool_heartbeat_timeout,
        )  # fmt: skip
        self.hotswap = HotSwap(
            cfg, env, self.client, store, progress, self._report, self.injector.fire
        )
        self.health = None  # started after the first iteration, with the heartbeats
        if cfg.deadpool.deadpool and client is None:
            self.hotswap.start_watching()

    def wire(self, trainer: Trainer) -> None:
        """Hook into a (new) trainer and pipeline: after start-up and after every recovery."""
        trainer.fire = self.fire
        if trainer.pipeline is not None:
            replicator = trainer.pipeline.replicator
            replicator.before_send = lambda it: self.injector.fire(it, "replicate")
            replicator.on_error = self._report  # the training thread may never notice

    def fire(self, iteration: int, phase: str) -> None:
        self.hotswap.check()  # a recovery was ordered: stop at this phase boundary
        self.injector.fire(iteration, phase)

    def _injected(self, fault, at: float) -> None:
        self.client.report_injection(fault, at)
        self.events.emit(FAULT_INJECTED, at=at, fault=str(fault))

    def on_iteration(self, trainer: Trainer) -> None:
        self.client.iteration = trainer.iteration
        if self.cfg.deadpool.deadpool:  # after the first iteration: warm-up is over
            self.client.start_heartbeats(self.cfg.deadpool.deadpool_heartbeat_interval)
            self._start_health_checks(trainer)
            self.hotswap.after_iteration(trainer)

    def _start_health_checks(self, trainer: Trainer) -> None:
        from ..failure.health import HealthCheck, HealthChecker

        interval = self.cfg.deadpool.deadpool_health_check_interval
        if self.health is not None or not interval:
            return
        device = torch.device("cuda", torch.cuda.current_device()) if trainer.on_gpu else "cpu"
        check = HealthCheck(torch.device(device))
        self.injector.on_unhealthy = lambda: setattr(check, "broken", True)
        self.health = HealthChecker(check, interval, self._unfit)
        self.health.start()

    def _unfit(self, reason: str) -> None:
        log.error("health check failed: %s; reported to the launcher", reason)
        self.client.report_failure("health_check", reason)

    def _report(self, err: BaseException) -> None:
        from ..failure.injector import InjectedFault

        if self.hotswap.stopping:
            return  # a recovery is under way: this error is its doing, not new evidence
        kind = "injected_transient" if isinstance(err, InjectedFault) else "collective_error"
        self.client.report_failure(kind, f"{type(err).__name__}: {err}")

    def failed(self, err: Exception) -> int:
        """Without --deadpool there is nothing to recover from: report what this process saw,
        stay alive and healthy, and let the launcher end the job."""
        self._report(err)
        log.error("training failed: %s: %s; reported to the launcher", type(err).__name__, err)
        time.sleep(self.cfg.deadpool.deadpool_heartbeat_timeout + 30.0)
        return 1

    def close(self) -> None:
        if self.health is not None:
            self.health.stop()
        self.client.close()
        self.events.close()


def _attach_control(
    cfg: JobConfig, env: ProcessEnv, store: dist.Store, progress: ProgressBoard, takeover
) -> WorkerControl | None:
    if takeover is not None:
        return WorkerControl(cfg, env, store, progress, client=takeover[0])
    wanted = cfg.deadpool.deadpool or cfg.deadpool.deadpool_inject
    if not wanted or not env.under_launcher:
        return None
    return WorkerControl(cfg, env, store, progress)
