"""A recovery's state transfer goes through the gloo group it is handed, never the default
group: in an NCCL job the default group cannot carry the host buffers a replica lives in."""

from __future__ import annotations

import pytest

from jobs import ROOT, run_drivers

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(180)]


@pytest.mark.parametrize("offer", [False, True])
def test_transfer_uses_the_explicit_host_group_when_the_default_moves_nothing(tmp_path, offer):
    """Offered (`--deadpool-transport tcp`), the receiver on this host reads both parts from
    the sender's memory; the header and the answer still go over the gloo group."""
    driver = ROOT / "tests" / "drivers" / "transfer_driver.py"
    store = tmp_path / "store"
    args = [[str(rank), str(store), *(["offer"] if offer else [])] for rank in range(2)]
    outs = run_drivers(driver, args, timeout_s=120)
    sender, receiver = outs
    assert sender["default_backend"] == "fake" and sender["group_backend"] == "gloo"
    assert sender["sent"] == [7, 7]
    assert receiver["replica_equal"] and receiver["params_equal"]
    assert receiver["iterations"] == [7, 7]
    assert receiver["pulled"] == [offer, offer]


@pytest.mark.parametrize("offer", [False, True])
def test_a_served_replica_whose_bytes_changed_since_its_commit_is_refused(tmp_path, offer):
    """The serving rank sends the digest its replica was committed with, not one taken now:
    bytes that went bad while held fail at the receiver, read or streamed."""
    driver = ROOT / "tests" / "drivers" / "transfer_driver.py"
    store = tmp_path / "store"
    args = [[str(rank), str(store), *(["offer"] if offer else []), "decayed"] for rank in range(2)]
    _, receiver = run_drivers(driver, args, timeout_s=120)
    assert "part of iteration 7 from rank 0 fails its checksum" in receiver["error"]
