"""The kernel, quantization and bfloat16 tests again with every CPU path forced down to AVX2,
so an AVX-512 machine checks what an AVX2-only CPU runs: torch's ATen kernels
(ATEN_CPU_CAPABILITY=avx2), oneDNN's (ONEDNN_MAX_CPU_ISA=AVX2: no VNNI, no AVX512-BW bfloat16)
and our C++ kernels' variant (SPLITSERVE_CPU_ISA=avx2). Each runs pytest in a fresh process,
since all three are read once at start-up. `make test` runs the quick subset, `make
test-slow` and `make test-avx2` the whole files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from splitserve.kernels import cpu as cpu_kernels
from splitserve.kernels.cpu import isa

FORCED_AVX2 = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    isa.ISA_ENV: "avx2",
    "TRITON_INTERPRET": "1",
}
# A few seconds each: every int4 variant and layout, int8's saturation-free products, the
# bfloat16 fallback, the fused decode loop's int4 weights.
QUICK = [
    "tests/test_isa_dispatch.py",
    "tests/test_int4_gemm.py",
    "tests/test_quantized_kernels.py::test_kernels_are_usable_on_this_machine",
    "tests/test_quantized_kernels.py::test_product_matches_its_float_reference",
    "tests/test_quantized_kernels.py::test_torchs_int4_kernel_on_weights_torch_packed_here",
    "tests/test_quantized_kernels.py::test_int8_products_are_exact_where_onednn_would_saturate",
    "tests/test_fused_decode.py::test_a_bfloat16_model_keeps_the_python_layers",
]
# What `make test-avx2` reruns (the files' fast tests; minutes).
FULL = [
    "tests/test_isa_dispatch.py",
    "tests/test_int4_gemm.py",
    "tests/test_quantized_kernels.py",
    "tests/test_quantization_quality.py",
    "tests/test_cpu_kernels.py",
    "tests/test_cpu_layer_ops.py",
    "tests/test_fused_decode.py",
    "tests/test_engine_tiny_models.py::test_bfloat16_first_step_logits_are_close_to_float32",
    "tests/test_kv_int8_engine.py::test_a_bfloat16_model_over_an_int8_cache",
]
_ROOT = Path(__file__).resolve().parent.parent


def _avx2_problem() -> str | None:
    features = isa.cpu_features()
    if not features.is_x86:
        return f"AVX2 is an x86-64 instruction set; this is {features.machine}"
    missing = features.missing(isa.KERNEL_ISAS["avx2"])
    return f"this CPU lacks {', '.join(missing)}" if missing else None


pytestmark = pytest.mark.skipif(_avx2_problem() is not None, reason=f"{_avx2_problem()}")


def _run(args: list[str], timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, **FORCED_AVX2}
    return subprocess.run(
        [sys.executable, *args], env=env, cwd=_ROOT, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def _pytest(tests: list[str], timeout: int) -> None:
    result = _run(
        ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", *tests], timeout
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


@pytest.mark.skipif(cpu_kernels.load() is None, reason=f"{cpu_kernels.unavailable_reason()}")
def test_every_path_is_forced_down_in_the_subprocess():
    # What the reruns below rely on: the three switches took effect, and the paths that differ
    # without AVX-512 are the ones taken (int8 products of many rows dequantize the weight: a
    # VNNI CPU capped to AVX2 saturates int8 x int8, an AVX2 CPU runs it in a slow loop).
    code = (
        "import torch\n"
        "from splitserve.kernels import cpu\n"
        "from splitserve.engine.model import linear, quantized_linear as q\n"
        "print(torch.backends.cpu.get_cpu_capability(), cpu.load().int4_isa(),\n"
        "      q.int8_by_int8_problem() is not None,\n"
        "      linear.onednn_bfloat16_problem() is not None, q.int4_layout())\n"
    )
    result = _run(["-c", code], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["AVX2", "avx2", "True", "True", "ours"], result.stdout


def test_kernel_and_quantization_tests_pass_forced_to_avx2():
    _pytest(QUICK, timeout=900)


@pytest.mark.slow  # the whole files again: minutes
def test_kernel_quantization_and_bfloat16_files_pass_forced_to_avx2():
    _pytest(FULL, timeout=3600)
