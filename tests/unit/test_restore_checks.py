"""A restore checks what the plan names (iteration, coordinates) against the metadata that
came with the state, and writes nothing into the live tensors when they differ."""

from __future__ import annotations

import pytest
import torch

from deadpool_megatron.checkpoint import metadata
from deadpool_megatron.checkpoint.buffers import SlotPair
from deadpool_megatron.checkpoint.layout import Entry, StateLayout, view_of
from deadpool_megatron.checkpoint.restore import (
    Expected,
    live_segments,
    restore_from_parts,
    restore_from_snapshot,
)
from deadpool_megatron.errors import DeadpoolError


class OneTensorState:
    """A ProtectedState of one fp32 tensor: 16 bytes of optimizer shard, 16 of parameters."""

    def __init__(self):
        entries = (
            Entry("opt", 0, 16, torch.float32, (4,)),
            Entry("param", 64, 16, torch.float32, (4,)),
        )
        self.layout = StateLayout(entries, 64, 128)
        self.live = [torch.zeros(4), torch.zeros(4)]
        self.applied: list[dict] = []

    def tensors(self):
        return self.live

    def capture_metadata(self, iteration, extra):
        return metadata.encode({"iteration": iteration, **extra})

    def restore_metadata(self, meta):
        self.applied.append(meta)

    def write_from(self, flat):
        for entry, t in zip(self.layout.entries, self.live):
            t.copy_(view_of(flat, entry))


def _snapshot(state, iteration, coordinates):
    pair = SlotPair(state.layout.total_nbytes)
    slot = pair.acquire_for_write()
    slot.buffer.view(torch.float32).fill_(float(iteration))
    pair.commit(slot, iteration, state.capture_metadata(iteration, {"coordinates": coordinates}))
    return pair.committed()


def test_a_snapshot_of_the_planned_iteration_and_coordinates_is_restored():
    state = OneTensorState()
    slot = _snapshot(state, 6, (0, 1, 0))
    assert restore_from_snapshot(state, slot, Expected(6, (0, 1, 0))) == 6
    assert state.live[1].tolist() == [6.0] * 4 and state.applied[0]["coordinates"] == (0, 1, 0)


@pytest.mark.parametrize(
    "expected, message",
    [(Expected(7, (0, 1, 0)), "holds iteration 6, the plan needs 7"),
     (Expected(6, (0, 1, 1)), r"coordinates \(tp, pp, dp\) \(0, 1, 0\), the rank restored holds \(0, 1, 1\)")],
)  # fmt: skip
def test_a_replica_for_other_coordinates_or_iteration_is_refused_before_any_write(
    expected, message
):
    state = OneTensorState()
    slot = _snapshot(state, 6, (0, 1, 0))
    opt, params = slot.buffer[:64], slot.buffer[64:]
    with pytest.raises(DeadpoolError, match=message):
        restore_from_parts(state, opt, slot.meta, params, expected)
    with pytest.raises(DeadpoolError, match=message.replace("replica", "local snapshot")):
        restore_from_snapshot(state, slot, expected)
    assert state.live[0].tolist() == [0.0] * 4 and state.applied == []


def test_live_segments_are_byte_views_of_each_part_at_their_offsets_in_it():
    state = OneTensorState()
    (opt_at, opt), (param_at, param) = (
        live_segments(state, "replica")[0],
        live_segments(state, "parameters")[0],
    )
    assert (opt_at, opt.numel(), param_at, param.numel()) == (0, 16, 0, 16)
    param.fill_(1)  # a view: writes land in the live tensor
    assert state.live[1].view(torch.uint8).tolist() == [1] * 16


def test_parts_restore_through_a_flat_buffer_where_a_tensor_has_no_byte_view():
    """A live tensor that is not contiguous cannot be written byte for byte: the parts go
    through the state's own whole-buffer copy, with the same result."""
    state = OneTensorState()
    state.live[1] = torch.zeros(4, 2)[:, 0]  # four floats, not contiguous
    assert live_segments(state, "parameters") is None
    slot = _snapshot(state, 6, (0, 1, 0))
    restore_from_parts(state, slot.buffer[:64], slot.meta, slot.buffer[64:], Expected(6, (0, 1, 0)))
    assert state.live[1].tolist() == [6.0] * 4 and state.applied[0]["iteration"] == 6


def test_a_part_read_in_place_is_not_written_again():
    """None for a part: it was read into the live tensors (restore.receive_into); only the
    other part and the metadata are written."""
    state = OneTensorState()
    slot = _snapshot(state, 6, (0, 1, 0))
    state.live[0].fill_(3.0)  # "read in place"
    restore_from_parts(state, None, slot.meta, slot.buffer[64:], Expected(6, (0, 1, 0)))
    assert state.live[0].tolist() == [3.0] * 4 and state.live[1].tolist() == [6.0] * 4
