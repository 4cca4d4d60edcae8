"""The failure simulator: exact accounting on hand-computed schedules, Young/Daly, seeds."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from deadpool_megatron.errors import ConfigError
from deadpool_megatron.sim.engine import Failure, poisson_failures, simulate
from deadpool_megatron.sim.params import NODE_FAILURES_PER_HOUR, SimParams
from deadpool_megatron.sim.study import optimal_interval_iterations, run_seeds, sweep_intervals

# 100 iterations of 1 s, a save (2 s) every 10 iterations; restart 5 s + load 3 s; a hot-swap
# costs 4 s, a transient reset 1 s, and re-executes one iteration.
SMALL = SimParams(
    iterations=100, iteration_s=1.0, checkpoint_interval=10, checkpoint_s=2.0, restart_s=5.0,
    load_s=3.0, swap_s=4.0, reset_s=1.0, replay_iterations=1, spares=1, replenish_s=1e9,
    hotswap_checkpoint_interval=10,
)  # fmt: skip
SAVES = 9 * 2.0  # after iterations 10, 20, ..., 90 (none after the last)


@pytest.mark.parametrize("strategy", ["ckpt_restart", "hotswap"])
def test_no_failure_loses_nothing(strategy):
    out = simulate(SMALL, strategy, [])
    assert out.lost_s == 0 and out.failures == 0
    assert out.overhead_s == pytest.approx(SAVES)
    assert out.wall_s == pytest.approx(100 + SAVES)


def test_checkpoint_restart_loses_the_work_since_the_last_save_plus_restart_and_load():
    # Saves end at t=12 and t=24 (work 20); at t=25.5 work is 21.5: 1.5 s of work is redone.
    out = simulate(SMALL, "ckpt_restart", [Failure(25.5)])
    assert out.lost_s == pytest.approx(1.5 + 5 + 3)
    assert out.wall_s == pytest.approx(100 + SAVES + 9.5)


def test_hot_swap_loses_the_partial_iteration_plus_one_replayed_plus_the_swap():
    out = simulate(SMALL, "hotswap", [Failure(25.5)])
    assert out.lost_s == pytest.approx(0.5 + 1 + 4)
    assert out.fallbacks == 0


def test_transient_failure_resets_in_place():
    out = simulate(SMALL, "hotswap", [Failure(25.5, transient=True)])
    assert out.lost_s == pytest.approx(0.5 + 1 + 1)


def test_without_a_spare_hot_swap_falls_back_to_the_checkpoint():
    # The first failure takes the only spare (never replenished): work back to 20 at t=29.5,
    # work 30 at t=39.5, saved by t=41.5; the second, at t=45 (work 33.5), restarts from it.
    out = simulate(SMALL, "hotswap", [Failure(25.5), Failure(45.0)])
    assert out.fallbacks == 1
    assert out.lost_s == pytest.approx(5.5 + (3.5 + 5 + 3))


def test_correlated_failure_falls_back_even_with_spares():
    out = simulate(SMALL, "hotswap", [Failure(25.5, correlated=True)])
    assert out.fallbacks == 1 and out.lost_s == pytest.approx(9.5)


def test_failure_during_a_save_loses_that_save():
    # The save of work 20 runs t=22..24; a failure at t=23 restarts from work 10.
    out = simulate(SMALL, "ckpt_restart", [Failure(23.0)])
    assert out.lost_s == pytest.approx(10 + 8)
    assert out.overhead_s == pytest.approx(SAVES + 1.0)  # 1 s of the lost save; redone later


def test_wall_time_is_work_plus_overhead_plus_lost_and_seeds_reproduce():
    p = replace(SimParams(), iterations=20_000)
    for strategy in ("ckpt_restart", "hotswap"):
        a, b = run_seeds(p, strategy, 3), run_seeds(p, strategy, 3)
        assert a == b
        for out in a:
            assert out.failures > 0
            assert out.wall_s == pytest.approx(out.work_s + out.overhead_s + out.lost_s)
    assert run_seeds(p, "hotswap", 1, first_seed=1) != run_seeds(p, "hotswap", 1, first_seed=2)


def test_the_same_seed_gives_both_strategies_the_same_failures():
    p = SimParams()
    a = list(zip(range(5), poisson_failures(p, random.Random(7)), strict=False))
    b = list(zip(range(5), poisson_failures(p, random.Random(7)), strict=False))
    assert a == b


def test_young_daly_interval_minimises_checkpoint_restart_waste():
    p = replace(SimParams(), iterations=50_000)
    best = optimal_interval_iterations(p)  # about 100 iterations at the defaults
    intervals = [int(best * f) for f in (0.25, 0.5, 1.0, 2.0, 4.0)]
    rows = sweep_intervals(p, intervals, seeds=40)
    waste = {r["interval"]: r["ckpt_waste_h"].mean for r in rows}
    at_best = waste[int(best)]
    assert at_best <= min(waste.values()) * 1.05, waste
    assert waste[intervals[0]] > at_best and waste[intervals[-1]] > at_best


def test_defaults_come_from_the_llama3_report_and_bad_values_are_named():
    assert pytest.approx(419 / (54 * 24 * 2048)) == NODE_FAILURES_PER_HOUR
    assert SimParams(gpus=16_384).mtbf_s / 3600 == pytest.approx(54 * 24 / 419)
    with pytest.raises(ConfigError, match="transient_fraction=1.5"):
        SimParams(transient_fraction=1.5)


def test_a_recovery_that_grows_with_the_job_costs_more_at_scale():
    # Measured 4 s at 8 GPUs, growing 10 ms per GPU: 4 + 0.01 x (1008 - 8) = 14 s at 1008.
    grown = replace(SMALL, gpus=1008, recovery_s_per_gpu=0.01, recovery_measured_gpus=8)
    out = simulate(grown, "hotswap", [Failure(25.5)])
    assert out.lost_s == pytest.approx(0.5 + 1 + 14)
    assert replace(grown, gpus=4).at_scale(4.0) == 4.0  # never below what was measured
    # A restart creates the same groups and model again: it pays the growth too.
    restarted = simulate(grown, "ckpt_restart", [Failure(25.5)])
    assert restarted.lost_s == pytest.approx(1.5 + (5 + 10) + 3)


def test_bench_costs_carry_the_measured_growth_per_process(tmp_path):
    import json

    from deadpool_megatron.sim.params import with_bench_costs

    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"summary": {"nproc": 8}, "sizes": [{
        "iteration_s": 0.5, "hotswap": {"recovery_total_s": 2.0, "transfer_state": 0.5},
        "ckpt_restart": {"detect": 1.0, "restart_processes": 9.0, "load": 2.0}}]}))  # fmt: skip
    scale = tmp_path / "scale.json"
    scale.write_text(json.dumps({"summary": {"recovery_fit": {"s_per_process": 0.02}}}))
    p = with_bench_costs(SimParams(gpus=512), bench, scale)
    assert (p.swap_s, p.reset_s, p.restart_s, p.load_s) == (2.0, 1.5, 10.0, 2.0)
    assert p.at_scale(p.swap_s) == pytest.approx(2.0 + 0.02 * (512 - 8))
    assert with_bench_costs(SimParams(), bench).recovery_s_per_gpu == 0.0
