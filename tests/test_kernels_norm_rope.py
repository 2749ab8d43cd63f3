"""Fused add + RMSNorm and rotary embedding kernels against their references, and the
references against Hugging Face Llama's own functions (the model's source of truth).

The interpreter rounds float32 -> bfloat16 toward zero where a GPU rounds to nearest, so the
bfloat16 results are compared within 1e-2 rather than exactly.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")  # Triton wheels exist for Linux only

import subprocess  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

from splitserve.kernels import reference  # noqa: E402
from splitserve.kernels.rms_norm import fused_add_rms_norm  # noqa: E402
from splitserve.kernels.rotary import rotary_embedding  # noqa: E402

DEVICE = "cuda" if os.environ["TRITON_INTERPRET"] == "0" else "cpu"
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert not actual.isnan().any()
    diff = (actual.double() - expected.double()).norm()
    return (diff / expected.double().norm()).item()


def random(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(DEVICE, dtype)


@pytest.mark.parametrize(
    ("dtype", "hidden_size", "with_residual"),
    [
        (torch.float32, 576, True),  # SmolLM2-135M: not a power of two
        (torch.float32, 64, False),
        (torch.bfloat16, 576, True),
        (torch.bfloat16, 128, False),
    ],
)
def test_fused_add_rms_norm_matches_reference(dtype, hidden_size, with_residual):
    gen = torch.Generator().manual_seed(hidden_size)
    x = random((7, hidden_size), dtype, gen)
    residual = random((7, hidden_size), dtype, gen) if with_residual else None
    weight = random((hidden_size,), torch.float32, gen)

    normed, new_residual = fused_add_rms_norm(x, residual, weight, 1e-5)

    expected = reference.fused_add_rms_norm(x.float(), None if residual is None else
                                            residual.float(), weight, 1e-5)
    assert normed.dtype == dtype and new_residual.dtype == dtype
    assert relative_error(normed, expected.normed) < TOLERANCE[dtype]
    if residual is None:
        assert new_residual is x
    elif dtype == torch.float32:
        assert torch.equal(new_residual, x + residual)
    else:
        assert relative_error(new_residual, expected.residual) < TOLERANCE[dtype]


def test_fused_add_rms_norm_reads_strided_rows():
    gen = torch.Generator().manual_seed(2)
    wide = random((5, 2 * 96), torch.float32, gen)
    x, residual = wide[:, :96], wide[:, 96:]  # row stride 192
    weight = random((96,), torch.float32, gen)
    normed, new_residual = fused_add_rms_norm(x, residual, weight, 1e-6)
    expected = reference.fused_add_rms_norm(x, residual, weight, 1e-6)
    assert relative_error(normed, expected.normed) < 1e-5
    assert torch.equal(new_residual, expected.residual)


def test_reference_rms_norm_matches_hugging_face():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(4)
    norm = LlamaRMSNorm(576, eps=1e-5)
    norm.weight.data = torch.randn(576, generator=gen)
    x, residual = torch.randn(6, 576, generator=gen), torch.randn(6, 576, generator=gen)
    normed, _ = reference.fused_add_rms_norm(x, residual, norm.weight.data, 1e-5)
    with torch.no_grad():
        assert relative_error(normed, norm(x + residual)) < 1e-6


def test_fused_add_rms_norm_rejects_bad_arguments():
    x = torch.randn(3, 64, device=DEVICE)
    weight = torch.randn(64, device=DEVICE)
    with pytest.raises(ValueError, match="residual must have shape"):
        fused_add_rms_norm(x, x[:, :32], weight, 1e-5)
    with pytest.raises(ValueError, match="residual must have the dtype"):
        fused_add_rms_norm(x, x.bfloat16(), weight, 1e-5)
    with pytest.raises(ValueError, match="weight must have shape"):
        fused_add_rms_norm(x, None, weight[:32], 1e-5)
    with pytest.raises(ValueError, match="eps"):
        fused_add_rms_norm(x, None, weight, 0.0)
    with pytest.raises(ValueError, match="x must be contiguous in its last dim"):
        fused_add_rms_norm(x.t(), None, torch.randn(3, device=DEVICE), 1e-5)


def llama_inv_freq(head_dim: int, base: float = 10000.0) -> torch.Tensor:
    return 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)


@pytest.mark.parametrize(
    ("dtype", "head_dim", "num_heads", "num_kv_heads"),
    [
        (torch.float32, 64, 9, 3),
        (torch.float32, 128, 8, 1),
        (torch.bfloat16, 64, 9, 3),
    ],
)
def test_rotary_embedding_matches_reference(dtype, head_dim, num_heads, num_kv_heads):
    gen = torch.Generator().manual_seed(head_dim + num_heads)
    num_tokens, max_position = 11, 300
    cos_sin_cache = reference.rotary_cos_sin_cache(llama_inv_freq(head_dim), max_position)
    cos_sin_cache = cos_sin_cache.to(DEVICE)
    # query and key as views of one fused QKV projection, the way the model produces them.
    qkv = random((num_tokens, num_heads + 2 * num_kv_heads, head_dim), dtype, gen)
    query, key = qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads]
    value_before = qkv[:, num_heads + num_kv_heads :].clone()
    positions = torch.randint(0, max_position, (num_tokens,), generator=gen)
    positions[:2] = torch.tensor([0, max_position - 1])
    positions = positions.to(DEVICE)
    expected_q, expected_k = query.float(), key.float()
    reference.rotary_embedding(expected_q, expected_k, positions, cos_sin_cache)

    rotary_embedding(query, key, positions, cos_sin_cache)

    assert relative_error(query, expected_q) < TOLERANCE[dtype]
    assert relative_error(key, expected_k) < TOLERANCE[dtype]
    assert torch.equal(qkv[:, num_heads + num_kv_heads :], value_before)


def test_reference_rotary_matches_hugging_face():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(9)
    head_dim, num_tokens = 64, 10
    inv_freq = llama_inv_freq(head_dim)
    query, key = torch.randn(num_tokens, 9, head_dim), torch.randn(num_tokens, 3, head_dim)
    positions = torch.randint(0, 500, (num_tokens,), generator=gen)
    # Hugging Face: emb = cat(freqs, freqs); q, k as [batch, heads, seq, head_dim].
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)[None]
    hf_q, hf_k = apply_rotary_pos_emb(query.transpose(0, 1)[None], key.transpose(0, 1)[None],
                                      emb.cos(), emb.sin())
    cos_sin_cache = reference.rotary_cos_sin_cache(inv_freq, 500)
    reference.rotary_embedding(query, key, positions, cos_sin_cache)
    assert relative_error(query, hf_q[0].transpose(0, 1)) < 1e-6
    assert relative_error(key, hf_k[0].transpose(0, 1)) < 1e-6


def test_rotary_embedding_rejects_bad_arguments():
    query, key = torch.randn(4, 9, 64, device=DEVICE), torch.randn(4, 3, 64, device=DEVICE)
    positions = torch.arange(4, device=DEVICE)
    cache = torch.randn(16, 64, device=DEVICE)
    with pytest.raises(ValueError, match="key must have shape"):
        rotary_embedding(query, key[:3], positions, cache)
    with pytest.raises(ValueError, match="key must have the dtype"):
        rotary_embedding(query, key.bfloat16(), positions, cache)
    with pytest.raises(ValueError, match="positions must have dtype"):
        rotary_embedding(query, key, positions.float(), cache)
    with pytest.raises(ValueError, match="cos_sin_cache must have shape"):
        rotary_embedding(query, key, positions, cache[:, :32])
    with pytest.raises(ValueError, match="head_dim must be even"):
        rotary_embedding(query[..., :63], key[..., :63], positions, cache[:, :63])


def test_kernels_package_imports_without_triton():
    """The CPU engine imports the references; they must not need Triton installed."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import splitserve.kernels, splitserve.kernels.reference\n"
        "assert not splitserve.kernels.has_triton()\n"
        "print(splitserve.kernels.reference.paged_decode_attention.__name__)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "paged_decode_attention"
