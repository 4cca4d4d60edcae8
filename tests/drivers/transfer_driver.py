"""One of two processes whose default process group cannot carry host tensors, as in an NCCL
job: torch's "fake" backend stands in for NCCL (it completes every operation and moves no
bytes). Rank 0 serves a committed replica and the parameter part of a committed snapshot to
rank 1 through `parallel.host_group()`, exactly as a recovery's restore stage does; rank 1
prints what arrived as JSON. Were the transfer on the default group, nothing would arrive.
With "offer", rank 0 offers both parts to be read from its memory (restore.post_part); with
"decayed", a byte of its committed replica changes after the commit (memory gone bad while
it was held), and only the replica is sent: rank 1 prints the error it raised. With "live",
rank 1 receives both parts as a rank being restored does (restore.receive_into) into the
tensors of a small state with padding between them, then restores from them; with "stale"
it expects iteration 8, not the 7 sent, and must write nothing into its tensors. With
"posted", rank 0 posts both parts before it finishes either (as a recovery's serving rank
does, each under its own tag); with "elsewhere", rank 1 takes itself for another host's
process, so every offered part is answered "stream it".

Several scenarios run one after the other in the same two processes (each in process groups
of its own), which saves each its interpreter and imports: SCENARIO is its flags joined by
"+" ("plain" for none). Prints one JSON object: scenario -> what rank RANK saw.

usage: transfer_driver.py RANK STORE_FILE SCENARIO [SCENARIO ...]
    flags: offer decayed live stale posted elsewhere
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch
import torch.distributed as dist
import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")

from deadpool_megatron.checkpoint import metadata, restore
from deadpool_megatron.checkpoint.buffers import SlotPair
from deadpool_megatron.checkpoint.layout import Entry, StateLayout, view_of
from deadpool_megatron.checkpoint.restore import (
    Expected,
    receive_into,
    recv_part,
    restore_from_parts,
    sent,
    serve_parameters,
    serve_replica,
)
from deadpool_megatron.errors import DeadpoolError
from deadpool_megatron.megatron import parallel

OPTIMIZER_NBYTES, PARAMS_NBYTES, ITERATION = 4096 + 64, 1024 * 1024, 7
COORDINATES = (0, 0, 1)
REPLICA_META = metadata.encode({"iteration": ITERATION, "coordinates": COORDINATES})


class PaddedState:
    """A ProtectedState whose layout has padding between tensors and after the last one,
    as a megatron rank's has (entries aligned to 64 bytes), of the two part sizes above."""

    def __init__(self):
        entries = (
            Entry("main", 0, 4000, torch.float32, (1000,)),
            Entry("exp_avg", 4032, 32, torch.float32, (8,)),
            Entry("step", 4096, 64, torch.int64, (8,)),
            Entry("weight", 4160, 524288, torch.float32, (512, 256)),
            Entry("bias", 528448, 524224, torch.float32, (131056,)),
        )
        self.layout = StateLayout(entries, OPTIMIZER_NBYTES, OPTIMIZER_NBYTES + PARAMS_NBYTES)
        self.live = [torch.zeros(e.shape, dtype=e.dtype) for e in entries]
        self.applied: list[dict] = []

    def tensors(self):
        return self.live

    def restore_metadata(self, meta):
        self.applied.append(meta)

    def write_from(self, flat):
        for entry, t in zip(self.layout.entries, self.live, strict=True):
            t.copy_(view_of(flat, entry))

    def as_bytes(self) -> torch.Tensor:
        """The live tensors laid out as a snapshot holds them (padding zero)."""
        flat = torch.zeros(self.layout.total_nbytes, dtype=torch.uint8)
        for entry, t in zip(self.layout.entries, self.live, strict=True):
            flat[entry.offset : entry.offset + entry.nbytes] = t.reshape(-1).view(torch.uint8)
        return flat


def committed(nbytes: int, seed: int, meta: bytes) -> SlotPair:
    pair = SlotPair(nbytes)
    slot = pair.acquire_for_write()
    slot.buffer.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                                    generator=torch.Generator().manual_seed(seed)))  # fmt: skip
    pair.commit(slot, ITERATION, meta)
    return pair


FLAGS = ("offer", "decayed", "live", "stale", "posted", "elsewhere")


def main(rank: int, store_file: str, scenarios: list[str]) -> None:
    store = dist.FileStore(store_file, 2)
    host = restore.HOST
    outs = {}
    for i, scenario in enumerate(scenarios):
        flags = set() if scenario == "plain" else set(scenario.split("+"))
        unknown = flags - set(FLAGS)
        if unknown:
            raise SystemExit(f"unknown flag(s) {sorted(unknown)} in {scenario!r}: {FLAGS}")
        restore.HOST = -1 if "elsewhere" in flags and rank == 1 else host  # another host's
        dist.init_process_group(
            "fake", store=dist.PrefixStore(f"scenario{i}", store), rank=rank, world_size=2
        )
        outs[scenario] = run(rank, flags)
        dist.destroy_process_group()
    print(json.dumps(outs), flush=True)


def run(rank: int, flags: set[str]) -> dict:
    offer, decayed, live, stale = (f in flags for f in ("offer", "decayed", "live", "stale"))
    posted = "posted" in flags
    group = parallel.host_group()
    out = {"default_backend": dist.get_backend(), "group_backend": dist.get_backend(group)}
    replica = committed(OPTIMIZER_NBYTES, 1, REPLICA_META)
    snapshot = committed(OPTIMIZER_NBYTES + PARAMS_NBYTES, 2, b"")
    if live and rank == 1:
        out.update(receive_live(replica, snapshot, group, stale, decayed, posted))
    elif posted and rank == 0:
        first = serve_replica({0: replica}, 0, 1, group, ITERATION, offer, tag=1)
        second = serve_parameters(snapshot, OPTIMIZER_NBYTES, 1, group, ITERATION, offer, tag=2)
        for _, serving in (first, second):
            serving.finish()
        out["sent"] = [first[0], second[0]]
    elif decayed:
        if rank == 0:
            replica.committed().buffer[100] ^= 0x01
            sent(serve_replica({0: replica}, 0, 1, group, ITERATION, offer))
        else:
            try:
                recv_part(OPTIMIZER_NBYTES, 0, group)
            except DeadpoolError as err:
                out["error"] = str(err)
    elif rank == 0:
        out["sent"] = [
            sent(serve_replica({0: replica}, 0, 1, group, ITERATION, offer)),
            sent(serve_parameters(snapshot, OPTIMIZER_NBYTES, 1, group, ITERATION, offer)),
        ]
    else:
        data, meta, iteration, pulled = recv_part(OPTIMIZER_NBYTES, 0, group)
        params, _, params_iteration, params_pulled = recv_part(PARAMS_NBYTES, 0, group)
        out["pulled"] = [pulled, params_pulled]
        expected = replica.committed()
        out["replica_equal"] = bool(torch.equal(data, expected.buffer)) and meta == expected.meta
        out["params_equal"] = bool(
            torch.equal(params, snapshot.committed().buffer[OPTIMIZER_NBYTES:])
        )
        out["iterations"] = [iteration, params_iteration]
        out["sha"] = hashlib.sha256(params.numpy().tobytes()).hexdigest()
    dist.barrier(group=group)
    return out


def receive_live(
    replica: SlotPair, snapshot: SlotPair, group, stale: bool, decayed: bool, posted: bool
) -> dict:
    """Rank 1 as a rank being restored: both parts into its live tensors, then the restore."""
    state = PaddedState()
    expected = Expected(ITERATION + 1 if stale else ITERATION, COORDINATES)
    tags = (1, 2) if posted else (0, 0)
    out: dict = {}
    try:
        opt = receive_into(state, "replica", OPTIMIZER_NBYTES, 0, group, expected, tags[0])
        if decayed:
            return out
        params = receive_into(state, "parameters", PARAMS_NBYTES, 0, group, expected, tags[1])
    except DeadpoolError as err:
        out["error"] = str(err)
        return out
    out["pulled"] = [opt.pulled, params.pulled]
    out["in_place"] = [opt.data is None, params.data is None]
    out["untouched"] = all(not t.any() for t in state.live)
    try:
        restore_from_parts(state, opt.data, opt.meta, params.data, expected)
    except DeadpoolError as err:
        out["error"] = str(err)
    sent = torch.cat([replica.committed().buffer, snapshot.committed().buffer[OPTIMIZER_NBYTES:]])
    mine = state.as_bytes()
    out["restored_equal"] = all(
        torch.equal(mine[e.offset : e.offset + e.nbytes], sent[e.offset : e.offset + e.nbytes])
        for e in state.layout.entries
    )
    out["applied"] = [m["iteration"] for m in state.applied]
    return out


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3:])
