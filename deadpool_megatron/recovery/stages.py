"""One process's part in a hot-swap, as stages read top to bottom.

Every worker runs them when its iteration fails (a collective raised, an injected fault, or
the agent's order to stop, obeyed at a phase boundary); a claimed spare runs them from
"await plan" on. The agent decides (recovery/coordinator.py); each process carries out:

1. stop: cut its communicators (recovery/abort.py), so every peer's pending collective fails
   too, and stop the protection pipeline, keeping its committed snapshots and replicas;
2. await order / report holdings: publish what it holds for the ordered generation;
3. await plan: the agent's plan for that generation, or why nothing can be recovered
   (2, 3 and 4's meeting go through the store: recovery/exchange.py);
4. rebuild: tear down every group, meet everyone of the generation on the store, build
   torch.distributed and megatron-core's groups on the generation's store prefix, then the
   model and optimizer (nothing built before stays reachable from training); with
   --deadpool-keep-model a survivor keeps its model and optimizer and swaps the groups they
   hold for the new ones instead (megatron/rebind.py); in patched Megatron-LM, after the same
   reset, its pretrain() builds them (process/upstream.py). A plan from the start (nothing
   trained yet and nothing to restore: a failure during the set-up) sets every rank up again
   here instead, the seeded model or --load's checkpoint, and 5 restores nothing;
5. restore (recovery/transfer.py): roll back to its own snapshot of the plan's iteration
   (after posting the parts it serves, so that it rolls back while they are read), or, for
   a spare, receive the parameters from one DP peer and the optimizer shard from one ring
   successor, on one host read straight into its live tensors;
6. verify (recovery/verify.py), with every rank: same generation, membership and iteration,
   each (tp, pp, dp) shard exactly once;
7. resume: a new protection pipeline, the trainer attached at the plan's iteration, and the
   job context advanced to the generation.

Each stage has its own timeout (`StageTimeouts`, from the config) and failure path: a newer
order at any wait (`Superseded`) starts again from 2 in the newer generation; an error in
4-7 is a failed attempt (a newer order follows: the agent sees the cause); a timeout, an
unrecoverable plan or a failed verification is `RecoveryFailed`, which ends the process.
Restore and verify are collectives of the new generation's groups, bounded by their timeout
(--distributed-timeout-minutes). A generation whose store prefix an attempt used is never
tried again. The buffers from before the failure are kept until the new generation has
protected its own state.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch.distributed as dist

from ..checkpoint.buffers import HostArena, Reusable
from ..checkpoint.pipeline import ProtectionPipeline
from ..config import JobConfig
from ..control import keys
from ..control.context import JobContext
from ..control.messages import HoldingsReport
from ..errors import CheckpointError, ConfigError
from ..failure.progress import ProgressBoard
from ..megatron import checkpointing, parallel
from ..megatron.checkpointing import materialize_optimizer_state, optimizer_state_ready
from ..megatron.groups import group_roles, live_groups
from ..megatron.model import TrainState, build_train_state, unbind_config, unhook
from ..megatron.prebuild import Prebuilt
from ..megatron.shard import RankState
from ..megatron.training import Trainer
from ..runtime import ProcessEnv
from ..topology import job_topology
from .abort import CommunicatorAbort
from .accounting import Lap, Resumed
from .exchange import (
    RecoveryExchange,
    RecoveryFailed,
    RecoveryOrdered,
    StageTimeouts,
    Superseded,
)
from .held import Held
from .kept import Kept, adopt_prebuilt, keep_or_build
from .leftovers import LeftBehind
from .own_failure import OwnFailure, caused_here, failed_here
from .plan import RecoveryPlan, anyone_builds
from .release import collect_left_behind
from .transfer import transfer_state
from .verify import verify_generation, verify_groups_replaced

log = logging.getLogger("deadpool.recovery")


@dataclass
class Rebuilt:
    """What the rebuild stage produced, carried through restore, verify and resume."""

    trainer: Trainer
    state: TrainState
    on_gpu: bool
    phases: dict[str, float]
    old_groups: list  # held while verifying: their ids stay unique
    host: dist.ProcessGroup  # parallel.host_group(): restore and verify move host memory on it
    phase_cpu: dict[str, float] = field(default_factory=dict)  # CPU seconds of each phase
    start: int | None = None  # from the start: the iteration training starts from, found again


MakeTrainer = Callable[..., Trainer]  # (state, on_gpu[, iteration training starts from])
# (state, on_gpu, generation, slot pairs to reuse) -> the generation's pipeline
Protect = Callable[[TrainState, bool, int, Reusable | None], ProtectionPipeline]


class ProcessRecovery:
    def __init__(
        self,
        cfg: JobConfig,
        env: ProcessEnv,
        ctx: JobContext,
        store: dist.Store,
        progress: ProgressBoard,
        abort: CommunicatorAbort,
        protect: Protect,
        report: Callable[[BaseException], None] | None = None,
        inject: Callable[[int, str], None] | None = None,
        report_recovery: Callable[[BaseException, int, int], None] | None = None,
        timeouts: StageTimeouts | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        cpu_clock: Callable[[], float] = time.process_time,
        keep_model: bool = False,
        reserve: HostArena | None = None,
        prebuilt: Prebuilt | None = None,
    ):
        """`reserve`: a claimed spare's host memory reserved while it was idle, for the slot
        pairs of its first pipeline; `prebuilt`: the state it built while idle for its rank,
        rebound instead of built when the plan counts on it."""
        self.cfg = cfg
        self.env = env
        self.ctx = ctx
        self.store = store  # the torch store the generations' process groups meet on
        self.progress = progress
        self.abort = abort
        self.protect = protect  # builds a generation's protection pipeline (collective)
        self.report = report  # evidence of this process's own failure, for the agent
        # ... and of its own error in a recovery: (error, generation, iteration recovered from)
        self.report_recovery = report_recovery
        self.inject = inject  # fault injection at the "recovery" phase
        self.timeouts = timeouts or StageTimeouts.from_config(cfg.deadpool)
        self.exchange = RecoveryExchange(ctx, env.rank, env.world_size, self.timeouts, clock,
                                         sleep)  # fmt: skip
        self._cpu_clock = cpu_clock  # this process's CPU seconds, every thread
        self._cpu_at = 0.0  # the CPU clock when the recovery under way began
        self.topology = job_topology(env.world_size, cfg.parallel, env.local_world_size)
        self.held = Held()
        self.active = False  # between a failure and the resumed iteration
        self.completed = 0  # the newest iteration this process finished before the failure
        # Whether this process holds state past where training starts (an iteration done, or
        # a restored one): while no live rank does, a plan may set everything up again.
        self.trained = False
        self.bytes_moved = 0
        self._failed_iteration = 0
        self._own = OwnFailure()  # the own error that started the recovery under way
        self._spent = 0  # the newest generation whose store prefix an attempt used
        self._resumed: Resumed | None = None  # a recovery awaiting its first iteration
        # Process groups of the generations left behind, released after the collection.
        self._retired: list[object] = []
        self.models = LeftBehind()  # each generation's model, to catch one that outlives it
        # A survivor's state, rebound instead of rebuilt (not when Megatron-LM's pretrain()
        # builds the model), and the role of every group it may hold, until it resumes.
        self.keep_model = keep_model
        self._kept: Kept | None = None
        self._reserve = reserve
        self._prebuilt = prebuilt
        self._roles: dict[int, tuple] = {}

    # -- entry points ------------------------------------------------------------------------
    def recover(self, trainer: Trainer, err: BaseException) -> None:
        """A worker: take part in recoveries until one succeeds; raises RecoveryFailed."""
        self.interrupted(trainer, err)
        self._until_recovered(trainer)

    def set_up_again(self, err: BaseException, make_trainer: MakeTrainer) -> Trainer:
        """A worker whose set-up failed (a peer died in one of its collectives, its own
        error, or the agent's order): set up again, from the start as every rank does, in
        the generation the agent plans; returns the trainer. Raises RecoveryFailed."""
        self.interrupted(None, err)
        return self._until_recovered(None, make_trainer)

    def _until_recovered(
        self, trainer: Trainer | None, make_trainer: MakeTrainer | None = None
    ) -> Trainer:
        """Stages 2-7 until a generation's recovery succeeds (a newer order, or a failure in
        one, leads to the next); without a trainer (its set-up failed) only a plan from the
        start will do. Raises RecoveryFailed."""
        while True:
            plan = self.next_plan()
            if trainer is None and not plan.from_start:
                raise RecoveryFailed(f"this rank's set-up failed, but the plan of generation "
                                     f"{plan.generation} restores iteration {plan.iteration}")  # fmt: skip
            try:
                rebuilt = self.rebuild(plan, trainer, make_trainer)
                self.complete(plan, rebuilt)
                return rebuilt.trainer
            except Superseded as why:
                log.info("%s; recovering into the newer generation", why)
            except (RecoveryFailed, ConfigError, CheckpointError):
                raise  # bad input (a --load the set-up reads again) ends the process
            except Exception as e:  # a failure during the recovery: a newer order follows
                self.failed_attempt(plan.generation, e, trainer)

    def interrupted(self, trainer: Trainer | None, err: BaseException) -> None:
        """Stage 1 for a worker whose iteration (None: set-up) failed: report it, stop."""
        if not isinstance(err, RecoveryOrdered) and not self.ctx.stopping and self.report:
            self.report(err)  # the agent classifies it, by where it struck: before the mark
        self._begin(trainer.iteration if trainer is not None else 0)
        training = trainer is not None and trainer.state is not None  # else still setting up
        where = f"iteration {trainer.iteration + 1}" if training else "set-up"
        own = self._own.interrupted(err)  # its traceback: what a user needs to fix it
        log.warning("%s stopped: %s: %s", where, type(err).__name__, err,
                    exc_info=err if own else None)  # fmt: skip
        if trainer is None:
            self.abort.abort()
        else:
            self.stop(trainer)

    def next_plan(self) -> RecoveryPlan:
        """Stages 2-3: the plan of the newest generation ordered; raises RecoveryFailed."""
        while True:
            generation = self.await_order()
            self.report_holdings(generation)
            try:
                return self.await_plan(generation)
            except Superseded as why:
                log.info("%s; recovering into the newer generation", why)

    def take_over(self, generation: int, make_trainer: MakeTrainer) -> Trainer:
        """A claimed spare joins the recovery into `generation`; returns its trainer. Its own
        failure ends it (it holds nothing yet; the agent seats the next spare); a failure
        elsewhere that cuts it short seats it in the next generation too (takeover_again).
        Raises RecoveryFailed."""
        plan = self.takeover_plan(generation)
        while True:
            try:
                rebuilt = self.rebuild(plan, None, make_trainer)
                self.complete(plan, rebuilt)
                return rebuilt.trainer
            except RecoveryFailed:
                raise
            except Exception as e:
                plan = self.takeover_again(plan.generation, e)

    def takeover_again(self, generation: int, err: BaseException) -> RecoveryPlan:
        """A claimed spare's takeover into `generation` failed after its plan seated it. Its
        own failure ends it: it holds nothing to stay for and leaves (the agent seats the
        next spare), its error reported first, which the agent weighs with the exit so that
        the same error met by the rank's every holder ends the job. Otherwise a failure
        elsewhere cut it short (a newer order, a peer lost): it holds the rank in the
        committed membership and stays, holding nothing, for the next plan, which sends it
        the rank's state again. Before, it left, and the next recovery took another spare
        for its rank: with none left, the job could not go on. Returns that plan; raises
        RecoveryFailed."""
        if failed_here(err):
            self._report_failure(err, generation)
            log.warning("taking over rank %d in generation %d failed: %s: %s", self.env.rank,
                        generation, type(err).__name__, err,
                        exc_info=err if caused_here(err) else None)  # fmt: skip
            raise RecoveryFailed(f"taking over rank {self.env.rank} failed: {err}") from err
        log.warning("taking over rank %d in generation %d was cut short: %s: %s; seated, it "
                    "waits for the next plan", self.env.rank, generation, type(err).__name__,
                    err)  # fmt: skip
        self.abort.abort()
        self._spent = max(self._spent, generation)  # its store prefix is spent: never retry
        while True:
            generation = self.await_order()
            self.report_holdings(generation, arriving=True)
            try:
                plan = self.await_plan(generation)
            except Superseded as why:
                log.info("%s; recovering into the newer generation", why)
                continue
            if self.env.rank not in plan.arriving:
                raise RecoveryFailed(f"the plan of generation {generation} does not seat rank "
                                     f"{self.env.rank} here again: {plan.arriving}")  # fmt: skip
            return plan

    def _report_failure(self, err: BaseException, generation: int) -> None:
        """This process's failure in the recovery into `generation` (own_failure.failed_here):
        the agent hears of it now (a failed attempt otherwise waits for an order nobody gave,
        and the agent waited out its recovery timeout, 300 s)."""
        if self.report_recovery is not None:
            self.report_recovery(err, generation, self._failed_iteration)

    def joining(self, generation: int) -> None:
        """A claimed spare: the order it was claimed for is known (before its order watcher
        starts, which would otherwise take that order, or an older one, for a new one and
        abort the communicators the takeover is building)."""
        if generation - 1 > self.ctx.generation:
            self.ctx.advance(generation - 1)  # the generation the job is leaving
        self.ctx.see_order(generation)

    def takeover_plan(self, generation: int) -> RecoveryPlan:
        """A claimed spare's stages 2-3: the plan that seats it; raises RecoveryFailed."""
        self.joining(generation)
        self._begin(0)
        try:
            plan = self.await_plan(generation)
        except Superseded as why:
            raise RecoveryFailed(f"taking over rank {self.env.rank}: {why}") from why
        if self.env.rank not in plan.replaced:
            raise RecoveryFailed(
                f"the plan of generation {generation} does not replace rank "
                f"{self.env.rank}: {sorted(plan.replaced)}"
            )
        return plan

    def _begin(self, iteration: int) -> None:
        self.progress.mark(iteration, "recovery")
        self.active = True
        self._cpu_at = self._cpu_clock()

    def complete(self, plan: RecoveryPlan, rebuilt: Rebuilt) -> None:
        """Stages 5-7 once the generation's groups, model and optimizer are built. Restore
        and verify move host memory: they go through the rebuild's gloo group over every rank
        (in an NCCL job the default group cannot carry CPU tensors). From the start nothing
        is restored: the rebuild set everything up again."""
        if plan.from_start:
            restored = rebuilt.start
        else:
            restored = self.restore(rebuilt, plan, rebuilt.host)
        self.verify(plan, restored, rebuilt, rebuilt.host)
        self.resume(plan, rebuilt, restored)

    # -- 1. stop -----------------------------------------------------------------------------
    def stop(self, trainer: Trainer) -> None:
        """Break this process's (and so its peers') pending collectives; keep the buffers."""
        self.abort.abort()
        self.completed = max(self.completed, trainer.iteration)
        if trainer.state is not None:
            self.models.track(self.ctx.generation, trainer.state.model[0])
            hooks = unhook(trainer.state)  # a pending operation's graph must not hold it
            log.debug("cut %d gradient hooks off generation %d's model",
                      sum(map(len, hooks)), self.ctx.generation)  # fmt: skip
            if self.keep_model:
                self._kept = Kept(trainer.state, hooks)
            else:
                unbind_config(trainer.state)
        self._keep(trainer.detach())

    def _keep(self, pipeline: ProtectionPipeline | None) -> None:
        if pipeline is not None:
            pipeline.abort(self.timeouts.stop_s)
            self.held.keep(pipeline)

    # -- 2. order, holdings (recovery/exchange.py) ------------------------------------------
    def await_order(self) -> int:
        return self.exchange.await_order(self._spent)

    def report_holdings(self, generation: int, arriving: bool = False) -> None:
        """`arriving`: a seated spare whose takeover was cut short (takeover_again)."""
        self.exchange.report_holdings(generation, HoldingsReport(
            self.held.holdings(), self.completed, self.trained, arriving=arriving
        ))  # fmt: skip

    # -- 3. plan -----------------------------------------------------------------------------
    def await_plan(self, generation: int) -> RecoveryPlan:
        decision = self.exchange.await_plan(generation)
        self._failed_iteration = decision.failed_iteration
        return decision.plan

    # -- 4. rebuild --------------------------------------------------------------------------
    def rebuild(
        self, plan: RecoveryPlan, trainer: Trainer | None, make_trainer: MakeTrainer | None = None
    ) -> Rebuilt:
        # stopping, reporting and waiting for the plan, from the recovery's start on
        phase_cpu = {"before_rebuild": self._cpu_clock() - self._cpu_at}
        lap = Lap(self._cpu_clock)
        old_groups = self.reset_communicators(plan)
        prebuilt = self._adopt_prebuilt(plan)
        on_gpu = parallel.init_distributed(
            self.cfg, self.env.rank, self.env.world_size, self.store,
            prefix=self.ctx.store_prefix(plan.generation),
        )  # fmt: skip
        host = parallel.host_group()  # with the other groups: before any fault can strike
        phases: dict[str, float] = {}
        lap.record(phases, phase_cpu, "rebuild_communicators")
        start = None
        if plan.from_start:
            state, start = self._set_up(on_gpu)
        else:
            state = self._rebound(anyone_builds(plan, self.keep_model), host, prebuilt)
        if state is None:
            # the restore overwrites weights and optimizer state entirely: neither is drawn
            state = build_train_state(self.cfg, on_gpu, initialize=False)
            materialize_optimizer_state(state.optimizer)
        self.models.track(plan.generation, state.model[0])
        if trainer is None:
            trainer = make_trainer(state, on_gpu) if start is None else make_trainer(
                state, on_gpu, start)  # fmt: skip
        lap.record(phases, phase_cpu, "rebuild_model")
        self.inject_recovery_fault()
        return Rebuilt(trainer, state, on_gpu, phases, old_groups, host, phase_cpu, start)

    def _set_up(self, on_gpu: bool) -> tuple[TrainState, int]:
        """From the start: the model and optimizer as the job's set-up builds them (the same
        seeded initialization), loaded from --load's checkpoint if it names one; returns them
        and the iteration training starts from. Nothing kept or built while idle is used."""
        self._kept, self._roles = None, {}
        state = build_train_state(self.cfg, on_gpu)
        start = checkpointing.load(self.cfg, state) if self.cfg.checkpoint.load else 0
        log.info("set up again from the start: iteration %d", start)
        return state, start

    def _adopt_prebuilt(self, plan: RecoveryPlan) -> bool:
        """A claimed spare keeps the state it built while idle if the plan counts on it."""
        prebuilt, self._prebuilt = self._prebuilt, None
        adopted = adopt_prebuilt(prebuilt, self.env.rank, self.env.rank in plan.prebuilt)
        if adopted is not None:
            self._kept, self._roles = adopted
        return adopted is not None

    def _rebound(self, plan_builds: bool, host, prebuilt: bool) -> TrainState | None:
        """The kept state rebound to the new generation (recovery/kept.py), or None: then it
        is built again."""
        kept, roles, self._roles = self._kept, self._roles, {}  # roles hold the old groups
        state = keep_or_build(kept, roles, plan_builds, host, prebuilt)
        if state is None:
            self._kept = None
        return state

    def reset_communicators(self, plan: RecoveryPlan) -> list:
        """Tear down every group and meet the generation on the store; returns the groups
        from before, for the stale-reference check (empty unless --deadpool-verify-groups)."""
        self._spent = plan.generation  # from here on, this generation's store prefix is used
        retiring = live_groups()
        self._retired.extend(retiring)  # released by _collect_previous_generation, not by gc
        old_groups = list(retiring) if self.cfg.deadpool.deadpool_verify_groups else []
        if self._kept is not None:
            self._roles.update(group_roles())  # what the kept state's groups were for
        parallel.destroy_distributed()
        self.exchange.rendezvous(plan.generation)
        self.abort.rearm()
        # An order that came while rearming may have aborted before the rearm undid it: its
        # peers are leaving, and a group built now would wait on them.
        self.exchange.superseded(plan.generation, "rearming its communicators")
        return old_groups

    def inject_recovery_fault(self) -> None:
        """kill@R:I:recovery: recovering from a failure in iteration I, groups rebuilt."""
        if self.inject is not None:
            self.inject(self._failed_iteration, "recovery")

    # -- 5. restore (recovery/transfer.py) ---------------------------------------------------
    def restore(self, rebuilt: Rebuilt, plan: RecoveryPlan, group: dist.ProcessGroup) -> int:
        lap = Lap(self._cpu_clock)
        state = rebuilt.state
        rank_state = RankState(state.model, state.optimizer, state.scheduler)
        offer = self.cfg.deadpool.deadpool_transport == "tcp"
        restored, received = transfer_state(
            plan, rank_state, self.held, self.topology, self.env.rank, group, offer
        )
        self.bytes_moved += received  # counted once, by the receiver
        if rank_state.gather_params():
            log.info(
                "parameters gathered from every rank's optimizer shard (overlapped "
                "all-gather: the snapshot's were an iteration old outside this shard)"
            )
        lap.record(rebuilt.phases, rebuilt.phase_cpu, "transfer_state")
        return restored

    # -- 6. verify (recovery/verify.py) -----------------------------------------------------
    def verify(
        self, plan: RecoveryPlan, restored: int, rebuilt: Rebuilt, group: dist.ProcessGroup
    ) -> None:
        lap = Lap(self._cpu_clock)
        verify_generation(plan, restored, self.topology, group)
        lap.record(rebuilt.phases, rebuilt.phase_cpu, "verify")

    # -- 7. resume ---------------------------------------------------------------------------
    def resume(self, plan: RecoveryPlan, rebuilt: Rebuilt, iteration: int) -> None:
        """`iteration`: the plan's, or from the start the one the set-up found."""
        lap = Lap(self._cpu_clock)
        reuse = dataclasses.replace(self.held.offer(iteration), arena=self._reserve)
        self._reserve = None  # carved into this pipeline's pairs: theirs from now on
        pipeline = self.protect(rebuilt.state, rebuilt.on_gpu, plan.generation, reuse)
        if not plan.from_start:
            pipeline.after_step(iteration)  # the new generation protects itself
        elif optimizer_state_ready(rebuilt.state.optimizer):
            pipeline.protect_start(iteration)  # as at the job's start
        lap.record(rebuilt.phases, rebuilt.phase_cpu, "rebuild_pipeline")
        rebuilt.trainer.attach(rebuilt.state, iteration, pipeline)
        checked = None
        if self.cfg.deadpool.deadpool_verify_groups:
            # the retired groups are held on purpose until the collection after the first
            # resumed iteration releases them
            checked = verify_groups_replaced(
                rebuilt.old_groups, rebuilt.trainer, self, skip=(self._retired,)
            )
        rebuilt.old_groups.clear()
        self._kept = None  # resumed: from here on the trainer holds it
        self.ctx.advance(plan.generation)
        self.active = False
        self.trained = self.trained or not plan.from_start
        phases = rebuilt.phases
        self._resumed = Resumed(phases, rebuilt.phase_cpu, checked, time.time(),
                                self._cpu_clock())  # fmt: skip
        log.info(
            "generation %d: %s iteration %d (%s), resuming", plan.generation,
            "set up again at" if plan.from_start else "rolled back to", iteration,
            ", ".join(f"{k} {v:.3f} s" for k, v in phases.items()),
        )  # fmt: skip

    def _collect_previous_generation(self) -> None:
        """Free the generations this process left behind, now, on a thread of its own
        (release.collect_left_behind says why). The abort's cut connections are closed
        first: every peer of this generation has trained an iteration in it, so each has
        ended its side of them, and closing them now reaches no gloo pair."""
        retired, self._retired = self._retired, []
        self.abort.release()
        collect_left_behind(self.ctx.generation, retired, self.models)

    def failed_attempt(self, generation: int, err: Exception, trainer: Trainer | None) -> None:
        """An attempt failed: wait for a newer order, unless it failed with the very error
        that started the recovery (own_failure.py): then raise RecoveryFailed. Its own error
        is reported first, the cause the agent orders that newer generation for."""
        repeated = self._own.repeated(err)
        own = caused_here(err)
        log.warning("recovery into generation %d failed: %s: %s", generation,
                    type(err).__name__, err, exc_info=err if own and not repeated else None)  # fmt: skip
        if failed_here(err):
            self._report_failure(err, generation)
        self.abort.abort()
        self._keep(trainer.detach() if trainer is not None else None)
        self._spent = max(self._spent, generation)  # its store prefix is spent: never retry
        if repeated:
            raise RecoveryFailed(
                f"recovery into generation {generation} failed with the error that started "
                f"it ({type(err).__name__}: {err}); it would fail the same way again"
            ) from err

    # -- after the first resumed iteration -----------------------------------------------------
    def after_iteration(self, trainer: Trainer) -> None:
        """Account for the first resumed iteration; drop buffers from before the failure
        once the new generation holds its own snapshot and every predecessor's replica."""
        self.trained = True
        if self._resumed is not None:
            record = self._resumed.recovered(trainer.iteration, self.bytes_moved, self._cpu_at,
                                             time.time(), self._cpu_clock())  # fmt: skip
            self.ctx.put(keys.recovered(self.ctx.job, self.ctx.generation, self.env.rank), record)
            self._resumed = None
            self.bytes_moved = 0
            self._collect_previous_generation()
        p = trainer.pipeline
        if self.held.snapshots and p is not None and p.replicated(0):
            self.held = Held()
