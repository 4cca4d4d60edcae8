"""A recovery's state transfer goes through the gloo group it is handed, never the default
group: in an NCCL job the default group cannot carry the host buffers a replica lives in.

Every scenario runs in one pair of driver processes, one after the other, each in process
groups of its own (tests/drivers/transfer_driver.py): a pair's start-up (two interpreters
importing torch and megatron-core) cost each of them most of its 9-10 s."""

from __future__ import annotations

import pytest

from jobs import ROOT

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

SCENARIOS = ["plain", "offer", "decayed", "offer+decayed", "live", "offer+live", "live+stale",
             "offer+live+stale", "offer+live+decayed", "offer+live+posted",
             "offer+live+posted+elsewhere"]  # fmt: skip


@pytest.fixture(scope="module")
def seen(tmp_path_factory, run_drivers) -> dict[str, tuple[dict, dict]]:
    """scenario -> (what rank 0, the serving rank, saw; what rank 1 saw)."""
    driver = ROOT / "tests" / "drivers" / "transfer_driver.py"
    store = tmp_path_factory.mktemp("transfer") / "store"
    sender, receiver = run_drivers(
        driver, [[str(rank), str(store), *SCENARIOS] for rank in range(2)], timeout_s=240
    )
    return {s: (sender[s], receiver[s]) for s in SCENARIOS}


def _scenario(*flags: str) -> str:
    return "+".join(flags) or "plain"


@pytest.mark.parametrize("offer", [False, True])
def test_transfer_uses_the_explicit_host_group_when_the_default_moves_nothing(seen, offer):
    """Offered (`--deadpool-transport tcp`), the receiver on this host reads both parts from
    the sender's memory; the header and the answer still go over the gloo group."""
    sender, receiver = seen[_scenario(*(["offer"] if offer else []))]
    assert sender["default_backend"] == "fake" and sender["group_backend"] == "gloo"
    assert sender["sent"] == [7, 7]
    assert receiver["replica_equal"] and receiver["params_equal"]
    assert receiver["iterations"] == [7, 7]
    assert receiver["pulled"] == [offer, offer]


@pytest.mark.parametrize("offer", [False, True])
def test_a_served_replica_whose_bytes_changed_since_its_commit_is_refused(seen, offer):
    """The serving rank sends the digest its replica was committed with, not one taken now:
    bytes that went bad while held fail at the receiver, read or streamed."""
    _, receiver = seen[_scenario(*(["offer"] if offer else []), "decayed")]
    assert "part of iteration 7 from rank 0 fails its checksum" in receiver["error"]


@pytest.mark.parametrize("offer", [False, True])
def test_a_restored_rank_reads_each_part_straight_into_its_live_tensors(seen, offer):
    """Offered, both parts are read into the live tensors of the rank being restored (the
    padding between them read apart, for the checksum): no buffer to fill and copy out of;
    streamed, they arrive in a buffer and are copied there. Either way the state restored
    holds exactly the bytes sent."""
    _, receiver = seen[_scenario(*(["offer"] if offer else []), "live")]
    assert receiver["pulled"] == [offer, offer]
    assert receiver["in_place"] == [offer, offer]
    assert receiver["untouched"] is not offer  # written in place before the restore, or not
    assert receiver["restored_equal"] and receiver["applied"] == [7]
    assert "error" not in receiver


@pytest.mark.parametrize("offer", [False, True])
def test_a_part_of_another_iteration_is_never_read_into_the_live_tensors(seen, offer):
    _, receiver = seen[_scenario(*(["offer"] if offer else []), "live", "stale")]
    assert receiver["in_place"] == [False, False] and receiver["untouched"]
    assert "holds iteration 7, the plan needs 8" in receiver["error"]
    assert not receiver["restored_equal"] and receiver["applied"] == []


def test_bytes_read_into_place_that_fail_their_checksum_are_asked_for_again(seen):
    """A replica that went bad while held, read into the live tensors, fails there; it is then
    streamed, and fails again: the receiver raises, it never restores from it."""
    _, receiver = seen["offer+live+decayed"]
    assert "part of iteration 7 from rank 0 fails its checksum" in receiver["error"]


@pytest.mark.parametrize("elsewhere", [False, True])
def test_parts_posted_together_stay_apart_when_one_is_streamed(seen, elsewhere):
    """A serving rank posts all its parts before it waits for any (it rolls back meanwhile):
    each transfer's messages go under a tag of their own, so a part asked for over the group
    ("stream it": the receiver is on another host) does not meet the next part's header."""
    sender, receiver = seen[
        _scenario("offer", "live", "posted", *(["elsewhere"] if elsewhere else []))
    ]
    assert sender["sent"] == [7, 7]
    assert receiver["pulled"] == [not elsewhere] * 2
    assert receiver["in_place"] == [not elsewhere] * 2
    assert receiver["restored_equal"] and "error" not in receiver
