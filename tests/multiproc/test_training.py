"""Real multi-process jobs: megatron-core GPT on gloo, started through deadpool-launch.

Each job is compared bitwise (per-iteration loss hex values and the final state digest over
every rank's parameters and optimizer state) with another run of the same configuration.
"""

from __future__ import annotations

import re

import pytest

from deadpool_megatron.runtime import ENV_GROUP_PER_ROLE
from jobs import ROOT, run_job, run_job_and_kill

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(900)]

DEMO = ["--config", str(ROOT / "configs" / "demo.yaml")]
# TP2 x PP2 x DP2 on 8 processes, the 1F1B schedule.
SHAPE_3D = [*DEMO, "--train-iters", "20"]
# PP2 x DP2 on 4 processes, the interleaved schedule (two virtual stages per rank).
SHAPE_INTERLEAVED = [*DEMO, "--tensor-model-parallel-size", "1",
                     "--num-layers-per-virtual-pipeline-stage", "1", "--train-iters", "12"]  # fmt: skip


def _loss(result, iteration: int) -> float:
    return float.fromhex(result.losses[iteration])


@pytest.fixture(scope="module")
def runs_3d(tmp_path_factory):
    # The second run gives every megatron-core role a gloo group of its own, as megatron-core
    # makes them; the first shares one among the roles of one rank list (the default).
    tmp = tmp_path_factory.mktemp("3d")
    return [run_job(tmp, 8, SHAPE_3D, spares=1, name=f"run{i}",
                    env={ENV_GROUP_PER_ROLE: str(i)}) for i in range(2)]  # fmt: skip


@pytest.fixture(scope="module")
def runs_interleaved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("interleaved")
    ckpt = tmp / "ckpt"
    # One uninterrupted run: the checkpointed pair must equal it (tests/multiproc/test_hotswap.py
    # compares further interleaved runs with theirs, through a failure).
    full = run_job(tmp, 4, SHAPE_INTERLEAVED, name="full")
    first = run_job(tmp, 4, [*SHAPE_INTERLEAVED, "--save", str(ckpt), "--exit-interval", "5"],
                    name="first")  # fmt: skip
    resumed = run_job(tmp, 4, [*SHAPE_INTERLEAVED, "--load", str(ckpt)], name="resumed")
    return full, first, resumed


def test_3d_parallel_runs_are_bitwise_identical_and_learn(runs_3d):
    a, b = runs_3d
    assert a.returncode == 0, a.failure()
    assert b.returncode == 0, b.failure()
    assert sorted(a.losses) == list(range(1, 21))
    assert a.losses == b.losses
    assert a.digest is not None and a.digest == b.digest
    assert _loss(a, 20) < _loss(a, 1) - 1.0, (_loss(a, 1), _loss(a, 20))
    assert "iteration       20/      20" in a.output  # Megatron-style progress lines


def test_roles_of_one_rank_list_share_a_group_and_train_bitwise_as_with_a_group_each(runs_3d):
    shared, own = runs_3d
    assert shared.losses == own.losses and shared.digest == own.digest
    # Rank 0 at TP2 x PP2 x DP2: megatron-core's 36 roles, in 17 groups made as it makes them,
    # or 7 shared (and the one of every rank is the default group).
    said = "INFO deadpool_megatron.megatron.parallel: process groups: 36 roles in {} group(s)"
    assert re.search(r"\[worker 0\] \S+ " + re.escape(said.format(7)), shared.output)
    assert re.search(r"\[worker 0\] \S+ " + re.escape(said.format(17)), own.output)
    assert f"({ENV_GROUP_PER_ROLE}=1)" in own.output and ENV_GROUP_PER_ROLE not in shared.output


def test_spare_registers_idles_and_exits_when_the_job_ends(runs_3d):
    out = runs_3d[0].output
    assert "[spare 0]" in out and "spare 0 registered" in out
    assert "spare 0: job finished, exiting" in out
    assert "8 worker(s) on node 0 succeeded" in out


def test_interleaved_schedule_learns(runs_interleaved):
    a, _, _ = runs_interleaved
    assert a.returncode == 0, a.failure()
    assert sorted(a.losses) == list(range(1, 13))
    assert _loss(a, 12) < _loss(a, 1) - 0.5


def test_resume_from_checkpoint_is_bitwise_identical(runs_interleaved):
    a, first, resumed = runs_interleaved
    assert first.returncode == 0, first.failure()
    assert resumed.returncode == 0, resumed.failure()
    assert "loaded checkpoint of iteration 5" in resumed.output
    assert sorted(first.losses) == [1, 2, 3, 4, 5]
    assert sorted(resumed.losses) == list(range(6, 13))
    assert {**first.losses, **resumed.losses} == a.losses
    assert resumed.digest == a.digest


def test_killed_worker_ends_the_job_with_one_clear_line(tmp_path):
    args = [*DEMO, "--tensor-model-parallel-size", "1", "--train-iters", "500"]
    result, pid, _ = run_job_and_kill(tmp_path, 4, args, victim_rank=3, after_iteration=2)
    assert result.returncode == 1
    line = f"worker rank 3 (pid {pid}) was killed by signal SIGKILL; ending the job"
    assert result.output.count(line) == 1, result.failure()
    assert result.output.count("ending the job") == 1


def test_indexed_dataset_trains_tp2_dp2(tmp_path):
    import subprocess
    import sys

    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"the quick brown fox {i % 7} jumps over the lazy dog.\n"
                            for i in range(400)))  # fmt: skip
    prefix = tmp_path / "corpus"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "preprocess_data.py"), "--input", str(text),
         "--output-prefix", str(prefix)], check=True, timeout=120,
    )  # fmt: skip
    args = [*DEMO, "--pipeline-model-parallel-size", "1", "--train-iters", "15",
            "--data-path", str(prefix), "--tokenizer-type", "ByteLevelTokenizer",
            "--vocab-size", "258", "--data-cache-path", str(tmp_path / "cache")]  # fmt: skip
    result = run_job(tmp_path, 4, args)
    assert result.returncode == 0, result.failure()
    assert sorted(result.losses) == list(range(1, 16))
    assert _loss(result, 15) < _loss(result, 1) - 1.0
