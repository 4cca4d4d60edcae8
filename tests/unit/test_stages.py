"""A process's recovery stages that wait on the store, each with its timeout and failure path,
on a real in-process TCPStore with a fake clock (no worker processes, no process groups); and
the attempt loop: a failed attempt never reuses its generation, the next order is joined."""

import dataclasses
import gc
import threading
import time
import weakref
from types import SimpleNamespace

import pytest

from deadpool_megatron.config import JobConfig
from deadpool_megatron.control import keys
from deadpool_megatron.control.context import JobContext
from deadpool_megatron.control.messages import (
    FROM_START,
    Flag,
    HoldingsReport,
    Member,
    Membership,
    PlanDecision,
    RankHoldings,
    Recovered,
    RecoveryOrder,
    RecoveryPlan,
)
from deadpool_megatron.failure.hang import HangPolicy
from deadpool_megatron.failure.progress import ProgressBoard
from deadpool_megatron.megatron.gloo_ops import AbortedByRecovery
from deadpool_megatron.process.watcher import OrderWatcher
from deadpool_megatron.recovery.accounting import Lap, Resumed
from deadpool_megatron.recovery.release import free_generation, release_groups
from deadpool_megatron.recovery.stages import (
    ProcessRecovery,
    RecoveryFailed,
    RecoveryOrdered,
    StageTimeouts,
    Superseded,
)
from deadpool_megatron.runtime import ProcessEnv

JOB = "stages-test"
TIMEOUTS = StageTimeouts(stop_s=1.0, order_s=5.0, plan_s=5.0, rendezvous_s=5.0)
POLICY = HangPolicy(heartbeat_timeout_s=2.0, floor_s=10.0, factor=5.0, slow_phase_s=100.0)


class FakeTime:
    """clock and sleep: a sleep advances the clock and runs the scheduled store writes."""

    def __init__(self):
        self.t = 0.0
        self.at: list[tuple[float, object]] = []

    def clock(self):
        return self.t

    def sleep(self, s):
        self.t += s
        for when, action in [a for a in self.at if a[0] <= self.t]:
            self.at.remove((when, action))
            action()


class FakeAbort:
    def __init__(self, on_rearm=lambda: None):
        self.aborts = 0
        self._on_rearm = on_rearm

    def abort(self):
        self.aborts += 1

    def rearm(self):
        self._on_rearm()

    def release(self):
        return 0


class FakeTrainer:
    iteration = 7
    state = None  # already detached
    pipeline = None

    def detach(self):
        return None


def make(kv, time_, rank=1, cls=ProcessRecovery, cpu_clock=time.process_time, abort=None):
    cfg = JobConfig()
    cfg.parallel.pipeline_model_parallel_size = 2
    env = ProcessEnv("worker", rank, 4, rank, 4, "127.0.0.1", None, None, JOB, False, True)
    ctx = JobContext(kv, JOB)
    abort = abort or FakeAbort()
    recovery = cls(cfg, env, ctx, None, ProgressBoard(), abort, protect=None,
                   timeouts=TIMEOUTS, clock=time_.clock, sleep=time_.sleep,
                   cpu_clock=cpu_clock)  # fmt: skip
    return recovery, ctx


def plan(generation):
    members = tuple(Member(r, f"h:{r}", (0, r // 2, r % 2)) for r in range(4))
    return RecoveryPlan(Membership(generation, members), 5, {}, (0, 1, 2, 3), ())


def test_await_order_returns_the_ordered_generation_or_times_out(kv):
    time_ = FakeTime()
    recovery, ctx = make(kv, time_)
    time_.at.append((1.0, lambda: ctx.see_order(1)))  # the watcher sees the order
    assert recovery.await_order() == 1 and time_.t >= 1.0
    recovery._spent = 1  # an attempt used generation 1: only a newer order will do
    with pytest.raises(RecoveryFailed, match="a recovery order from the agent: not within 5 s"):
        recovery.await_order()


def test_holdings_are_reported_for_the_generation(kv):
    recovery, _ = make(kv, FakeTime())
    recovery.completed = 7
    recovery.report_holdings(3)
    report = HoldingsReport.decode(kv.get(keys.holdings(JOB, 3, 1)))
    # Nothing trained in this process yet: a plan may set everything up again.
    assert report == HoldingsReport(RankHoldings(frozenset(), {}), 7, trained=False)


def test_await_plan_returns_it_stops_on_unrecoverable_and_yields_to_a_newer_order(kv):
    time_ = FakeTime()
    recovery, ctx = make(kv, time_)
    ctx.see_order(1)
    put = lambda: kv.set(keys.recovery_plan(JOB, 1), PlanDecision(plan(1), 6).encode())  # noqa: E731
    time_.at.append((0.5, put))
    assert recovery.await_plan(1) == plan(1) and recovery._failed_iteration == 6
    kv.set(
        keys.recovery_plan(JOB, 2), PlanDecision(unrecoverable="rank 3's shard is lost").encode()
    )
    ctx.see_order(2)
    with pytest.raises(RecoveryFailed, match="rank 3's shard is lost"):
        recovery.await_plan(2)
    time_.at.append((time_.t + 1.0, lambda: ctx.see_order(4)))
    with pytest.raises(
        Superseded, match="generation 4 was ordered while waiting for its plan of 3"
    ):
        recovery.await_plan(3)
    with pytest.raises(RecoveryFailed, match="the plan of generation 4: not within 5 s"):
        recovery.await_plan(4)


def test_rendezvous_waits_for_everyone_names_who_is_missing_and_yields_to_a_newer_order(kv):
    time_ = FakeTime()
    recovery, ctx = make(kv, time_)
    ctx.see_order(1)
    for r in (0, 2):
        kv.set(keys.arrived(JOB, 1, r), Flag(str(r)).encode())
    time_.at.append((2.0, lambda: kv.set(keys.arrived(JOB, 1, 3), Flag("3").encode())))
    recovery.exchange.rendezvous(1)
    assert time_.t >= 2.0
    ctx.see_order(2)
    kv.set(keys.arrived(JOB, 2, 0), Flag("0").encode())
    with pytest.raises(RecoveryFailed, match=r"ranks \[2, 3\] never joined"):
        recovery.exchange.rendezvous(2)
    time_.at.append((time_.t + 0.5, lambda: ctx.see_order(3)))
    with pytest.raises(Superseded, match="generation 3 was ordered while meeting"):
        recovery.exchange.rendezvous(2)


def test_an_order_that_comes_while_the_communicators_are_rearmed_stops_the_rebuild(kv):
    time_ = FakeTime()
    seen = []  # the order watcher sees generation 2 ordered just as the groups are rearmed
    recovery, ctx = make(kv, time_, abort=FakeAbort(lambda: seen[0].see_order(2)))
    seen.append(ctx)
    ctx.see_order(1)
    for r in (0, 2, 3):
        kv.set(keys.arrived(JOB, 1, r), Flag(str(r)).encode())
    with pytest.raises(Superseded, match="generation 2 was ordered while rearming"):
        recovery.reset_communicators(plan(1))


class Scripted(ProcessRecovery):
    """Rebuild scripted per generation: raise, or succeed (then resume advances the context)."""

    outcomes: dict = {}

    def rebuild(self, plan, trainer, make_trainer=None):
        self._spent = plan.generation
        outcome = self.outcomes[plan.generation]
        if isinstance(outcome, BaseException):
            raise outcome
        return SimpleNamespace(trainer=trainer)  # what complete() would resume

    def complete(self, plan, rebuilt):
        self.ctx.advance(plan.generation)
        self.active = False
        self._resumed = Resumed({"verify": 0.1}, {"verify": 0.25}, None, 0.0, 11.0)


def test_a_failed_attempt_waits_for_a_newer_order_and_never_reuses_its_generation(kv):
    time_ = FakeTime()
    recovery, ctx = make(kv, time_, cls=Scripted)
    Scripted.outcomes = {1: RuntimeError("connection closed by peer"), 2: object()}
    for g in (1, 2):
        kv.set(keys.recovery_plan(JOB, g), PlanDecision(plan(g), 8).encode())
    ctx.see_order(1)
    time_.at.append((3.0, lambda: ctx.see_order(2)))  # the agent saw the cause: a new order
    recovery.recover(FakeTrainer(), RecoveryOrdered("recovery into generation 1 ordered"))
    assert ctx.generation == 2 and not recovery.active
    assert recovery.abort.aborts == 2  # at the stop, and after the failed attempt
    for g in (1, 2):  # holdings reported for both generations
        assert kv.get(keys.holdings(JOB, g, 1)) is not None
    assert recovery.progress.read().phase == "recovery"


def test_a_failed_attempt_reports_its_own_error_in_the_generation_it_recovered_into(kv):
    # Nothing else would tell the agent (its monitor watches generation 1, which it ordered):
    # the job waited out the 300 s recovery timeout. A peer's loss is not reported.
    time_ = FakeTime()
    told = []
    recovery, ctx = make(kv, time_, cls=Scripted)
    recovery.report_recovery = lambda err, generation, iteration: told.append(
        (str(err), generation, iteration))  # fmt: skip
    bug = TypeError("jit_warmup() got an unexpected keyword argument 'tp_size'")
    Scripted.outcomes = {1: bug, 2: RuntimeError("Connection closed by peer"), 3: object()}
    for g in (1, 2, 3):
        kv.set(keys.recovery_plan(JOB, g), PlanDecision(plan(g), 8).encode())
    ctx.see_order(1)
    time_.at.append((1.0, lambda: ctx.see_order(2)))
    time_.at.append((2.0, lambda: ctx.see_order(3)))
    recovery.recover(FakeTrainer(), RecoveryOrdered("recovery into generation 1 ordered"))
    assert told == [(str(bug), 1, 8)] and ctx.generation == 3  # 8: the plan's failed iteration


def test_a_spare_whose_takeover_failed_reports_its_own_error_before_it_leaves(kv):
    time_ = FakeTime()
    told = []
    recovery, ctx = make(kv, time_, cls=Scripted)
    recovery.report_recovery = lambda err, generation, iteration: told.append(
        (type(err).__name__, generation, iteration))  # fmt: skip
    Scripted.outcomes = {1: ValueError("a bug in the set-up")}
    kv.set(keys.recovery_plan(JOB, 1), PlanDecision(replacing(plan(1), 1), 8).encode())
    with pytest.raises(RecoveryFailed, match="taking over rank 1 failed: a bug in the set-up"):
        recovery.take_over(1, make_trainer=None)
    assert told == [("ValueError", 1, 8)]


def test_a_seated_spare_cut_short_by_a_newer_order_stays_for_the_next_plan(kv):
    # Its takeover into generation 1 was aborted (a failure elsewhere, a newer order): it
    # holds rank 1 in the committed membership, so it reports that it holds nothing yet
    # (arriving) and takes part in generation 2, receiving rank 1's state again.
    time_ = FakeTime()
    recovery, ctx = make(kv, time_, cls=Scripted)
    Scripted.outcomes = {1: AbortedByRecovery("communication aborted: a recovery was ordered"),
                         2: object()}  # fmt: skip
    kv.set(keys.recovery_plan(JOB, 1), PlanDecision(replacing(plan(1), 1), 8).encode())
    again = dataclasses.replace(replacing(plan(2), 1), arriving=(1,))
    kv.set(keys.recovery_plan(JOB, 2), PlanDecision(again, 8).encode())
    time_.at.append((0.5, lambda: ctx.see_order(2)))
    trainer = recovery.take_over(1, make_trainer=None)
    assert ctx.generation == 2 and trainer is None  # what Scripted's rebuild hands back
    report = HoldingsReport.decode(kv.get(keys.holdings(JOB, 2, 1)))
    assert report.arriving and not report.trained and not report.holdings.snapshots
    # a plan that does not seat it again (it was counted lost meanwhile): it leaves
    recovery, ctx = make(kv, time_, cls=Scripted)
    Scripted.outcomes = {3: AbortedByRecovery("communication aborted: a recovery was ordered")}
    kv.set(keys.recovery_plan(JOB, 3), PlanDecision(replacing(plan(3), 1), 8).encode())
    kv.set(keys.recovery_plan(JOB, 4), PlanDecision(replacing(plan(4), 1), 8).encode())
    time_.at.append((time_.t + 0.5, lambda: ctx.see_order(4)))
    with pytest.raises(RecoveryFailed, match="does not seat rank 1 here again"):
        recovery.take_over(3, make_trainer=None)


def replacing(p, rank):
    return dataclasses.replace(p, replaced={rank: "spare-0"},
                               local_restores=tuple(r for r in p.local_restores if r != rank))  # fmt: skip


def test_a_failed_set_up_is_set_up_again_only_by_a_plan_from_the_start(kv):
    # Its set-up failed: it holds no trainer and nothing trained, so it reports that, and
    # only a plan that sets every rank up again can seat it; one that restores state cannot.
    time_ = FakeTime()
    reported = []
    recovery, ctx = make(kv, time_, cls=Scripted)
    recovery.report = reported.append
    Scripted.outcomes = {1: object(), 2: object()}
    fresh = dataclasses.replace(plan(1), iteration=FROM_START, local_restores=(),
                                from_start=True)  # fmt: skip
    kv.set(keys.recovery_plan(JOB, 1), PlanDecision(fresh, 1).encode())
    time_.at.append((0.1, lambda: ctx.see_order(1)))
    err = RuntimeError("connection reset by peer")
    recovery.set_up_again(err, make_trainer=None)
    assert reported == [err] and ctx.generation == 1 and recovery.abort.aborts == 1
    assert not HoldingsReport.decode(kv.get(keys.holdings(JOB, 1, 1))).trained
    kv.set(keys.recovery_plan(JOB, 2), PlanDecision(plan(2), 8).encode())
    time_.at.append((time_.t + 0.1, lambda: ctx.see_order(2)))
    with pytest.raises(RecoveryFailed, match="set-up failed, but the plan of generation 2 "
                       "restores iteration 5"):  # fmt: skip
        recovery.set_up_again(RuntimeError("again"), make_trainer=None)


def test_a_process_that_failed_by_itself_reports_it_before_stopping(kv):
    time_ = FakeTime()
    reported = []
    recovery, ctx = make(kv, time_, cls=Scripted)
    recovery.report = reported.append
    Scripted.outcomes = {1: object()}
    kv.set(keys.recovery_plan(JOB, 1), PlanDecision(plan(1), 8).encode())
    time_.at.append((0.1, lambda: ctx.see_order(1)))
    err = RuntimeError("injected")
    recovery.recover(FakeTrainer(), err)
    assert reported == [err] and ctx.generation == 1


def test_the_account_of_a_recovery_carries_its_cpu_seconds_from_the_failure_on(kv):
    time_ = FakeTime()
    cpu = iter([10.0, 12.5])  # the process's CPU clock at the failure, at the first iteration
    recovery, ctx = make(kv, time_, cls=Scripted, cpu_clock=lambda: next(cpu))
    Scripted.outcomes = {1: object()}
    kv.set(keys.recovery_plan(JOB, 1), PlanDecision(plan(1), 8).encode())
    ctx.see_order(1)
    recovery.recover(FakeTrainer(), RecoveryOrdered("recovery into generation 1 ordered"))
    recovery.after_iteration(FakeTrainer())
    record = Recovered.decode(kv.get(keys.recovered(JOB, 1, 1)))
    assert record.cpu_s == 2.5 and record.phases["verify"] == 0.1
    # by phase: what the phases before it spent, and the first iteration from its resume
    # (the CPU clock read 11.0 there)
    assert record.phase_cpu_s == {"verify": 0.25, "first_iteration": 1.5}


def test_a_lap_times_each_phase_in_cpu_seconds_apart_from_wall_time():
    cpu = iter([1.0, 1.25, 3.0])
    lap = Lap(lambda: next(cpu))
    phases, phase_cpu = {}, {}
    lap.record(phases, phase_cpu, "rebuild_communicators")
    lap.record(phases, phase_cpu, "rebuild_model")  # counted from the previous phase's end
    assert phase_cpu == {"rebuild_communicators": 0.25, "rebuild_model": 1.75}
    assert set(phases) == set(phase_cpu) and all(s >= 0 for s in phases.values())


class _Group:
    """Stands for an old process group whose destructor waits (gloo waiting out an operation
    the abort never woke); records the order in which the groups were closed."""

    def __init__(self, name, closing_s, closed):
        self.group_name, self._closing_s, self._closed = name, closing_s, closed

    def __del__(self):
        time.sleep(self._closing_s)
        self._closed.append(self.group_name)


def test_old_groups_are_released_in_turn_and_a_stuck_one_holds_back_no_other():
    closed = []
    groups = [_Group("a", 0.0, closed), _Group("b", 2.0, closed), _Group("c", 0.0, closed)]
    gc.disable()  # the groups must be closed by the release, not by a collection
    try:
        assert release_groups(groups, slow_s=0.2) == 1  # b: still closing, counted
        assert groups == [] and closed == ["c", "a"]  # a did not wait for b
        for closer in [t for t in threading.enumerate() if t.name == "deadpool-close"]:
            closer.join(10)
    finally:
        gc.enable()
    assert closed == ["c", "a", "b"]  # b closed on its own thread, once its wait was over


def test_a_group_held_elsewhere_is_not_closed_by_the_release():
    closed = []
    kept = _Group("kept", 0.0, closed)
    groups = [kept]
    assert release_groups(groups) == 0
    assert closed == [] and groups == []


class _Hostage:
    """Stands for an old group with an operation still pending on it: until the group is
    destroyed, the pending operation holds (from outside Python) the old model's cycle."""

    def __init__(self, name, closed, holds, in_collection):
        self.group_name, self._closed, self._holds = name, closed, holds
        self._in_collection = in_collection

    def __del__(self):
        self._closed.append((self.group_name, self._in_collection[0]))
        self._holds.clear()  # the pending operation ends with the group


class _Model:
    def __init__(self, groups):
        self.groups = groups
        self.hook = lambda: self  # a cycle, as the DDP's gradient hooks make one


def test_a_model_held_through_an_old_group_is_freed_in_the_same_collection_round():
    closed, holds, in_collection = [], [], [False]
    pending = _Hostage("ring", closed, holds, in_collection)
    world, pp = (
        _Hostage("world", closed, [], in_collection),
        _Hostage("pp", closed, [], in_collection),
    )
    model = _Model([world, pp])  # the model holds its own groups
    holds.append(model)  # the pending operation on "ring" holds the model
    alive = weakref.ref(model)
    retired = [world, pp, pending]
    del model, world, pp, pending

    def collect():
        in_collection[0] = True
        try:
            return gc.collect()
        finally:
            in_collection[0] = False

    found = free_generation(retired, collect, lambda: alive() is not None)
    assert alive() is None and found > 0  # freed now, not one recovery later
    assert retired == []
    assert sorted(name for name, _ in closed) == ["pp", "ring", "world"]
    assert not any(inside for _, inside in closed), closed  # no destructor inside a collection


def test_a_model_something_else_keeps_stays_reported_and_its_groups_are_still_released():
    closed, in_collection = [], [False]
    world = _Hostage("world", closed, [], in_collection)
    model = _Model([world])
    kept = [model]  # a real leak: nothing this process releases frees it
    alive = weakref.ref(model)
    retired = [world]
    del model, world
    free_generation(retired, gc.collect, lambda: alive() is not None)
    assert alive() is not None and retired == [] and closed == []
    kept.clear()
    gc.collect()
    assert alive() is None and [n for n, _ in closed] == ["world"]


def test_a_claimed_spares_watcher_takes_only_a_newer_order_than_the_one_it_joins(kv):
    # Claimed into generation 3 (orders 1-3 on the store). Its watcher started before the
    # takeover knew that order, and its first looks took orders 1-3 for new ones: each aborted
    # the communicators the takeover was building (seen in CI: the spare failed with
    # "communication aborted" in its model build, and the job ran out of spares).
    time_ = FakeTime()
    recovery, ctx = make(kv, time_, rank=3)
    for generation in (1, 2, 3):
        kv.set(keys.recovery_order(JOB, generation), RecoveryOrder("rank 3 exited", (3,)).encode())
    recovery.joining(3)
    watcher = OrderWatcher(ctx, recovery.abort.abort, ProgressBoard(), POLICY, lambda: True,
                           clock=time_.clock)  # fmt: skip
    for _ in range(4):
        watcher.poll_once()
    assert recovery.abort.aborts == 0
    assert ctx.ordered == 3 and ctx.generation == 2 and ctx.stopping
    kv.set(keys.recovery_order(JOB, 4), RecoveryOrder("rank 1 exited", (1,)).encode())
    watcher.poll_once()  # a failure during the takeover: that one is acted on
    assert recovery.abort.aborts == 1 and ctx.ordered == 4
