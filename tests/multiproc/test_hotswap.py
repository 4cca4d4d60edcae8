"""Hot-swap recovery on real jobs: a failed rank is replaced (or a transiently failed one reset)
while the job keeps running, and the run ends bitwise identical to the failure-free run of
the same configuration (per-iteration loss hex values and the final state digest)."""

from __future__ import annotations

import re
import shutil

import pytest

from deadpool_megatron.events import read_events
from jobs import ROOT, run_job

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(900)]

DEMO = ["--config", str(ROOT / "configs" / "demo.yaml")]
HEARTBEATS = ["--deadpool-heartbeat-interval", "0.5", "--deadpool-heartbeat-timeout", "2.0"]
# PP2 x DP2 on 4 processes: ranks 0, 1 are the first pipeline stage, 2, 3 the last; DP rings
# [0, 1] and [2, 3].
SHAPE_PP2 = [*DEMO, "--tensor-model-parallel-size", "1", "--train-iters", "12", "--deadpool",
             *HEARTBEATS]  # fmt: skip
# TP2 x PP2 x DP2 on 8 processes (the demo): ranks 2k, 2k+1 are TP peers.
SHAPE_3D = [*DEMO, "--train-iters", "10", "--deadpool", *HEARTBEATS]
# DP4 on 4 processes: the ring 0 -> 1 -> 2 -> 3 -> 0.
SHAPE_DP4 = [*DEMO, "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
             "--train-iters", "10", "--deadpool", *HEARTBEATS]  # fmt: skip
# Ranks 1 and 2 die together: at the optimizer step of iteration 5, which every rank enters
# within milliseconds of the others (after the gradients' reduce-scatter). At the forward pass
# a rank can still be finishing the iteration before while its peer dies: it was then told
# of the first death before it reached its own and died in the replay, a second recovery.
TOGETHER = "kill@1:5:optimizer,kill@2:5:optimizer"
# Dropout 0.1 on attention scores (megatron's RNG tracker) and hidden states (torch's generator):
# a restored rank draws the same masks only if every RNG came back with its state.
DROPOUT = ["--attention-dropout", "0.1", "--hidden-dropout", "0.1"]
SHAPE_DROPOUT = [*SHAPE_PP2, *DROPOUT]
# The interleaved 1F1B schedule: two virtual pipeline stages of one layer per rank.
SHAPE_INTERLEAVED = [*SHAPE_DROPOUT, "--num-layers-per-virtual-pipeline-stage", "1"]
RANK_PHASES = ("rebuild_communicators", "rebuild_model", "transfer_state", "verify",
               "first_iteration")  # fmt: skip


@pytest.fixture(scope="module")
def baseline_pp2(tmp_path_factory):
    result = run_job(tmp_path_factory.mktemp("base_pp2"), 4, SHAPE_PP2, name="baseline")
    assert result.returncode == 0, result.failure()
    return result


@pytest.fixture(scope="module")
def first_five(tmp_path_factory):
    """The same job with --exit-interval 5 and --save: iterations 1-5 and their checkpoint,
    which tests copy (a job that loads it trains on from iteration 5)."""
    path = tmp_path_factory.mktemp("first_five")
    ckpt = str(path / "ckpt")
    again = [*SHAPE_PP2, "--save", ckpt, "--load", ckpt, "--exit-interval", "5"]
    result = run_job(path, 4, again, name="first")
    assert result.returncode == 0, result.failure()
    assert sorted(result.losses) == [1, 2, 3, 4, 5]
    return result, path / "ckpt"


@pytest.fixture(scope="module")
def baseline_dropout(tmp_path_factory):
    result = run_job(tmp_path_factory.mktemp("base_dropout"), 4, SHAPE_DROPOUT, name="baseline")
    assert result.returncode == 0, result.failure()
    return result


@pytest.fixture(scope="module")
def baseline_3d(tmp_path_factory):
    result = run_job(tmp_path_factory.mktemp("base_3d"), 8, SHAPE_3D, name="baseline")
    assert result.returncode == 0, result.failure()
    return result


@pytest.fixture(scope="module")
def baseline_dp4(tmp_path_factory):
    result = run_job(tmp_path_factory.mktemp("base_dp4"), 4, SHAPE_DP4, name="baseline")
    assert result.returncode == 0, result.failure()
    return result


def _run(tmp_path, nproc, shape, spec, spares, extra=(), script=ROOT / "pretrain_gpt.py"):
    log = tmp_path / "events.jsonl"
    args = [*shape, "--deadpool-inject", spec, "--deadpool-event-log", str(log), *extra]
    result = run_job(tmp_path, nproc, args, spares=spares, script=script)
    events = read_events(str(log)) if log.exists() else []
    return result, events


def _named(events, name):
    return [e for e in events if e["event"] == name]


def _assert_same_run(result, baseline):
    assert result.returncode == 0, result.failure()
    assert result.losses == baseline.losses  # every iteration, replayed ones included
    assert result.digest == baseline.digest
    for iteration, runs in result.executions.items():  # a replay's loss equals the original's
        assert set(runs) == {baseline.losses[iteration]}, (iteration, runs)


def _replays(result) -> int:
    """How many iteration executions were repeats (one metrics line per execution)."""
    return sum(len(runs) - 1 for runs in result.executions.values())


def _assert_recovered(events, recoveries: int = 1, interval: int = 1):
    """Every recovery has its phases; it replays at most one snapshot interval."""
    done = _named(events, "recovery_done")
    assert len(done) == recoveries, events
    for d in done:
        assert d["total_s"] > 0, d
        assert d["replayed_iterations"] <= interval, d
    phases = {e["phase"] for e in _named(events, "recovery_phase")}
    assert {"detect", "fence", "plan", *RANK_PHASES} <= phases
    return done


@pytest.mark.parametrize(
    "spec",
    [
        "kill@0:6:forward",  # global rank 0, first pipeline stage
        "kill@3:7:backward",  # last stage, DP rank 1
        "kill@1:5:optimizer",  # first stage, DP rank 1
        "kill@2:6:snapshot",  # last stage, DP rank 0, between its step and its snapshot
        "kill@3:5:replicate",  # while its replication thread sends
    ],
)
def test_killed_rank_is_replaced_by_a_spare_bitwise(tmp_path, baseline_pp2, spec):
    result, events = _run(tmp_path, 4, SHAPE_PP2, spec, spares=1)
    _assert_same_run(result, baseline_pp2)
    victim = int(spec.split("@")[1].split(":")[0])
    detected = _named(events, "failure_detected")
    assert [(d["rank"], d["kind"]) for d in detected] == [(victim, "permanent")]
    assert [(c["spare"], c["replaces"]) for c in _named(events, "spare_claimed")] == [
        ("spare-0", victim)
    ]
    (done,) = _assert_recovered(events)
    assert done["replaced"] == {str(victim): "spare-0"}
    assert done["bytes_moved"] > 0  # parameters + optimizer shard, to the spare only
    # Stop points on every model a loop trains: 4 ranks' in generation 0, then the spare's and
    # the 3 survivors' rebuilt ones (2 transformer layers each, PP2).
    covered = [line for line in result.output.splitlines() if "stop points before" in line]
    assert len(covered) == 8 and all("before 2 transformer" in line for line in covered), covered
    if victim != 3:  # rank 3 writes the metrics: killed, its last line may be missing
        # A replayed iteration's first run has its metrics line, also when the order stopped
        # rank 3 between that iteration's optimizer step and its snapshot (seen in one run of
        # kill@0:6: it snapshots the iteration, then obeys).
        assert _replays(result) == done["replayed_iterations"]


@pytest.mark.parametrize(
    "spec, kind", [("kill@1:1:forward", "permanent"), ("raise@2:1:backward", "transient")]
)
def test_a_failure_in_the_first_iteration_rolls_back_to_the_state_training_started_from(
    tmp_path, baseline_pp2, spec, kind
):
    # Before the first step no iteration's snapshot exists: every rank snapshots the state it
    # starts from, and the ring holds it, before the first iteration. Without it, this job
    # ended: "the live ranks share no committed snapshot iteration".
    result, events = _run(tmp_path, 4, SHAPE_PP2, spec, spares=1)
    _assert_same_run(result, baseline_pp2)
    victim = int(spec.split("@")[1].split(":")[0])
    detected = _named(events, "failure_detected")
    assert [(d["rank"], d["kind"]) for d in detected] == [(victim, kind)]
    (done,) = _assert_recovered(events)
    assert done["iteration"] == 0 and done["replayed_iterations"] <= 1, done
    assert done["replaced"] == ({str(victim): "spare-0"} if kind == "permanent" else {})
    # Restored from the start's snapshot, not set up again. A rank whose ring was still
    # replicating it when the order came stops waiting without its log line (seen: 2 of 4).
    assert not done.get("from_start"), done
    started = re.findall(r"iteration 0, where training starts, snapshotted and replicated",
                         result.output)  # fmt: skip
    assert started, result.output[-3000:]


@pytest.mark.parametrize("spec, kind, load", [("kill@1:0:setup", "permanent", False),
                                              ("raise@2:0:setup", "transient", True)])  # fmt: skip
def test_a_failure_during_the_set_up_sets_every_rank_up_again_bitwise(
    tmp_path, baseline_pp2, first_five, spec, kind, load
):
    # Nothing is trained yet, and a rank whose set-up failed holds no snapshot: every rank
    # sets up again in the next generation (a spare in a dead rank's place), the model seeded
    # as at the job's start, or --load's checkpoint (of iteration 5) read again. Before, the
    # job ended (with --save: restarted every process).
    extra = []
    if load:
        shutil.copytree(first_five[1], tmp_path / "ckpt")
        extra = ["--load", str(tmp_path / "ckpt")]
    result, events = _run(tmp_path, 4, SHAPE_PP2, spec, spares=1, extra=extra)
    start = 5 if load else 0
    assert result.returncode == 0, result.failure()
    assert result.losses == {i: baseline_pp2.losses[i] for i in range(start + 1, 13)}
    assert result.digest == baseline_pp2.digest
    victim = int(spec.split("@")[1].split(":")[0])
    detected = _named(events, "failure_detected")
    assert [(d["rank"], d["kind"]) for d in detected] == [(victim, kind)]
    (done,) = _assert_recovered(events)
    assert done["from_start"] and done["iteration"] == start and done["replayed_iterations"] == 0
    assert done["replaced"] == ({str(victim): "spare-0"} if kind == "permanent" else {})
    assert "every rank sets up again from the start" in result.output


def test_deaths_before_and_just_after_registering_start_a_seat_again_and_hot_swap_bitwise(
    tmp_path, baseline_pp2
):
    # Rank 1 dies in its first moments (connected to the store, not registered): no peer has
    # met it, so its agent starts its seat again. Rank 2 dies as soon as it registered, as its
    # groups are about to be created: its failure waits for every rank to register (the new
    # rank 1 included), and its peers, in their groups' rendezvous waiting for its address,
    # stop there at the recovery order; every rank sets up again from the start, a spare in
    # rank 2's seat. Before, either death ended the job (or the peers sat in the rendezvous
    # until the recovery took them for blocked and every rank was lost).
    result, events = _run(tmp_path, 4, SHAPE_PP2, "kill@1:0:launch,kill@2:0:groups", spares=1)
    _assert_same_run(result, baseline_pp2)
    (again,) = _named(events, "rank_relaunched")
    assert again["rank"] == 1 and again["returncode"] == -9 and again["pid"] != again["old_pid"]
    detected = _named(events, "failure_detected")
    assert sorted((d["rank"], d["kind"]) for d in detected) == [(1, "permanent"), (2, "permanent")]
    (done,) = _assert_recovered(events)
    assert done["from_start"] and done["iteration"] == 0 and done["replayed_iterations"] == 0
    assert done["replaced"] == {"2": "spare-0"}, done
    assert "before it registered with the job" in result.output
    assert "every rank sets up again from the start" in result.output


def test_replicas_over_tcp_connections_serve_a_hot_swap_and_a_reset_bitwise(tmp_path, baseline_pp2):
    # --deadpool-transport tcp (the default): rank 3 dies while its replication thread sends,
    # rank 0 fails transiently later; the new generation's ring is connected anew each time.
    spec = "kill@3:5:replicate,raise@0:8"
    result, events = _run(tmp_path, 4, SHAPE_PP2, spec, spares=1,
                          extra=["--deadpool-transport", "tcp"])  # fmt: skip
    _assert_same_run(result, baseline_pp2)
    assert [(d["rank"], d["kind"]) for d in _named(events, "failure_detected")] == [
        (3, "permanent"),
        (0, "transient"),
    ]
    _assert_recovered(events, recoveries=2)
    assert "left the replication thread behind" not in result.output
    for generation in range(3):  # every rank's ring, at the start and after each recovery
        line = f"replica ring of generation {generation} over tcp"
        assert result.output.count(line) == 4, (generation, result.output)
    # One host: every receiver reads its predecessor's parts from its memory, in each of the
    # three generations (the spare's ring included).
    assert result.output.count("are read from their memory (one copy)") == 3 * 4
    # ... and the spare reads its optimizer shard and its parameters from the ranks that
    # serve them (the transient reset restores from the rank's own snapshot).
    assert result.output.count("read from its memory into place)") == 2, result.output


def test_without_the_fork_server_every_process_is_its_own_interpreter_and_trains_alike(
    tmp_path, baseline_pp2
):
    # The baseline's processes were forked from the agent's fork server; these start with
    # `python pretrain_gpt.py`: the same losses and digest, through a hot-swap.
    log = tmp_path / "events.jsonl"
    args = [*SHAPE_PP2, "--deadpool-inject", "kill@2:6", "--deadpool-event-log", str(log)]
    result = run_job(tmp_path, 4, args, spares=1, launcher=["--no-fork-server"])
    assert "fork server ready" in baseline_pp2.output
    _assert_same_run(result, baseline_pp2)
    assert "fork server" not in result.output
    _assert_recovered(read_events(str(log)))


def test_corrupted_replica_is_rejected_and_the_recovery_rolls_back_past_it_bitwise(
    tmp_path, baseline_pp2
):
    # Rank 1's replica of iteration 6 reaches rank 0 (its ring successor) corrupt and is
    # rejected; rank 1 dies late in iteration 7: the newest iteration whole everywhere is 5.
    spec = "corrupt@1:6,kill@1:7:optimizer"
    result, events = _run(tmp_path, 4, SHAPE_PP2, spec, spares=1)
    _assert_same_run(result, baseline_pp2)
    assert "rejected replica from rank 1" in result.output
    (done,) = _assert_recovered(events)
    assert done["iteration"] == 5 and done["replaced"] == {"1": "spare-0"}
    assert _replays(result) == done["replayed_iterations"] >= 1  # 6 at least runs twice


def test_dropout_masks_are_drawn_again_after_a_hot_swap_with_snapshots_every_3_iterations(
    tmp_path, baseline_dropout, baseline_pp2
):
    # Snapshots after iterations 3, 6 and 9; rank 1 dies in iteration 9: every rank rolls back
    # to 6 and replays 7 and 8, which draw the same dropout masks only if every RNG (Python,
    # numpy, torch, megatron's tracker) came back from the snapshot or the replica.
    extra = ["--deadpool-snapshot-interval", "3"]
    result, events = _run(tmp_path, 4, SHAPE_DROPOUT, "kill@1:9:backward", 1, extra)
    _assert_same_run(result, baseline_dropout)
    assert baseline_dropout.losses[1] != baseline_pp2.losses[1]  # dropout is on
    (done,) = _assert_recovered(events, interval=3)
    assert done["iteration"] == 6 and done["replaced"] == {"1": "spare-0"}
    assert _replays(result) == done["replayed_iterations"] == 2


def test_interleaved_schedule_with_dropout_survives_a_hot_swap_and_a_reset_bitwise(tmp_path):
    # Rank 2 (last stage, both of its virtual stages) dies in iteration 6; rank 0 raises in
    # iteration 9 and is reset in place from its own snapshot.
    baseline = run_job(tmp_path, 4, SHAPE_INTERLEAVED, name="baseline")
    assert baseline.returncode == 0, baseline.failure()
    spec = "kill@2:6:backward,raise@0:9:forward"
    result, events = _run(tmp_path, 4, SHAPE_INTERLEAVED, spec, spares=1)
    _assert_same_run(result, baseline)
    swap, reset = _assert_recovered(events, recoveries=2)
    assert swap["replaced"] == {"2": "spare-0"} and reset["replaced"] == {}


def test_fused_adam_step_kept_in_param_groups_survives_a_hot_swap_bitwise(tmp_path):
    # apex's and TE's FusedAdam keep `step` in the param groups; building the spare's optimizer
    # sets it to 1, so only the snapshot's param groups carry the true count (bias correction).
    script = ROOT / "tests" / "drivers" / "fused_adam_gpt.py"
    baseline = run_job(tmp_path, 4, SHAPE_PP2, name="baseline", script=script)
    assert baseline.returncode == 0, baseline.failure()
    result, events = _run(tmp_path, 4, SHAPE_PP2, "kill@1:7", spares=1, script=script)
    _assert_same_run(result, baseline)
    (done,) = _assert_recovered(events)
    assert done["replaced"] == {"1": "spare-0"}


def test_bf16_hot_swap_restores_the_fp32_main_parameters_bitwise(tmp_path):
    # The replica carries the distributed optimizer's fp32 main parameters and state; the
    # spare's bf16 model copy comes from a DP peer, the low-precision image of the same step.
    shape = [*SHAPE_PP2, "--bf16"]
    baseline = run_job(tmp_path, 4, shape, name="baseline")
    assert baseline.returncode == 0, baseline.failure()
    result, events = _run(tmp_path, 4, shape, "kill@2:6:backward", spares=1)
    _assert_same_run(result, baseline)
    (done,) = _assert_recovered(events)
    assert done["replaced"] == {"2": "spare-0"}


def test_tp_rank_swap_on_the_demo_shape_leaves_no_stale_group(tmp_path, baseline_3d):
    # TP rank 1 of (pp 0, dp 1); every process walks its live objects after the recovery.
    result, events = _run(
        tmp_path, 8, SHAPE_3D, "kill@3:6:backward", spares=1, extra=["--deadpool-verify-groups"]
    )
    _assert_same_run(result, baseline_3d)
    (done,) = _assert_recovered(events)
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
    result, events = _run(tmp_path, 8, SHAPE_3D, faults, spares=2, extra=extra)
    _assert_same_run(result, baseline_3d)
    done = _assert_recovered(events, recoveries=3)
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
    result, events = _run(tmp_path, 8, SHAPE_3D, faults, spares=2, extra=extra)
    _assert_same_run(result, baseline_3d)
    done = _assert_recovered(events, recoveries=2)
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
    result, events = _run(tmp_path, 4, SHAPE_PP2, "kill@3:6:forward", spares=1, extra=extra)
    _assert_same_run(result, baseline_pp2)
    (done,) = _assert_recovered(events)
    assert done["replaced"] == {"3": "spare-0"}
    assert "spare-0 replaces rank 3 (prebuilt)" in result.output
    assert re.search(r"\[spare 0\] .*kept the model built while idle: \d+ process group "
                     r"references swapped, [1-9]\d* build collectives", result.output)  # fmt: skip


def test_two_sequential_permanent_failures_use_two_spares(tmp_path, baseline_pp2):
    result, events = _run(tmp_path, 4, SHAPE_PP2, "kill@1:4,kill@2:8", spares=2)
    _assert_same_run(result, baseline_pp2)
    done = _assert_recovered(events, recoveries=2)
    assert [d["replaced"] for d in done] == [{"1": "spare-0"}, {"2": "spare-1"}]
    assert [e["generation"] for e in _named(events, "recovery_started")] == [1, 2]
    # Spare 1 idled through generation 0's start: it reserved its buffers before its claim.
    assert re.search(r"\[spare 1\] .*reserved while the spare was idle", result.output)


@pytest.mark.parametrize("kill", ["kill@1:8", "kill@1:6:forward"])
def test_a_job_submitted_again_at_its_exit_interval_trains_on_and_its_spare_stops_with_it(
    tmp_path, baseline_pp2, first_five, kill
):
    # Megatron-LM's requeue pattern: the same flags each time, --exit-interval 5 and --load of
    # the job's own --save. The first job trains 1-5 and exits; the second loads 5 and trains
    # to 10, the next multiple, losing rank 1 in iteration 8 to a spare: the spare starts from
    # the resumed iteration, and stops at 10 with the survivors because it reads the job's end
    # from the store (from iteration 0, the flags alone would end it at 5). Or in iteration 6,
    # the first after the load: rolled back to the loaded state, snapshotted before it. The
    # third trains 11-12. Together: the uninterrupted 12-iteration run, bitwise.
    first, saved = first_five  # the first launch, shared
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(saved, ckpt)
    again = [*SHAPE_PP2, "--save", ckpt, "--load", ckpt, "--exit-interval", "5"]
    second, events = _run(tmp_path, 4, again, kill, spares=1)
    third = run_job(tmp_path, 4, again, name="third")
    for job in (first, second, third):
        assert job.returncode == 0, job.failure()
    assert sorted(first.losses) == [1, 2, 3, 4, 5]
    assert "loaded checkpoint of iteration 5" in second.output
    assert sorted(second.losses) == [6, 7, 8, 9, 10]
    (done,) = _assert_recovered(events)
    assert done["replaced"] == {"1": "spare-0"}
    if kill.endswith(":6:forward"):
        assert done["iteration"] == 5, done  # the loaded state
    assert "loaded checkpoint of iteration 10" in third.output
    assert sorted(third.losses) == [11, 12]
    assert {**first.losses, **second.losses, **third.losses} == baseline_pp2.losses
    assert third.digest == baseline_pp2.digest


def test_a_fresh_spare_replenishes_the_pool_and_serves_the_next_failure(tmp_path, baseline_pp2):
    # One spare: it takes over rank 1 (dead in iteration 4), and the agent starts a fresh
    # spare in the freed slot; rank 2 dies in iteration 7, while that one is still starting:
    # the recovery waits for it rather than give up.
    result, events = _run(tmp_path, 4, SHAPE_PP2, "kill@1:4,kill@2:7", spares=1)
    _assert_same_run(result, baseline_pp2)
    first, second = _assert_recovered(events, recoveries=2)
    assert first["replaced"] == {"1": "spare-0"} and second["replaced"] == {"2": "spare-1"}
    started = _named(events, "spare_started")
    assert [(e["spare"], e["local_rank"]) for e in started][:2] == [(1, 1), (2, 2)]
    assert [e["size"] for e in _named(events, "spare_pool")][:4] == [0, 1, 0, 1]


def test_transient_error_resets_in_place_without_a_spare(tmp_path, baseline_pp2):
    result, events = _run(tmp_path, 4, SHAPE_PP2, "raise@1:6:backward", spares=1)
    _assert_same_run(result, baseline_pp2)
    detected = _named(events, "failure_detected")
    assert [(d["rank"], d["kind"]) for d in detected] == [(1, "transient")]
    assert _named(events, "spare_claimed") == []
    (done,) = _assert_recovered(events)
    assert done["replaced"] == {} and done["bytes_moved"] == 0
    assert "spare 0: job finished, exiting" in result.output  # never used, still idle


def test_single_process_job_with_local_snapshots_only_resets_a_transient_error_bitwise(tmp_path):
    # Data-parallel size 1 leaves nowhere for a replica: --deadpool-replicas 0 (what a
    # one-GPU NCCL job runs, tests/gpu); the rank resets from its own snapshot.
    shape = [*DEMO, "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
             "--train-iters", "10", "--deadpool", "--deadpool-replicas", "0", *HEARTBEATS]  # fmt: skip
    baseline = run_job(tmp_path, 1, shape, name="baseline")
    assert baseline.returncode == 0, baseline.failure()
    result, events = _run(tmp_path, 1, shape, "raise@0:6:backward", spares=0)
    _assert_same_run(result, baseline)
    (done,) = _assert_recovered(events)
    assert done["replaced"] == {} and done["bytes_moved"] == 0


def test_hung_rank_is_fenced_then_replaced(tmp_path, baseline_pp2):
    result, events = _run(tmp_path, 4, SHAPE_PP2, "hang@2:6:backward", spares=1)
    _assert_same_run(result, baseline_pp2)
    (fenced,) = _named(events, "fenced")
    assert fenced["rank"] == 2
    (detected,) = _named(events, "failure_detected")
    assert detected["evidence"] == "HeartbeatStale" and detected["kind"] == "permanent"
    (done,) = _assert_recovered(events)
    assert done["replaced"] == {"2": "spare-0"}


def test_spare_dying_during_its_own_recovery_is_replaced_by_the_next(tmp_path, baseline_pp2):
    # Rank 3 dies in iteration 6; the spare taking it over dies while it recovers into
    # iteration 6: the recovery starts again in a newer generation with the second spare.
    result, events = _run(tmp_path, 4, SHAPE_PP2, "kill@3:6,kill@3:6:recovery", spares=2)
    _assert_same_run(result, baseline_pp2)
    started = _named(events, "recovery_started")
    assert [s["generation"] for s in started] == [1, 2]
    claimed = [(c["spare"], c["replaces"]) for c in _named(events, "spare_claimed")]
    assert claimed == [("spare-0", 3), ("spare-1", 3)]
    (done,) = _assert_recovered(events)
    assert done["replaced"] == {"3": "spare-1"}


def test_adjacent_ring_ranks_lost_together_with_one_replica_is_unrecoverable(tmp_path):
    # Rank 1's optimizer shard lives on rank 1 and its ring successor 2 only: both die.
    result, events = _run(tmp_path, 4, SHAPE_DP4, TOGETHER, spares=2)
    assert result.returncode == 1
    assert "its optimizer shard at iteration" in result.output
    assert "was replicated on ranks [2] only, and [2] failed too (--deadpool-replicas 1)" in (
        result.output
    )
    assert _named(events, "recovery_done") == []
    (ended,) = _named(events, "job_ended")
    assert ended["status"] == 1 and ended["reason"].startswith("unrecoverable")


def test_adjacent_ring_ranks_lost_together_with_two_replicas_recover(tmp_path, baseline_dp4):
    result, events = _run(
        tmp_path, 4, SHAPE_DP4, TOGETHER, spares=2, extra=["--deadpool-replicas", "2"]
    )
    _assert_same_run(result, baseline_dp4)
    (done,) = _assert_recovered(events)
    assert done["replaced"] == {"1": "spare-0", "2": "spare-1"}


def test_two_replicas_over_gloo_groups_serve_adjacent_ranks_lost_together(tmp_path, baseline_dp4):
    # --deadpool-transport gloo (the other tests' replicas go over tcp, the default): a gloo
    # group per ring edge, two successors and two predecessors per rank.
    result, events = _run(tmp_path, 4, SHAPE_DP4, TOGETHER, spares=2,
                          extra=["--deadpool-replicas", "2", "--deadpool-transport", "gloo"])  # fmt: skip
    _assert_same_run(result, baseline_dp4)
    (done,) = _assert_recovered(events)
    assert done["replaced"] == {"1": "spare-0", "2": "spare-1"}


def test_rank_failing_its_health_check_is_fenced_and_replaced(tmp_path):
    # Rank 1's device starts computing wrong results in iteration 5: it is alive and beating,
    # but unfit, so it is killed and a spare takes its place.
    shape = [*SHAPE_PP2, "--train-iters", "30", "--deadpool-health-check-interval", "0.3"]
    base = run_job(tmp_path, 4, shape, name="baseline")
    assert base.returncode == 0, base.failure()
    result, events = _run(tmp_path, 4, shape, "unhealthy@1:5", spares=1)
    _assert_same_run(result, base)
    (detected,) = _named(events, "failure_detected")
    assert (detected["rank"], detected["kind"]) == (1, "permanent")
    assert detected["evidence"] == "HealthCheckFailed"
    (fenced,) = _named(events, "fenced")
    assert fenced["rank"] == 1
    (done,) = _assert_recovered(events)
    assert done["replaced"] == {"1": "spare-0"}
