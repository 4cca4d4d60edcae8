"""A survivor's kept model, DDP and optimizer are rebound to the new generation's process
groups: every reference to an old group is replaced by the group of the same role, or, if one
has no counterpart, nothing is changed and the caller builds the state again."""

from __future__ import annotations

import pytest

from jobs import ROOT

pytestmark = pytest.mark.timeout(180)


def _run(run_drivers, *args: str) -> dict:
    # A process of its own: torch.distributed and megatron-core's globals are per process.
    (out,) = run_drivers(ROOT / "tests" / "drivers" / "rebind_driver.py", [list(args)], 150)
    return out


def test_every_old_group_a_real_gpt_state_holds_is_swapped_for_the_new_one(run_drivers):
    out = _run(run_drivers)
    assert "_TENSOR_MODEL_PARALLEL_GROUP" in out["roles"] and "WORLD" in out["roles"]
    assert out["swapped"] > 10  # layers, DDP, its bucket groups, the optimizer
    assert out["reachable"] > 0 and out["stale"] == []
    assert out["layer_group_is_new"] and not out["layer_group_unchanged"]
    assert out["hooks"] > 0  # the gradient hooks are back
    # The build's collectives, recorded by group role: the optimizer's gathering of
    # parameter-group keys over every rank. DDP's parameter broadcast over the DP group is
    # performed at the first build only and left out of the record (a recovery's build and a
    # replay skip it: the restore overwrites every parameter).
    calls = [tuple(c) for c in out["build_calls"]]
    broadcast = ("broadcast", "_DATA_PARALLEL_GROUP_WITH_CP")
    assert ("all_gather_object", "WORLD") in calls and broadcast not in calls
    performed = [tuple(c) for c in out["performed"]]
    assert broadcast in performed and set(calls) <= set(performed)
    assert [tuple(c) for c in out["performed_in_recovery"]] == calls
    assert out["unreplayable"] is None and out["replayed"] == len(calls)


def test_roles_sharing_one_group_are_each_swapped_for_the_new_generations(run_drivers):
    # As a job has its groups by default: every role whose ranks are the same list shares one
    # group; in a world of one, that is the default group for every role.
    out = _run(run_drivers, "shared")
    assert out["roles"] == ["WORLD"] and out["distinct_groups"] == 1
    assert out["swapped"] > 10 and out["stale"] == []
    assert out["layer_group_is_new"] and not out["layer_group_unchanged"]
    assert out["unreplayable"] is None and out["replayed"] == len(out["build_calls"]) > 0


def test_a_group_with_no_role_refuses_the_rebind_and_changes_nothing(run_drivers):
    out = _run(run_drivers, "unknown")
    assert "stray_group" in out["refused"] and "swapped" not in out
    assert out["layer_group_unchanged"] and not out["layer_group_is_new"]
    assert any("stray_group" in path for path in out["stale"])
