"""What only a GPU can show: the CUDA snapshot path (copy stream, pinned buffers, events) off
the training stream's critical path, a transient reset of an NCCL job, and bf16 with
transformer-engine's layers protected for 50 iterations, equal to the unprotected run.

Skipped without a CUDA device; scripts/gpu_check.sh runs them on one. NCCL allows one rank per
GPU, so on a one-GPU machine the jobs are single-process (local snapshots only:
--deadpool-replicas 0; the ring replicas are exercised on CPU/gloo by the rest of the suite).
"""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch

from deadpool_megatron.checkpoint.layout import align
from deadpool_megatron.checkpoint.snapshot import Snapshotter
from deadpool_megatron.events import read_events
from jobs import ROOT, run_job

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

SINGLE = ["--config", str(ROOT / "configs" / "demo.yaml"), "--tensor-model-parallel-size", "1",
          "--pipeline-model-parallel-size", "1", "--deadpool-replicas", "0"]  # fmt: skip


def _views(tensors):
    spans, offset = [], 0
    for t in tensors:
        spans.append((offset, t.numel() * t.element_size(), t.dtype, t.shape))
        offset = align(offset + spans[-1][1])
    return offset, lambda flat: [flat[o : o + n].view(d).view(s) for o, n, d, s in spans]


def test_cuda_snapshot_is_copied_on_its_stream_into_pinned_memory_off_the_critical_path():
    tensors = [torch.randn(64 * 2**20, device="cuda") for _ in range(8)]  # 2 GiB of fp32
    nbytes, views = _views(tensors)
    snap = Snapshotter(lambda: tensors, views, nbytes, use_cuda=True)
    assert all(slot.buffer.is_pinned() for slot in snap.slots.slots)
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()

    started = time.perf_counter()
    snap.start(1, b"meta")
    enqueue_s = time.perf_counter() - started
    work = a @ a  # the training stream's next work, queued after the snapshot began
    done = torch.cuda.Event()
    done.record()
    while not done.query():
        pass
    copying_when_training_done = snap.copy_in_flight()

    started = time.perf_counter()
    snap.fence()  # the next optimizer step's pre-hook: a device-side wait, not a host stall
    fence_s = time.perf_counter() - started
    after_fence = torch.cuda.Event()
    after_fence.record()
    after_fence.synchronize()
    copy_done_before_the_step = not snap.copy_in_flight()

    snap.wait_committed(60)
    slot = snap.slots.committed()
    snap.close()
    del work
    print(json.dumps({"snapshot_enqueue_ms": enqueue_s * 1e3, "fence_host_ms": fence_s * 1e3}))
    assert slot is not None and slot.iteration == 1 and slot.verify() and not snap.errors
    assert torch.equal(views(slot.buffer)[5], tensors[5].cpu())
    assert copying_when_training_done, "the training stream waited for the snapshot copy"
    assert copy_done_before_the_step, "the fence did not order the next step after the copy"
    assert enqueue_s < 0.1 and fence_s < 0.01  # 2 GiB takes ~40+ ms over PCIe: not waited for


def _events(tmp_path):
    log = tmp_path / "events.jsonl"
    return read_events(str(log)) if log.exists() else []


def test_transient_error_in_a_single_process_nccl_job_resets_in_place_bitwise(tmp_path):
    args = [*SINGLE, "--train-iters", "12", "--deadpool"]
    baseline = run_job(tmp_path, 1, args, name="baseline")
    assert baseline.returncode == 0, baseline.failure()
    log = tmp_path / "events.jsonl"
    result = run_job(tmp_path, 1, [*args, "--deadpool-inject", "raise@0:6:backward",
                                   "--deadpool-event-log", str(log)])  # fmt: skip
    assert result.returncode == 0, result.failure()
    assert "backend nccl" in result.output
    assert result.losses == baseline.losses and result.digest == baseline.digest
    (done,) = [e for e in _events(tmp_path) if e["event"] == "recovery_done"]
    assert done["replaced"] == {}
    out = os.environ.get("DEADPOOL_GPU_RESULTS")
    if out:  # scripts/gpu_check.sh reports it
        with open(out, "a") as fh:
            fh.write(json.dumps({"transient_reset_s": done["total_s"]}) + "\n")


def test_bf16_transformer_engine_job_protected_for_50_iterations_equals_unprotected(tmp_path):
    pytest.importorskip("transformer_engine", reason="transformer-engine is not installed")
    args = [*SINGLE, "--train-iters", "50", "--bf16", "--transformer-impl", "transformer_engine"]
    plain = run_job(tmp_path, 1, args, name="plain")
    assert plain.returncode == 0, plain.failure()
    protected = run_job(tmp_path, 1, [*args, "--deadpool"], name="protected")
    assert protected.returncode == 0, protected.failure()
    assert "with the transformer_engine layer spec" in protected.output
    assert protected.losses == plain.losses and protected.digest == plain.digest


def test_a_pinned_snapshot_slot_reaches_its_ring_successor_whole():
    """A CUDA job's snapshot slots are pinned memory; between two ranks on one host the ring
    successor reads their parts with process_vm_readv (`--deadpool-transport tcp`). Whether the
    kernel reads pinned pages or refuses them (the transport then streams) is recorded; the
    replica must arrive whole either way."""
    from rings import tcp_ring

    from deadpool_megatron.checkpoint.buffers import allocate

    nbytes = 9 << 20  # three parts
    slot = allocate(nbytes, pin=True)
    assert slot.is_pinned()
    slot.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    sender, receiver = tcp_ring(2, pull=True)
    replica = torch.empty(nbytes, dtype=torch.uint8)
    parts = list(zip(slot.split(4 << 20), replica.split(4 << 20), strict=True))
    for src, dst in parts:
        receive = receiver.irecv(dst, 0)
        send = sender.isend(src, 1)
        done = threading.Thread(target=send.wait)
        done.start()
        receive.wait()
        done.join(30)
    assert torch.equal(replica, slot)
    refused = 0 in receiver._refused
    for t in (sender, receiver):
        t.close()
    out = os.environ.get("DEADPOOL_GPU_RESULTS")
    if out:  # scripts/gpu_check.sh reports it
        with open(out, "a") as fh:
            fh.write(json.dumps({"pinned_slot_read_across_processes": not refused}) + "\n")
