"""Megatron-LM's own pretrain_gpt.py, patched (patches/), trains on CPU/gloo under
deadpool-launch; a rank killed mid-run is hot-swapped by a spare and every per-iteration loss
and the final state digest equal the same job without the failure: in its set-up, in a save,
twice, with tensor parallel, the overlapped all-gather and the configurations users run.
What Megatron-LM's loop does around a hot-swap (its counts, evaluations, exits, Slurm) is
test_megatron_lm_loop.py's; the jobs are tests/megatron_lm_jobs.py's (skipped, saying why,
without a Megatron-LM checkout).
"""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from megatron_lm_jobs import DP4, MODEL, job_env, launch, printed_lines, release, run

from deadpool_megatron.metrics import read_metrics
from jobs import ROOT

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(1200)]


def test_upstream_pretrain_gpt_hot_swaps_a_killed_rank_bitwise(megatron_lm, failure_free, tmp_path):
    losses, final = failure_free
    events = tmp_path / "events.jsonl"
    killed_losses, killed_final, output = run(
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
    # Megatron-LM's printed lines are the failure-free run's: each shows its iteration's loss
    # (but the 2nd, which averages the 1st and 2nd: train() does not reset its sums after its
    # first iteration); the line after the resumed iteration averaged two before
    printed = re.findall(r"iteration +(\d+)/ +12 \|.*?\| lm loss: ([0-9.E+-]+) \|", output)
    assert {int(i) for i, _ in printed} == set(range(1, 13)), printed
    for i, shown in printed:
        if int(i) != 2:
            assert shown == f"{float.fromhex(losses[int(i)]):.6E}", (i, shown)


PARSER_CHECK = """
import argparse, inspect
from deadpool_megatron.megatron import upstream
from megatron.training import arguments

def build():
    # every flag and its help text (core_v0.18's and core_v0.19's format_help() fail on a
    # '%' in one of them, with or without DeadPool)
    parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    return [(a.option_strings, a.dest, a.help, repr(a.default)) for a in parser._actions]

uncached = build()
read = []
source = inspect.getsource
inspect.getsource = lambda obj: (read.append(obj), source(obj))[1]
assert upstream.cache_field_docstrings() and upstream.cache_field_docstrings()
first = build()
classes = len(read)
again = build()
assert classes > 0 and len(read) == classes, (classes, len(read))
assert first == uncached and again == uncached
print("read", classes, "sources once")
"""


def test_megatron_lm_parser_reads_its_config_sources_once_with_the_same_help(megatron_lm):
    # Megatron-LM's parse_args reads and parses its config dataclasses' sources for their
    # help texts at every call, twice per pretrain(): once per class per process now, the
    # parser's help (and so every flag) unchanged.
    env = {**os.environ, **job_env(megatron_lm)}
    done = subprocess.run([sys.executable, "-c", PARSER_CHECK], cwd=megatron_lm, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0 and "sources once" in done.stdout, done.stdout + done.stderr[-3000:]


def test_upstream_help_with_deadpool_lists_megatron_lm_s_flags_and_deadpool_s(megatron_lm):
    # The script's first parse (in-process restart's) printed Megatron-LM's help without
    # DeadPool's flags (core_v0.16.1, core_v0.17.1) or failed on a bare '%' in one of its
    # own texts (core_v0.18.2, core_v0.19.0); hooks.show_help comes before it.
    env = {**os.environ, **job_env(megatron_lm)}
    done = subprocess.run([sys.executable, "pretrain_gpt.py", "--deadpool", "--help"],
                          cwd=megatron_lm, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    for flag in ("--tensor-model-parallel-size", "--deadpool-replicas", "--deadpool-transport",
                 "--deadpool-metrics-jsonl"):  # fmt: skip
        assert f"[{flag}" in done.stdout, flag
    assert "10%)" in done.stdout or release() < (0, 18)  # the text that failed, shown


@pytest.mark.parametrize("spec", ["kill@1:0:setup", "raise@2:0:setup", "kill@1:0:groups"])
def test_upstream_failure_during_the_set_up_sets_every_rank_up_again_bitwise(
    megatron_lm, failure_free, tmp_path, spec
):
    # Nothing trained and nothing to restore: every rank runs pretrain()'s set-up again in
    # the next generation (a spare in the killed rank's place), as at the job's start. At
    # phase groups, rank 1 dies before pretrain() creates its groups: its peers wait for it
    # in their rendezvous until the recovery order ends that wait.
    losses, final = failure_free
    got, got_final, output = run(megatron_lm, tmp_path, "setup", ["--deadpool-inject", spec])
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
    killed_losses, killed_final, output = run(
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
    got, got_final, output = run(
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
    got, got_final, output = run(
        megatron_lm, tmp_path, "twice", ["--deadpool-inject", "kill@1:5,kill@2:9"], spares=2
    )  # fmt: skip
    assert "spare 0 claimed: takes over rank 1 in generation 1" in output
    assert "spare 1 claimed: takes over rank 2 in generation 2" in output
    kept = re.findall(r"\[(worker \d|spare \d)\] .* 3 data loader\(s\) of the previous set-up "
                      r"serve again", output)  # fmt: skip
    assert sorted(kept) == ["spare 0", "worker 0", "worker 0", "worker 2", "worker 3",
                            "worker 3"], kept  # fmt: skip
    assert got == losses and got_final["state_digest"] == final["state_digest"]


def test_upstream_hot_swap_with_replicas_over_mpi_is_bitwise(
    megatron_lm, failure_free, tmp_path, mpirun
):
    # The launcher under mpirun spawns Megatron-LM's pretrain_gpt.py (--deadpool-transport
    # mpi): rank 1 dies in iteration 5 and the spare takes it over from a replica that came
    # over MPI; the failure-free run (over tcp) gives the same losses and digest.
    losses, final = failure_free
    code, output = launch(megatron_lm, tmp_path, "mpi",
                          ["--deadpool-transport", "mpi", "--deadpool-inject", "kill@1:5"],
                          prefix=(*mpirun, "-n", "1"))  # fmt: skip
    assert "job" in output and "finished: 4 worker(s) on node 0 succeeded" in output, output[-6000:]
    got, got_final = read_metrics(str(tmp_path / "mpi.jsonl"))
    assert got == losses and got_final["state_digest"] == final["state_digest"]
    assert "spare 0 claimed: takes over rank 1 in generation 1" in output
    assert "replica ring of generation 1 over mpi" in output


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
    losses, final, _ = run(megatron_lm, tmp_path, "tp_free", TP2, env=env)
    got, got_final, output = run(
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
    losses, final, _ = run(megatron_lm, tmp_path, "overlap_free", overlap)
    got, got_final, output = run(
        megatron_lm, tmp_path, "overlap_swap", [*overlap, "--deadpool-inject", "kill@1:7"]
    )
    assert "spare 0 claimed: takes over rank 1 in generation 1" in output
    assert output.count("parameters gathered from every rank's optimizer shard") == 4
    assert sorted(losses) == list(range(1, 13))
    assert got == losses and got_final["state_digest"] == final["state_digest"]


def test_upstream_blended_indexed_datasets_hot_swap_of_rank_0_is_bitwise(megatron_lm, tmp_path):
    # A blend of two Megatron indexed datasets (--data-path 0.7 A 0.3 B, what users train on;
    # the other tests use --mock-data) with a validation split evaluated every 3 iterations:
    # GPTDataset's indices are built by rank 0 first and cached beside the data, the others
    # read them. Rank 0 dies, so the spare that takes its place is the rank that builds first
    # in the recovery's set-up: it finds the cache and the run ends as the failure-free one.
    blend = []
    for name, weight, words in (("a", "0.7", "the quick brown fox"), ("b", "0.3", "alpha beta")):
        corpus = tmp_path / f"{name}.txt"
        corpus.write_text("".join(f"{words} {i % 13} jumps {' '.join(words.split()[: i % 3])}\n"
                                  for i in range(2000)))  # fmt: skip
        subprocess.run([sys.executable, str(ROOT / "scripts" / "preprocess_data.py"), "--input",
                        str(corpus), "--output-prefix", str(tmp_path / name)],
                       check=True, capture_output=True, timeout=120)  # fmt: skip
        blend += [weight, str(tmp_path / name)]
    model = [a for a in MODEL if a != "--mock-data"] + ["--data-path", *blend]
    for flag, value in (("--split", "90,10,0"), ("--eval-iters", "2"), ("--eval-interval", "3")):
        model[model.index(flag) + 1] = value
    losses, final, free = run(megatron_lm, tmp_path, "data_free", [], model=model)
    got, got_final, output = run(
        megatron_lm, tmp_path, "data_swap", ["--deadpool-inject", "kill@0:5"], model=model
    )
    assert "spare 0 claimed: takes over rank 0 in generation 1" in output
    for name in ("a", "b"):
        assert list((tmp_path / name / "cache").iterdir()), (
            f"GPTDataset cached no indices of {name}"
        )

    def validation(log: str) -> list[str]:
        return re.findall(r"validation loss at iteration .*", log)

    assert len(validation(free)) == 5 and validation(output) == validation(free)
    assert sorted(losses) == list(range(1, 13))
    assert got == losses and got_final["state_digest"] == final["state_digest"]


def test_upstream_tensorboard_holds_every_iterations_loss_across_hot_swaps(
    megatron_lm, failure_free, tmp_path
):
    # --tensorboard-dir: the last rank writes the scalars. It survives the first failure
    # (its pretrain() run again closes the old writer and opens a new event file) and dies in
    # the second (the spare that takes its place writes on). Read back from every event file,
    # each iteration's loss is there with the failure-free run's value, once, but for an
    # iteration run again (a roll-back past the last completed iteration), which is twice.
    pytest.importorskip("tensorboard", reason="--tensorboard-dir needs the tensorboard package")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tb"
    *_, output = run(megatron_lm, tmp_path, "tb_swaps",
        ["--tensorboard-dir", str(tb), "--deadpool-inject", "kill@1:5,kill@3:9"], spares=2)  # fmt: skip
    rolled_to = [int(n) for n in re.findall(r"roll back to iteration (\d+)", output)]
    assert len(rolled_to) == 2, output[-3000:]
    again = [i for start, killed in zip(rolled_to, (5, 9)) for i in range(start + 1, killed)]
    files = sorted(tb.iterdir())
    assert len(files) == 3, files  # generation 0's, the survivor's new one, the spare's
    written: dict[int, list[float]] = {}
    for events in files:
        scalars = EventAccumulator(str(events), size_guidance={"scalars": 0})
        scalars.Reload()
        for point in scalars.Scalars("lm loss"):
            written.setdefault(point.step, []).append(point.value)
    losses, _ = failure_free
    as_written = {i: [float(struct.unpack("f", struct.pack("f", float.fromhex(h)))[0])]
                  * (1 + again.count(i)) for i, h in losses.items()}  # fmt: skip
    assert written == as_written


def offline_history(path: Path) -> Iterator[dict]:
    """The history rows of an offline W&B run's .wandb file: wandb's log format (leveldb's: a
    7-byte header, then records in 32 KiB blocks, each record's parts with a 7-byte header of
    checksum, length and type), each a wandb_internal_pb2.Record; a killed writer's file ends
    early."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        if (left := 32768 - pos % 32768) < 7:  # a block's tail too short for a header
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 or pos + 7 + length > len(data):
            return
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or its last part
            record = wandb_internal_pb2.Record.FromString(parts)
            parts = b""
            if record.WhichOneof("record_type") == "history":
                yield {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                       for item in record.history.item}  # fmt: skip


def test_upstream_w_and_b_keeps_one_run_across_hot_swaps_of_its_last_rank(
    megatron_lm, failure_free, tmp_path
):
    # --wandb-project: the last rank logs (Megatron-LM writes W&B beside TensorBoard). It
    # survives the first failure (its pretrain() run again gets the run it has open) and dies
    # in the second; the spare that takes its place opens the job's run again, by the id
    # every process of the job is given, instead of a run of its own. Offline here: each
    # process that opens the run writes a folder of it, named by the run's id; the spare's
    # holds every iteration it ran with the failure-free value, from the roll-back on; the
    # killed process's what W&B had written of its scalars before the kill (it buffers: in
    # one run iterations 1-3 of 1-8, in another none).
    pytest.importorskip("tensorboard", reason="W&B scalars are written with TensorBoard's")
    pytest.importorskip("wandb", reason="--wandb-project needs the wandb package")
    runs = tmp_path / "wandb"
    got, got_final, output = run(megatron_lm, tmp_path, "wandb_swaps",
        ["--tensorboard-dir", str(tmp_path / "tb"), "--wandb-project", "deadpool-test",
         "--wandb-exp-name", "hot-swaps", "--wandb-save-dir", str(runs),
         "--deadpool-inject", "kill@1:5,kill@3:9"], spares=2,
        env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})  # fmt: skip
    job = re.search(r"job ([0-9a-f]{8})", output).group(1)
    folders = sorted((runs / "wandb").glob("offline-run-*"))
    # generation 0's last rank, (perhaps) its second init after the first failure, the spare
    assert len(folders) >= 2, folders
    assert {f.name.split("-", 3)[-1].removesuffix("-1") for f in folders} == {f"deadpool-{job}"}
    rolled_to = [int(n) for n in re.findall(r"roll back to iteration (\d+)", output)]
    assert len(rolled_to) == 2, output[-3000:]
    logged = {}  # a second init in one process writes nothing into its folder
    for folder in folders:
        for wandb_file in folder.glob("*.wandb"):
            rows = offline_history(wandb_file)
            logged[folder] = {row["_step"]: row["lm loss"] for row in rows if "lm loss" in row}
    losses, final = failure_free
    assert got == losses and got_final["state_digest"] == final["state_digest"]
    free = {i: float.fromhex(h) for i, h in losses.items()}
    *killed, spare = (logged[f] for f in sorted(logged))  # folders are named by start time
    assert spare == {i: v for i, v in free.items() if i > rolled_to[1]}
    # what the killed process's W&B had written (some runs nothing: it buffers), as logged
    assert all(free[i] == v for run in killed for i, v in run.items()), killed


NPROC = {"moe_expert_tensor_parallel_1": 8}  # the other configurations: 4 ranks


@pytest.mark.parametrize(
    "name, flags, kill",
    [
        # what a GPU job runs, on CPU: bf16, tensor and sequence parallel, the overlapped
        # all-reduce and all-gather, SwiGLU, RMSNorm, rotary embeddings, untied output
        # weights (TP2 x DP2)
        ("gpu_style", [*TP2, "--sequence-parallel", "--bf16", "--overlap-grad-reduce",
                       "--overlap-param-gather",
                       "--swiglu", "--untie-embeddings-and-output-weights", "--normalization",
                       "RMSNorm", "--position-embedding-type", "rope"], "kill@3:8"),
        # two virtual stages per pipeline stage (interleaved schedule) with full activation
        # recomputation, which draws dropout's masks again in the backward (PP2 x DP2)
        ("interleaved_recompute", ["--num-layers", "4", "--num-layers-per-virtual-pipeline-stage",
                                   "1", "--recompute-granularity", "full", "--recompute-method",
                                   "uniform", "--recompute-num-layers", "1"], "kill@2:7"),
        # a mixture of experts, 4 experts in 2 expert-parallel ranks (DP4 x EP2: ranks 0 and 2
        # hold experts 0-1, 1 and 3 experts 2-3), tokens sent by all-to-all: the spare for rank
        # 1 gets its parameters from rank 3, not from its ring predecessor 0 (whose experts are
        # others: the state diverged from the first resumed iteration on when it did). No
        # bias: core_v0.16.1's local experts add theirs in place on a view (autograd refuses).
        ("moe_expert_parallel", [*DP4, "--num-experts", "4", "--expert-model-parallel-size",
                                 "2", "--moe-token-dispatcher-type", "alltoall",
                                 "--moe-aux-loss-coeff", "0.01", "--disable-bias-linear"],
         "kill@1:5"),
        # experts without tensor parallelism in a tensor-parallel job (8 ranks, TP2 x DP4,
        # EP4 x ETP1: each expert whole on one rank, the dense layers split across pairs),
        # the layout most mixtures of experts with tensor parallelism use, with sequence
        # parallelism (megatron-core refuses MoE with TP without it): rank 1's dense shard is
        # also on ranks 3, 5 and 7, its experts (2-3 of 8) only on rank 5. Megatron-LM checks
        # that its data-parallel replicas hold the same weights (dense and expert, by SHA-1)
        # as each loop starts, the resumed one included, and every 4 iterations
        ("moe_expert_tensor_parallel_1", [*TP2, "--sequence-parallel", "--num-experts", "8",
                                          "--expert-model-parallel-size", "4",
                                          "--expert-tensor-parallel-size", "1",
                                          "--moe-token-dispatcher-type", "alltoall",
                                          "--moe-aux-loss-coeff", "0.01", "--disable-bias-linear",
                                          "--check-weight-hash-across-dp-replicas-interval", "4"],
         "kill@1:5"),
        # fp16 with Megatron-LM's dynamic loss scale: from 2**17, doubled after every 3
        # iterations without an overflow, halved after two with one (7 and 8, 12 skipped);
        # rank 1 dies in iteration 6 (rolled back to 5, a growth due at 6): the spare's
        # scale and growth tracker come with the snapshot (without them, iteration 8's loss
        # differed). PP2 x DP2, with Megatron-LM's manual garbage collection (automatic
        # collection off, one every 5 iterations), which large jobs turn on
        ("fp16_loss_scale", ["--fp16", "--initial-loss-scale", "131072",
                             "--loss-scale-window", "3", "--manual-gc", "--manual-gc-interval",
                             "5"], "kill@1:6"),
        # the optimizer sharded within two instances of DP2 each, the grads all-reduced across
        # them in torch's coalescing manager (DP4; needs einops)
        ("distributed_optimizer_instances", [*DP4, "--num-distributed-optimizer-instances",
                                             "2"], "kill@1:5"),
    ],
)  # fmt: skip
def test_upstream_configurations_users_run_are_hot_swapped_bitwise(
    megatron_lm, tmp_path, name, flags, kill
):
    if name == "distributed_optimizer_instances":
        pytest.importorskip("einops", reason="Megatron-LM's optimizer instances import einops")
    how = {"env": {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}, "nproc": NPROC.get(name, 4)}
    losses, final, free_output = run(megatron_lm, tmp_path, f"{name}_free", flags, **how)
    got, got_final, output = run(
        megatron_lm, tmp_path, f"{name}_swap", [*flags, "--deadpool-inject", kill], **how
    )
    assert "spare 0 claimed" in output
    assert sorted(losses) == list(range(1, 13))
    if "--check-weight-hash-across-dp-replicas-interval" in flags:  # at 0, 4, 8, 12; at 4 again
        assert output.count(">>> Weight hashes match after") == 5, output[-3000:]
    assert got == losses and got_final["state_digest"] == final["state_digest"]
    # and Megatron-LM printed the same lines (losses, MoE's auxiliary one, grad norm, ...)
    assert printed_lines(output) == printed_lines(free_output)


def test_upstream_lines_after_hot_swaps_average_the_iterations_the_failure_free_run_averaged(
    megatron_lm, failure_free, tmp_path
):
    # Megatron-LM prints every --log-interval iterations the mean of the losses it summed
    # since its last line (4 here: lines 1, 4, 8, 12; the first line resets nothing, so line
    # 4 averages 1-4). Rank 1 dies in iteration 2 (rolled back to 1, the job's first; to 0
    # where the kill came before 1 was replicated) and the last rank, which prints, in
    # iteration 7 (rolled back to 6, or 5): each resumed train() started its sums empty, so
    # line 4 averaged 2-4 and line 8 7-8 (or 6-8). The ranks now carry the sums as they
    # stood after the restored iteration (to the spare that prints, from rank 2, on the
    # same stage), and every line is the failure-free run's.
    losses, final = failure_free
    every4 = ["--log-interval", "4"]
    _, _, free_output = run(megatron_lm, tmp_path, "every4_free", every4)
    got, got_final, output = run(megatron_lm, tmp_path, "every4_swap",
                                 [*every4, "--deadpool-inject", "kill@1:2,kill@3:7"],
                                 spares=2)  # fmt: skip
    assert "spare 1 claimed: takes over rank 3 in generation 2" in output
    assert re.search(r"generation 1: rolled back to iteration [01] \(", output)
    assert re.search(r"generation 2: rolled back to iteration [56] \(", output)
    assert got == losses and got_final["state_digest"] == final["state_digest"]
    printed = printed_lines(free_output)
    assert sorted(printed) == [1, 4, 8, 12]
    assert printed_lines(output) == printed


def test_upstream_hot_swap_back_to_the_loaded_iteration_prints_what_the_resumed_run_prints(
    megatron_lm, tmp_path
):
    # A job resumed with --load from iteration 4 (a first launch stopped at --exit-interval 4
    # and saved it), rank 1 killed in iteration 5: the roll-back goes to 4, where this
    # launch's training began, and Megatron-LM's loop is run again from there. It logs its
    # first iteration as the job's start (its line for 6 averages 5 and 6); the resumed loop
    # logged it as a continuation, since the roll-back was past iteration 0 (line 6: 6 alone).
    ckpt = tmp_path / "ckpt"
    run(megatron_lm, tmp_path, "first", ["--exit-interval", "4", "--save", str(ckpt),
                                         "--save-interval", "4"])  # fmt: skip
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    losses, final, free_output = run(megatron_lm, tmp_path, "resumed_free", ["--load", str(ckpt)])
    got, got_final, output = run(
        megatron_lm,
        tmp_path,
        "resumed_swap",
        ["--load", str(ckpt), "--deadpool-inject", "kill@1:5"],
    )
    assert "spare 0 claimed" in output and "roll back to iteration 4" in output
    assert sorted(losses) == list(range(5, 13))
    assert got == losses and got_final["state_digest"] == final["state_digest"]
    assert printed_lines(output) == printed_lines(free_output)


def test_upstream_set_up_that_fails_again_the_same_way_ends_the_job_with_its_traceback(
    megatron_lm, tmp_path
):
    # Tensor parallel without CUDA_DEVICE_MAX_CONNECTIONS=1: Megatron-LM's argument check
    # fails on every rank, in the set-up and again in the recovery's set-up. Each rank logs
    # its traceback, and gives up when the same error comes back: the job ends at once with
    # that cause, instead of waiting out the recovery's timeout (300 s) as it did.
    returncode, output = launch(megatron_lm, tmp_path, "tp_unset", TP2)
    assert returncode != 0
    assert "Traceback (most recent call last)" in output
    assert "in validate_args" in output
    assert "it would fail the same way again" in output
    assert "did not finish within" not in output
    assert "ending the job" in output


def test_upstream_recovery_that_fails_the_same_way_falls_back_to_its_checkpoint_bitwise(
    megatron_lm, failure_free, tmp_path
):
    # Rank 1's transient failure in iteration 6 starts a recovery in which every process
    # holding rank 0 fails after pretrain()'s set-up (bug@0:6:recovery, an error of its own,
    # as a TypeError in a set-up run again): reported in the generation it recovered into,
    # reset, replaced, met by the spare too. Before, the failed attempt waited for an order
    # nobody gave, 300 s. A restart from Megatron-LM's checkpoint runs no recovery: the job
    # falls back to it and ends equal to the failure-free run.
    losses, final = failure_free
    save = tmp_path / "ckpt"
    got, got_final, output = run(
        megatron_lm, tmp_path, "recovery_bug",
        ["--deadpool-inject", "raise@1:6,bug@0:6:recovery", "--save", str(save),
         "--save-interval", "4", "--load", str(save)],
        spares=1,
    )  # fmt: skip
    assert "the same error as 2 time(s) before in the recovery from a failure in iteration 6" in (
        output
    )
    assert "the recovery cannot succeed in memory: falling back to the persistent checkpoint" in (
        output
    )
    assert "did not finish within" not in output
    assert got == losses and got_final["state_digest"] == final["state_digest"]


def test_upstream_failure_during_a_spare_s_takeover_keeps_the_spare_bitwise(
    megatron_lm, failure_free, tmp_path
):
    # Rank 1 dies in iteration 6 and the one spare is seated on it; rank 0 fails transiently
    # after pretrain()'s set-up in that recovery (raise@0:6:recovery): generation 2 cuts the
    # spare's takeover short, and the spare, which holds rank 1 in the membership, runs
    # pretrain() again there and receives rank 1's state. Before, it left, and with no spare
    # left the job ended.
    losses, final = failure_free
    got, got_final, output = run(
        megatron_lm, tmp_path, "takeover_cut",
        ["--deadpool-inject", "kill@1:6,raise@0:6:recovery"], spares=1,
    )  # fmt: skip
    assert "taking over rank 1 in generation 1 was cut short" in output
    assert "spare-0 replaces rank 1 (seated already)" in output
    assert got == losses and got_final["state_digest"] == final["state_digest"]
