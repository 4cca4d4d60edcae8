"""Host buffers: atomic commit, ping-pong superseding, corrupt copies never replace."""

import threading

import pytest
import torch

from deadpool_megatron.checkpoint.buffers import CorruptCopy, SlotPair, checksum, checksums
from deadpool_megatron.checkpoint.pipeline import check_host_memory
from deadpool_megatron.errors import ConfigError


def _write(pair: SlotPair, value: int, iteration: int, digest=None):
    slot = pair.acquire_for_write()
    slot.buffer.fill_(value)
    pair.commit(slot, iteration, b"meta%d" % iteration, digest)
    return slot


def test_commit_keeps_the_newest_and_writes_go_to_the_other_slot():
    pair = SlotPair(32)
    assert pair.committed() is None
    a = _write(pair, 1, 1)
    b = _write(pair, 2, 2)
    assert a is not b and pair.committed() is b
    c = _write(pair, 3, 3)
    assert c is a and pair.committed().iteration == 3
    assert pair.committed().verify()


def test_checksum_covers_bytes_and_metadata():
    buf = torch.arange(64, dtype=torch.uint8)
    assert checksum(buf, b"x") == checksum(buf.clone(), b"x")
    assert checksum(buf, b"x") != checksum(buf, b"y")
    flipped = buf.clone()
    flipped[10] ^= 1
    assert checksum(flipped, b"x") != checksum(buf, b"x")


def test_checksum_covers_the_iteration_a_header_announces():
    buf = torch.arange(64, dtype=torch.uint8)
    assert checksum(buf, b"x", 7) != checksum(buf, b"x", 8)
    pair = SlotPair(64)
    slot = pair.acquire_for_write()
    slot.buffer.copy_(buf)
    with pytest.raises(CorruptCopy):  # the bytes of iteration 7, announced as iteration 8
        pair.commit(slot, 8, b"x", checksum(buf, b"x", 7))


def test_corrupt_copy_is_rejected_and_the_previous_commit_stays():
    pair = SlotPair(32)
    _write(pair, 7, 1)
    slot = pair.acquire_for_write()
    slot.buffer.fill_(8)
    expected = checksum(torch.full((32,), 9, dtype=torch.uint8), b"meta2")
    with pytest.raises(CorruptCopy, match="keeping iteration 1"):
        pair.commit(slot, 2, b"meta2", expected)
    kept = pair.committed()
    assert kept.iteration == 1 and bool((kept.buffer == 7).all()) and kept.verify()


def test_a_slot_held_by_a_sender_is_never_overwritten():
    pair = SlotPair(16)
    first = _write(pair, 1, 1)
    pair.hold(first)  # a sender reads iteration 1
    second = _write(pair, 2, 2)
    third = _write(pair, 3, 3)  # supersedes 2, never touches the held slot
    assert second is third and first.iteration == 1 and bool((first.buffer == 1).all())
    got = []
    waiter = threading.Thread(target=lambda: got.append(pair.acquire_for_write()))
    pair.hold(third)
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # both busy: the writer waits
    pair.release(first)
    waiter.join(2)
    assert got == [first]


def test_host_memory_check_names_the_figures():
    with pytest.raises(ConfigError, match=r"needs .* MiB of host memory per rank x 8 ranks"):
        check_host_memory(2**50, 8)
    check_host_memory(1024, 8)


def test_one_pass_gives_the_whole_and_the_replicated_part_their_own_checksums():
    buf = torch.arange(200, dtype=torch.int64).to(torch.uint8)
    for prefix in (0, 1, 73, 200):
        whole, part = checksums(buf, prefix, b"meta", 5)
        assert whole == checksum(buf, b"meta", 5)
        assert part == checksum(buf[:prefix], b"meta", 5)


def test_a_commit_records_the_checksum_its_sent_part_is_checked_against():
    pair = SlotPair(64, prefix_nbytes=40)
    slot = pair.acquire_for_write()
    slot.buffer.copy_(torch.arange(64, dtype=torch.uint8))
    pair.commit(slot, 3, b"m")
    assert slot.prefix_checksum == checksum(slot.buffer[:40], b"m", 3)
    assert slot.checksum == checksum(slot.buffer, b"m", 3) and slot.verify()
    with pytest.raises(ValueError, match="prefix_nbytes 65"):
        SlotPair(64, prefix_nbytes=65)
