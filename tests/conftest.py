from pathlib import Path

import pytest
import torch

# The modules whose paths depend on the CPU's instruction sets (`-m isa`): CI runs them a second time with
# the capabilities lowered to AVX2 (`make test-avx2`), so an AVX-512 or AMX machine also checks what an
# AVX2-only CPU runs, and the suite cannot pass on one CPU class and fail on another.
ISA_SENSITIVE = {
    "kernels/test_cpu.py", "kernels/test_moe_experts.py", "kernels/test_skinny_linear.py",
    "model/test_w8a8.py", "model/test_quant.py", "model/test_packed.py", "model/test_moe.py",
    "model/test_model_dtype.py", "model/test_model_quant.py",
    "engine/test_kernels.py", "engine/test_kernels_bf16.py", "engine/test_attention.py", "engine/test_fused_ops.py",
    "engine/test_kernel_bounds.py", "engine/test_engine_bf16_vs_hf.py",
    "lora/test_lora_sgmv.py", "lora/test_lora_batching.py",
    "bench/test_bench_profile.py",
}
_TESTS = Path(__file__).parent


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.relative_to(_TESTS).as_posix() in ISA_SENSITIVE:
            item.add_marker(pytest.mark.isa)


@pytest.fixture
def torch_threads():
    """Set torch's intra-op threads for one test (a kernel's multi-thread split); restored after it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)
