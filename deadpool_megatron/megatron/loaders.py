"""A survivor's data loaders, kept from one pretrain() to the next.

A hot-swap runs Megatron-LM's pretrain() again in every surviving process, and pretrain()
builds its data loaders again: with `--num-workers` above 0 each loader's first iterator
forks its worker processes, which was most of the first resumed iteration's extra time
(seen 2026-12-05: 0.05 to 0.29 s per loader on a survivor, three loaders). A loader built
again for the same dataset and the same data-parallel place differs from the one the
survivor already has only in where its sampler starts; so the kept loader is handed back
with its sampler moved there, and its persistent workers start the new epoch (torch's own
reset: what they had prefetched past the rolled-back iteration is dropped). A claimed spare
has none to keep and builds its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch.utils.data import DataLoader

# The sampler whose place is all its `consumed_samples`: Megatron-LM's sequential one
# (--dataloader-type single, its default). The random one (cyclic) also sets its dataset's
# epoch in the main process only, which persistent workers never see: not kept.
SEQUENTIAL_SAMPLER = "MegatronPretrainingSampler"


def reuse_key(loader: DataLoader) -> tuple | None:
    """What must match for a kept loader to stand in for `loader`, or None where it never may:
    no persistent workers to keep, a dataset without Megatron's description hash, or a
    sampler other than the sequential one."""
    sampler = loader.batch_sampler
    dataset_id = getattr(loader.dataset, "unique_description_hash", None)
    if not (loader.persistent_workers and loader.num_workers > 0) or dataset_id is None:
        return None
    if type(sampler).__name__ != SEQUENTIAL_SAMPLER:
        return None
    fields = {k: v for k, v in vars(sampler).items() if k != "consumed_samples"}
    if not all(isinstance(v, (int, float, str, bool, type(None))) for v in fields.values()):
        return None
    return (dataset_id, type(sampler).__qualname__, tuple(sorted(fields.items())),
            loader.num_workers, loader.prefetch_factor, loader.pin_memory,
            loader.timeout)  # fmt: skip


def workers_alive(loader: DataLoader) -> bool:
    """Whether the loader's iterator exists and every worker process of it still runs."""
    iterator = getattr(loader, "_iterator", None)
    workers = getattr(iterator, "_workers", None)
    return bool(workers) and all(w.is_alive() for w in workers)


class KeptLoaders:
    """The loaders of this process's last pretrain(), handed back to the next one that asks
    for the same; the ones not asked for are let go (their workers end with them)."""

    def __init__(self) -> None:
        self._kept: dict[tuple, DataLoader] = {}
        self._built: dict[tuple, DataLoader] | None = None
        self.reused = 0

    @contextmanager
    def building(self) -> Iterator[None]:
        """One pretrain()'s loaders are built inside; a build cut short by a failure lets
        nothing go."""
        self._built = {}
        try:
            yield
        except BaseException:
            self._kept = {**self._kept, **self._built}
            raise
        else:
            self._kept = self._built
        finally:
            self._built = None

    def loader(self, fresh: DataLoader) -> DataLoader:
        """`fresh` (just built, no worker forked yet), or the kept loader that stands in for
        it, its sampler moved to where `fresh`'s starts."""
        key = reuse_key(fresh)
        if key is None or self._built is None or key in self._built:
            return fresh
        kept = self._kept.pop(key, None)
        if kept is None or not workers_alive(kept):
            self._built[key] = fresh
            return fresh
        kept.batch_sampler.consumed_samples = fresh.batch_sampler.consumed_samples
        self._built[key] = kept
        self.reused += 1
        return kept
