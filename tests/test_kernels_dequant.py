"""The dequantizing matmuls (kernels/dequant_matmul.py) against their PyTorch references.

Fresh random codes, scales, minimums and activations (never zeros), at 1, 3, 16 and 64 rows,
on SmolLM2's sizes (576 / 1536 / 192) and odd ones that are not a multiple of any tile or of
the int4 group (the layout's padding columns must not be read). Errors are the largest absolute
difference over the largest output: float32 differs from the float32 reference only by
summation order; bfloat16 rounds the dequantized weight and the output once each, and the
interpreter rounds float32 -> bfloat16 toward zero (a GPU rounds to nearest), up to 2^-7 of a
value, hence 2e-2 - far below what a wrong nibble, group or scale gives (tens of percent).
int4's other inner loops (INT4_LOOP "group_dot", "gemv") round nothing before the output (the
codes are exact in every dtype; scales and minimums apply in float32), so the same bounds hold
with room; "group_dot" in half precision dots x with 128 + code (bfloat16) or 1024 + code
(float16) and takes the bias back per group, which costs float32 sums a few of their 24 bits.
`TRITON_INTERPRET=0 pytest tests/test_kernels_dequant.py` runs the same checks on a GPU.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")  # Triton wheels exist for Linux only

import torch  # noqa: E402

from splitserve.kernels import reference  # noqa: E402
from splitserve.kernels.dequant_matmul import (  # noqa: E402
    INT4_LOOPS,
    int4_group_matmul,
    int8_matmul,
)

DEVICE = "cuda" if os.environ["TRITON_INTERPRET"] == "0" else "cpu"
ROWS = (1, 3, 16, 64)
# (out, in): SmolLM2's k/v projection (192 x 576), its down projection's inner size (1536) with
# fewer outputs than a column tile (96, to keep the interpreter quick); 100 x 50 is neither a
# tile's multiple nor whole groups (in padded to 64).
SHAPES = ((192, 576), (96, 1536), (100, 50))
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def _pad(size: int) -> int:
    return -(-size // 32) * 32


def _activations(rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=gen) + 0.1).to(DEVICE, dtype)


def _int8_weight(out: int, inner: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (out, _pad(inner)), generator=gen, dtype=torch.int8)
    scales = (torch.rand(out, generator=gen) + 0.5) / 127
    return codes.to(DEVICE), scales.to(DEVICE, torch.bfloat16)


def _int4_weight(out: int, inner: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    groups = _pad(inner) // 32
    codes = torch.randint(0, 16, (out, _pad(inner)), generator=gen)
    scales = (torch.rand(out, groups, generator=gen) + 0.5) / 15
    # Minimums off centre (-8 * scale would be GGUF's Q4_0), so a lost minimum shows.
    minimums = -8 * scales + 0.2 * torch.rand(out, groups, generator=gen)
    packed = reference.pack_int4_groups(codes)
    return packed.to(DEVICE), scales.to(DEVICE, torch.float16), minimums.to(DEVICE, torch.float16)


def _error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert not actual.isnan().any()
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_int8_matmul_matches_reference(out_features, in_features, dtype):
    codes, scales = _int8_weight(out_features, in_features, seed=out_features)
    for rows in ROWS:
        x = _activations(rows, in_features, dtype, seed=rows)
        got = int8_matmul(x, codes, scales)
        assert got.shape == (rows, out_features) and got.dtype == dtype
        want = reference.int8_matmul(x.float(), codes, scales)
        assert _error(got, want) < TOLERANCE[dtype], f"{rows} rows"


@pytest.mark.parametrize("loop", INT4_LOOPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_int4_group_matmul_matches_reference(out_features, in_features, dtype, loop):
    packed, scales, minimums = _int4_weight(out_features, in_features, seed=out_features)
    for rows in ROWS:
        x = _activations(rows, in_features, dtype, seed=rows)
        got = int4_group_matmul(x, packed, scales, minimums, launch=dict(INT4_LOOP=loop))
        assert got.shape == (rows, out_features) and got.dtype == dtype
        want = reference.int4_group_matmul(x.float(), packed, scales, minimums)
        assert _error(got, want) < TOLERANCE[dtype], f"{rows} rows"


# Launch configurations a GPU's tuned table may hold (kernels/launch_configs.py): K split over
# 2 and 3 programs (3 does not divide the K tiles: the last split is short or empty), scales
# read once per group, tiles narrower and deeper than the default; the same for int4's other
# loops, "gemv" with 2 rows per program (17 rows: a last tile of one) and with more rows per
# program than there are (capped). int8 ignores INT4_LOOP.
LAUNCH_VARIANTS = (
    dict(SPLIT_K=2),
    dict(SPLIT_K=3, BLOCK_K=128, SCALE_BROADCAST=1),
    dict(BLOCK_N=32, BLOCK_K=256, SCALE_BROADCAST=1),
    dict(BLOCK_M=32, BLOCK_N=16, SPLIT_K=4),
    dict(INT4_LOOP="group_dot", SPLIT_K=3, BLOCK_K=128),
    dict(INT4_LOOP="group_dot", BLOCK_M=32, BLOCK_N=16, BLOCK_K=256, SPLIT_K=2),
    dict(INT4_LOOP="gemv", SPLIT_K=3, BLOCK_N=32, BLOCK_K=128),
    dict(INT4_LOOP="gemv", BLOCK_M=2, BLOCK_N=16, BLOCK_K=256, SPLIT_K=4),
    dict(INT4_LOOP="gemv", BLOCK_M=64, BLOCK_N=128, BLOCK_K=32),
)


@pytest.mark.parametrize("launch", LAUNCH_VARIANTS, ids=lambda launch: str(sorted(launch.items())))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_launch_variants_match_reference(launch, dtype):
    out_features, in_features = 100, 300  # K of 10 int4 groups: splits of uneven length
    packed, scales, minimums = _int4_weight(out_features, in_features, seed=21)
    codes, int8_scales = _int8_weight(out_features, in_features, seed=22)
    for rows in (1, 17):
        x = _activations(rows, in_features, dtype, seed=rows)
        got = int4_group_matmul(x, packed, scales, minimums, launch=launch)
        assert got.shape == (rows, out_features) and got.dtype == dtype
        want = reference.int4_group_matmul(x.float(), packed, scales, minimums)
        assert _error(got, want) < TOLERANCE[dtype], f"int4, {rows} rows"
        got = int8_matmul(x, codes, int8_scales, launch=launch)
        assert got.dtype == dtype
        want = reference.int8_matmul(x.float(), codes, int8_scales)
        assert _error(got, want) < TOLERANCE[dtype], f"int8, {rows} rows"


def test_a_tuned_table_is_read_for_its_gpu_only(tmp_path, monkeypatch):
    """A table names its device's kernels' launches; CPU tensors and the interpreter keep the
    defaults whatever the table says."""
    from splitserve.kernels import launch_configs

    path = tmp_path / "table.json"
    launch_configs.write_table(path, "Some GPU", {"int8_matmul": {"k": {"SPLIT_K": 4}}})
    monkeypatch.setenv(launch_configs.CONFIG_FILE_VARIABLE, str(path))
    assert launch_configs.device_table("Some GPU", str(path)) == {
        "int8_matmul": {"k": {"SPLIT_K": 4}}
    }
    default = {"SPLIT_K": 1}
    assert launch_configs.launch_config("int8_matmul", "k", torch.device("cpu"), default) == default
    name = "NVIDIA H100 80GB HBM3"
    assert launch_configs.table_path(name).name == "nvidia_h100_80gb_hbm3.json"


def test_float16_activations_and_bfloat16_scales():
    packed, scales, minimums = _int4_weight(64, 96, seed=3)
    x = _activations(5, 96, torch.float16, seed=4)
    want = reference.int4_group_matmul(x.float(), packed, scales.float(), minimums.float())
    for loop in INT4_LOOPS:  # "group_dot" makes float16 codes its own way (1024 + code)
        got = int4_group_matmul(x, packed, scales, minimums, launch=dict(INT4_LOOP=loop))
        assert got.dtype == torch.float16 and _error(got, want) < TOLERANCE[torch.float16], loop
    codes, int8_scales = _int8_weight(64, 96, seed=5)
    want = reference.int8_matmul(x.float(), codes, int8_scales)
    assert _error(int8_matmul(x, codes, int8_scales), want) < TOLERANCE[torch.float16]


def test_strided_rows_and_no_rows():
    """x may be a view with a row stride wider than its columns (the model's slices)."""
    packed, scales, minimums = _int4_weight(70, 64, seed=6)
    wide = _activations(3, 100, torch.float32, seed=7)
    x = wide[:, 10:74]
    want = reference.int4_group_matmul(x.contiguous(), packed, scales, minimums)
    for loop in INT4_LOOPS:
        got = int4_group_matmul(x, packed, scales, minimums, launch=dict(INT4_LOOP=loop))
        assert _error(got, want) < 1e-5, loop
    codes, int8_scales = _int8_weight(70, 64, seed=8)
    want = reference.int8_matmul(x.contiguous(), codes, int8_scales)
    assert _error(int8_matmul(x, codes, int8_scales), want) < 1e-5
    assert int8_matmul(wide[:0, :64], codes, int8_scales).shape == (0, 70)


def test_packing_round_trips_in_ggml_order():
    codes = torch.randint(0, 16, (4, 64), generator=torch.Generator().manual_seed(9))
    packed = reference.pack_int4_groups(codes)
    assert packed.shape == (4, 32) and packed.dtype == torch.uint8
    assert torch.equal(reference.unpack_int4_groups(packed), codes.to(torch.uint8))
    # Byte j of a group: column j in the low nibble, column j + 16 in the high one.
    assert packed[1, 16 + 5].item() == codes[1, 32 + 5].item() | codes[1, 32 + 21].item() << 4


def test_wrappers_reject_bad_arguments():
    packed, scales, minimums = _int4_weight(64, 64, seed=10)
    codes, int8_scales = _int8_weight(64, 64, seed=11)
    x = _activations(2, 64, torch.float32, seed=12)
    with pytest.raises(ValueError, match="codes must have dtype"):
        int8_matmul(x, codes.to(torch.int32), int8_scales)
    with pytest.raises(ValueError, match="x has 96 columns but the weight only 64"):
        int8_matmul(_activations(2, 96, torch.float32, seed=13), codes, int8_scales)
    with pytest.raises(ValueError, match="scales must have shape"):
        int8_matmul(x, codes, int8_scales[:32])
    with pytest.raises(ValueError, match="whole groups of 32"):
        int4_group_matmul(x[:, :48], packed[:, :24].contiguous(), scales, minimums)
    with pytest.raises(ValueError, match="minimums must have the dtype of scales"):
        int4_group_matmul(x, packed, scales, minimums.float())
    with pytest.raises(ValueError, match="scales must have shape"):
        int4_group_matmul(x, packed, scales[:, :1], minimums)
    with pytest.raises(ValueError, match="x must be contiguous in its last dim"):
        int4_group_matmul(x.t(), packed, scales, minimums)
    with pytest.raises(ValueError, match="INT4_LOOP must be one of"):
        int4_group_matmul(x, packed, scales, minimums, launch=dict(INT4_LOOP="marlin"))
