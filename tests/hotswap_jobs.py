"""Jobs of the hot-swap tests (tests/multiproc/test_hotswap*.py): the shapes they train, a
job run with faults injected and its event log, and what a recovered run must show."""

from __future__ import annotations

import re

from deadpool_megatron.events import read_events
from jobs import ROOT, run_job

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
# Ranks 1 and 2 die together at the optimizer step of iteration 5: kills of several ranks at
# one point wait for each other there (inject.companions). Without that, a busy machine once
# let rank 2's death start a recovery that stopped rank 1 before it got there; rank 1 then died
# in the replay, a second recovery, and the "unrecoverable" test saw the job recover.
TOGETHER = "kill@1:5:optimizer,kill@2:5:optimizer"
# Dropout 0.1 on attention scores (megatron's RNG tracker) and hidden states (torch's generator):
# a restored rank draws the same masks only if every RNG came back with its state.
DROPOUT = ["--attention-dropout", "0.1", "--hidden-dropout", "0.1"]
SHAPE_DROPOUT = [*SHAPE_PP2, *DROPOUT]
# The interleaved 1F1B schedule: two virtual pipeline stages of one layer per rank.
SHAPE_INTERLEAVED = [*SHAPE_DROPOUT, "--num-layers-per-virtual-pipeline-stage", "1"]
RANK_PHASES = ("rebuild_communicators", "rebuild_model", "transfer_state", "verify",
               "first_iteration")  # fmt: skip


def run_injected(tmp_path, nproc, shape, spec, spares, extra=(), script=ROOT / "pretrain_gpt.py"):
    log = tmp_path / "events.jsonl"
    args = [*shape, "--deadpool-inject", spec, "--deadpool-event-log", str(log), *extra]
    result = run_job(tmp_path, nproc, args, spares=spares, script=script)
    events = read_events(str(log)) if log.exists() else []
    return result, events


def named(events, name):
    return [e for e in events if e["event"] == name]


def assert_same_run(result, baseline):
    assert result.returncode == 0, result.failure()
    assert result.losses == baseline.losses  # every iteration, replayed ones included
    assert result.digest == baseline.digest
    for iteration, runs in result.executions.items():  # a replay's loss equals the original's
        assert set(runs) == {baseline.losses[iteration]}, (iteration, runs)


def replays(result) -> int:
    """How many iteration executions were repeats (one metrics line per execution)."""
    return sum(len(runs) - 1 for runs in result.executions.values())


def held_snapshots(output: str, rank: int, generation: int) -> list[int]:
    """The snapshots worker `rank` said it held as `generation`'s recovery began (its log)."""
    pattern = rf"\[worker {rank}\] .*generation {generation}: holding snapshots \[([\d, ]*)\]"
    (held,) = re.findall(pattern, output)
    return [int(i) for i in held.split(",") if i.strip()]


def assert_recovered(events, recoveries: int = 1, interval: int = 1):
    """Every recovery has its phases; it replays at most one snapshot interval."""
    done = named(events, "recovery_done")
    assert len(done) == recoveries, events
    for d in done:
        assert d["total_s"] > 0, d
        assert d["replayed_iterations"] <= interval, d
    phases = {e["phase"] for e in named(events, "recovery_phase")}
    assert {"detect", "fence", "plan", *RANK_PHASES} <= phases
    return done
