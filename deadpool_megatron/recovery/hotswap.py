"""One process's part in a hot-swap: stop, say what it holds, rebuild, restore, verify, resume.

Every worker runs this when its iteration fails (a collective raised, an injected fault, or
the launcher's order to stop); a spare runs it when it is claimed for a failed rank. The
launcher decides what happens (recovery/coordinator.py); here each process carries it out:

1. stop: break its own pending collectives (recovery/abort.py), so every peer's fail too, and
   stop the protection pipeline, keeping its committed snapshots and replicas (host memory);
2. report: publish what it holds (snapshot iterations, replicas) for the new generation;
3. rebuild: when the plan arrives, tear down every group and build torch.distributed and
   megatron-core's groups again on the generation's store prefix, then the model, optimizer
   and pipeline against them (nothing built before stays reachable from training);
4. restore: roll back to its own snapshot of the plan's iteration, or, for a spare, receive
   the parameters from one DP peer and the optimizer shard from one ring successor;
5. verify, with every rank: same generation, membership and iteration, each (tp, pp, dp)
   shard exactly once; then resume at the next iteration.

A newer order at any point (a failure during the recovery) restarts from 2 in that
generation; the buffers from before the failure are kept until the new generation has
protected its own state.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

import torch.distributed as dist

from ..checkpoint.buffers import Slot, SlotPair
from ..checkpoint.restore import (
    recv_part,
    restore_from_parts,
    restore_from_snapshot,
    send_parameters,
    send_replica,
)
from ..config import JobConfig
from ..control import keys
from ..errors import DeadpoolError
from ..failure.evidence import EXIT_BLOCKED
from ..failure.hang import HangPolicy, StallWatch
from ..failure.procstate import working_cpu_seconds
from ..failure.progress import ProgressBoard
from ..megatron import parallel
from ..megatron.checkpointing import materialize_optimizer_state
from ..megatron.groups import live_groups, stale_groups
from ..megatron.hooks import build_pipeline
from ..megatron.model import build_train_state
from ..megatron.shard import RankState
from ..runtime import ProcessEnv
from ..topology import Topology
from .abort import CommunicatorAbort
from .plan import RankHoldings, RecoveryPlan, check_plan, decode_plan, encode_holdings

log = logging.getLogger("deadpool.recovery")

POLL_S = 0.02


class RecoveryOrdered(DeadpoolError):
    """The launcher ordered a recovery into a newer generation: stop this iteration."""


class RecoveryFailed(DeadpoolError):
    """This process cannot take part in any recovery (unrecoverable, or no order came)."""


@dataclass
class Held:
    """Committed snapshots and replicas kept from before a failure, newest source first."""

    snapshots: list[SlotPair] = field(default_factory=list)
    replicas: dict[int, list[SlotPair]] = field(default_factory=dict)

    def add_pipeline(self, pipeline) -> None:
        self.snapshots.insert(0, pipeline.snapshotter.slots)
        for owner, pair in pipeline.replicator.replicas.items():
            self.replicas.setdefault(owner, []).insert(0, pair)

    def holdings(self) -> RankHoldings:
        return RankHoldings(
            frozenset(i for p in self.snapshots for i in p.iterations()),
            {
                o: frozenset(i for p in ps for i in p.iterations())
                for o, ps in self.replicas.items()
            },
        )

    def snapshot(self, iteration: int) -> tuple[SlotPair, Slot]:
        for pair in self.snapshots:
            slot = pair.find(iteration)
            if slot is not None:
                return pair, slot
        raise DeadpoolError(f"no committed snapshot of iteration {iteration} is held here")

    def replica(self, owner: int, iteration: int) -> SlotPair:
        for pair in self.replicas.get(owner, []):
            if pair.find(iteration) is not None:
                return pair
        raise DeadpoolError(f"no replica of rank {owner}'s shard at iteration {iteration} here")


class HotSwap:
    def __init__(
        self,
        cfg: JobConfig,
        env: ProcessEnv,
        client,
        store: dist.Store,
        progress: ProgressBoard,
        report=None,
        fire=None,
    ):
        self.cfg = cfg
        self.progress = progress
        self.env = env
        self.client = client
        self.kv = client.kv
        self.job = env.job_id
        self.store = store
        self.abort = CommunicatorAbort(control_ports=client.kv_ports)
        self.report = report  # evidence of this process's own failure, for the launcher
        self.fire = fire  # fault injection at the "recovery" phase
        self.generation = 0
        self.topology = Topology(
            env.world_size,
            cfg.parallel.tensor_model_parallel_size,
            cfg.parallel.pipeline_model_parallel_size,
        )
        self.held = Held()
        self.completed = 0  # the newest iteration this process finished before the failure
        self.bytes_moved = 0
        self._failed_iteration = 0
        self._ordered = 0
        self._failed_generation = 0
        self._in_recovery = False
        policy = HangPolicy.from_config(cfg.deadpool)
        # How long an order, a plan or the rendezvous may take: a recovery's allowance (the
        # launcher waits as long for a rank that is still computing towards a phase boundary).
        self.wait_s = policy.slow_phase_s
        self._stall = StallWatch(policy)  # is the training thread coming to a stop?
        self._lock = threading.Lock()
        self._pending: dict | None = None  # phases of a recovery awaiting its first iteration
        self._watcher: threading.Thread | None = None

    # -- watching for the launcher's orders ------------------------------------------------
    def start_watching(self) -> None:
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name="deadpool-order", daemon=True)
            self._watcher.start()

    def _watch(self) -> None:
        while True:
            with self._lock:
                nxt = max(self.generation, self._ordered) + 1
            try:
                raw = self.kv.get(keys.recovery_order(self.job, nxt))
            except Exception:  # the store is gone: the job is ending
                return
            now = time.monotonic()
            if raw is not None:
                with self._lock:
                    self._ordered = max(self._ordered, nxt)
                log.info("recovery into generation %d ordered: %s", nxt, json.loads(raw)["reason"])
                self.abort.abort()  # whoever is blocked in a collective now fails
            self._stall.observe(self.progress.read(), now)
            if self._waiting_for_training_thread():
                self._stall.watch_cpu(working_cpu_seconds(), now)
                self._leave_if_stalled(now)
            time.sleep(POLL_S)

    def _waiting_for_training_thread(self) -> bool:
        with self._lock:
            return self._ordered > self.generation and not self._in_recovery

    def _leave_if_stalled(self, now: float) -> None:
        """Leave if the training thread stopped making progress after an order.

        A healthy rank stops at its next phase boundary (or its pending collective fails), so
        it is waited for as long as it computes. One that is blocked (no progress mark and no
        CPU time: e.g. a gloo send waiting for its peer to post the matching receive, which a
        closed connection does not wake) cannot join the recovery: it exits and the launcher
        replaces it with a spare.
        """
        why = self._stall.stalled(now)
        if why is None:
            return
        frame = sys._current_frames().get(threading.main_thread().ident)
        stack = "".join(traceback.format_stack(frame)) if frame else "?"
        log.error(
            "the training thread is %s after the recovery order; leaving so that a spare takes "
            "this rank over. It is at:\n%s", why, stack,
        )  # fmt: skip
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(EXIT_BLOCKED)

    @property
    def stopping(self) -> bool:
        with self._lock:
            return self._ordered > self.generation

    def check(self) -> None:
        """Raise RecoveryOrdered if the launcher has ordered a recovery (phase boundaries)."""
        if self.stopping:
            raise RecoveryOrdered(f"recovery into generation {self._ordered} ordered")

    # -- a worker's recovery -----------------------------------------------------------------
    def recover(self, trainer, err: BaseException) -> None:
        """Take part in recoveries until one succeeds; raises RecoveryFailed if none can."""
        self._enter_recovery(trainer.iteration)
        if not isinstance(err, RecoveryOrdered) and not self.stopping and self.report:
            self.report(err)  # the launcher classifies it
        log.warning("iteration %d stopped: %s: %s", trainer.iteration + 1, type(err).__name__, err)
        self.abort.abort()
        self.completed = max(self.completed, trainer.iteration)
        self._stop_pipeline(trainer)
        while True:
            generation = self._wait_for_order()
            self._publish_holdings(generation)
            plan = self._wait_for_plan(generation)
            if plan is None:
                continue  # a newer order superseded it
            try:
                self._rebuild(trainer, plan)
                self._recovered()
                return
            except RecoveryFailed:
                raise
            except Exception as e:  # a failure during the recovery: a newer order follows
                log.warning("recovery into generation %d failed: %s: %s", generation,
                            type(e).__name__, e)  # fmt: skip
                self.abort.abort()
                self._stop_pipeline(trainer)
                self._failed_generation = generation  # its store prefix is spent: never retry

    def take_over(self, generation: int, trainer_factory):
        """A claimed spare joins the recovery into `generation`; returns its Trainer."""
        with self._lock:
            self.generation, self._ordered = generation - 1, generation
        self._enter_recovery(0)
        self.start_watching()
        while True:
            plan = self._wait_for_plan(generation)
            if plan is not None:
                if self.env.rank not in plan.replaced:
                    raise RecoveryFailed(
                        f"the plan of generation {generation} does not replace rank "
                        f"{self.env.rank}: {sorted(plan.replaced)}"
                    )
                try:
                    trainer = self._rebuild(None, plan, trainer_factory)
                    self._recovered()
                    return trainer
                except RecoveryFailed:
                    raise
                except Exception as e:
                    raise RecoveryFailed(f"taking over rank {self.env.rank} failed: {e}") from e
            generation = self._wait_for_order()

    def _enter_recovery(self, iteration: int) -> None:
        self.progress.mark(iteration, "recovery")
        with self._lock:
            self._in_recovery = True
        self._stall.stop_watching()

    def _recovered(self) -> None:
        with self._lock:
            self._in_recovery = False

    def _stop_pipeline(self, trainer) -> None:
        p = trainer.pipeline if trainer is not None else None
        if p is None:
            return
        p.replicator.on_error = None  # errors from here on are the abort's doing
        p.abort()
        if p.snapshotter.slots.committed() is not None:
            self.held.add_pipeline(p)
        trainer.pipeline = None

    def _wait_for_order(self) -> int:
        deadline = time.monotonic() + self.wait_s
        while not self.stopping or self._ordered <= self._failed_generation:
            if time.monotonic() > deadline:
                raise RecoveryFailed(
                    f"no recovery order from the launcher within {self.wait_s:.0f} s"
                )
            time.sleep(POLL_S)
        with self._lock:
            return self._ordered

    def _publish_holdings(self, generation: int) -> None:
        h = self.held.holdings()
        doc = encode_holdings(h, self.completed)
        self.kv.set(keys.holdings(self.job, generation, self.env.rank), json.dumps(doc).encode())
        log.info(
            "generation %d: holding snapshots %s and replicas %s",
            generation, sorted(h.snapshots), {o: sorted(i) for o, i in h.replicas.items()},
        )  # fmt: skip

    def _wait_for_plan(self, generation: int) -> RecoveryPlan | None:
        deadline = time.monotonic() + self.wait_s
        key = keys.recovery_plan(self.job, generation)
        while True:
            raw = self.kv.get(key)
            if raw is not None:
                doc = json.loads(raw)
                if "unrecoverable" in doc:
                    raise RecoveryFailed(doc["unrecoverable"])
                self._failed_iteration = doc["failed_iteration"]
                return decode_plan(doc)
            with self._lock:
                if self._ordered > generation:
                    return None
            if time.monotonic() > deadline:
                raise RecoveryFailed(f"no plan for generation {generation} within the timeout")
            time.sleep(POLL_S)

    # -- rebuild, restore, verify -------------------------------------------------------------
    def _rebuild(self, trainer, plan: RecoveryPlan, trainer_factory=None):
        generation = plan.generation
        phases: dict[str, float] = {}
        t = time.perf_counter()
        verify_groups = self.cfg.deadpool.deadpool_verify_groups
        old_groups = live_groups() if verify_groups else []  # held: their ids stay unique
        if trainer is not None:
            trainer.state = None  # the old model, DDP and optimizer hold the old groups
            trainer.abandon_saves()
        parallel.destroy_distributed()
        self._rendezvous(generation)
        self.abort.rearm()
        on_gpu = parallel.init_distributed(
            self.cfg,
            self.env.rank,
            self.env.world_size,
            self.store,
            prefix=parallel.store_prefix(self.job, generation),
        )
        phases["rebuild_communicators"] = time.perf_counter() - t
        t = time.perf_counter()
        state = build_train_state(self.cfg, on_gpu)
        materialize_optimizer_state(state.optimizer)  # the restore overwrites it entirely
        if trainer is None:
            trainer = trainer_factory(state, on_gpu)
        else:
            trainer.attach(state)
        phases["rebuild_model"] = time.perf_counter() - t
        if self.fire is not None:  # kill@R:I:recovery: recovering from a failure in I
            self.fire(self._failed_iteration, "recovery")
        t = time.perf_counter()
        rank_state = RankState(state.model, state.optimizer, state.scheduler)
        restored = self._restore(rank_state, plan)
        phases["transfer_state"] = time.perf_counter() - t
        t = time.perf_counter()
        self._verify(plan, restored)
        phases["verify"] = time.perf_counter() - t
        t = time.perf_counter()
        trainer.iteration = plan.iteration
        trainer.pipeline = build_pipeline(self.cfg, state, self.env, on_gpu, generation)
        trainer.pipeline.after_step(plan.iteration)  # the new generation protects itself
        phases["rebuild_pipeline"] = time.perf_counter() - t
        checked = None
        if verify_groups:
            reachable, stale = stale_groups(old_groups, trainer, self)
            if stale:
                raise RecoveryFailed(
                    f"{len(stale)} reference(s) to process groups from before the recovery "
                    f"remain: {stale[:5]}"
                )
            checked = reachable
            log.info("verified: %d process groups reachable, none from before", reachable)
        del old_groups
        with self._lock:
            self.generation = generation
        self.client.generation = generation
        self._pending = {"phases": phases, "restored_at": time.time(), "groups": checked}
        log.info(
            "generation %d: rolled back to iteration %d (%s), resuming",
            generation, plan.iteration, ", ".join(f"{k} {v:.3f} s" for k, v in phases.items()),
        )  # fmt: skip
        return trainer

    def _rendezvous(self, generation: int) -> None:
        """Everyone of the generation is here: only then build groups (a gloo rendezvous
        waiting for a dead process cannot be interrupted; this wait can)."""
        self.kv.set(keys.arrived(self.job, generation, self.env.rank), b"1")
        deadline = time.monotonic() + self.wait_s
        waiting = set(range(self.env.world_size))
        while waiting:
            waiting = {
                r for r in waiting if self.kv.get(keys.arrived(self.job, generation, r)) is None
            }
            with self._lock:
                if self._ordered > generation:
                    raise RecoveryOrdered(f"generation {self._ordered} ordered during rendezvous")
            if time.monotonic() > deadline:
                raise RecoveryFailed(
                    f"ranks {sorted(waiting)} never joined generation {generation}"
                )
            if waiting:
                time.sleep(POLL_S)

    def _restore(self, state: RankState, plan: RecoveryPlan) -> int:
        me = self.env.rank
        layout = state.layout
        parts: dict[str, tuple] = {}
        for t in plan.transfers:  # in the plan's order on every rank: no send/recv cycle
            if t.src == me and t.kind == "parameters":
                pair, _ = self.held.snapshot(t.iteration)
                send_parameters(pair, layout.optimizer_nbytes, t.dst, iteration=t.iteration)
            elif t.src == me:
                pair = self.held.replica(t.owner, t.iteration)
                send_replica({t.owner: pair}, t.owner, t.dst, iteration=t.iteration)
            elif t.dst == me:
                nbytes = layout.params_nbytes if t.kind == "parameters" else layout.optimizer_nbytes
                data, meta, iteration = recv_part(nbytes, t.src)
                if iteration != plan.iteration:
                    raise DeadpoolError(
                        f"rank {t.src} sent {t.kind} of iteration {iteration}, the plan needs "
                        f"{plan.iteration}"
                    )
                parts[t.kind] = (data, meta)
                self.bytes_moved += nbytes  # counted once, by the receiver
        if me in plan.local_restores:
            _, slot = self.held.snapshot(plan.iteration)
            return restore_from_snapshot(state, slot)
        (optimizer_part, meta), (params_part, _) = parts["replica"], parts["parameters"]
        return restore_from_parts(state, optimizer_part, meta, params_part)

    def _verify(self, plan: RecoveryPlan, restored: int) -> None:
        """Every rank checks the same facts about everyone before anyone resumes."""
        check_plan(plan, self.topology)
        view = hashlib.sha1(plan.membership.to_json()).hexdigest()
        mine = (plan.generation, restored, view, parallel.coordinates())
        everyone: list = [None] * self.env.world_size
        dist.all_gather_object(everyone, mine)
        problems = []
        for rank, (generation, iteration, membership, coords) in enumerate(everyone):
            if generation != plan.generation or membership != view:
                problems.append(f"rank {rank} is in generation {generation} / view {membership}")
            if iteration != plan.iteration:
                problems.append(f"rank {rank} restored iteration {iteration}")
            expected = self.topology.coords(rank)
            if tuple(coords) != (expected.tp, expected.pp, expected.dp):
                problems.append(f"rank {rank} holds coordinates {coords}")
        if problems:
            raise RecoveryFailed(
                f"generation {plan.generation} does not hold at iteration {plan.iteration}: "
                + "; ".join(problems)
            )

    # -- after the first resumed iteration -----------------------------------------------------
    def after_iteration(self, trainer) -> None:
        """Record the first resumed iteration; drop buffers from before the failure once the
        new generation holds its own snapshot and every predecessor's replica."""
        if self._pending is not None:
            now = time.time()
            phases = dict(self._pending["phases"])
            phases["first_iteration"] = now - self._pending["restored_at"]
            record = {
                "phases": phases,
                "finished_at": now,
                "iteration": trainer.iteration,
                "bytes_moved": self.bytes_moved,
                "groups_checked": self._pending["groups"],
            }
            key = keys.recovered(self.job, self.generation, self.env.rank)
            self.kv.set(key, json.dumps(record).encode())
            self._pending = None
            self.bytes_moved = 0
        p = trainer.pipeline
        if self.held.snapshots and p is not None:
            protected = p.committed_iteration() >= 0 and all(
                p.replicator.committed_iteration(src) >= 0 for src in p.replicator.predecessors
            )
            if protected:
                self.held = Held()
