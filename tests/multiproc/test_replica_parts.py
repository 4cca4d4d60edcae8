"""Replicas that span several parts (`RingReplicator._exchange_payloads`): on real gloo edge
groups, each rank's shard a different size and none a whole number of parts, every replica
equals its predecessor's shard after every iteration (two replicas each: a part of each
predecessor's payload comes in with each part of this rank's going out)."""

from __future__ import annotations

import pytest

from jobs import ROOT

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(240)]

DRIVER = ROOT / "tests" / "drivers" / "replica_parts_driver.py"


def test_replicas_in_parts_equal_their_shards(tmp_path, run_drivers):
    world, replicas = 4, 2
    argvs = [[str(r), str(world), str(replicas), "4096", str(tmp_path / "store")]
             for r in range(world)]  # fmt: skip
    outs = run_drivers(DRIVER, argvs, timeout_s=200)
    for out in outs:
        preds = [str((out["rank"] - j) % world) for j in range(1, replicas + 1)]
        assert out["equal"] == {str(it): {p: True for p in preds} for it in (1, 2, 3)}
        assert out["rejected"] == 0 and out["errors"] == []
        assert out["received"] >= 3 * replicas
