"""Megatron-LM's own pretrain_gpt.py, patched (patches/), trains on CPU/gloo under
deadpool-launch; a rank killed mid-run is hot-swapped by a spare and every per-iteration loss
and the final state digest equal the same job without the failure.

Needs a Megatron-LM checkout (git clone https://github.com/NVIDIA/Megatron-LM) named by
MEGATRON_LM_DIR, and the Python modules its pretrain_gpt.py imports (six, regex, pydantic,
pybind11, triton); skips, saying why, without them. The checkout is not touched: the tag is
cloned into a temporary folder and patched there.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurm_cluster import start_cluster
from slurm_jobs import lose_node, node_logs, submit, wait_for_iteration

from deadpool_megatron.metrics import read_metrics
from jobs import JOB_TIMEOUT_S, ROOT

sys.path.insert(0, str(ROOT / "scripts"))

from bench_megatron_lm import python_first  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(1200)]

TAG = "core_v0.16.1"
# A small GPT on Megatron-LM's mock data, every CUDA-only fusion off, 4 ranks as PP2 x DP2;
# dropout at Megatron-LM's default (0.1): on CPU its masks come from the generator that the
# data loaders draw from (upstream.data_iterators_for_hot_swaps).
MODEL = shlex.split(
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
    "--max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 8 --train-iters 12 "
    "--lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 1024 --split 100,0,0 "
    "--distributed-backend gloo --transformer-impl local --no-gradient-accumulation-fusion "
    "--no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion --no-rope-fusion "
    "--no-persist-layer-norm --use-cpu-initialization --use-distributed-optimizer "
    "--eval-iters 0 --eval-interval 1000 "
    "--log-interval 1 --pipeline-model-parallel-size 2 --deadpool "
    "--deadpool-heartbeat-interval 0.5 --deadpool-heartbeat-timeout 2.0"
)
NEEDED = ("six", "regex", "pydantic", "pybind11", "triton")
DP4 = ["--pipeline-model-parallel-size", "1"]  # after MODEL's: the same job as DP4


@pytest.fixture(scope="module")
def megatron_lm(tmp_path_factory) -> Path:
    source = os.environ.get("MEGATRON_LM_DIR")
    if not source:
        pytest.skip(
            "MEGATRON_LM_DIR is not set: this test needs a Megatron-LM checkout "
            f"(git clone https://github.com/NVIDIA/Megatron-LM; tag {TAG})"
        )
    missing = [m for m in NEEDED if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"Megatron-LM's pretrain_gpt.py needs modules missing here: {missing}")
    checkout = tmp_path_factory.mktemp("megatron-lm") / "Megatron-LM"
    is_git = subprocess.run(["git", "-C", source, "rev-parse", "--git-dir"],
                            capture_output=True).returncode == 0  # fmt: skip
    if is_git:  # a clone, or a bare mirror
        subprocess.run(["git", "clone", "-q", "--branch", TAG, source, str(checkout)], check=True)
    else:
        shutil.copytree(source, checkout)
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "apply_megatron_patch.sh"), str(checkout)],
        capture_output=True, text=True, env={**os.environ, "PYTHON": sys.executable},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "applied: 0002-training-deadpool-hooks.patch" in done.stdout
    return checkout


def _launch(
    checkout: Path, tmp_path: Path, name: str, extra: list[str], spares: int = 1,
    model: list[str] = MODEL, env: dict[str, str] | None = None,
) -> tuple[int, str]:  # fmt: skip
    """deadpool-launch runs the job (output under tmp_path/NAME.log): exit status, output."""
    cmd = [
        sys.executable, "-m", "deadpool_megatron.launch", "--nproc-per-node", "4",
        "--spares", str(spares), "pretrain_gpt.py", *model,
        "--deadpool-metrics-jsonl", str(tmp_path / f"{name}.jsonl"), *extra,
    ]  # fmt: skip
    # Megatron-LM's check for tensor parallel reads this one: set by the tests that need it
    run_env = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    run_env.update(PYTHONPATH=str(ROOT), PATH=python_first(checkout.parent), **(env or {}))
    done = subprocess.run(cmd, cwd=checkout, env=run_env, capture_output=True, text=True,
                          timeout=2 * JOB_TIMEOUT_S)  # fmt: skip
    output = done.stdout + done.stderr
    (tmp_path / f"{name}.log").write_text(output)
    return done.returncode, output


def _run(
    checkout: Path, tmp_path: Path, name: str, extra: list[str], **how
) -> tuple[dict, dict, str]:
    """The job, which must succeed: its per-iteration losses, final record, output."""
    returncode, output = _launch(checkout, tmp_path, name, extra, **how)
    assert returncode == 0, output[-6000:]
    losses, final = read_metrics(str(tmp_path / f"{name}.jsonl"))
    return losses, final, output


@pytest.fixture(scope="module")
def failure_free(megatron_lm, tmp_path_factory) -> tuple[dict, dict]:
    losses, final, _ = _run(megatron_lm, tmp_path_factory.mktemp("base"), "failure_free", [])
    assert sorted(losses) == list(range(1, 13)) and final["iteration"] == 12
    return losses, final


def test_upstream_pretrain_gpt_hot_swaps_a_killed_rank_bitwise(megatron_lm, failure_free, tmp_path):
    losses, final = failure_free
    events = tmp_path / "events.jsonl"
    killed_losses, killed_final, output = _run(
        megatron_lm, tmp_path, "killed",
        ["--deadpool-inject", "kill@1:7", "--deadpool-event-log", str(events)],
    )  # fmt: skip
    assert "spare 0 claimed: takes over rank 1 in generation 1" in output
    # every process of generation 1, the spare too: its model phase was 7.2 s with it, 1.1 s
    # without (both fusions off here; skipping it leaves the digest alone)
    assert output.count("pretrain() runs again without Megatron-LM's JIT warm-up") == 4
    # Killed as iteration 7 starts: back to 6, or to 5 if 6's replica was still on its way.
    assert "roll back to iteration 6" in output or "roll back to iteration 5" in output
    # The collection after the recovery walks what the job built (a few thousand objects):
    # not Megatron-LM's imports (some 430,000 objects, 0.23 s a walk, of CPU the next
    # iteration waited for), nor, in the survivors, what generation 0's JIT warm-up compiled
    # (torch.compile's tables, some 150,000 objects, 0.08-0.23 s a walk).
    walked = re.findall(r"\[(worker \d|spare 0)\] .* freed the previous generation "
                        r"\(\d+ objects found of (\d+) walked\)", output)  # fmt: skip
    assert len(walked) == 4 and all(int(n) < 50_000 for _, n in walked), walked
    # rank 0 printed Megatron-LM's argument table in generation 0 only
    assert output.count("------------------------ arguments ------------------------") == 1
    assert "Megatron-LM's arguments: as printed at this process's first pretrain()" in output
    assert killed_losses == losses
    assert killed_final["state_digest"] == final["state_digest"]


PARSER_CHECK = """
import argparse, inspect
from deadpool_megatron.megatron import upstream
from megatron.training import arguments

def build():
    return arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))

uncached = build().format_help()
read = []
source = inspect.getsource
inspect.getsource = lambda obj: (read.append(obj), source(obj))[1]
assert upstream.cache_field_docstrings() and upstream.cache_field_docstrings()
first = build().format_help()
classes = len(read)
again = build().format_help()
assert classes > 0 and len(read) == classes, (classes, len(read))
assert first == uncached and again == uncached
print("read", classes, "sources once")
"""


def test_megatron_lm_parser_reads_its_config_sources_once_with_the_same_help(megatron_lm):
    # Megatron-LM's parse_args reads and parses its config dataclasses' sources for their
    # help texts at every call, twice per pretrain(): once per class per process now, the
    # parser's help (and so every flag) unchanged.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", PARSER_CHECK], cwd=megatron_lm, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0 and "sources once" in done.stdout, done.stdout + done.stderr[-3000:]


@pytest.mark.parametrize("spec", ["kill@1:0:setup", "raise@2:0:setup", "kill@1:0:groups"])
def test_upstream_failure_during_the_set_up_sets_every_rank_up_again_bitwise(
    megatron_lm, failure_free, tmp_path, spec
):
    # Nothing trained and nothing to restore: every rank runs pretrain()'s set-up again in
    # the next generation (a spare in the killed rank's place), as at the job's start. At
    # phase groups, rank 1 dies before pretrain() creates its groups: its peers wait for it
    # in their rendezvous until the recovery order ends that wait.
    losses, final = failure_free
    got, got_final, output = _run(megatron_lm, tmp_path, "setup", ["--deadpool-inject", spec])
    assert "every rank sets up again from the start" in output
    # its JIT warm-up too: the model's initialization follows its random draws, and nothing
    # is restored over them (skipped, every loss differed)
    assert "without Megatron-LM's JIT warm-up" not in output
    assert got == losses and got_final["state_digest"] == final["state_digest"]


def test_upstream_death_in_the_last_periodic_save_is_hot_swapped_and_saved_again(
    megatron_lm, failure_free, tmp_path
):
    # Rank 1 dies as Megatron-LM's save of iteration 12 (the last, on the interval) starts,
    # once 12 is protected: the job rolls back to 12, train() has nothing left to run and
    # pretrain() would skip its save at the end (12 % 12 == 0); the tracker does not name 12,
    # so the hook after it saves.
    losses, final = failure_free
    save = tmp_path / "ckpt"
    killed_losses, killed_final, output = _run(
        megatron_lm, tmp_path, "killed_in_save",
        ["--deadpool-inject", "kill@1:12:save", "--save", str(save), "--save-interval", "12"],
    )  # fmt: skip
    assert "roll back to iteration 12" in output
    assert "the checkpoint of iteration 12 is missing" in output
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "12"
    assert killed_losses == losses
    assert killed_final["state_digest"] == final["state_digest"]


@pytest.mark.parametrize("ckpt_format", ["torch_dist", "torch"])
def test_upstream_falls_back_to_its_checkpoint_without_a_spare_and_resumes_bitwise(
    megatron_lm, failure_free, tmp_path, ckpt_format
):
    # No spare: rank 1's death cannot be hot-swapped, so the job restarts from Megatron-LM's
    # own checkpoint of iteration 4 (--load), which megatron-core's DistributedOptimizer on
    # torch's AdamW (no Apex or TE here) cannot load by itself (upstream
    # .torch_adam_loads_checkpoints). Without that step's fix the restart diverges silently;
    # from the legacy format (torch) every restart failed in its load, ten times, until the
    # job ended (2026-12-05).
    losses, final = failure_free
    save = tmp_path / "ckpt"
    got, got_final, output = _run(
        megatron_lm, tmp_path, "fallback",
        ["--deadpool-inject", "kill@1:6", "--save", str(save), "--save-interval", "4",
         "--load", str(save), "--ckpt-format", ckpt_format],
        spares=0,
    )  # fmt: skip
    assert "falling back to the persistent checkpoint" in output
    loading = (
        "loading distributed checkpoint" if ckpt_format == "torch_dist" else "loading checkpoint"
    )
    assert re.search(rf"{loading} from \S+ at iteration 4", output), output[-3000:]
    assert got == losses and got_final["state_digest"] == final["state_digest"]


def test_upstream_two_failures_are_hot_swapped_in_turn_and_survivors_keep_their_loaders(
    megatron_lm, failure_free, tmp_path
):
    # Rank 1 dies in iteration 5, rank 2 in iteration 9, two spares: each survivor's
    # pretrain() run again gets its data loaders (and their worker processes) back, the first
    # spare's too once it survives the second failure; every loss and the digest are the
    # failure-free run's.
    losses, final = failure_free
    got, got_final, output = _run(
        megatron_lm, tmp_path, "twice", ["--deadpool-inject", "kill@1:5,kill@2:9"], spares=2
    )  # fmt: skip
    assert "spare 0 claimed: takes over rank 1 in generation 1" in output
    assert "spare 1 claimed: takes over rank 2 in generation 2" in output
    kept = re.findall(r"\[(worker \d|spare \d)\] .* 3 data loader\(s\) of the previous set-up "
                      r"serve again", output)  # fmt: skip
    assert sorted(kept) == ["spare 0", "worker 0", "worker 0", "worker 2", "worker 3",
                            "worker 3"], kept  # fmt: skip
    assert got == losses and got_final["state_digest"] == final["state_digest"]


TP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1"]


def test_upstream_tensor_parallel_hot_swap_takes_parameters_from_the_same_shard_bitwise(
    megatron_lm, tmp_path
):
    # TP2 x DP2 (Megatron-LM orders ranks tensor-parallel first): rank 1 holds tensor shard 1
    # of data-parallel replica 0, so its parameters come from rank 3 (shard 1 of replica 1)
    # and its optimizer shard from its ring replica. Megatron-LM requires
    # CUDA_DEVICE_MAX_CONNECTIONS=1 with tensor parallel before Blackwell; the CPU view says
    # compute capability 0.0.
    env = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    losses, final, _ = _run(megatron_lm, tmp_path, "tp_free", TP2, env=env)
    got, got_final, output = _run(
        megatron_lm, tmp_path, "tp_swap", [*TP2, "--deadpool-inject", "kill@1:7"], env=env
    )
    assert "spare 0 claimed: takes over rank 1 in generation 1" in output
    assert re.search(r"transfers: parameters 3->1, replica \d->1", output), output[-3000:]
    assert sorted(losses) == list(range(1, 13))
    assert got == losses and got_final["state_digest"] == final["state_digest"]


def test_upstream_overlapped_param_gather_hot_swap_is_bitwise(megatron_lm, tmp_path):
    # --overlap-grad-reduce --overlap-param-gather (what GPU users run with the distributed
    # optimizer), as DP4: after a step, a rank's parameters outside its optimizer shard are
    # gathered by the next forward, so the snapshot's are not the step's there. Without
    # gathering them after the restore the run diverged from the resumed iteration on
    # (digest d60939e8... against 44fe78f6..., 2026-12-05).
    overlap = [*DP4, "--overlap-grad-reduce", "--overlap-param-gather"]
    losses, final, _ = _run(megatron_lm, tmp_path, "overlap_free", overlap)
    got, got_final, output = _run(
        megatron_lm, tmp_path, "overlap_swap", [*overlap, "--deadpool-inject", "kill@1:7"]
    )
    assert "spare 0 claimed: takes over rank 1 in generation 1" in output
    assert output.count("parameters gathered from every rank's optimizer shard") == 4
    assert sorted(losses) == list(range(1, 13))
    assert got == losses and got_final["state_digest"] == final["state_digest"]


@pytest.mark.parametrize(
    "name, flags, kill",
    [
        # what a GPU job runs, on CPU: bf16, tensor parallel, the overlapped all-reduce and
        # all-gather, SwiGLU, RMSNorm, rotary embeddings, untied output weights (TP2 x DP2)
        ("gpu_style", [*TP2, "--bf16", "--overlap-grad-reduce", "--overlap-param-gather",
                       "--swiglu", "--untie-embeddings-and-output-weights", "--normalization",
                       "RMSNorm", "--position-embedding-type", "rope"], "kill@3:8"),
        # two virtual stages per pipeline stage (interleaved schedule) with full activation
        # recomputation, which draws dropout's masks again in the backward (PP2 x DP2)
        ("interleaved_recompute", ["--num-layers", "4", "--num-layers-per-virtual-pipeline-stage",
                                   "1", "--recompute-granularity", "full", "--recompute-method",
                                   "uniform", "--recompute-num-layers", "1"], "kill@2:7"),
    ],
)  # fmt: skip
def test_upstream_configurations_users_run_are_hot_swapped_bitwise(
    megatron_lm, tmp_path, name, flags, kill
):
    env = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    losses, final, _ = _run(megatron_lm, tmp_path, f"{name}_free", flags, env=env)
    got, got_final, output = _run(
        megatron_lm, tmp_path, f"{name}_swap", [*flags, "--deadpool-inject", kill], env=env
    )
    assert "spare 0 claimed" in output
    assert sorted(losses) == list(range(1, 13))
    assert got == losses and got_final["state_digest"] == final["state_digest"]


def test_upstream_set_up_that_fails_again_the_same_way_ends_the_job_with_its_traceback(
    megatron_lm, tmp_path
):
    # Tensor parallel without CUDA_DEVICE_MAX_CONNECTIONS=1: Megatron-LM's argument check
    # fails on every rank, in the set-up and again in the recovery's set-up. Each rank logs
    # its traceback, and gives up when the same error comes back: the job ends at once with
    # that cause, instead of waiting out the recovery's timeout (300 s) as it did.
    returncode, output = _launch(megatron_lm, tmp_path, "tp_unset", TP2)
    assert returncode != 0
    assert "Traceback (most recent call last)" in output
    assert "in validate_args" in output
    assert "it would fail the same way again" in output
    assert "did not finish within" not in output
    assert "ending the job" in output


def _saved_counts(save: Path, iteration: int) -> tuple[float, int, int]:
    """What Megatron-LM counted in a checkpoint it saved (torch_dist): floating-point
    operations, training and validation samples consumed."""
    import torch

    common = torch.load(save / f"iter_{iteration:07d}" / "common.pt", weights_only=False)
    args = common["args"]
    return (float(common["num_floating_point_operations_so_far"]),
            args.consumed_train_samples, args.consumed_valid_samples)  # fmt: skip


# The same 12 iterations, sample-based (--train-samples, as Megatron-LM's GPT-3 scripts
# train), validating 2 global batches every 3 iterations on a tenth of the mock data.
BY_SAMPLES = [a for a in MODEL if a not in ("--train-iters", "12")] + shlex.split(
    "--train-samples 96 --split 90,10,0 --eval-iters 2 --eval-interval 3"
)
BY_ITERATIONS = MODEL + shlex.split("--split 90,10,0 --eval-iters 2 --eval-interval 3")
VALIDATION = re.compile(r"validation loss at iteration \d+.*? \| lm loss value: \S+")


SAVED = ["--save-interval", "4"]


@pytest.fixture(scope="module")
def saved_free(megatron_lm, tmp_path_factory) -> tuple[Path, str]:
    """BY_SAMPLES without a failure, saving every 4 iterations: its --save folder, output."""
    tmp_path = tmp_path_factory.mktemp("saved_free")
    free_dir = tmp_path / "free_ckpt"
    _, _, free_output = _run(
        megatron_lm, tmp_path, "save_free",
        [*SAVED, "--save", str(free_dir), "--load", str(free_dir)], model=BY_SAMPLES,
    )  # fmt: skip
    return free_dir, free_output


def test_upstream_hot_swap_skips_the_load_and_saves_what_the_failure_free_run_saves(
    megatron_lm, failure_free, saved_free, tmp_path
):
    # With --save and --load (a user's usual pair), a hot-swap's pretrain() run again read
    # the checkpoint of iteration 4 from storage on every rank before the restore overwrote
    # it: skipped. Its counts came from that checkpoint, so after the recovery (rolled back
    # to 6, or 5) the checkpoints counted 2 iterations' floating-point operations short
    # (checked: 6 against 8 at iteration 8), and a sample-based run validated from its first
    # sample again (the losses at 9 and 12 differed, checked); the ranks that kept where
    # their loop started now carry both (the spare has none), as the failure-free run counts.
    losses, final = failure_free
    (free_dir, free_output), swap_dir = saved_free, tmp_path / "swap_ckpt"
    got, got_final, output = _run(
        megatron_lm, tmp_path, "save_swap",
        [*SAVED, "--save", str(swap_dir), "--load", str(swap_dir), "--deadpool-inject", "kill@1:7"],
        model=BY_SAMPLES,
    )  # fmt: skip
    assert "spare 0 claimed: takes over rank 1 in generation 1" in output
    assert output.count("Megatron-LM's --load is skipped") == 4
    assert "loading distributed checkpoint from" not in output
    # validation does not touch the training: its losses are the iteration-based run's
    assert got == losses and got_final["state_digest"] == final["state_digest"]
    validated = VALIDATION.findall(free_output)
    assert len(validated) == 6, validated  # at 3, 6, 9 and 12, then the end's two sets
    assert VALIDATION.findall(output) == validated
    for iteration in (8, 12):
        counts = _saved_counts(swap_dir, iteration)
        assert counts == _saved_counts(free_dir, iteration)
        assert counts[0] > 0 and counts[1:] == (8 * iteration, 16 * (iteration // 3))


def test_upstream_evaluation_cut_short_by_a_failure_runs_again_from_its_first_sample(
    megatron_lm, failure_free, saved_free, tmp_path
):
    # Rank 1 dies as the evaluation after iteration 3 starts (iteration 3 protected): the
    # recovery restores 3, and the resumed loop went on with iteration 4, so the validation
    # loss at 3 was never printed. Now every survivor says it had not finished that
    # evaluation, which runs again before iteration 4 from its first sample, and every later
    # one reads what it reads without the failure. Iteration-based, the same job as
    # BY_SAMPLES (which validates on the same samples): there Megatron-LM's loaders take 0
    # samples consumed at iteration 3 for a count to make from the iteration (16: the
    # losses at 3, 6, 9 and 12 differed, checked), so the count is given as exact.
    losses, final = failure_free
    (free_dir, free_output), swap_dir = saved_free, tmp_path / "swap_ckpt"
    got, got_final, output = _run(
        megatron_lm, tmp_path, "evaluate_swap",
        [*SAVED, "--save", str(swap_dir), "--load", str(swap_dir),
         "--deadpool-inject", "kill@1:3:evaluate"],
        model=BY_ITERATIONS,
    )  # fmt: skip
    assert "spare 0 claimed: takes over rank 1 in generation 1" in output
    assert "generation 1: rolled back to iteration 3 (" in output, output[-4000:]
    again = "the evaluation after iteration 3 was cut short by the failure: it runs again"
    assert output.count(again) == 4  # every rank of the new generation, the spare included
    validated = VALIDATION.findall(free_output)
    assert VALIDATION.findall(output) == validated  # at 3 once, and 6, 9, 12 as without it
    assert got == losses and got_final["state_digest"] == final["state_digest"]
    for iteration in (4, 8, 12):
        assert _saved_counts(swap_dir, iteration) == _saved_counts(free_dir, iteration)


def test_upstream_exit_interval_ends_training_and_a_kill_after_it_needs_no_recovery(
    megatron_lm, failure_free, tmp_path
):
    # Megatron-LM's train() leaves through sys.exit(0) at --exit-interval: that is the end of
    # training (the final metrics line, the agreed stop), and a rank killed after it (phase
    # finish, checked against the exit interval) is not replaced.
    losses, _ = failure_free
    free_losses, free_final, _ = _run(megatron_lm, tmp_path, "exit_free", ["--exit-interval", "8"])
    exited_losses, exited_final, output = _run(
        megatron_lm, tmp_path, "exit_interval",
        ["--exit-interval", "8", "--deadpool-inject", "kill@1:8:finish"],
    )  # fmt: skip
    assert free_final is not None and free_final["iteration"] == 8
    assert free_losses == {i: losses[i] for i in range(1, 9)}
    assert exited_losses == free_losses
    assert exited_final["state_digest"] == free_final["state_digest"]
    assert "injecting kill@1:8:finish" in output and "spare 0 claimed" not in output
    assert "rank(s) [0, 2, 3] finished training before rank(s) [1] failed" in output


def _signalled_run(
    checkout: Path, tmp_path: Path, after_iteration: int, extra: list[str]
) -> tuple[int, str, dict]:
    """A job with --exit-signal-handler and --save, sent SIGTERM (to deadpool-launch, which
    forwards it to the workers) once `after_iteration` is logged; it must end 0. Returns the
    iteration its checkpoint holds, its output and its losses."""
    metrics, save = tmp_path / "signalled.jsonl", tmp_path / "ckpt"
    cmd = [
        sys.executable, "-m", "deadpool_megatron.launch", "--nproc-per-node", "4",
        "--spares", "1", "pretrain_gpt.py", *MODEL, "--deadpool-metrics-jsonl", str(metrics),
        "--exit-signal-handler", "--save", str(save), "--save-interval", "100", *extra,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PATH": python_first(checkout.parent)}
    log = tmp_path / "signalled.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=checkout, env=env, stdout=out,
                                stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while not (metrics.exists() and after_iteration in read_metrics(str(metrics))[0]):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=JOB_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = log.read_text()
    assert proc.returncode == 0, output[-6000:]
    stopped = int((save / "latest_checkpointed_iteration.txt").read_text())
    losses, _ = read_metrics(str(metrics))
    return stopped, output, losses


def test_upstream_exit_signal_handler_stops_every_rank_after_one_iteration_and_saves_it(
    megatron_lm, failure_free, tmp_path
):
    # SIGTERM to deadpool-launch once iteration 4 is logged (Slurm's notice of a time limit).
    # With Megatron-LM's --exit-signal-handler the launcher forwards it to the workers alone:
    # Megatron-LM's own handler stops them after one iteration, they save it and leave
    # pretrain(), and the job ends 0 with its spare.
    losses, _ = failure_free
    stopped, output, got = _signalled_run(megatron_lm, tmp_path, 4, [])
    assert 4 <= stopped < 12, output[-3000:]
    assert got == {i: losses[i] for i in range(1, stopped + 1)}
    assert "exiting program after receiving SIGTERM" in output
    assert "spare 0: job finished, exiting" in output


def test_upstream_exit_signal_noted_before_a_recovery_is_not_forgotten(
    megatron_lm, failure_free, tmp_path
):
    # The signal comes while rank 1 is slow in iteration 6, and rank 1 dies as that
    # iteration's snapshot starts, before Megatron-LM's loop asks its handler. The recovery
    # runs pretrain() again, which drops that handler and installs a fresh one: the signal it
    # noted is raised again for the new one, so every rank still stops after one iteration
    # and saves it (before, the job trained on to --train-iters).
    losses, _ = failure_free
    faults = ["--deadpool-inject", "slow@1:6,kill@1:6:snapshot"]
    stopped, output, got = _signalled_run(megatron_lm, tmp_path, 5, faults)
    assert "spare 0 claimed: takes over rank 1" in output
    assert "raised again for Megatron-LM's handler" in output
    assert 6 <= stopped < 12, output[-3000:]
    assert got == {i: losses[i] for i in range(1, stopped + 1)}
    assert "exiting program after receiving SIGTERM" in output


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    cluster = start_cluster(tmp_path_factory.mktemp("slurm"), 3)
    yield cluster
    cluster.stop()


def test_upstream_under_sbatch_hot_swaps_a_lost_node_onto_the_spare_node_bitwise(
    megatron_lm, slurm, tmp_path
):
    # The README's Slurm command for Megatron-LM (MEGATRON_LM_DIR=... sbatch
    # scripts/slurm/pretrain_gpt.sbatch MEGATRON_FLAGS --deadpool) on a local Slurm of three
    # nodes: two worker nodes of two processes and a spare node. Node 1 (ranks 2 and 3) is
    # lost whole, its agent and every process on it at once, and the spare node's processes
    # take its ranks over. DP4 (no pipeline): with PP2 x DP2, Megatron-LM's rank order puts
    # a whole pipeline stage's DP group on node 1, which no hot-swap can recover (the
    # launcher warns of it at start).
    losses, final, _ = _run(megatron_lm, tmp_path, "failure_free_dp4", DP4)
    run_dir, metrics = tmp_path / "run", tmp_path / "metrics.jsonl"
    # No zygote: the node's fork server must be in its agent's process tree, which the loss
    # below kills (as in test_multinode.py). A node timeout of 5 s, not 2: Megatron-LM's
    # set-up in six processes on this 2-core machine once starved node 1's agent past 2 s
    # after every rank had registered (2026-12-05), and that node was counted lost (a
    # false accusation then costs a hot-swap, which the job survived, but not the test).
    job = submit(
        slurm, tmp_path, run_dir, 3, 1,
        [*MODEL, *DP4, "--deadpool-node-timeout", "5", "--deadpool-metrics-jsonl", str(metrics)],
        zygote=False, nproc=2,
        env={"MEGATRON_LM_DIR": str(megatron_lm), "PATH": python_first(megatron_lm.parent)},
    )  # fmt: skip
    wait_for_iteration(tmp_path, metrics, 5, JOB_TIMEOUT_S)
    lose_node(job, 1)
    state = slurm.wait_job(job, 2 * JOB_TIMEOUT_S)
    out = (tmp_path / "batch.out").read_text()
    logs = node_logs(run_dir)
    assert state == "COMPLETED", out + logs[-6000:]
    assert "node(s) 1 lost during the job; it finished on the others" in out
    assert re.search(r"spare \d+ claimed: takes over rank [23] in generation 1", logs), logs[-6000:]
    got, got_final = read_metrics(str(metrics))
    assert got == losses and got_final["state_digest"] == final["state_digest"]
