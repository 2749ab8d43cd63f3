"""The C++ CPU kernels against their PyTorch references, on fresh random inputs of several
shapes (GQA groups, block sizes, ragged lengths, padding rows, scattered block tables)."""

from __future__ import annotations

import pytest
import torch

from splitserve.kernels import reference
from splitserve.kernels.cpu import load, paged_decode_attention

pytestmark = pytest.mark.skipif(load() is None, reason="no C++ compiler on this machine")

SHAPES = [
    # num_seqs, num_heads, num_kv_heads, head_dim, block_size, num_blocks, max_len
    (1, 9, 3, 64, 16, 40, 200),  # SmolLM2's heads
    (7, 8, 8, 32, 16, 64, 130),  # no GQA
    (5, 12, 2, 64, 8, 96, 90),  # groups of 6, small blocks
    (16, 4, 1, 128, 32, 80, 300),  # one kv head, long head_dim
    (3, 4, 2, 80, 16, 60, 150),  # head_dim past 64, not a multiple of it (AVX2: 64 + 16)
    (2, 6, 3, 20, 16, 40, 120),  # head_dim not a multiple of 8 (position by position)
]


def random_case(shape, seed: int):
    num_seqs, num_heads, num_kv_heads, head_dim, block_size, num_blocks, max_len = shape
    generator = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    query = torch.randn(num_seqs, num_heads, head_dim, generator=generator)
    seq_lens = torch.randint(1, max_len + 1, (num_seqs,), generator=generator, dtype=torch.int32)
    seq_lens[num_seqs // 2] = 0 if num_seqs > 2 else seq_lens[0]  # a padding row
    max_blocks = -(-max_len // block_size)
    # Every row's blocks scattered over the cache (distinct ids per row).
    tables = torch.stack(
        [torch.randperm(num_blocks, generator=generator)[:max_blocks] for _ in range(num_seqs)]
    ).to(torch.int32)
    return query, cache[0], cache[1], tables, seq_lens, head_dim**-0.5


@pytest.mark.parametrize("shape", SHAPES)
def test_paged_decode_attention_matches_the_reference(shape):
    for seed in range(3):
        case = random_case(shape, seed)
        got = paged_decode_attention(*case)
        expected = reference.paged_decode_attention(*case)
        assert not torch.equal(expected, torch.zeros_like(expected))
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


# window, softcap: a window shorter than most rows (one position; several blocks, not a
# multiple of the block size), one longer than every row, and Gemma 2's cap with and without
# a window.
VISIBILITY = [(1, 0.0), (37, 0.0), (1000, 0.0), (0, 3.0), (20, 2.5)]


@pytest.mark.parametrize(("window", "softcap"), VISIBILITY)
@pytest.mark.parametrize("shape", SHAPES[:3])
def test_windows_and_soft_caps_match_the_reference(shape, window, softcap):
    """Mistral's and Gemma's sliding windows (only the last `window` positions are read) and
    Gemma 2's soft-capped scores, on float32 and int8 rows."""
    from splitserve.kernels.kv_int8 import quantize_rows

    for seed in range(2):
        query, keys, values, tables, lens, scale = random_case(shape, seed + 20)
        query = query * 4  # scores large enough for the cap to bend them
        for cache in ((keys, values), (quantize_rows(keys), quantize_rows(values))):
            case = (query, *cache, tables, lens, scale)
            got = paged_decode_attention(*case, window=window, softcap=softcap)
            expected = reference.paged_decode_attention(*case, window=window, softcap=softcap)
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
            everything = reference.paged_decode_attention(*case)
            window_cuts = bool(window) and bool((lens > window).any())
            if window_cuts or softcap:  # what the window or the cap leaves out matters
                assert not torch.allclose(expected, everything, rtol=1e-3, atol=1e-3)


def test_bad_inputs_are_refused_before_the_kernel_runs():
    query, keys, values, tables, lens, scale = random_case(SHAPES[0], 0)
    with pytest.raises(ValueError, match="float32"):
        paged_decode_attention(query.double(), keys, values, tables, lens, scale)
    with pytest.raises(ValueError, match="int32"):
        paged_decode_attention(query, keys, values, tables.long(), lens, scale)
    with pytest.raises(RuntimeError, match="does not fit its block table"):
        paged_decode_attention(query, keys, values, tables[:, :2].contiguous(), lens + 100, scale)
    with pytest.raises(RuntimeError, match="outside"):
        paged_decode_attention(query, keys, values, tables + 1000, lens, scale)
    with pytest.raises(ValueError, match="multiple"):
        paged_decode_attention(query[:, :8], keys, values, tables, lens, scale)
    with pytest.raises(ValueError, match="window"):
        paged_decode_attention(query, keys, values, tables, lens, scale, window=-1)
    with pytest.raises(ValueError, match="softcap"):
        paged_decode_attention(query, keys, values, tables, lens, scale, softcap=-1.0)


@pytest.fixture
def four_threads():
    """Four threads for the test's own calls (the workers run with one): the kernel splits a
    sequence's positions among threads only when there are more threads than sequences."""
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(threads)


# (num_seqs, max_len): one sequence split four ways, and into as many parts as its keys allow
# (32 each: a 40-key row takes one part, 70 two); two sequences split two ways each beside a
# padding row; windows that cut the split ranges.
SPLIT_CASES = [(1, 2000), (1, 40), (1, 70), (3, 600)]


@pytest.mark.parametrize(("num_seqs", "max_len"), SPLIT_CASES)
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (300, 0.0), (0, 3.0)])
def test_a_sequence_split_among_threads_matches_the_reference(
    four_threads, num_seqs, max_len, window, softcap
):
    """Fewer sequences than threads: each one's positions are split into parts (at least 32
    keys each) whose maxima, sums and weighted values are merged (split-K), on float32 and
    int8 rows."""
    from splitserve.kernels.kv_int8 import quantize_rows

    shape = (num_seqs, 9, 3, 64, 16, 160, max_len)
    for seed in range(2):
        query, keys, values, tables, lens, scale = random_case(shape, seed + 30)
        lens[0] = max_len  # the longest row, split as far as it goes
        query = query * 4  # scores large enough for the parts' maxima to differ
        for cache in ((keys, values), (quantize_rows(keys), quantize_rows(values))):
            case = (query, *cache, tables, lens, scale)
            got = paged_decode_attention(*case, window=window, softcap=softcap)
            expected = reference.paged_decode_attention(*case, window=window, softcap=softcap)
            assert not torch.equal(expected, torch.zeros_like(expected))
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES)
def test_decode_over_int8_rows_matches_the_reference(shape):
    """kv_cache_dtype int8: codes and their bfloat16 scale per row (kernels/kv_int8.py), read in
    place with the scale applied once per row; the reference dequantizes, then attends."""
    from splitserve.kernels.kv_int8 import quantize_rows

    for seed in range(3):
        query, keys, values, tables, lens, scale = random_case(shape, seed + 10)
        case = (query, quantize_rows(keys), quantize_rows(values), tables, lens, scale)
        got = paged_decode_attention(*case)
        expected = reference.paged_decode_attention(*case)
        assert not torch.equal(expected, torch.zeros_like(expected))
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_int8_rows_of_the_wrong_width_are_refused():
    from splitserve.kernels.kv_int8 import quantize_rows

    query, keys, values, tables, lens, scale = random_case(SHAPES[0], 0)
    with pytest.raises(ValueError, match="do not fit query"):
        paged_decode_attention(query, quantize_rows(keys)[..., :-2].contiguous(),
                               quantize_rows(values)[..., :-2].contiguous(), tables, lens, scale)
    with pytest.raises(ValueError, match="caches of"):
        paged_decode_attention(query, quantize_rows(keys), values, tables, lens, scale)


@pytest.mark.parametrize(("num_tokens", "num_kv_heads", "head_dim"), [(1, 3, 64), (200, 2, 128),
                                                                       (7, 1, 80)])
def test_write_kv_int8_writes_what_the_reference_writes(num_tokens, num_kv_heads, head_dim):
    """Bit for bit: codes and scales, the slots not written left alone, padding skipped."""
    from splitserve.kernels.cpu import write_kv_int8
    from splitserve.kernels.kv_int8 import quantize_rows

    generator = torch.Generator().manual_seed(num_tokens)
    num_blocks, block_size = 30, 16
    cache = quantize_rows(torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim,
                                      generator=generator))
    qkv = torch.randn(num_tokens, 3, num_kv_heads, head_dim, generator=generator) * 4
    key, value = qkv[:, 1].contiguous(), qkv[:, 2]  # value as a view of a fused projection
    key[0, 0] = 0.0  # a zero row: scale 0, codes 0
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    if num_tokens > 1:
        slots[1] = -1  # a padding token
    expected = cache.clone()
    reference.write_kv(key, value, expected[0], expected[1], slots)

    write_kv_int8(key, value, cache, slots)

    assert torch.equal(cache, expected)


def test_write_kv_int8_refuses_a_float_cache():
    from splitserve.kernels.cpu import write_kv_int8

    key = torch.randn(2, 1, 64)
    with pytest.raises(ValueError, match="contiguous int8"):
        write_kv_int8(key, key, torch.zeros(2, 4, 16, 1, 66), torch.tensor([0, 1]))
