"""Chaos mode carried out with a fake clock, fake processes and a recorded kill: faults follow
the seeded schedule of training time, one per look, never in a burst after a pause, each
recorded with the generation it happened in."""

import signal

from deadpool_megatron.control import keys
from deadpool_megatron.control.chaos import Chaos
from deadpool_megatron.control.context import JobContext
from deadpool_megatron.control.messages import Injection
from deadpool_megatron.events import EventLog, read_events
from deadpool_megatron.failure.inject import ChaosSchedule

JOB = "chaos-test"


class Rig:
    def __init__(self, kv, tmp_path, mtbf=5.0):
        self.t = 100.0
        self.kills: list[tuple[float, int, int]] = []
        self.ctx = JobContext(kv, JOB)
        self.log = tmp_path / "ev.jsonl"
        events = EventLog(str(self.log), generation=lambda: self.ctx.generation)
        self.chaos = Chaos(
            mtbf, 7, 4, self.ctx, lambda: {r: 1000 + r for r in range(4)}, events,
            clock=lambda: self.t, kill=lambda pid, sig: self.kills.append((self.t, pid, sig)),
        )  # fmt: skip

    def run(self, seconds, step=0.02, iteration=1):
        end = self.t + seconds
        while self.t < end:
            self.t += step
            self.chaos.step(iteration)


def test_faults_follow_the_schedule_of_training_time(kv, tmp_path):
    rig = Rig(kv, tmp_path)
    rig.chaos.step(0)  # before the first iteration: the clock has not started
    rig.t += 50
    rig.chaos.step(0)
    assert rig.kills == []
    rig.chaos.step(1)
    rig.run(30.0)
    expected = ChaosSchedule(5.0, 7, 4).until(29.9)
    assert len(rig.kills) == len(expected) > 2
    for (_at, pid, sig), event in zip(rig.kills, expected, strict=True):
        assert pid == 1000 + event.rank
        assert sig == (signal.SIGKILL if event.action == "kill" else signal.SIGSTOP)
    offsets = [offset for offset, _ in rig.chaos.injected]
    assert all(abs(o - e.offset_s) < 0.1 for o, e in zip(offsets, expected, strict=True))


def test_a_pause_of_the_agent_does_not_fire_overdue_faults_in_a_burst(kv, tmp_path):
    rig = Rig(kv, tmp_path, mtbf=2.0)
    rig.chaos.step(1)
    rig.run(3.0)
    before = len(rig.kills)
    rig.t += 60.0  # the agent was busy with a recovery for a minute
    rig.chaos.step(1)
    rig.chaos.step(1)
    assert len(rig.kills) - before <= 1
    rig.run(0.5)
    times = [at for at, _, _ in rig.kills[before:]]
    assert all(b - a >= 0.02 for a, b in zip(times, times[1:], strict=False))


def test_no_fault_goes_into_a_job_that_is_recovering(kv, tmp_path):
    rig = Rig(kv, tmp_path, mtbf=0.5)
    rig.chaos.step(1)
    rig.run(2.0)
    before, elapsed = len(rig.kills), rig.chaos._elapsed
    for _ in range(200):  # 0.8 s steps: a recovery under way, every look says so
        rig.t += 0.8
        rig.chaos.step(9, running=False)
    assert len(rig.kills) == before and rig.chaos._elapsed == elapsed


def test_each_injection_is_recorded_with_the_generation_it_happened_in(kv, tmp_path):
    rig = Rig(kv, tmp_path, mtbf=1.0)
    rig.chaos.step(1)
    while not rig.kills:
        rig.run(0.1)
    rank = rig.kills[-1][1] - 1000
    assert Injection.decode(kv.get(keys.injected(JOB, rank))).generation == 0
    rig.ctx.advance(1)
    count = len(rig.kills)
    while len(rig.kills) == count:
        rig.run(0.1)
    rank = rig.kills[-1][1] - 1000
    injection = Injection.decode(kv.get(keys.injected(JOB, rank)))
    assert injection.generation == 1 and injection.at == rig.kills[-1][0]
    events = [e for e in read_events(str(rig.log)) if e["event"] == "fault_injected"]
    generations = [e["generation"] for e in events]
    assert generations == sorted(generations) and generations[0] == 0 and generations[-1] == 1
