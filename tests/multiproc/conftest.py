"""The jobs of these tests fork their fork servers from one zygote (agent/zygote.py) that
imports torch and megatron-core once for the session, where each job's agent would otherwise
import them again before its first child starts (5-7 CPU-seconds a job here, most of a short
job's time). Jobs run as they would with a server of their own: the zygote refuses, and the
agent starts one, wherever a fork of it would differ (tests/unit/test_zygote.py). A test that
must not use it (a job under Slurm, whose node loss kills the agent's process tree) drops
DEADPOOL_FORK_ZYGOTE from its jobs' environment."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from zygotes import running_zygote

from deadpool_megatron.agent.zygote import ENV_FORK_ZYGOTE


@pytest.fixture(scope="session", autouse=True)
def zygote() -> Iterator[Path]:
    with running_zygote() as (_, path):
        os.environ[ENV_FORK_ZYGOTE] = str(path)
        try:
            yield path
        finally:
            os.environ.pop(ENV_FORK_ZYGOTE, None)
