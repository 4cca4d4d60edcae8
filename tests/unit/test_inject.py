"""Fault-injection grammar, validation against the job's size, and the chaos schedule."""

import statistics

import pytest

from deadpool_megatron.errors import ConfigError
from deadpool_megatron.failure.inject import (
    DEFAULT_PHASE,
    PHASES,
    ChaosSchedule,
    Fault,
    faults_at,
    parse_faults,
    spare_kills_at,
)


def test_valid_specs_parse_in_order_with_the_default_phase():
    faults = parse_faults(
        "kill@5:20, hang@0:7:snapshot,raise@3:30:backward,kill-spare@1:40,corrupt@2:6"
    )
    assert faults == (
        Fault("kill", 5, 20, DEFAULT_PHASE),
        Fault("hang", 0, 7, "snapshot"),
        Fault("raise", 3, 30, "backward"),
        Fault("kill-spare", 1, 40, None),
        Fault("corrupt", 2, 6, "replicate"),  # a replica in flight: its only phase
    )
    assert DEFAULT_PHASE == "forward"
    assert [f.transient for f in faults] == [False, False, True, False, False]
    assert [f.on_spare for f in faults] == [False, False, False, True, False]


@pytest.mark.parametrize("phase", PHASES)
def test_every_phase_round_trips(phase):
    # only a kill acts after training, or before the process registers
    action = "kill" if phase in ("finish", "digest", "launch") else "hang"
    iteration = 0 if phase in ("setup", "launch", "groups") else 9  # before any iteration
    (fault,) = parse_faults(f"{action}@2:{iteration}:{phase}")
    assert fault.phase == phase and parse_faults(str(fault)) == (fault,)


@pytest.mark.parametrize("text", ["", "   "])
def test_empty_means_no_faults(text):
    assert parse_faults(text) == ()


@pytest.mark.parametrize(
    "text, bad, why",
    [
        ("explode@1:5", "explode@1:5", "unknown action"),
        ("kill@1:5:lunch", "kill@1:5:lunch", "unknown phase"),
        ("kill@1", "kill@1", "not of the form"),
        ("kill1:5", "kill1:5", "not of the form"),
        ("kill@-1:5", "kill@-1:5", "not of the form"),
        ("kill@x:5", "kill@x:5", "not of the form"),
        ("kill@1:5:forward:extra", "kill@1:5:forward:extra", "not of the form"),
        ("kill@1:0", "kill@1:0", "must be >= 1"),
        ("kill@1:0:forward", "kill@1:0:forward", "0 only with phase launch, groups or setup"),
        ("raise@1:3:setup", "raise@1:3:setup", r"write raise@1:0:setup"),
        ("kill@1:2:launch", "kill@1:2:launch", r"write kill@1:0:launch"),
        ("raise@1:1:groups", "raise@1:1:groups", r"write raise@1:0:groups"),
        ("raise@1:0:launch", "raise@1:0:launch", "only kill and hang take phase launch"),
        ("slow@1:0:launch", "slow@1:0:launch", "only kill and hang take phase launch"),
        ("kill-spare@0:5:forward", "kill-spare@0:5:forward", "takes no phase"),
        ("kill@1:5,", "", "not of the form"),
        ("kill@1:5,,raise@2:6", "", "not of the form"),
        ("kill@1:5,hang@1:5", "hang@1:5:forward", "conflicts with 'kill@1:5:forward'"),
        ("KILL@1:5", "KILL@1:5", "not of the form"),
        ("corrupt@1:5:forward", "corrupt@1:5:forward", "its phase is replicate"),
        ("hang@1:5:finish", "hang@1:5:finish", "only kill takes phase finish"),
        ("raise@1:5:finish", "raise@1:5:finish", "only kill takes phase finish"),
        ("hang@1:5:digest", "hang@1:5:digest", "only kill takes phase digest"),
    ],
)
def test_bad_specs_name_the_spec_and_show_the_grammar(text, bad, why):
    with pytest.raises(ConfigError) as info:
        parse_faults(text)
    message = str(info.value)
    assert f"bad fault spec {bad!r}" in message
    assert why in message
    for piece in ("kill@RANK:ITER[:PHASE]", "hang@RANK", "raise@RANK", "kill-spare@INDEX:ITER"):
        assert piece in message
    assert "|".join(PHASES) in message


def test_ranks_and_spare_indexes_are_checked_against_the_job():
    assert parse_faults("kill@7:1,kill-spare@1:2", world_size=8, spares=2)
    with pytest.raises(ConfigError, match=r"'kill@8:1'.*rank 8 out of range: world size is 8"):
        parse_faults("kill@8:1", world_size=8)
    with pytest.raises(ConfigError, match=r"'kill-spare@2:3'.*spare index 2 out of range.*2 spare"):
        parse_faults("kill-spare@2:3", world_size=8, spares=2)
    with pytest.raises(ConfigError, match="spare index 0"):
        parse_faults("kill-spare@0:3", spares=0)
    # sizes not given: not checked
    assert parse_faults("kill@99:1,kill-spare@9:1")


def test_a_kill_after_training_must_name_the_last_iteration():
    assert parse_faults("kill@1:40:finish", last_iteration=40) == (Fault("kill", 1, 40, "finish"),)
    with pytest.raises(ConfigError, match=r"'kill@1:39:finish'.*last iteration, 40, not after 39"):
        parse_faults("kill@1:39:finish", last_iteration=40)
    assert parse_faults("kill@1:39", last_iteration=40)  # other phases are not checked
    with pytest.raises(ConfigError, match=r"'kill@1:39:digest'.*phase digest comes after the "
                       r"last iteration, 40, not after 39"):  # fmt: skip
        parse_faults("kill@1:39:digest", last_iteration=40)


def test_a_fault_is_due_until_it_fired():
    from deadpool_megatron.failure.injector import FaultInjector, InjectedFault

    reported = []
    injector = FaultInjector(parse_faults("raise@1:12:save,kill@2:12:save"), 1,
                             lambda f, at: reported.append(str(f)))  # fmt: skip
    assert injector.due(12, "save") and not injector.due(12, "forward")
    assert not injector.due(11, "save")
    with pytest.raises(InjectedFault):
        injector.fire(12, "save")
    assert reported == ["raise@1:12:save"] and not injector.due(12, "save")


def test_faults_at_answers_should_this_rank_fail_now():
    faults = parse_faults("kill@1:5,raise@1:5:backward,hang@2:5,kill-spare@1:5")
    assert faults_at(faults, 5, "forward", 1) == (Fault("kill", 1, 5, "forward"),)
    assert faults_at(faults, 5, "backward", 1) == (Fault("raise", 1, 5, "backward"),)
    assert faults_at(faults, 4, "forward", 1) == ()
    assert faults_at(faults, 5, "optimizer", 1) == ()
    assert faults_at(faults, 5, "forward", 3) == ()
    assert spare_kills_at(faults, 5) == (1,)
    assert spare_kills_at(faults, 6) == ()
    with pytest.raises(ValueError, match="unknown phase"):
        faults_at(faults, 5, "lunch", 1)


def test_chaos_is_reproducible_per_seed_and_differs_across_seeds():
    a = ChaosSchedule(60.0, seed=7, world_size=8).take(50)
    assert a == ChaosSchedule(60.0, seed=7, world_size=8).take(50)
    assert a != ChaosSchedule(60.0, seed=8, world_size=8).take(50)
    s = ChaosSchedule(60.0, seed=7, world_size=8)
    assert s.take(10) == s.take(10)  # iterating again replays, no hidden state
    offsets = [e.offset_s for e in a]
    assert offsets == sorted(offsets) and offsets[0] > 0
    assert {e.action for e in a} <= {"kill", "hang"}
    assert all(0 <= e.rank < 8 for e in a)


def test_chaos_inter_arrival_mean_is_the_mtbf_and_hangs_follow_the_fraction():
    events = ChaosSchedule(30.0, seed=1, world_size=4, hang_fraction=0.2).take(20000)
    gaps = [
        b.offset_s - a.offset_s for a, b in zip([events[0]._replace(offset_s=0.0)] + events, events)
    ]
    assert statistics.fmean(gaps) == pytest.approx(30.0, rel=0.03)
    # exponential: the standard deviation equals the mean, and ~63% of gaps are below it
    assert statistics.pstdev(gaps) == pytest.approx(30.0, rel=0.05)
    assert sum(g < 30.0 for g in gaps) / len(gaps) == pytest.approx(0.632, abs=0.015)
    hangs = sum(e.action == "hang" for e in events) / len(events)
    assert hangs == pytest.approx(0.2, abs=0.015)
    assert {e.rank for e in events} == {0, 1, 2, 3}


def test_chaos_until_and_extreme_hang_fractions():
    s = ChaosSchedule(10.0, seed=3, world_size=2, hang_fraction=1.0)
    window = s.until(100.0)
    assert window == s.take(len(window)) and all(e.offset_s <= 100.0 for e in window)
    assert s.take(len(window) + 1)[-1].offset_s > 100.0
    assert all(e.action == "hang" for e in window)
    assert all(e.action == "kill" for e in ChaosSchedule(10.0, 3, 2, hang_fraction=0.0).take(100))


@pytest.mark.parametrize(
    "args, match",
    [
        ((0.0, 1, 8), "chaos-mtbf"),
        ((-5.0, 1, 8), "chaos-mtbf"),
        ((float("inf"), 1, 8), "chaos-mtbf"),
        ((10.0, 1, 0), "world size"),
        ((10.0, 1, 8, 1.5), "hang_fraction"),
    ],
)
def test_chaos_validation(args, match):
    with pytest.raises(ConfigError, match=match):
        ChaosSchedule(*args)


def test_a_bug_is_raised_every_time_its_place_is_reached_and_not_as_an_injected_fault():
    from deadpool_megatron.failure.injector import FaultInjector, InjectedBug, InjectedFault

    claims, reported = [], []
    injector = FaultInjector(parse_faults("bug@1:5"), 1, lambda f, at: reported.append(str(f)),
                             claim=lambda f: claims.append(f) or True)  # fmt: skip
    for _ in range(3):  # the replay after each recovery, or a spare, meets it again
        with pytest.raises(InjectedBug, match="injected bug at iteration 5, phase forward"):
            injector.fire(5, "forward")
    assert reported == ["bug@1:5:forward"] * 3 and claims == []  # never claimed once per job
    assert not issubclass(InjectedBug, InjectedFault)  # reported as the training's own
    injector.fire(5, "backward")


def test_kills_and_hangs_of_several_ranks_at_one_point_strike_together():
    from deadpool_megatron.failure.inject import companions

    faults = parse_faults("kill@1:5:optimizer,kill@2:5:optimizer,hang@3:5:optimizer,kill@0:5,"
                          "raise@4:5:optimizer,kill@4:6:optimizer,kill-spare@1:5")  # fmt: skip
    assert companions(faults, Fault("kill", 1, 5, "optimizer")) == (2, 3)
    assert companions(faults, Fault("hang", 3, 5, "optimizer")) == (1, 2)
    assert companions(faults, Fault("kill", 0, 5, "forward")) == ()  # alone at its point
    assert companions(faults, Fault("raise", 4, 5, "optimizer")) == ()  # stays alive


def test_a_kill_with_companions_waits_for_them_before_it_strikes(monkeypatch):
    from deadpool_megatron.failure import injector as injector_module

    order = []
    monkeypatch.setattr(injector_module.os, "kill", lambda pid, sig: order.append(("kill", sig)))

    def together(fault, others):
        order.append(("together", str(fault), others))
        return (2,)  # rank 2 never came: strike alone, and say so

    injector = injector_module.FaultInjector(
        parse_faults("kill@1:5:optimizer,kill@2:5:optimizer"), 1,
        lambda f, at: order.append(("report", str(f))), together=together,
    )  # fmt: skip
    injector.fire(5, "optimizer")
    assert order == [("together", "kill@1:5:optimizer", (2,)), ("report", "kill@1:5:optimizer"),
                     ("kill", injector_module.signal.SIGKILL)]  # fmt: skip


def test_a_kill_after_the_last_iteration_waits_for_every_rank_to_finish_first(monkeypatch):
    # A kill at phase finish is a death after the job's last collective: it waits for every
    # rank to get there, as every rank says it did (CI: rank 5 died while ranks 0-4 were still
    # in the final digest's gather, which the recovery it started then cut: all exited 1).
    from deadpool_megatron.failure import injector as injector_module
    from deadpool_megatron.failure.inject import awaited_at, companions

    faults = parse_faults("kill@5:14:finish,raise@0:14:forward")
    kill = Fault("kill", 5, 14, "finish")
    assert companions(faults, kill, world_size=6) == (0, 1, 2, 3, 4)
    assert companions(faults, kill) == ()  # the world's size unknown: nobody to wait for
    assert awaited_at(faults, 14, "finish", 2) == kill
    assert awaited_at(faults, 14, "finish", 5) is None  # the victim waits, says nothing more
    assert awaited_at(faults, 13, "finish", 2) is None
    assert awaited_at(faults, 14, "forward", 2) is None

    calls = []
    monkeypatch.setattr(injector_module.os, "kill", lambda pid, sig: calls.append(("kill", sig)))

    def injector(rank):
        return injector_module.FaultInjector(
            faults, rank, lambda f, at: calls.append(("report", rank)),
            together=lambda f, others: calls.append(("together", rank, str(f), others)) or (),
            world_size=6,
        )  # fmt: skip

    injector(2).fire(14, "finish")  # a bystander says it got there and goes on
    assert calls == [("together", 2, "kill@5:14:finish", ())]
    calls.clear()
    injector(5).fire(14, "finish")  # the victim waits for all five, then dies
    assert calls == [("together", 5, "kill@5:14:finish", (0, 1, 2, 3, 4)), ("report", 5),
                     ("kill", injector_module.signal.SIGKILL)]  # fmt: skip
