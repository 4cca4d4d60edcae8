"""ProtectedLoop, the hook API's implementation for both training loops: what each hook does,
in which order, with fakes for the guard, the recovery, the pipeline and the loop."""

from __future__ import annotations

import pytest

from deadpool_megatron import hooks
from deadpool_megatron.config import JobConfig
from deadpool_megatron.events import EventLog, read_events
from deadpool_megatron.failure.injector import InjectedFault
from deadpool_megatron.failure.progress import ProgressBoard
from deadpool_megatron.process.guard import restart_faults
from deadpool_megatron.process.session import ProtectedLoop, current, serving
from deadpool_megatron.recovery.stages import RecoveryOrdered
from deadpool_megatron.runtime import ProcessEnv


class Calls(list):
    def __call__(self, *args):
        self.append(args)


class FakeGuard:
    def __init__(self, calls, stop=False):
        self.calls, self.stop = calls, stop

    def check_stop(self):
        self.calls("check_stop")
        if self.stop:
            raise RecoveryOrdered("recovery ordered")

    def inject(self, iteration, phase):
        self.calls("inject", iteration, phase)

    def after_warmup(self, on_gpu):
        self.calls("after_warmup", on_gpu)


class FakeRecovery:
    def __init__(self, calls):
        self.calls = calls

    def after_iteration(self, position):
        self.calls("after_iteration", position.iteration)


class FakePipeline:
    def __init__(self, calls):
        self.calls = calls

    def after_step(self, iteration):
        self.calls("snapshot", iteration)


class FakeLoop:
    on_gpu = False

    def __init__(self, pipeline=None, iteration=0):
        self.pipeline, self.iteration, self.state = pipeline, iteration, None

    def attach(self, state, iteration, pipeline=None):
        self.state, self.iteration, self.pipeline = state, iteration, pipeline


def _session(calls, stop=False, pipeline=True):
    session = ProtectedLoop(ProgressBoard(), FakeGuard(calls, stop), FakeRecovery(calls))
    session.bind(FakeLoop(FakePipeline(calls) if pipeline else None, iteration=4))
    return session


def test_before_step_marks_the_next_iteration_then_obeys_orders_then_injects():
    calls = Calls()
    session = _session(calls)
    session.before_step(4)
    assert calls == [("check_stop",), ("inject", 5, "forward")]
    assert (session.progress.read().iteration, session.progress.read().phase) == (5, "forward")


def test_a_stop_order_raises_before_any_fault_fires():
    calls = Calls()
    with pytest.raises(RecoveryOrdered, match="recovery ordered"):
        _session(calls, stop=True).before_step(4)
    assert calls == [("check_stop",)]


def test_after_step_snapshots_then_marks_done_then_lets_guard_and_recovery_act():
    calls = Calls()
    session = _session(calls)
    session.after_step(5, 2.5)
    assert calls == [
        ("check_stop",), ("inject", 5, "snapshot"), ("snapshot", 5), ("after_warmup", False),
        ("after_iteration", 4),
    ]  # fmt: skip
    assert session.progress.read().phase == "done"


def test_an_order_at_the_snapshot_phase_is_obeyed_once_the_finished_step_is_snapshotted():
    # The step is done: throwing its snapshot away would make the plan replay the iteration.
    calls = Calls()
    session = _session(calls, stop=True)
    with pytest.raises(RecoveryOrdered):
        session.after_step(5, 2.5)
    assert calls == [("check_stop",), ("snapshot", 5)]  # no fault fires, nothing more runs
    assert (session.progress.read().iteration, session.progress.read().phase) == (5, "snapshot")


def test_without_protection_or_guard_only_progress_is_marked():
    calls = Calls()
    session = ProtectedLoop(ProgressBoard(), after_iteration=calls)
    loop = FakeLoop()
    session.bind(loop)
    session.before_step(0)
    session.after_step(1, None)
    session.inject(1, "save")
    assert calls == [(loop,)]
    assert session.progress.read().phase == "done"


def test_the_module_functions_reach_the_serving_session_only_while_it_serves():
    calls = Calls()
    session = _session(calls, pipeline=False)
    assert current() is None
    with serving(session):
        assert current() is session
        hooks.before_step(7)
        hooks.after_step(8, {"lm loss": 1.0})
    hooks.before_step(9)  # nobody serving: nothing happens
    assert ("inject", 8, "forward") in calls and ("after_iteration", 4) in calls
    assert not any(c[1:] == (10, "forward") for c in calls if c[0] == "inject")
    assert current() is None


def test_without_a_guard_faults_fire_through_the_injector_once_per_job(tmp_path):
    """A process torchrun restarts: the fault fires in the first attempt only, and is logged."""
    cfg = JobConfig()
    cfg.deadpool.deadpool_inject = "raise@3:5:backward"
    path = tmp_path / "events.jsonl"
    for attempt, fires in (("0", True), ("1", False)):
        torchrun = {"RANK": "3", "WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "r",
                    "TORCHELASTIC_RESTART_COUNT": attempt}  # fmt: skip
        faults = restart_faults(cfg, ProcessEnv.from_environ(torchrun), EventLog(str(path), 3))
        session = ProtectedLoop(ProgressBoard(), faults=faults)
        session.bind(FakeLoop())
        session.phase(5, "forward")
        if fires:
            with pytest.raises(InjectedFault):
                session.phase(5, "backward")
        else:
            session.phase(5, "backward")
    assert [e["fault"] for e in read_events(str(path))] == ["raise@3:5:backward"]
