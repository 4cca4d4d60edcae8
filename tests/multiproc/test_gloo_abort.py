"""Operations gloo would not wake after a failure: the training thread gives up at the abort,
and a pipeline send or receive left pending is ended, so neither a helper thread nor the old
group's destructor waits for the group's timeout (minutes) with the generation's resources."""

from __future__ import annotations

import pytest

from jobs import ROOT

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(480)]


def test_an_abort_ends_pending_sends_and_receives_and_their_helper_threads(tmp_path, run_drivers):
    driver = ROOT / "tests" / "drivers" / "abort_p2p_driver.py"
    outs = run_drivers(driver, [[str(r), str(tmp_path / "store")] for r in range(2)], 150)
    out = outs[1]
    assert out["helpers_waiting"] == 3 and out["training"] == "aborted"
    assert out["collective"] == "aborted"  # the caller gave up; gloo's operation goes on
    # megatron-core's DDP gradient reduce-scatter and parameter all-gather: posted and waited
    # for at the exit of torch's coalescing manager, which waited on the training thread
    # itself ("blocked in a collective it could not abort", status 75, a spare used up)
    assert out["coalesced"] == "aborted"
    assert out["waiting_before"] == {
        "default_pg": ["irecv (default_pg) from main < <module>, posted in this generation",
                       "isend (default_pg) from main < <module>, posted in this generation"],
        "DEADPOOL_RING_EDGE_0_1": ["replica receive (DEADPOOL_RING_EDGE_0_1), posted in this "
                                   "generation"],
        "LATE": ["all_reduce (LATE) from collective < run, posted in this generation"],
    }  # fmt: skip
    # what an old group still waits on when it is closed: only the collective, posted in the
    # generation before (none since)
    assert out["waiting_after"] == {
        "default_pg": [],
        "DEADPOOL_RING_EDGE_0_1": [],
        "LATE": ["all_reduce (LATE) from collective < run"],
    }
    assert out["helpers_left"] == 0  # the helper's wait on gloo ended, and with it the thread
    assert out["replication"] == "ended"  # the replication thread's receive, too
    assert out["late_replication"] == "ended"  # and one it posted after the abort
    assert out["destroyed"]  # the group's destructor found nothing pending


def test_an_abort_while_all_reduces_run_rarely_leaves_one_pending(tmp_path, run_drivers):
    # 100 rounds per rank. The previous abort (both directions shut, the connection closed by
    # gloo at once) left one pending in 11 of 120 rank-rounds of the same driver; this one
    # about 1 in 100 (4 of 560 here, 1 of 40 in CI; always a 4 MB all-reduce on the process
    # that aborted second): the residual race the abort's docstring describes. At most 8 of
    # 200: this abort exceeds it about one run in 50 even at 2 in 100, the previous one would
    # meet it about one run in 170. The pause before each abort was 200-400 ms, now 50-150 ms
    # (one run 45 s -> 20-31 s): the same rate, 4 of 600 in three runs.
    driver = ROOT / "tests" / "drivers" / "abort_race_driver.py"
    outs = run_drivers(driver, [[str(r), str(tmp_path / "store"), "100"] for r in range(2)], 400)
    assert sum(o["stuck"] for o in outs) <= 8, outs
    assert all(o["cut"] >= 100 for o in outs), outs  # every round cut its group's connection


def test_the_interruptible_view_takes_async_op_and_group_by_name_or_by_position(
    tmp_path, run_drivers
):
    # Megatron-LM's signal handler calls all_gather(outs, tensor, group, async_op): the view
    # took async_op by name only ("got multiple values for argument 'async_op'"); inside
    # torch's coalescing manager it waited on a placeholder ("Illegal to call wait on
    # IllegalWork object": --num-distributed-optimizer-instances 2 failed its first iteration).
    driver = ROOT / "tests" / "drivers" / "view_calls_driver.py"
    outs = run_drivers(driver, [[str(r), str(tmp_path / "store")] for r in range(2)], 120)
    for out in outs:
        assert out == {"positional_sync": None, "gathered": [1.0, 2.0],
                       "positional_async": [10.0, 11.0], "keyword_sync": 3.0,
                       "default_group": 1.0, "coalesced_sync": [3.0, 30.0],
                       "coalesced_async": [3.0, 30.0]}, out  # fmt: skip
