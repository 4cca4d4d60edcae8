"""A recovery's state transfer goes through the gloo group it is handed, never the default
group: in an NCCL job the default group cannot carry the host buffers a replica lives in."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from jobs import ROOT

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(180)]


def test_transfer_uses_the_explicit_host_group_when_the_default_moves_nothing(tmp_path):
    driver = ROOT / "tests" / "drivers" / "transfer_driver.py"
    store = tmp_path / "store"
    procs = [
        subprocess.Popen([sys.executable, str(driver), str(rank), str(store)], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in range(2)
    ]  # fmt: skip
    outs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err[-3000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            proc.kill()
    sender, receiver = outs
    assert sender["default_backend"] == "fake" and sender["group_backend"] == "gloo"
    assert sender["sent"] == [7, 7]
    assert receiver["replica_equal"] and receiver["params_equal"]
    assert receiver["iterations"] == [7, 7]
