"""A survivor's data loaders serve its next pretrain() (loaders.KeptLoaders): the kept loader,
its sampler moved to where the new one starts, yields what a loader built there yields, with
the same worker processes; anything that differs, or a dead worker, gets the new loader.
Real torch DataLoaders with worker processes; the sampler is Megatron-LM's sequential one as
its data_samplers.py defines it (Megatron-LM is not installed for the unit tests)."""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from deadpool_megatron.megatron.loaders import KeptLoaders, reuse_key

pytestmark = pytest.mark.timeout(120)


class MegatronPretrainingSampler:
    """Megatron-LM's sampler (--dataloader-type single): from `consumed_samples` on, each
    data-parallel rank takes its micro-batch of every global slice."""

    def __init__(self, total_samples, consumed_samples, micro_batch_size, data_parallel_rank,
                 data_parallel_size, drop_last=True):  # fmt: skip
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self):
        return self.total_samples

    def __iter__(self):
        batch = []
        for idx in range(self.consumed_samples, self.total_samples):
            batch.append(idx)
            if len(batch) == self.micro_batch_times_data_parallel_size:
                start = self.data_parallel_rank * self.micro_batch_size
                yield batch[start : start + self.micro_batch_size]
                batch = []


class Numbered(Dataset):
    """Sample i is [i, pid of the process that read it]: the data and who fetched it."""

    def __init__(self, n: int, description: str = "numbered"):
        self.n = n
        self.unique_description_hash = description

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([i, os.getpid()])


def _loader(consumed: int, dp_rank: int = 0, workers: int = 2, description: str = "numbered"):
    sampler = MegatronPretrainingSampler(64, consumed, 2, dp_rank, 2)
    return DataLoader(Numbered(64, description), batch_sampler=sampler, num_workers=workers,
                      persistent_workers=workers > 0)  # fmt: skip


def _take(it, n: int) -> tuple[list[list[int]], set[int]]:
    batches = [next(it) for _ in range(n)]
    return [b[:, 0].tolist() for b in batches], {int(p) for b in batches for p in b[:, 1]}


def test_the_kept_loader_yields_what_a_new_one_would_with_the_same_workers():
    kept = KeptLoaders()
    with kept.building():
        first = kept.loader(_loader(0))
    it = iter(first)
    _, pids = _take(it, 5)  # and its workers have prefetched beyond
    # the next set-up rolls back to 12 samples consumed (the third global batch)
    with kept.building():
        again = kept.loader(_loader(12))
    assert again is first and kept.reused == 1
    got, pids_after = _take(iter(again), 4)
    expected, _ = _take(iter(_loader(12, workers=0)), 4)
    assert got == expected == [[12, 13], [16, 17], [20, 21], [24, 25]]
    assert pids_after <= pids  # no worker forked again


@pytest.mark.parametrize(
    "other", [{"dp_rank": 1}, {"workers": 1}, {"description": "another dataset"}]
)
def test_a_loader_for_another_place_or_dataset_is_built_and_the_old_one_let_go(other):
    kept = KeptLoaders()
    with kept.building():
        first = kept.loader(_loader(0))
    iter(first)
    with kept.building():
        fresh = _loader(4, **other)
        assert kept.loader(fresh) is fresh
    with kept.building():  # the first is no longer kept
        fresh = _loader(4)
        assert kept.loader(fresh) is fresh
    assert kept.reused == 0


def test_a_loader_whose_workers_are_gone_is_not_kept():
    # Shut down as torch does (a killed worker is not the case to test here: torch's SIGCHLD
    # handler raises in the main process then, the training process with it).
    kept = KeptLoaders()
    with kept.building():
        first = kept.loader(_loader(0))
    iter(first)
    first._iterator._shutdown_workers()
    assert not any(w.is_alive() for w in first._iterator._workers)
    with kept.building():
        fresh = _loader(8)
        assert kept.loader(fresh) is fresh


def test_a_set_up_cut_short_lets_nothing_go():
    kept = KeptLoaders()
    with kept.building():
        first = kept.loader(_loader(0))
    iter(first)
    with pytest.raises(RuntimeError), kept.building():
        raise RuntimeError("a peer died while the datasets were built")
    with kept.building():
        assert kept.loader(_loader(8)) is first


def test_without_persistent_workers_or_a_description_nothing_is_kept():
    assert reuse_key(_loader(0, workers=0)) is None
    plain = DataLoader(list(range(8)), batch_size=2, num_workers=1, persistent_workers=True)
    assert reuse_key(plain) is None
    assert reuse_key(_loader(0)) == reuse_key(_loader(40))
