"""The CPU view of torch.cuda that megatron-core and Megatron-LM's training code see on a
machine without a GPU: what it says a device is."""

from __future__ import annotations

from deadpool_megatron.megatron import cpu_backend


def test_the_cpu_view_describes_a_device_of_compute_capability_0():
    # Megatron-LM's argument checks ask for the architecture with tensor or context
    # parallel (get_device_arch_version); torch's own call asserts without CUDA.
    cuda = cpu_backend._build_cuda_view(claim_available=True)
    props = cuda.get_device_properties(0)
    assert (props.major, props.minor) == (0, 0) and cuda.get_device_capability() == (0, 0)
    assert props.total_memory > 2**30 and props.multi_processor_count >= 1
    assert cuda.is_available()


MOE_ROUTER = """
import torch
from deadpool_megatron.megatron import cpu_backend
cpu_backend.activate()
from megatron.core.transformer.moe import moe_utils
inp, weight = torch.randn(3, 8), torch.randn(4, 8)
logits = moe_utils.router_gating_linear(inp, weight, None, torch.float32)
assert torch.equal(logits, inp @ weight.t()), logits
print("router", tuple(logits.shape), moe_utils.te_general_gemm)
from megatron.core.transformer.moe import token_dispatcher
splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 5]), as_numpy=True)
kept = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 5]))
print("splits", type(splits).__name__, splits.tolist(), type(kept).__name__)
from megatron.core.distributed import param_and_grad_buffer as ddp
from megatron.core import timers
from megatron.core.tensor_parallel import mappings
from deadpool_megatron.megatron import gloo_ops
view = gloo_ops.distributed_view()
print("coalescing", ddp._coalescing_manager is gloo_ops.coalescing_manager,
      ddp.dist_reduce_scatter_func is view.reduce_scatter_tensor,
      ddp.dist_all_gather_func is view.all_gather_into_tensor,
      mappings.dist_reduce_scatter_func is view.reduce_scatter_tensor,
      timers.dist_all_gather_func is view.all_gather_into_tensor)
"""


def test_megatron_core_s_moe_and_ddp_modules_get_what_the_cpu_backend_gives():
    # core_v0.16.1 imports te_general_gemm only with transformer-engine, then reads it in the
    # router's gating (a NameError on CPU): the CPU backend gives the name, None
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", MOE_ROUTER], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "router (3, 4) None" in done.stdout
    # the alltoall dispatcher's split sizes as numpy, as from a GPU (torch's all_to_all_single
    # refuses tensors there)
    assert "splits ndarray [3, 5] Tensor" in done.stdout
    # DDP's bucket groups post their gradient reduce-scatter and parameter all-gather through
    # a coalescing manager whose wait a recovery can interrupt (tests/multiproc/test_gloo_abort),
    # and every collective a module bound at import is the interruptible view's
    assert "coalescing True True True True True" in done.stdout


SEQUENCE_PARALLEL_NORM = """
import torch
from deadpool_megatron.megatron import cpu_backend
cpu_backend.activate()
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import TransformerConfig
common = dict(num_layers=1, hidden_size=8, num_attention_heads=2, normalization="RMSNorm")
sp = TransformerConfig(tensor_model_parallel_size=2, sequence_parallel=True, **common)
plain = TransformerConfig(**common)
norm, other = WrappedTorchNorm(sp, 8), WrappedTorchNorm(plain, 8)
print("norm", type(norm).__name__, sp.sequence_parallel,
      [getattr(p, "sequence_parallel", None) for p in norm.parameters()],
      [getattr(p, "sequence_parallel", None) for p in other.parameters()])
"""


def test_torch_norms_under_sequence_parallelism_are_marked_as_a_gpu_s_norms():
    # core's WrappedTorchNorm asserts without sequence parallelism; under the CPU backend it
    # builds the norm and marks its weight, as apex's and transformer-engine's norms do, so
    # that megatron-core all-reduces its gradient across the tensor-parallel pair (unmarked,
    # the pair's copies of the weight would drift apart)
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", SEQUENCE_PARALLEL_NORM], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "norm RMSNorm True [True] [None]" in done.stdout


ENTRY_SCRIPT_CUDA = """
import torch
from deadpool_megatron.megatron import cpu_backend
cpu_backend.activate()
batch = torch.ones(2)
script = {"__name__": "__main__", "batch": batch}
exec("moved = batch.cuda(non_blocking=True)", script)  # core_v0.19's get_batch, in the script
print("script", script["moved"] is batch)
try:
    exec("batch.cuda()", {"__name__": "another_library", "batch": batch})
except (AssertionError, RuntimeError) as err:
    print("other", type(err).__name__)
"""


def test_the_entry_scripts_cuda_calls_stay_on_the_cpu_as_megatrons_do():
    # core_v0.19's pretrain_gpt.py moves each batch with Tensor.cuda() in its own get_batch
    # (core_v0.16.1 asked megatron.training's); any other caller still gets torch's own
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", ENTRY_SCRIPT_CUDA], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "script True" in done.stdout and "other AssertionError" in done.stdout
