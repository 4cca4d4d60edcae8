"""A real training job (pretrain_gpt.py's worker, with --deadpool) that also checks the
protection pipeline from inside, at chosen iterations:

--check-replicas            after every iteration, every replica must equal, byte for byte,
                            its ring predecessor's live optimizer shard of that iteration
--wipe-replica ITER:RANK    overwrite RANK's parameters, optimizer state, scheduler and RNG
                            with garbage after ITER, then rebuild it from its ring replica
                            (held by its DP successor) and a DP peer's parameters
--wipe-local ITER:RANK      the same, restored from RANK's own host snapshot
--corrupt ITER:RANK:SRC     flip bytes of the replica RANK receives from SRC for ITER: it must
                            be rejected and the replica of ITER-1 must stay

Run under deadpool-launch (--no-preflight); results go to --result as JSON (rank 0).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

import torch
import torch.distributed as dist

from deadpool_megatron.checkpoint.restore import (
    Expected,
    recv_part,
    restore_from_parts,
    restore_from_snapshot,
    sent,
    serve_parameters,
    serve_replica,
)
from deadpool_megatron.failure.progress import ProgressBoard
from deadpool_megatron.logging_setup import setup_logging
from deadpool_megatron.megatron import parallel
from deadpool_megatron.megatron.arguments import parse_job_args
from deadpool_megatron.megatron.model import build_train_state
from deadpool_megatron.megatron.training import Trainer
from deadpool_megatron.process.protection import build_pipeline
from deadpool_megatron.process.session import ProtectedLoop
from deadpool_megatron.process.worker import open_store
from deadpool_megatron.runtime import ProcessEnv
from deadpool_megatron.topology import Topology


def _pair(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(":"))


def live_optimizer_bytes(trainer) -> torch.Tensor:
    state = trainer.pipeline.state
    layout = state.layout
    flat = torch.zeros(layout.optimizer_nbytes, dtype=torch.uint8)
    for entry, t in zip(layout.entries, state.tensors()):
        if entry.offset >= layout.optimizer_nbytes:
            break
        flat[entry.offset : entry.offset + entry.nbytes] = t.detach().reshape(-1).view(torch.uint8)
    return flat


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


def wipe(trainer) -> None:
    """Garbage in every tensor and in the scheduler and RNG state of this rank."""
    gen = torch.Generator().manual_seed(4242)
    with torch.no_grad():
        for t in trainer.pipeline.state.tensors():
            t.copy_(torch.rand(t.shape, generator=gen).to(t.dtype) * 1e3)
    trainer.state.scheduler.num_steps = 10**6
    torch.manual_seed(999)


class Checks:
    def __init__(self, args, topo: Topology):
        self.args = args
        self.topo = topo
        self.rank = dist.get_rank()
        self.results = {"checked": [], "mismatches": [], "restored": [], "corrupt": []}
        self.restored_here: list = []
        self.live_hashes: dict[int, dict[int, str]] = {}

    def __call__(self, trainer) -> None:
        i = trainer.iteration
        pipeline = trainer.pipeline
        corrupted = {s for it, v, s in self.args.corrupt if it == i and v == self.rank}
        preds = pipeline.replicator.predecessors
        pipeline.wait_for_replicas(i, [s for s in preds if s not in corrupted])
        pipeline.wait_for_replicas(i - 1, [s for s in preds if s in corrupted])
        if self.args.check_replicas:
            self.check_replicas(trainer, i)
        for it, victim in self.args.wipe_replica:
            if it == i:
                self.restore_from_replica(trainer, victim)
        for it, victim in self.args.wipe_local:
            if it == i:
                self.restore_local(trainer, victim)
        for it, victim, src in self.args.corrupt:
            if it - 1 == i and self.rank == victim:
                pipeline.replicator.inject_corruption(src)
            if it == i:
                self.check_corrupt(trainer, victim, src, i)
        dist.barrier()

    def check_replicas(self, trainer, i: int) -> None:
        pipeline = trainer.pipeline
        mine = {
            "rank": self.rank,
            "live": sha(live_optimizer_bytes(trainer)),
            "replicas": {
                src: (slot.iteration, sha(slot.buffer), slot.verify())
                for src in pipeline.replicator.predecessors
                for slot in [pipeline.replicator.replica(src)]
            },
        }
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        self.live_hashes[i] = {e["rank"]: e["live"] for e in everyone}
        if self.rank != 0:
            return
        skip = {(victim, src) for it, victim, src in self.args.corrupt if it == i}
        for holder in everyone:
            for src, (iteration, digest, ok) in holder["replicas"].items():
                if (holder["rank"], src) in skip:
                    continue
                good = iteration == i and ok and digest == self.live_hashes[i][src]
                self.results["checked"].append([i, holder["rank"], src])
                if not good:
                    self.results["mismatches"].append([i, holder["rank"], src, iteration])

    def _coordinates(self, rank: int) -> tuple[int, int, int]:
        c = self.topo.coords(rank)
        return (c.tp, c.pp, c.dp)

    def restore_from_replica(self, trainer, victim: int) -> None:
        pipeline = trainer.pipeline
        successor = self.topo.ring_successors(victim, 1)[0]
        peer = self.topo.ring_predecessors(victim, 1)[0]
        layout = pipeline.state.layout
        if self.rank == victim:
            wipe(trainer)
            start = time.perf_counter()
            optimizer_part, meta, it_opt, _ = recv_part(layout.optimizer_nbytes, successor)
            params_part, _, it_params, _ = recv_part(layout.params_nbytes, peer)
            assert it_opt == it_params == trainer.iteration, (it_opt, it_params)
            expected = Expected(trainer.iteration, self._coordinates(victim))
            restored = restore_from_parts(
                pipeline.state, optimizer_part, meta, params_part, expected
            )
            trainer.attach(trainer.state, restored, pipeline)
            self.restored_here.append(
                ["replica", trainer.iteration, victim, time.perf_counter() - start]
            )
        if self.rank == successor:
            sent(serve_replica(pipeline.replicator.replicas, victim, victim))
        if self.rank == peer:
            sent(serve_parameters(pipeline.snapshotter.slots, layout.optimizer_nbytes, victim))
        self._share_restored()

    def restore_local(self, trainer, victim: int) -> None:
        if self.rank == victim:
            pipeline = trainer.pipeline
            pipeline.snapshotter.wait_committed()
            wipe(trainer)
            start = time.perf_counter()
            restored = restore_from_snapshot(
                pipeline.state,
                pipeline.snapshotter.slots.committed(),
                Expected(trainer.iteration, self._coordinates(victim)),
            )
            trainer.attach(trainer.state, restored, pipeline)
            self.restored_here.append(
                ["local", trainer.iteration, victim, time.perf_counter() - start]
            )
        self._share_restored()

    def check_corrupt(self, trainer, victim: int, src: int, i: int) -> None:
        record = None
        if self.rank == victim:
            replicator = trainer.pipeline.replicator
            deadline = time.monotonic() + 60
            while replicator.stats.rejected == 0 and time.monotonic() < deadline:
                time.sleep(0.005)
            slot = replicator.replica(src)
            record = {
                "rejected": replicator.stats.rejected,
                "kept_iteration": slot.iteration,
                "kept_verifies": slot.verify(),
                "kept_equals_live_of_previous": sha(slot.buffer)
                == self.live_hashes.get(i - 1, {}).get(src),
                "errors": list(replicator.errors),
            }
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, record)
        if self.rank == 0:
            self.results["corrupt"].append(everyone[victim])

    def _share_restored(self) -> None:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, self.restored_here)
        if self.rank == 0:
            self.results["restored"] = [r for rs in everyone for r in rs]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--result", required=True)
    parser.add_argument("--check-replicas", action="store_true")
    parser.add_argument("--wipe-replica", type=_pair, action="append", default=[])
    parser.add_argument("--wipe-local", type=_pair, action="append", default=[])
    parser.add_argument("--corrupt", type=_pair, action="append", default=[])
    args, job_args = parser.parse_known_args()
    env = ProcessEnv.from_environ()
    cfg = parse_job_args(job_args, env.world_size)
    setup_logging()
    store = open_store(env, cfg)
    on_gpu = parallel.init_distributed(cfg, env.rank, env.world_size, store)
    state = build_train_state(cfg, on_gpu)
    p = cfg.parallel
    checks = Checks(
        args, Topology(env.world_size, p.tensor_model_parallel_size, p.pipeline_model_parallel_size)
    )
    session = ProtectedLoop(ProgressBoard(), after_iteration=checks)
    trainer = Trainer(cfg, state, env.world_size, on_gpu, hooks=session,
                      pipeline=build_pipeline(cfg, state, env, on_gpu))  # fmt: skip
    session.bind(trainer)
    trainer.train()
    trainer.pipeline.close()
    trainer.finish()
    if env.rank == 0:
        checks.results["lag_max"] = trainer.pipeline.stats.lag_max
        checks.results["stall_s"] = list(trainer.pipeline.stats.stall_s)
        with open(args.result, "w") as fh:
            json.dump(checks.results, fh)
    parallel.destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
