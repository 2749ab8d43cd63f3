"""The int8 KV cache format (kernels/kv_int8.py) and the Triton kernels that write and read it,
against their PyTorch references on random inputs of several shapes.

Runs in Triton's interpreter on the CPU (TRITON_INTERPRET=1); `TRITON_INTERPRET=0` runs the
same checks on a GPU. Rows the kernels must not read carry NaN scales, so a stray read turns
the output NaN. The write is bit-exact (the kernel rounds the scale to bfloat16 and the codes
half away from zero exactly as the reference does); attention matches the reference's float32
math on the dequantized values within the bounds of tests/test_kernels_attention.py.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")  # Triton wheels exist for Linux only

import torch  # noqa: E402

from splitserve.kernels import kv_int8, reference  # noqa: E402
from splitserve.kernels.decode_attention import paged_decode_attention  # noqa: E402
from splitserve.kernels.kv_cache_ops import pack_kv_pages, unpack_kv_pages, write_kv  # noqa: E402
from splitserve.kernels.prefill_attention import paged_prefill_attention  # noqa: E402
from tests.test_kernels_attention import (  # noqa: E402
    DEVICE,
    TOLERANCE,
    PagedKV,
    make_paged_kv,
    make_query_layout,
    relative_error,
)


def random(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * 3).to(DEVICE, dtype)


def quantized(kv: PagedKV) -> PagedKV:
    """The same K/V as int8 rows; the NaN rows (never to be read) get NaN scales."""
    return PagedKV(
        kv_int8.quantize_rows(kv.key_cache), kv_int8.quantize_rows(kv.value_cache),
        kv.block_tables, kv.seq_lens,
    )


# ---- the format ----------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim", [64, 128, 80])
def test_quantize_round_trip_error_is_within_half_a_step(head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    x = torch.randn(50, 3, head_dim, generator=gen) * torch.rand(50, 3, 1, generator=gen) * 10
    rows = kv_int8.quantize_rows(x)
    codes, scales = kv_int8.split_rows(rows)

    assert rows.shape == (50, 3, head_dim + 2) and rows.dtype == torch.int8
    assert codes.abs().max() <= 127
    expected_scale = (x.abs().amax(-1, keepdim=True) / 127).to(torch.bfloat16)
    assert torch.equal(scales, expected_scale)
    error = (kv_int8.dequantize_rows(rows, torch.float32) - x).abs()
    # Half a code step, plus the bfloat16 scale's rounding (2^-9) on the largest value.
    bound = scales.float() * 0.5 + x.abs().amax(-1, keepdim=True) * 2**-8
    assert (error <= bound).all()


def test_a_zero_row_has_scale_zero_and_comes_back_zero():
    rows = kv_int8.quantize_rows(torch.zeros(2, 64))
    assert not rows.any()
    assert not kv_int8.dequantize_rows(rows, torch.float32).any()


# ---- the write ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "block_size", "num_kv_heads", "head_dim"),
    [
        (torch.float32, 16, 3, 64),
        (torch.bfloat16, 32, 8, 128),
        (torch.float16, 16, 1, 80),
        (torch.float32, 8, 2, 96),
    ],
)
def test_write_kv_into_int8_rows_matches_reference(dtype, block_size, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(block_size * 7 + num_kv_heads)
    num_blocks, num_tokens = 6, 23
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = kv_int8.quantize_rows(random(shape, torch.float32, gen))
    value_cache = kv_int8.quantize_rows(random(shape, torch.float32, gen))
    key = random((num_tokens, num_kv_heads, head_dim), dtype, gen)
    value = random((num_tokens, num_kv_heads, head_dim), dtype, gen)
    slot_mapping = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slot_mapping[[0, 9, 22]] = -1  # padding tokens
    slot_mapping = slot_mapping.to(DEVICE)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()

    write_kv(key, value, key_cache, value_cache, slot_mapping)

    reference.write_kv(key, value, expected_k, expected_v, slot_mapping)
    assert torch.equal(key_cache, expected_k)  # written slots and untouched ones alike
    assert torch.equal(value_cache, expected_v)
    block, offset = divmod(int(slot_mapping[1]), block_size)
    assert torch.equal(key_cache[block, offset], kv_int8.quantize_rows(key[1]))


def test_write_kv_refuses_an_int8_cache_of_odd_head_dim():
    cache = torch.zeros(2, 16, 1, 65 + 2, dtype=torch.int8, device=DEVICE)
    key = torch.randn(1, 1, 65, device=DEVICE)
    with pytest.raises(ValueError, match="even head_dim"):
        write_kv(key, key.clone(), cache, cache.clone(), torch.zeros(1, dtype=torch.int64))


# ---- attention ------------------------------------------------------------------------------

DECODE_CASES = [
    # dtype, block_size, head_dim, num_kv_heads, group, seq_lens, partition_size
    (torch.float32, 16, 64, 3, 3, [1, 17, 40, 100], 512),
    (torch.float32, 32, 128, 1, 8, [1, 33, 150, 64], 64),
    (torch.bfloat16, 32, 64, 2, 3, [1, 45, 160], 64),
    (torch.float32, 32, 80, 2, 4, [77, 2], 32),  # head_dim not a power of two
]


@pytest.mark.parametrize(
    ("dtype", "block_size", "head_dim", "num_kv_heads", "group", "seq_lens", "partition_size"),
    DECODE_CASES,
)
def test_decode_over_int8_rows_matches_reference(
    dtype, block_size, head_dim, num_kv_heads, group, seq_lens, partition_size
):
    gen = torch.Generator().manual_seed(len(seq_lens) * 100 + head_dim + group)
    kv_float = make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, torch.float32, gen)
    kv = quantized(kv_float)
    query = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, generator=gen)
    query = query.to(DEVICE, dtype)
    out = torch.full_like(query, float("nan"))
    scale = head_dim**-0.5

    paged_decode_attention(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens,
                           scale, out, partition_size=partition_size)

    expected = reference.paged_decode_attention(query.float(), kv.key_cache, kv.value_cache,
                                                kv.block_tables, kv.seq_lens, scale)
    assert relative_error(out, expected) < TOLERANCE[dtype]
    # And what int8 storage costs against the float values it came from: a few tenths of 1%.
    unquantized = reference.paged_decode_attention(
        query.float(), kv_float.key_cache, kv_float.value_cache, kv.block_tables, kv.seq_lens,
        scale,
    )
    assert relative_error(expected, unquantized) < 2e-2


PREFILL_CASES = [
    # dtype, block_size, head_dim, num_kv_heads, group, seq_lens, query_lens
    (torch.float32, 16, 64, 3, 3, [1, 17, 40], [1, 17, 40]),  # whole prompts
    (torch.float32, 32, 128, 1, 8, [20, 100, 35, 1], [3, 37, 35, 1]),  # cached prefixes
    (torch.bfloat16, 32, 64, 2, 3, [50, 17], [20, 17]),
    (torch.float32, 16, 96, 1, 4, [90, 15], [45, 15]),  # head_dim not a power of two
]


@pytest.mark.parametrize(
    ("dtype", "block_size", "head_dim", "num_kv_heads", "group", "seq_lens", "query_lens"),
    PREFILL_CASES,
)
def test_prefill_over_int8_rows_matches_reference(
    dtype, block_size, head_dim, num_kv_heads, group, seq_lens, query_lens
):
    gen = torch.Generator().manual_seed(sum(seq_lens) + head_dim + group + 1)
    kv = quantized(make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, torch.float32,
                                 gen))
    query_start_loc = make_query_layout(query_lens)
    query = torch.randn(sum(query_lens), num_kv_heads * group, head_dim, generator=gen)
    query = query.to(DEVICE, dtype)
    out = torch.full_like(query, float("nan"))
    scale = head_dim**-0.5

    paged_prefill_attention(query, kv.key_cache, kv.value_cache, kv.block_tables,
                            query_start_loc, kv.seq_lens, scale, out)

    expected = reference.paged_prefill_attention(query.float(), kv.key_cache, kv.value_cache,
                                                 kv.block_tables, query_start_loc, kv.seq_lens,
                                                 scale)
    assert relative_error(out, expected) < TOLERANCE[dtype]


# ---- pages ----------------------------------------------------------------------------------


def test_pack_and_unpack_move_int8_rows_with_their_scales():
    gen = torch.Generator().manual_seed(3)
    num_layers, num_blocks, block_size, num_kv_heads, head_dim = 3, 9, 16, 2, 64
    shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
    source = kv_int8.quantize_rows(random(shape, torch.float32, gen))
    block_ids = torch.tensor([7, 2, 5], device=DEVICE)

    buffer = pack_kv_pages(source, block_ids)

    assert buffer.dtype == torch.int8 and buffer.shape[-1] == head_dim + 2
    assert torch.equal(buffer, reference.pack_kv_pages(source, block_ids))
    destination = torch.zeros_like(source)
    unpack_kv_pages(buffer, destination, [0, 8, 4])
    assert torch.equal(destination[:, :, 8], source[:, :, 2])
    values = kv_int8.dequantize_rows(destination[:, :, 8], torch.float32)
    assert torch.equal(values, kv_int8.dequantize_rows(source[:, :, 2], torch.float32))
