"""megatron-core imported with torch.compile deferred (megatron/core_import.py)."""

from __future__ import annotations

import json
import subprocess
import sys

from deadpool_megatron.megatron.core_import import deferred
from jobs import ROOT


def test_a_deferred_function_is_compiled_once_at_its_first_call_with_its_options():
    compiled = []

    def compile_fn(fn, **options):
        compiled.append((fn.__name__, options))
        return lambda *a, **k: ("compiled", fn(*a, **k))

    stand_in = deferred(compile_fn)

    @stand_in
    def double(x):
        return 2 * x

    @stand_in(mode="max-autotune")
    def square(x):
        return x * x

    assert compiled == [] and double.__name__ == "double"  # nothing compiled at import
    assert double(3) == ("compiled", 6) and double(4) == ("compiled", 8)
    assert square(3) == ("compiled", 9)
    assert compiled == [("double", {}), ("square", {"mode": "max-autotune"})]


PROBE = """
import json, sys, torch
eager = torch.compile
from deadpool_megatron.megatron.core_import import import_megatron_core
import_megatron_core()
import megatron.core.jit, megatron.core.models.gpt, deadpool_megatron.process.worker
from megatron.core.fusions import fused_bias_gelu
import torch.distributed as dist
from deadpool_megatron.megatron import parallel
from deadpool_megatron.megatron.arguments import parse_job_args
from deadpool_megatron.megatron.model import build_train_state
cfg = parse_job_args(["--config", "configs/demo.yaml", "--tensor-model-parallel-size", "1",
                      "--pipeline-model-parallel-size", "1"], 1)
parallel.init_distributed(cfg, 0, 1, dist.HashStore())
build_train_state(cfg, on_gpu=False)  # the optimizer's construction imports Dynamo
parallel.destroy_distributed()
print(json.dumps({
    "compiler": "torch._inductor.compile_fx" in sys.modules,
    "restored": torch.compile is eager,
    "fuser_deferred": megatron.core.jit.jit_fuser is not eager,
    "fused_name": fused_bias_gelu.bias_gelu.__name__,
}), flush=True)
# End as our workers do, without the interpreter's teardown: torch's has aborted once in three
# suites here ("terminate called without an active exception", SIGABRT), which is not what this
# probe asks about.
import os
os._exit(0)
"""


def test_importing_megatron_core_and_building_a_model_leave_inductors_compiler_unimported():
    # A fresh interpreter: this one may have imported megatron-core already.
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=True)  # fmt: skip
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out == {"compiler": False, "restored": True, "fuser_deferred": True,
                   "fused_name": "bias_gelu"}  # fmt: skip
