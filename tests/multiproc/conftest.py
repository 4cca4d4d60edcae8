"""The jobs of these tests fork their fork servers from one zygote (agent/zygote.py) that
imports torch and megatron-core once for the session, where each job's agent would otherwise
import them again before its first child starts (5-7 CPU-seconds a job here, most of a short
job's time). Jobs run as they would with a server of their own: the zygote refuses, and the
agent starts one, wherever a fork of it would differ (tests/unit/test_zygote.py). A test that
must not use it (a job under Slurm, whose node loss kills the agent's process tree) drops
DEADPOOL_FORK_ZYGOTE from its jobs' environment."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hotswap_jobs import SHAPE_PP2
from megatron_lm_jobs import patched_checkout, run
from zygotes import running_zygote

from deadpool_megatron.agent.mpi_spawn import mpirun_command
from deadpool_megatron.agent.zygote import ENV_FORK_ZYGOTE
from jobs import ROOT, run_failure_free


@pytest.fixture(scope="session", autouse=True)
def zygote() -> Iterator[Path]:
    with running_zygote() as (_, path):
        os.environ[ENV_FORK_ZYGOTE] = str(path)
        try:
            yield path
        finally:
            os.environ.pop(ENV_FORK_ZYGOTE, None)


@pytest.fixture(scope="session")
def megatron_lm(tmp_path_factory) -> Path:
    """A patched Megatron-LM checkout (megatron_lm_jobs.py), for every file that runs one."""
    return patched_checkout(tmp_path_factory)


@pytest.fixture(scope="session")
def failure_free(megatron_lm, tmp_path_factory) -> tuple[dict, dict]:
    """Megatron-LM's job (megatron_lm_jobs.MODEL) without a failure: losses, final record."""
    losses, final, _ = run(megatron_lm, tmp_path_factory.mktemp("base"), "failure_free", [])
    assert sorted(losses) == list(range(1, 13)) and final["iteration"] == 12
    return losses, final


@pytest.fixture(scope="session")
def baseline_pp2(tmp_path_factory):
    """Our pretrain_gpt.py as PP2 x DP2 without a failure (hotswap_jobs.SHAPE_PP2), for
    both hot-swap files."""
    return run_failure_free(tmp_path_factory, "base_pp2", 4, SHAPE_PP2)


@pytest.fixture(scope="session")
def mpirun() -> list[str]:
    """`mpirun` of the Open MPI installed into this interpreter's environment."""
    venv = Path(sys.executable).parent.parent
    setup = subprocess.run(["bash", str(ROOT / "scripts" / "setup_mpi.sh")], capture_output=True,
                           text=True, timeout=600, env={**os.environ, "VENV": str(venv)})  # fmt: skip
    if setup.returncode != 0:
        pytest.fail(
            f"scripts/setup_mpi.sh could not install mpi4py and Open MPI: {setup.stderr[-500:]}"
        )
    return mpirun_command()  # with ULFM: a death ends no job
