"""kernels/cpu/int4_gemm.cpp (int8 activations x 4-bit codes, VNNI) against the dequantized
weight's product in float64, and its place in shared/model/quantized_linear.py.

The kernel rounds each activation to int8 against its group of 32's largest magnitude, so an
activation moves by at most d = amax / 254 (half a step): each output's error is bounded by
sum_k |w_k| * d_group(k). The tests check that bound element by element (the justification of
the tolerance), and that the typical error is far inside it (under 1% of the largest output).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from splitserve.engine.model.quantized_linear import (
    GROUP_SIZE,
    INT4_VNNI_FROM_ROWS,
    Int4Weight,
    int4_from_codes,
    int4_vnni_problem,
    quantize_int4,
    quantized_matmul,
)
from splitserve.kernels import cpu as cpu_kernels

# (out, in) -> rows: SmolLM2's four products (a float64 reference of 300 rows of them would
# take seconds), and odd ones (in not a multiple of 64 or 32, out not a multiple of 16) at up
# to 300 rows (tails of the kernel's 4-row tiles, several threads' shares).
SHAPES = {
    (960, 576): (1, 5, 64),
    (576, 576): (2, 17),
    (3072, 576): (3, 8),
    (576, 1536): (1, 33),
    (200, 96): (1, 2, 3, 5, 8, 17, 64, 300),
    (7, 50): (1, 3, 300),
    (100, 72): (4, 9, 130),
}

pytestmark = pytest.mark.skipif(
    int4_vnni_problem() is not None, reason=f"int4_gemm not usable: {int4_vnni_problem()}"
)


def _random(*shape: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator) + 0.1  # never zeros, and not centred


def _kernel(x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    module = cpu_kernels.load()
    return module.int4_gemm(x, weight.packed, weight.scales_zeros, weight.out_features)


def _check_product(x: torch.Tensor, weight: Int4Weight) -> None:
    out_features, in_features = weight.out_features, weight.in_features
    dense = weight.dequantize(torch.float32)[:out_features, :in_features].double()
    got = _kernel(x, weight).double()
    want = x.double() @ dense.t()
    # Half an int8 step of each activation's group, times |w|, summed: the rounding's bound.
    padded = torch.nn.functional.pad(x.double(), (0, (-in_features) % GROUP_SIZE))
    group_max = padded.abs().view(x.shape[0], -1, GROUP_SIZE).amax(dim=-1)
    half_step = (group_max / 254).repeat_interleave(GROUP_SIZE, dim=1)[:, :in_features]
    bound = half_step @ dense.abs().t()
    slack = 1e-5 * (x.double().abs() @ dense.abs().t())  # float32 sums of the scaled groups
    assert got.shape == want.shape
    assert ((got - want).abs() <= bound + slack).all(), (got - want).abs().max().item()
    relative = ((got - want).abs().max() / want.abs().max()).item()
    assert relative < 0.01, relative


@pytest.mark.parametrize(("out_features", "in_features"), list(SHAPES))
def test_kernel_matches_the_dequantized_product(out_features, in_features):
    weight = quantize_int4(_random(out_features, in_features, seed=out_features) * 0.05)
    for rows in SHAPES[out_features, in_features]:
        _check_product(_random(rows, in_features, seed=rows), weight)


def _gguf_weight(out_features: int, in_features: int, form: str) -> Int4Weight:
    """A GGUF block weight as the loader packs it: Q4_0 is d * (q - 8), Q4_1 d * q + m."""
    generator = torch.Generator().manual_seed(7)
    codes = torch.randint(0, 16, (out_features, in_features), generator=generator)
    groups = in_features // GROUP_SIZE
    scale = torch.rand(out_features, groups, generator=generator) * 0.02 + 0.001
    if form == "q4_0":
        minimum = -8 * scale
    else:
        minimum = torch.randn(out_features, groups, generator=generator) * 0.1
    return int4_from_codes(codes.to(torch.uint8), scale, minimum, in_features)


@pytest.mark.parametrize("form", ["q4_0", "q4_1"])
def test_kernel_reads_gguf_q4_blocks(form):
    weight = _gguf_weight(200, 576, form)
    for rows in (1, 4, 33):
        _check_product(_random(rows, 576, seed=rows), weight)


def test_quantized_matmul_takes_the_kernel_from_its_row_count_in_the_callers_dtype():
    weight = quantize_int4(_random(130, 96, seed=3))
    x = _random(INT4_VNNI_FROM_ROWS, 96, seed=4)
    assert torch.equal(quantized_matmul(x, weight), _kernel(x, weight))
    got = quantized_matmul(x.to(torch.bfloat16), weight)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, _kernel(x.to(torch.bfloat16).float(), weight).to(torch.bfloat16))
    # Fewer rows: torch's kernel on bfloat16 activations.
    few = x[: INT4_VNNI_FROM_ROWS - 1]
    torchs = weight.kernel(few.to(torch.bfloat16))[:, :130].float()
    assert torch.equal(quantized_matmul(few, weight), torchs)


def test_the_fused_decode_loop_switches_at_the_same_row_count():
    assert cpu_kernels.load().INT4_VNNI_FROM_ROWS == INT4_VNNI_FROM_ROWS


def test_bad_inputs_are_refused():
    weight = quantize_int4(_random(64, 64, seed=5))
    with pytest.raises(RuntimeError, match="float32"):
        _kernel(_random(2, 64, seed=6).double(), weight)
    with pytest.raises(RuntimeError, match="columns"):
        _kernel(_random(2, 96, seed=6), weight)


@pytest.mark.slow  # a fresh Python process: ~5 s
def test_without_the_cpu_kernels_int4_keeps_torchs_path():
    # A fresh process: load() and the usability check are cached per process.
    code = (
        "import torch\n"
        "from splitserve.engine.model.quantized_linear import int4_vnni_problem, quantize_int4, "
        "quantized_matmul\n"
        "assert 'not built' in int4_vnni_problem()\n"
        "w = quantize_int4(torch.randn(64, 64) + 0.1)\n"
        "x = torch.randn(3, 64) + 0.1\n"
        "want = x @ w.dequantize(torch.float32).t()\n"
        "err = (quantized_matmul(x, w) - want).abs().max() / want.abs().max()\n"
        "assert err < 0.01, err\n"
    )
    env = {**os.environ, "SPLITSERVE_CPU_KERNELS": "0"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
