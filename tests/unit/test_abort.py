"""Aborting communicators: every group of the backend is aborted through torch's API, one
failing group is logged and does not stop the others (the NCCL path runs the same function)."""

from __future__ import annotations

import logging

import pytest
import torch.distributed as dist

from deadpool_megatron.recovery.abort import abort_groups


@pytest.fixture
def gloo_world(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)  # fmt: skip
    yield
    dist.destroy_process_group()


def test_groups_of_the_backend_are_aborted_and_others_left(gloo_world):
    group = dist.new_group([0], backend="gloo")
    assert abort_groups([group], "nccl") == []  # not an NCCL group: untouched
    assert abort_groups([group], "gloo") == []


def test_a_group_that_cannot_be_aborted_is_logged_and_the_rest_still_aborted(gloo_world, caplog):
    gone, live = dist.new_group([0], backend="gloo"), dist.new_group([0], backend="gloo")
    dist.destroy_process_group(gone)
    with caplog.at_level(logging.ERROR, logger="deadpool.recovery"):
        errors = abort_groups([gone, live], "gloo")
    assert len(errors) == 1 and "not initialized" in errors[0], errors
    assert "could not abort gloo group" in caplog.text
