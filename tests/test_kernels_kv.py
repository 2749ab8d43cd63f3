"""KV write and page pack/unpack kernels against their PyTorch references.

These kernels only move data, so the results must be bit-exact, in every dtype.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")  # Triton wheels exist for Linux only

import torch  # noqa: E402

from splitserve.kernels import reference  # noqa: E402
from splitserve.kernels.kv_cache_ops import pack_kv_pages, unpack_kv_pages, write_kv  # noqa: E402

DEVICE = "cuda" if os.environ["TRITON_INTERPRET"] == "0" else "cpu"


def random(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(DEVICE, dtype)


@pytest.mark.parametrize(
    ("dtype", "block_size", "num_kv_heads", "head_dim"),
    [
        (torch.float32, 16, 3, 64),
        (torch.bfloat16, 32, 8, 128),
        (torch.float16, 16, 1, 80),
    ],
)
def test_write_kv_matches_reference(dtype, block_size, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(block_size + num_kv_heads)
    num_blocks, num_tokens = 6, 23
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache, value_cache = random(cache_shape, dtype, gen), random(cache_shape, dtype, gen)
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
    assert torch.equal(key_cache[block, offset], key[1])


def test_write_kv_into_one_layer_of_the_engine_cache():
    """The engine passes views kv[l, 0], kv[l, 1]; other layers must stay as they were."""
    gen = torch.Generator().manual_seed(5)
    kv = random((3, 2, 4, 16, 2, 64), torch.float32, gen)
    before = kv.clone()
    key, value = random((5, 2, 64), torch.float32, gen), random((5, 2, 64), torch.float32, gen)
    slot_mapping = torch.tensor([63, 0, 17, -1, 40], device=DEVICE)

    write_kv(key, value, kv[1, 0], kv[1, 1], slot_mapping)

    reference.write_kv(key, value, before[1, 0], before[1, 1], slot_mapping)
    assert torch.equal(kv, before)
    assert torch.equal(kv[1, 1, 3, 15], value[0])  # slot 63 = block 3, offset 15


def test_write_kv_rejects_bad_arguments():
    gen = torch.Generator().manual_seed(6)
    cache = random((4, 16, 2, 64), torch.float32, gen)
    key = random((3, 2, 64), torch.float32, gen)
    slots = torch.tensor([0, 1, 2], device=DEVICE)
    with pytest.raises(ValueError, match="key must have shape"):
        write_kv(key[:, :1], key[:, :1], cache, cache.clone(), slots)
    with pytest.raises(ValueError, match="key must have the dtype"):
        write_kv(key.bfloat16(), key.bfloat16(), cache, cache.clone(), slots)
    with pytest.raises(ValueError, match="slot_mapping must have dtype"):
        write_kv(key, key.clone(), cache, cache.clone(), slots.int())
    with pytest.raises(ValueError, match="slot_mapping must have shape"):
        write_kv(key, key.clone(), cache, cache.clone(), slots[:2])
    with pytest.raises(ValueError, match="value_cache must have shape"):
        write_kv(key, key.clone(), cache, cache[:2].clone(), slots)


@pytest.mark.parametrize(
    ("dtype", "block_size", "num_kv_heads", "head_dim"),
    [(torch.float32, 16, 3, 64), (torch.bfloat16, 32, 8, 128), (torch.bfloat16, 16, 1, 576)],
)
def test_pack_and_unpack_move_whole_blocks(dtype, block_size, num_kv_heads, head_dim):
    """K/V pages, and MLA's latent pages (one part, one row of 576 per token)."""
    gen = torch.Generator().manual_seed(block_size)
    num_layers, num_blocks = 3, 9
    kv_parts = 1 if head_dim == 576 else 2
    shape = (num_layers, kv_parts, num_blocks, block_size, num_kv_heads, head_dim)
    source = random(shape, dtype, gen)
    block_ids = torch.tensor([7, 2, 5], device=DEVICE)

    buffer = pack_kv_pages(source, block_ids)

    assert buffer.shape == (3, num_layers, kv_parts, block_size, num_kv_heads, head_dim)
    assert buffer.is_contiguous()
    assert torch.equal(buffer, reference.pack_kv_pages(source, block_ids))
    assert torch.equal(buffer[1, 2, kv_parts - 1], source[2, kv_parts - 1, 2])  # block 2, layer 2

    destination = random(shape, dtype, gen)
    expected = destination.clone()
    unpack_kv_pages(buffer, destination, [0, 8, 4])  # a plain list of ids works too
    reference.unpack_kv_pages(buffer, expected, [0, 8, 4])
    assert torch.equal(destination, expected)
    assert torch.equal(destination[:, :, 8], source[:, :, 2])


def test_pack_of_no_blocks_is_empty():
    cache = torch.randn(2, 2, 3, 16, 1, 64, device=DEVICE)
    assert pack_kv_pages(cache, []).shape == (0, 2, 2, 16, 1, 64)


def test_pack_and_unpack_reject_bad_arguments():
    gen = torch.Generator().manual_seed(8)
    cache = random((2, 2, 3, 16, 1, 64), torch.float32, gen)
    with pytest.raises(ValueError, match="kv_cache must have 6 dims"):
        pack_kv_pages(cache[0], [0])
    with pytest.raises(ValueError, match="K, V"):
        pack_kv_pages(random((2, 3, 3, 16, 1, 64), torch.float32, gen), [0])
    with pytest.raises(ValueError, match="pages must be contiguous"):
        pack_kv_pages(cache.transpose(4, 5), [0])
    with pytest.raises(ValueError, match="block_ids must have dtype"):
        pack_kv_pages(cache, torch.tensor([0.0], device=DEVICE))
    buffer = pack_kv_pages(cache, [1])
    with pytest.raises(ValueError, match="buffer must have shape"):
        unpack_kv_pages(buffer, cache, [0, 1])
    with pytest.raises(ValueError, match="buffer must have dtype"):
        unpack_kv_pages(buffer.bfloat16(), cache, [0])
