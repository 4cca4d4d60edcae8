"""Megatron-LM core_v0.19's own pretrain_gpt.py, patched (patches/megatron-lm-core_v0.19.0),
beside the release the other Megatron-LM tests run (megatron_lm_jobs.TAG; all of them run on
core_v0.19 with MEGATRON_LM_TAG=core_v0.19.0): its script parses and builds its configs
before pretrain(), and a hot-swap runs both again. On Python 3.11 its `typing.override` is
typing_extensions' (tests/py311)."""

from __future__ import annotations

from pathlib import Path

import pytest
from megatron_lm_jobs import patched_checkout, printed_lines, run

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(1200)]

V019 = "core_v0.19.0"


@pytest.fixture(scope="module")
def v019(tmp_path_factory) -> Path:
    return patched_checkout(tmp_path_factory, V019)


@pytest.fixture(scope="module")
def v019_failure_free(v019, tmp_path_factory) -> tuple[dict, dict, str]:
    losses, final, output = run(v019, tmp_path_factory.mktemp("v019"), "failure_free", [])
    assert sorted(losses) == list(range(1, 13)) and final["iteration"] == 12
    assert "Megatron-Core version .......... 0.19" in output
    return losses, final, output


def test_core_v019_hot_swaps_a_killed_rank_bitwise(v019, v019_failure_free, tmp_path):
    losses, final, clean = v019_failure_free
    got, got_final, output = run(v019, tmp_path, "killed", ["--deadpool-inject", "kill@1:7"])
    assert "spare 0 claimed: takes over rank 1 in generation 1" in output
    assert "roll back to iteration 6" in output or "roll back to iteration 5" in output
    assert got == losses and got_final["state_digest"] == final["state_digest"]
    # every printed line but the resumed one's (which averages two) is the failure-free run's
    want, seen = printed_lines(clean), printed_lines(output)
    assert set(seen) == set(range(1, 13))
    assert {i for i in want if want[i] != seen[i]} <= {7}, output[-3000:]
    # the config core_v0.19 builds before pretrain() is frozen with the JIT warm-up's caches;
    # what train() bound to it no longer keeps the survivors' old model (and its groups)
    assert output.count("freed the previous generation") == 4
    assert "outlived its collection" not in output


def test_core_v019_failure_in_the_set_up_sets_every_rank_up_again_bitwise(
    v019, v019_failure_free, tmp_path
):
    losses, final, _ = v019_failure_free
    got, got_final, output = run(v019, tmp_path, "setup", ["--deadpool-inject", "kill@1:0:setup"])
    assert "every rank sets up again from the start" in output
    assert got == losses and got_final["state_digest"] == final["state_digest"]
