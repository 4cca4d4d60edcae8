"""A kept model through a recovery (recovery/kept.py), with real processes and megatron-core."""

from __future__ import annotations

import pytest

from jobs import ROOT

pytestmark = pytest.mark.timeout(180)

DRIVER = ROOT / "tests" / "drivers" / "keep_or_build_driver.py"


def test_a_rank_that_cannot_keep_its_model_builds_and_its_peer_meets_the_build(
    tmp_path, run_drivers
):
    # The plan counted on nobody building; rank 1's model holds a group with no role, so it
    # builds all the same. Rank 0 learns so and performs its own build's collectives again
    # (the optimizer's key gathering over every rank): without that, rank 1 would wait in
    # them and rank 0's next collective would meet the wrong one.
    store = str(tmp_path / "store")
    zero, one = run_drivers(DRIVER, [["0", store, "1"], ["1", store, "1"]], timeout_s=150)
    assert zero["kept"] and not one["kept"]
    assert "all_gather_object" in one["built"] and zero["built"] == []
    # One all-gather of the flags, then rank 0 replays exactly what rank 1's build performs.
    assert one["agreed"] == ["all_gather"] and zero["agreed"] == ["all_gather", *one["built"]]
    assert zero["sum"] == one["sum"] == 3.0


def test_ranks_that_all_keep_their_models_perform_no_build_collective(tmp_path, run_drivers):
    store = str(tmp_path / "store")
    outs = run_drivers(DRIVER, [["0", store, "-1"], ["1", store, "-1"]], timeout_s=150)
    assert [o["kept"] for o in outs] == [True, True] and [o["sum"] for o in outs] == [3.0, 3.0]
    assert [o["agreed"] for o in outs] == [["all_gather"]] * 2  # the flags, nothing replayed
