"""Stop points inside a micro-batch (megatron/stop_points.py) on megatron-core's GPT in a real
process, trained by our Trainer: where they strike, and that they change no byte."""

from __future__ import annotations

import pytest

from jobs import ROOT

pytestmark = pytest.mark.timeout(240)

DRIVER = ROOT / "tests" / "drivers" / "stop_points_driver.py"


def test_stop_points_strike_inside_a_micro_batch_and_change_nothing(tmp_path, run_drivers):
    (out,) = run_drivers(DRIVER, [["plain,covered,stop:6,stop:38", str(tmp_path / "store")]],
                         timeout_s=200)  # fmt: skip
    plain, covered, early, later = (out[m] for m in ("plain", "covered", "stop:6", "stop:38"))
    # Each of the 4 layers' forward in each of the 8 micro-batches.
    assert covered["covered"] == 4 and covered["covered_again"] == 0
    assert covered["calls_per_iteration"] == [32, 32]
    assert covered["losses"] == plain["losses"] and covered["digest"] == plain["digest"]
    # Call 6: the first micro-batch went through its 4 layers (and its backward), the second
    # through 1; the iteration stops there, not at that micro-batch's backward.
    assert early["stopped"] == "call 6" and early["completed"] == 0 and early["losses"] == []
    assert later["completed"] == 1 and later["losses"] == plain["losses"][:1]
    assert later["calls_per_iteration"] == [32, 6]
