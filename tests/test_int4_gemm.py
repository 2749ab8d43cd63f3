"""kernels/cpu/int4_gemm.cpp (int8 activations x 4-bit codes in our own layout, int4_gemm.h)
against the dequantized weight's product in float64, in every variant this CPU runs
(AVX-512 VNNI, AVX2, generic: each selected in turn), and its place in
shared/model/quantized_linear.py.

The kernel rounds each activation to int8 against its group of 32's largest magnitude, so in one
pass an activation moves by at most d = amax / 254 (half a step); in two passes (fewer than
INT4_ONE_PASS_FROM_ROWS rows, where the caller's decode_passes says 2) the second quantizes what
the first rounded away, so at most amax / 254^2. Each output's error is bounded by sum_k |w_k| *
that: the tests check the bound element by element (the justification of the tolerance), that
the typical error is far inside it, and that all variants give the same bits (the same integers,
the same float steps).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from splitserve.engine.model.quantized_linear import (
    GROUP_SIZE,
    INT4_ONE_PASS_FROM_ROWS,
    Int4Weight,
    int4_groups,
    int4_kernel_problem,
    pack_int4_tiles,
    quantize_int4,
    quantized_matmul,
)
from splitserve.kernels import cpu as cpu_kernels

# (out, in) -> rows: SmolLM2's four products (a float64 reference of 300 rows of them would
# take seconds), and odd ones (in not a multiple of 64 or 32, out not a multiple of 16) at up
# to 300 rows (tails of the kernel's row tiles, several threads' shares, both pass modes).
SHAPES = {
    (960, 576): (1, 5, 64),
    (576, 576): (2, 17),
    (3072, 576): (3, 8),
    (576, 1536): (1, 33),
    (200, 96): (1, 2, 3, 5, 8, 15, 16, 17, 64, 300),
    (7, 50): (1, 3, 300),
    (100, 72): (4, 9, 130),
}

pytestmark = pytest.mark.skipif(
    int4_kernel_problem() is not None, reason=f"int4_gemm not usable: {int4_kernel_problem()}"
)


def _variants() -> list[str]:
    """The chosen variant and those below it (all this CPU runs, unless SPLITSERVE_CPU_ISA
    forced a lower one: tests/test_forced_avx2.py)."""
    module = cpu_kernels.load()
    if module is None:
        return []
    names = module.int4_isas()
    return names[names.index(module.int4_isa()) :]


@pytest.fixture(params=_variants())
def variant(request):
    """Runs the test with int4_gemm's `request.param` variant selected, then restores it."""
    module = cpu_kernels.load()
    chosen = module.int4_isa()
    module.select_int4_isa(request.param)
    yield request.param
    module.select_int4_isa(chosen)


def _random(*shape: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator) + 0.1  # never zeros, and not centred


def _kernel(x: torch.Tensor, weight: Int4Weight, passes: int = 2) -> torch.Tensor:
    module = cpu_kernels.load()
    return module.int4_gemm(
        x, weight.packed, weight.scales_minimums, weight.out_features, decode_passes=passes
    )


def _check_product(x: torch.Tensor, weight: Int4Weight, passes: int) -> None:
    out_features, in_features = weight.out_features, weight.in_features
    dense = weight.dequantize(torch.float32)[:out_features, :in_features].double()
    got = _kernel(x, weight, passes).double()
    want = x.double() @ dense.t()
    # Half an int8 step of each activation's group (of the second pass's, with two), times
    # |w|, summed: the rounding's bound.
    two_passes = x.shape[0] < INT4_ONE_PASS_FROM_ROWS and passes == 2
    steps = 254.0**2 if two_passes else 254.0
    padded = torch.nn.functional.pad(x.double(), (0, (-in_features) % GROUP_SIZE))
    group_max = padded.abs().view(x.shape[0], -1, GROUP_SIZE).amax(dim=-1)
    half_step = (group_max / steps).repeat_interleave(GROUP_SIZE, dim=1)[:, :in_features]
    bound = half_step @ dense.abs().t()
    slack = 1e-5 * (x.double().abs() @ dense.abs().t())  # float32 sums of the scaled groups
    assert got.shape == want.shape
    assert ((got - want).abs() <= bound + slack).all(), (got - want).abs().max().item()
    relative = ((got - want).abs().max() / want.abs().max()).item()
    assert relative < (0.01 if steps == 254.0 else 1e-4), relative


@pytest.mark.parametrize(("out_features", "in_features"), list(SHAPES))
def test_kernel_matches_the_dequantized_product(variant, out_features, in_features):
    weight = quantize_int4(_random(out_features, in_features, seed=out_features) * 0.05)
    for rows in SHAPES[out_features, in_features]:
        for passes in (1, 2):
            _check_product(_random(rows, in_features, seed=rows), weight, passes)


def test_every_variant_gives_the_same_bits():
    module = cpu_kernels.load()
    chosen, names = module.int4_isa(), _variants()
    weight = quantize_int4(_random(200, 96, seed=9))
    try:
        # Rows and passes of both AVX2 loops: a tile's 16 outputs at once (up to two
        # activation rows) and half a tile at a time (more).
        cases = [(r, p) for r in (1, 2, 3, INT4_ONE_PASS_FROM_ROWS, 70) for p in (1, 2)]
        for rows, passes in cases:
            x = _random(rows, 96, seed=rows + 10)
            results = {}
            for name in names:
                module.select_int4_isa(name)
                results[name] = _kernel(x, weight, passes)
            first = results.pop("generic")
            for name, got in results.items():
                assert torch.equal(got, first), (name, rows, passes)
    finally:
        module.select_int4_isa(chosen)


def _gguf_weight(out_features: int, in_features: int, form: str) -> Int4Weight:
    """A GGUF block weight as the loader packs it: Q4_0 is d * (q - 8), Q4_1 d * q + m, with d
    and m float16 in the file."""
    generator = torch.Generator().manual_seed(7)
    codes = torch.randint(0, 16, (out_features, in_features), generator=generator)
    groups = in_features // GROUP_SIZE
    scale = (torch.rand(out_features, groups, generator=generator) * 0.02 + 0.001).half()
    if form == "q4_0":
        minimum = -8 * scale
    else:
        minimum = (torch.randn(out_features, groups, generator=generator) * 0.1).half()
    return pack_int4_tiles(codes.to(torch.uint8), scale.float(), minimum.float(), in_features)


@pytest.mark.parametrize("form", ["q4_0", "q4_1"])
def test_kernel_reads_gguf_q4_blocks(variant, form):
    weight = _gguf_weight(200, 576, form)
    for rows in (1, 4, 33):
        for passes in (1, 2):
            _check_product(_random(rows, 576, seed=rows), weight, passes)


def test_the_layout_reads_back_its_codes_and_float16_numbers():
    generator = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 16, (50, 96), generator=generator).to(torch.uint8)
    scale = torch.rand(50, 3, generator=generator).half().float()
    minimum = torch.randn(50, 3, generator=generator).half().float()
    weight = pack_int4_tiles(codes, scale, minimum, in_features=90)
    assert weight.packed.shape == (4, 3, 256) and weight.scales_minimums.shape == (4, 3, 2, 16)
    assert torch.equal(weight.codes()[:50], codes)
    assert not weight.codes()[50:].any()  # padding outputs: zero weights
    read_scale, read_minimum = weight.scales()
    assert torch.equal(read_scale[:50], scale) and torch.equal(read_minimum[:50], minimum)
    # One output's byte of one chunk, by hand: tile 1 (outputs 16..31), group 2, chunk 3,
    # output 20 is lane 4; byte i holds columns 64 + 24 + i (low) and 64 + 28 + i (high).
    byte = weight.packed[1, 2, 3 * 64 + 4 * 4 + 1]
    assert byte == codes[20, 89] | (codes[20, 93] << 4)


def test_int4_groups_codes_fit_the_rounded_numbers():
    weight = _random(64, 96, seed=3)
    codes, scale, minimum = int4_groups(weight)
    assert torch.equal(scale, scale.half().float()) and torch.equal(minimum, minimum.half().float())
    restored = codes.float().view(64, 3, GROUP_SIZE) * scale[..., None] + minimum[..., None]
    # Round to nearest against the numbers kept: within half a step (plus float32's rounding).
    error = (restored.view(64, 96) - weight).abs().view(64, 3, GROUP_SIZE)
    assert (error <= scale[..., None] * 0.5 + 1e-6).all()
    constant = int4_groups(torch.full((2, 32), 0.25))
    assert not constant[0].any() and torch.equal(constant[2], torch.full((2, 1), 0.25))


def test_quantized_matmul_takes_the_kernel_at_every_row_count_in_the_callers_dtype():
    weight = quantize_int4(_random(130, 96, seed=3))
    assert isinstance(weight, Int4Weight)
    for rows in (1, INT4_ONE_PASS_FROM_ROWS - 1, INT4_ONE_PASS_FROM_ROWS):
        x = _random(rows, 96, seed=4)
        for passes in (1, 2):  # the layer's activation_passes reach the kernel
            assert torch.equal(quantized_matmul(x, weight, passes), _kernel(x, weight, passes))
        got = quantized_matmul(x.to(torch.bfloat16), weight)
        assert got.dtype == torch.bfloat16
        want = _kernel(x.to(torch.bfloat16).float(), weight, passes=1).to(torch.bfloat16)
        assert torch.equal(got, want)
    one, two = (quantized_matmul(_random(1, 96, seed=4), weight, passes) for passes in (1, 2))
    assert not torch.equal(one, two)  # a decode row's passes change its product


def test_decode_passes_other_than_one_or_two_are_refused():
    weight = quantize_int4(_random(32, 64, seed=5))
    with pytest.raises(RuntimeError, match="decode_passes must be 1 or 2"):
        _kernel(_random(1, 64, seed=6), weight, passes=3)


def test_the_fused_decode_loop_switches_passes_at_the_same_row_count():
    assert cpu_kernels.load().INT4_ONE_PASS_FROM_ROWS == INT4_ONE_PASS_FROM_ROWS


def test_bad_inputs_and_unknown_variants_are_refused():
    weight = quantize_int4(_random(64, 64, seed=5))
    with pytest.raises(RuntimeError, match="float32"):
        _kernel(_random(2, 64, seed=6).double(), weight)
    with pytest.raises(RuntimeError, match="columns"):
        _kernel(_random(2, 96, seed=6), weight)
    with pytest.raises(RuntimeError, match="no variant sse"):
        cpu_kernels.load().select_int4_isa("sse")


@pytest.mark.slow  # a fresh Python process: ~5 s
def test_without_the_cpu_kernels_int4_takes_torchs_kernel_packed_here():
    # A fresh process: load() and the layout's check are cached per process.
    code = (
        "import torch\n"
        "from splitserve.engine.model.quantized_linear import TorchInt4Weight, int4_layout, "
        "quantize_int4, quantized_matmul\n"
        "assert int4_layout() == 'torch'\n"
        "w = quantize_int4(torch.randn(64, 64) + 0.1)\n"
        "assert isinstance(w, TorchInt4Weight)\n"
        "x = torch.randn(3, 64) + 0.1\n"
        "want = x @ w.dequantize(torch.float32).t()\n"
        "err = (quantized_matmul(x, w) - want).abs().max() / want.abs().max()\n"
        "assert err < 0.01, err\n"
    )
    env = {**os.environ, "SPLITSERVE_CPU_KERNELS": "0"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
