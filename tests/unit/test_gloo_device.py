"""Every gloo group of a process shares one gloo device (`parallel.share_gloo_device`): a
device's event loop wakes every 10 ms, so one per group cost a process about a hundred
wake-ups a second per group."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from deadpool_megatron.megatron import parallel


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.fixture
def gloo_world(tmp_path, monkeypatch):
    # restore torch's own class after the test: the patch is process-wide
    monkeypatch.setattr(dist.distributed_c10d, "ProcessGroupGloo",
                        dist.distributed_c10d.ProcessGroupGloo)  # fmt: skip
    parallel.share_gloo_device()
    parallel.share_gloo_device()  # idempotent: not a subclass of the subclass
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)  # fmt: skip
    yield
    dist.destroy_process_group()


def test_groups_share_one_device_and_keep_their_own_worker_threads(gloo_world):
    base = dist.distributed_c10d.ProcessGroupGloo
    assert base.deadpool_shared_device and base.__base__ is torch.distributed.ProcessGroupGloo
    before = _threads()
    groups = [dist.new_group([0], backend="gloo") for _ in range(10)]
    # torch's own devices: a loop thread each, beside the group's two worker threads
    assert _threads() - before == 2 * len(groups)
    for i, group in enumerate(groups):
        t = torch.full((4,), float(i))
        dist.all_reduce(t, group=group)
        assert t.tolist() == [float(i)] * 4
    backend = groups[0]._get_backend(torch.device("cpu"))
    assert isinstance(backend, torch.distributed.ProcessGroupGloo)
