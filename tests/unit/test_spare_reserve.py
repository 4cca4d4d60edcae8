"""An idle spare reserves the host memory of its future protection buffers (the largest rank's
footprint) and its first pipeline carves its slot pairs from it. Real buffers and pipelines;
the store is a dict and the clock a fake."""

from __future__ import annotations

import pytest
from test_reuse import NBYTES, OneTensor, Predecessor
from waiting import FakeClock

from deadpool_megatron.checkpoint.buffers import (
    ALIGN,
    HostArena,
    Reusable,
    SlotPair,
    arena_nbytes,
)
from deadpool_megatron.checkpoint.pipeline import ProtectionPipeline
from deadpool_megatron.control.messages import HostFootprint
from deadpool_megatron.process.reserve import SpareReserve


def _inside(tensor, arena: HostArena) -> bool:
    start = arena.buffer.data_ptr()
    return start <= tensor.data_ptr() < start + arena.buffer.numel()


def test_an_arena_hands_out_page_aligned_disjoint_buffers_while_it_lasts():
    arena = HostArena(3 * ALIGN, pin=False)
    a, b = arena.take(10, False), arena.take(ALIGN + 1, False)
    assert a.numel() == 10 and b.numel() == ALIGN + 1
    assert (b.data_ptr() - a.data_ptr()) == ALIGN and b.data_ptr() % 64 == 0
    assert arena.free == 0 and arena.take(1, False) is None
    assert HostArena(ALIGN, pin=False).take(8, True) is None  # pageable cannot stand for pinned
    assert arena_nbytes([10, ALIGN + 1]) == 3 * ALIGN


def test_a_pair_takes_its_slots_from_the_arena_else_allocates_them():
    arena = HostArena(arena_nbytes([100, 100]), pin=False)
    pair = SlotPair(100, arena=arena)
    assert all(_inside(s.buffer, arena) for s in pair.slots)
    other = SlotPair(100, arena=arena)  # nothing left
    assert not any(_inside(s.buffer, arena) for s in other.slots)


def test_a_pipeline_built_on_its_own_footprint_allocates_nothing_beyond_the_arena():
    def build(reuse=None):
        return ProtectionPipeline(OneTensor(), Predecessor(stop=True), successors=[],
                                  predecessors=[0], replica_nbytes={0: NBYTES}, use_cuda=False,
                                  reuse=reuse)  # fmt: skip

    first = build()
    footprint = first.footprint()
    first.abort(timeout=30)
    assert footprint == [NBYTES] * 4  # its snapshot's two slots, its replica's two
    arena = HostArena(arena_nbytes(footprint), pin=False)
    second = build(Reusable(arena=arena))
    try:
        assert arena.free == 0
        assert all(_inside(s.buffer, arena) for p in second.slot_pairs() for s in p.slots)
        second.after_step(1)
        second.snapshotter.wait_committed(30)
        assert second.committed_iteration() == 1
    finally:
        second.abort(timeout=30)


def _reserve(store: dict, clock: FakeClock, world: int = 3, available: int = 2**30, **kw):
    asked: list[int] = []

    def footprint(rank: int):
        asked.append(rank)
        return store.get(rank)

    return SpareReserve(footprint, world, 0.5, clock, lambda: available, **kw), asked


def test_the_reserve_waits_for_every_rank_then_takes_the_largest_once():
    store, clock = {0: HostFootprint((4096, 4096), False)}, FakeClock()
    reserve, asked = _reserve(store, clock)
    reserve.poll()
    assert asked == [0, 1] and reserve.arena is None and not reserve.settled
    reserve.poll()  # within the interval: no store reads
    assert asked == [0, 1]
    store[1] = HostFootprint((8192, 8192, 100, 100), False)
    store[2] = HostFootprint((4096,), False)
    clock.now = 0.6
    reserve.poll()
    assert asked == [0, 1, 1, 2]  # rank 0's is not read again
    assert reserve.settled and reserve.arena.buffer.numel() == 2 * 8192 + 2 * ALIGN
    clock.now = 5.0
    reserve.poll()
    assert asked == [0, 1, 1, 2]


@pytest.mark.parametrize(
    ("footprint", "kw", "why"),
    [
        (HostFootprint((2**20,), False), {"available": 2**20}, "more than half"),
        (HostFootprint((4096,), True), {"can_pin": lambda: False}, "pinned"),
    ],
)
def test_no_reserve_when_memory_is_short_or_pinned_memory_cannot_be_had(footprint, kw, why, caplog):
    reserve, _ = _reserve({0: footprint}, FakeClock(), world=1, **kw)
    reserve.poll()
    assert reserve.settled and reserve.arena is None and why in caplog.text


def test_the_footprint_record_survives_the_store():
    record = HostFootprint((1, 2, 3), True)
    assert HostFootprint.decode(record.encode()) == record
