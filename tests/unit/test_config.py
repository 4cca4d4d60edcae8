"""Flag parsing and validation: every bad value is named, with what would be valid."""

import subprocess
import sys

import pytest

from deadpool_megatron.errors import ConfigError
from deadpool_megatron.megatron.arguments import build_parser, parse_job_args
from jobs import ROOT

DEMO = ["--config", str(ROOT / "configs" / "demo.yaml")]


def test_demo_config_parses_and_fills_derived_defaults():
    cfg = parse_job_args(DEMO, world_size=8)
    assert cfg.parallel.tensor_model_parallel_size == 2
    assert cfg.parallel.use_distributed_optimizer is True
    assert cfg.model.ffn_hidden_size == 4 * cfg.model.hidden_size
    assert cfg.model.max_position_embeddings == cfg.model.seq_length
    assert cfg.training.lr_decay_iters == cfg.training.train_iters


def test_command_line_overrides_config_file():
    cfg = parse_job_args([*DEMO, "--train-iters", "7", "--no-use-distributed-optimizer"], 8)
    assert cfg.training.train_iters == 7
    assert cfg.parallel.use_distributed_optimizer is False


def test_every_config_field_is_a_flag_with_help():
    help_text = build_parser().format_help()
    for flag in ("--tensor-model-parallel-size", "--num-layers-per-virtual-pipeline-stage",
                 "--global-batch-size", "--lr-decay-style", "--save-interval", "--data-path",
                 "--metrics-jsonl", "--exit-interval", "--tokenizer-type"):  # fmt: skip
        assert flag in help_text


@pytest.mark.parametrize(
    "args, world, message",
    [
        (["--tensor-model-parallel-size", "3"], 8, "world size 8 is not divisible by"),
        (["--global-batch-size", "10"], 8, "--global-batch-size 10 is not divisible by"),
        (
            ["--num-attention-heads", "3", "--hidden-size", "60"],
            8,
            "--num-attention-heads 3 is not divisible by --tensor-model-parallel-size 2",
        ),
        (["--num-layers", "3"], 8, "--num-layers 3 is not divisible by"),
        (["--micro-batch-size", "0"], 8, "--micro-batch-size=0 is invalid"),
        (["--data-path", "/nonexistent/corpus"], 8, "/nonexistent/corpus.bin does not exist"),
        (["--bf16", "--fp16"], 8, "--bf16 and --fp16 are both set"),
        (["--save-interval", "5"], 8, "--save-interval is set but --save is not"),
        (["--load", "/nonexistent/ckpt"], 8, "--load '/nonexistent/ckpt' is not a directory"),
        (
            ["--num-layers-per-virtual-pipeline-stage", "3"],
            8,
            "--num-layers-per-virtual-pipeline-stage 3 needs",
        ),
        (
            ["--deadpool", "--no-use-distributed-optimizer"],
            8,
            "--deadpool needs --use-distributed-optimizer",
        ),
        (
            ["--deadpool", "--deadpool-replicas", "2"],
            8,
            "--deadpool-replicas 2 needs 0 <= K <= data-parallel size - 1 (data-parallel size is 2",
        ),
        (
            ["--deadpool", "--tensor-model-parallel-size", "4"],
            8,
            "--deadpool-replicas 1 needs 0 <= K <= data-parallel size - 1 (data-parallel size is 1",
        ),
        (["--deadpool-snapshot-interval", "0"], 8, "--deadpool-snapshot-interval=0 must be"),
        (
            ["--expert-model-parallel-size", "2"],
            8,
            "--expert-model-parallel-size 2 / --expert-tensor-parallel-size None: this "
            "pretrain_gpt.py builds no experts",
        ),
        (["--distributed-timeout-minutes", "0"], 8, "--distributed-timeout-minutes=0.0 must be"),
        (
            ["--deadpool", "--deadpool-inject", "kill@1:6:evaluate"],
            8,
            "kill@1:6:evaluate: phase evaluate strikes in Megatron-LM's evaluations, and this "
            "pretrain_gpt.py does not evaluate",
        ),
        (
            ["--deadpool", "--exit-interval", "30", "--deadpool-inject", "kill@1:40:finish"],
            8,
            "phase finish comes after the last iteration, 30, not after 40",
        ),
    ],
)
def test_invalid_combinations_name_the_value(args, world, message):
    with pytest.raises(ConfigError) as err:
        parse_job_args([*DEMO, *args], world)
    assert message in str(err.value)


def test_training_ends_at_the_first_multiple_of_the_exit_interval_after_its_start(tmp_path):
    # Megatron-LM's --exit-interval: a job that saved and exited at iteration 8 and is
    # submitted again with the same flags (and --load) trains on to 16, then to --train-iters.
    t = parse_job_args([*DEMO, "--train-iters", "20", "--exit-interval", "8"], 8).training
    assert [t.end_iteration(s) for s in (0, 7, 8, 9, 16)] == [8, 8, 16, 16, 20]
    assert parse_job_args([*DEMO, "--train-iters", "20"], 8).training.end_iteration(8) == 20
    # With --load and --exit-interval the end depends on the checkpoint: a finish-phase fault
    # is not checked against the flags alone.
    ckpt = str(tmp_path / "ckpt")
    cfg = parse_job_args([*DEMO, "--deadpool", "--save", ckpt, "--load", ckpt, "--exit-interval",
                          "8", "--deadpool-inject", "kill@1:16:finish"], 8)  # fmt: skip
    assert cfg.deadpool.deadpool_inject == "kill@1:16:finish"


def test_load_may_name_the_save_directory_before_it_exists(tmp_path):
    """Megatron's resume-if-present pattern (`--save DIR --load DIR`), as torchrun restarts use
    it; a --load naming another missing directory stays an error."""
    ckpt = str(tmp_path / "ckpt")
    cfg = parse_job_args([*DEMO, "--save", ckpt, "--load", ckpt], 8)
    assert cfg.checkpoint.load == ckpt
    with pytest.raises(ConfigError, match="is not a directory"):
        parse_job_args([*DEMO, "--save", ckpt, "--load", str(tmp_path / "other")], 8)


def test_unknown_config_key_is_rejected(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("num-layerz: 4\n")
    with pytest.raises(ConfigError, match="unknown key 'num-layerz'"):
        parse_job_args(["--config", str(bad)], 1)


def test_pretrain_gpt_exits_2_with_one_message_before_importing_torch():
    done = subprocess.run(
        [sys.executable, "-X", "importtime", str(ROOT / "pretrain_gpt.py"), *DEMO,
         "--global-batch-size", "10"],
        env={"WORLD_SIZE": "8", "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert errors == [
        "pretrain_gpt.py: error: --global-batch-size 10 is not divisible by --micro-batch-size "
        "2 x data-parallel size 2 = 4; use a multiple of 4"
    ]
    imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines() if "|" in line}
    assert "torch" not in imported
