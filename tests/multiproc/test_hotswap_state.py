"""Hot-swap recovery restores the whole training state bitwise across the model
configurations users train: dropout (every RNG), the interleaved schedule, a fused Adam's
step, bf16's fp32 main parameters, tensor parallelism, survivors that keep their model, and
spares that built theirs while idle. The jobs are tests/hotswap_jobs.py's."""

from __future__ import annotations

import re

import pytest
from hotswap_jobs import (
    SHAPE_3D,
    SHAPE_DROPOUT,
    SHAPE_INTERLEAVED,
    SHAPE_PP2,
    assert_recovered,
    assert_same_run,
    replays,
    run_injected,
)

from jobs import ROOT, run_failure_free, run_job

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def baseline_dropout(tmp_path_factory):
    return run_failure_free(tmp_path_factory, "base_dropout", 4, SHAPE_DROPOUT)


@pytest.fixture(scope="module")
def baseline_3d(tmp_path_factory):
    return run_failure_free(tmp_path_factory, "base_3d", 8, SHAPE_3D)


def test_dropout_masks_are_drawn_again_after_a_hot_swap_with_snapshots_every_3_iterations(
    tmp_path, baseline_dropout, baseline_pp2
):
    # Snapshots after iterations 3, 6 and 9; rank 1 dies in iteration 9: every rank rolls back
    # to 6 and replays 7 and 8, which draw the same dropout masks only if every RNG (Python,
    # numpy, torch, megatron's tracker) came back from the snapshot or the replica.
    extra = ["--deadpool-snapshot-interval", "3"]
    result, events = run_injected(tmp_path, 4, SHAPE_DROPOUT, "kill@1:9:backward", 1, extra)
    assert_same_run(result, baseline_dropout)
    assert baseline_dropout.losses[1] != baseline_pp2.losses[1]  # dropout is on
    (done,) = assert_recovered(events, interval=3)
    assert done["iteration"] == 6 and done["replaced"] == {"1": "spare-0"}
    assert replays(result) == done["replayed_iterations"] == 2


def test_interleaved_schedule_with_dropout_survives_a_hot_swap_and_a_reset_bitwise(tmp_path):
    # Rank 2 (last stage, both of its virtual stages) dies in iteration 6; rank 0 raises in
    # iteration 9 and is reset in place from its own snapshot.
    baseline = run_job(tmp_path, 4, SHAPE_INTERLEAVED, name="baseline")
    assert baseline.returncode == 0, baseline.failure()
    spec = "kill@2:6:backward,raise@0:9:forward"
    result, events = run_injected(tmp_path, 4, SHAPE_INTERLEAVED, spec, spares=1)
    assert_same_run(result, baseline)
    swap, reset = assert_recovered(events, recoveries=2)
    assert swap["replaced"] == {"2": "spare-0"} and reset["replaced"] == {}


def test_fused_adam_step_kept_in_param_groups_survives_a_hot_swap_bitwise(tmp_path):
    # apex's and TE's FusedAdam keep `step` in the param groups; building the spare's optimizer
    # sets it to 1, so only the snapshot's param groups carry the true count (bias correction).
    script = ROOT / "tests" / "drivers" / "fused_adam_gpt.py"
    baseline = run_job(tmp_path, 4, SHAPE_PP2, name="baseline", script=script)
    assert baseline.returncode == 0, baseline.failure()
    result, events = run_injected(tmp_path, 4, SHAPE_PP2, "kill@1:7", spares=1, script=script)
    assert_same_run(result, baseline)
    (done,) = assert_recovered(events)
    assert done["replaced"] == {"1": "spare-0"}


def test_bf16_hot_swap_restores_the_fp32_main_parameters_bitwise(tmp_path):
    # The replica carries the distributed optimizer's fp32 main parameters and state; the
    # spare's bf16 model copy comes from a DP peer, the low-precision image of the same step.
    shape = [*SHAPE_PP2, "--bf16"]
    baseline = run_job(tmp_path, 4, shape, name="baseline")
    assert baseline.returncode == 0, baseline.failure()
    result, events = run_injected(tmp_path, 4, shape, "kill@2:6:backward", spares=1)
    assert_same_run(result, baseline)
    (done,) = assert_recovered(events)
    assert done["replaced"] == {"2": "spare-0"}


def test_tp_rank_swap_on_the_demo_shape_leaves_no_stale_group(tmp_path, baseline_3d):
    # TP rank 1 of (pp 0, dp 1); every process walks its live objects after the recovery.
    result, events = run_injected(
        tmp_path, 8, SHAPE_3D, "kill@3:6:backward", spares=1, extra=["--deadpool-verify-groups"]
    )
    assert_same_run(result, baseline_3d)
    (done,) = assert_recovered(events)
    assert done["replaced"] == {"3": "spare-0"}
    # the walk reached model, DDP and optimizer: every rank's 36 megatron-core roles share
    # 6 or 7 groups besides the default one (parallel.one_group_per_rank_list)
    assert done["groups_checked_min"] >= 7
    assert "none from before" in result.output


def test_survivors_keeping_their_model_meet_two_spares_and_a_reset_bitwise(tmp_path, baseline_3d):
    # --deadpool-keep-model: survivors swap their groups instead of building; each spare's build
    # is met by the survivors' replayed build collectives (DDP's broadcasts, the tied
    # embeddings' all-reduce, the optimizer's key gathering); the second spare replaces a rank
    # whose survivors include the first spare. A transient error last: nobody builds.
    faults = "kill@3:4:backward,kill@6:7:forward,raise@1:9:optimizer"
    extra = ["--deadpool-keep-model", "--deadpool-verify-groups"]
    result, events = run_injected(tmp_path, 8, SHAPE_3D, faults, spares=2, extra=extra)
    assert_same_run(result, baseline_3d)
    done = assert_recovered(events, recoveries=3)
    assert [d["replaced"] for d in done] == [{"3": "spare-0"}, {"6": "spare-1"}, {}]
    assert result.output.count("kept the model") >= 7 + 7 + 8  # survivors of each recovery
    assert "none from before" in result.output


def test_spares_that_built_while_idle_are_seated_on_their_ranks_bitwise(tmp_path, baseline_3d):
    # --deadpool-spare-prebuild 1: spare 0 builds rank 0's model and optimizer while idle,
    # spare 1 rank 1's (TP rank 1: its embedding shard's vocabulary range differs from TP rank
    # 0's). Rank 1 fails: the agent seats spare 1 (not spare 0, first in line), which swaps
    # the stand-in groups for the new generation's; the survivors keep theirs, and nobody
    # builds or replays anything. Rank 5 fails next: spare 0 built for rank 0, so it builds;
    # every other process replays its own build's collectives to meet it.
    faults = "kill@1:5:backward,kill@5:8:forward"
    extra = ["--deadpool-keep-model", "--deadpool-spare-prebuild", "1", "--deadpool-verify-groups"]
    result, events = run_injected(tmp_path, 8, SHAPE_3D, faults, spares=2, extra=extra)
    assert_same_run(result, baseline_3d)
    done = assert_recovered(events, recoveries=2)
    assert [d["replaced"] for d in done] == [{"1": "spare-1"}, {"5": "spare-0"}]
    assert "spare-1 replaces rank 1 (prebuilt)" in result.output
    assert re.search(r"\[spare 1\] .*kept the model built while idle: \d+ process group "
                     r"references swapped, 0 build collectives", result.output)  # fmt: skip
    assert "spare-0 replaces rank 5;" in result.output  # not counted on: it builds
    assert not re.search(r"\[spare 0\] .*kept the model built while idle", result.output)
    replays = re.findall(r"kept the model.*, ([1-9]\d*) build collectives", result.output)
    assert len(replays) == 7  # the second recovery's survivors, spare 1 among them
    assert "none from before" in result.output


def test_a_spare_that_built_while_idle_replays_its_build_for_survivors_that_build(
    tmp_path, baseline_pp2
):
    # Survivors build anew (no --deadpool-keep-model); the spare built every rank's state
    # while idle and performs its build's collectives again to meet theirs. Rank 3: the last
    # stage's DP rank 1 (the distributed optimizer's second shard).
    extra = ["--deadpool-spare-prebuild", "4"]
    result, events = run_injected(tmp_path, 4, SHAPE_PP2, "kill@3:6:forward", spares=1, extra=extra)
    assert_same_run(result, baseline_pp2)
    (done,) = assert_recovered(events)
    assert done["replaced"] == {"3": "spare-0"}
    assert "spare-0 replaces rank 3 (prebuilt)" in result.output
    assert re.search(r"\[spare 0\] .*kept the model built while idle: \d+ process group "
                     r"references swapped, [1-9]\d* build collectives", result.output)  # fmt: skip
