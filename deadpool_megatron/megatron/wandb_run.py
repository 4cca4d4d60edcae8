"""One Weights & Biases run per job across hot-swaps (Megatron-LM's `--wandb-project`).

Megatron-LM logs to W&B from its last rank only, opening the run in `pretrain()`
(`global_vars._set_wandb_writer`: `wandb.init(dir, name, project, config)`, no id). A
survivor's `pretrain()` run again gets the run it has open; but a spare that takes the last
rank over is a new process, and its `wandb.init` would open a new run with an id of its own,
splitting the job's curves in two (so would every restart of a checkpoint-restart). So every
process of the job is given one run id derived from the job's id, with resumption allowed,
through the variables `wandb.init` reads (WANDB_RUN_ID, WANDB_RESUME); a user's own
WANDB_RUN_ID stands. Pure: the caller applies what `run_env` returns.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from ..runtime import ENV_JOB_ID

ENV_RUN_ID = "WANDB_RUN_ID"
ENV_RESUME = "WANDB_RESUME"
FLAG = "--wandb-project"


def wandb_project(argv: list[str]) -> str | None:
    """The `--wandb-project` the command line names (the last one, as argparse takes it);
    None without one or with an empty one (Megatron-LM then logs nothing to W&B)."""
    project = None
    for i, arg in enumerate(argv):
        if arg == FLAG and i + 1 < len(argv):
            project = argv[i + 1]
        elif arg.startswith(FLAG + "="):
            project = arg.split("=", 1)[1]
    return project or None


def run_id(job_id: str) -> str:
    """The job's W&B run id: W&B allows letters, digits, '-' and '_' (a --job-id such as
    Slurm's is any string), so anything else becomes '-'."""
    return "deadpool-" + re.sub(r"[^A-Za-z0-9_-]", "-", job_id)


def run_env(environ: Mapping[str, str], argv: list[str]) -> dict[str, str]:
    """What to add to this process's environment so that the job logs to one W&B run: empty
    without `--wandb-project`, outside deadpool-launch (no job id) or where WANDB_RUN_ID is
    set already; a WANDB_RESUME the user set stands ("allow" otherwise: the first process to
    open the run creates it, every later one resumes it)."""
    job = environ.get(ENV_JOB_ID)
    if ENV_RUN_ID in environ or not job or wandb_project(argv) is None:
        return {}
    return {ENV_RUN_ID: run_id(job), ENV_RESUME: environ.get(ENV_RESUME) or "allow"}
