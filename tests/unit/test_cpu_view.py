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
