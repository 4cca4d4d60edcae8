"""An idle spare's build on stand-in groups (torch's "fake" backend, no peers) builds what
megatron-core builds for the target rank, in the spare's own process, and leaves
torch.distributed as it found it. Whether the state then trains bitwise as the rank's own is
tested by tests/multiproc/test_hotswap.py."""

from __future__ import annotations

import pytest

from jobs import ROOT

pytestmark = pytest.mark.timeout(180)


def test_a_stand_in_build_is_the_target_ranks_own(run_drivers):
    # A process of its own: torch.distributed and megatron-core's globals are per process.
    (out,) = run_drivers(ROOT / "tests" / "drivers" / "prebuild_driver.py", [[]], timeout_s=150)
    first, last = out["3"], out["5"]  # demo vocabulary 128 over TP2: TP rank 1 holds 64-128
    assert first["vocab_range"] == [64, 128] and first["pre_process"]
    assert not first["post_process"] and last["post_process"] and not last["pre_process"]
    # The distributed optimizer holds its DP rank's shard of the stage: a part, not all.
    for built in (first, last):
        assert 0.4 < built["optimizer_shard_numel"] / built["stage_numel"] < 0.6
    assert {"WORLD", "_TENSOR_MODEL_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP"} <= set(first["roles"])
    # Its record holds the optimizer's key gathering (replayed if a peer builds at the claim)
    # and no parameter broadcast; the first stage's tied-embedding all-reduce too.
    assert "all_gather_object" in first["build_calls"] and "broadcast" not in first["build_calls"]
    assert first["hooks_cut"] > 0 and first["hooks_left"] == 0  # back on at the claim
    assert not first["initialized_after"] and not last["initialized_after"]
