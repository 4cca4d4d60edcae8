"""One W&B run per job: every process of a job that logs to W&B gets the job's run id."""

from __future__ import annotations

import pytest

from deadpool_megatron.megatron.wandb_run import run_env, run_id, wandb_project
from deadpool_megatron.runtime import ENV_JOB_ID

JOB = {ENV_JOB_ID: "1a2b3c4d"}


@pytest.mark.parametrize(
    "argv, project",
    [
        (["--wandb-project", "gpt", "--lr", "1"], "gpt"),
        (["--wandb-project=gpt"], "gpt"),
        (["--wandb-project", "a", "--wandb-project", "b"], "b"),  # argparse keeps the last
        (["--wandb-project", ""], None),  # Megatron-LM logs nothing then
        (["--wandb-project"], None),
        (["--wandb-exp-name", "x"], None),
    ],
)
def test_the_project_is_read_as_megatron_lm_s_parser_reads_it(argv, project):
    assert wandb_project(argv) == project


def test_the_run_id_keeps_what_w_and_b_allows_of_the_job_s_id():
    assert run_id("1a2b3c4d") == "deadpool-1a2b3c4d"
    assert run_id("slurm:123/4 x") == "deadpool-slurm-123-4-x"


def test_a_job_logging_to_w_and_b_gets_one_resumable_run():
    env = run_env(JOB, ["--wandb-project", "gpt"])
    assert env == {"WANDB_RUN_ID": "deadpool-1a2b3c4d", "WANDB_RESUME": "allow"}
    assert run_env({**JOB, "WANDB_RESUME": "must"}, ["--wandb-project", "gpt"]) == {
        "WANDB_RUN_ID": "deadpool-1a2b3c4d", "WANDB_RESUME": "must"}  # fmt: skip


@pytest.mark.parametrize(
    "environ, argv",
    [
        ({**JOB, "WANDB_RUN_ID": "mine"}, ["--wandb-project", "gpt"]),  # the user's stands
        ({}, ["--wandb-project", "gpt"]),  # outside deadpool-launch
        (JOB, ["--lr", "1"]),  # no W&B
    ],
)
def test_nothing_is_set_where_the_user_chose_or_nothing_logs(environ, argv):
    assert run_env(environ, argv) == {}
