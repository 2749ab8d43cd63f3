"""The C++ layer ops (kernels/cpu/layer_ops.cpp) against their PyTorch references on fresh random
inputs: row counts on both sides of the parallel threshold, strided rows, GQA head layouts; and
the model's choice of them (shared/model/layer_ops.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from splitserve.engine.model.layer_ops import CpuKernelLayerOps, TorchLayerOps, select_layer_ops
from splitserve.engine.model.rotary import RotaryAngles
from splitserve.kernels import cpu as cpu_kernels
from splitserve.kernels import reference

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C++ compiler here")

ROWS = [1, 3, 16, 31, 32, 100]  # the C++ splits rows over threads from 32 on
EPS = 1e-5


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("hidden", [576, 64, 100])
def test_rms_norm_matches_the_reference(rows, hidden):
    g = generator(rows * hidden)
    x = torch.randn(rows, hidden, generator=g) * 3
    weight = torch.randn(hidden, generator=g)
    expected = reference.fused_add_rms_norm(x, None, weight, EPS).normed
    torch.testing.assert_close(cpu_kernels.rms_norm(x, weight, EPS), expected)


@pytest.mark.parametrize("rows", ROWS)
def test_add_rms_norm_returns_the_sum_and_its_norm(rows):
    g = generator(rows)
    x, residual = torch.randn(2, rows, 576, generator=g)
    weight = torch.randn(576, generator=g)
    expected = reference.fused_add_rms_norm(x, residual, weight, EPS)
    normed, summed = cpu_kernels.add_rms_norm(x, residual, weight, EPS)
    assert torch.equal(summed, x + residual)  # one float add per element, as torch's
    torch.testing.assert_close(normed, expected.normed)


def test_norms_read_strided_rows():
    # A slice of wider rows (what a split of a fused projection would hand over).
    g = generator(7)
    wide = torch.randn(5, 1000, generator=g)
    x, residual = wide[:, :576], wide[:, 300:876]
    weight = torch.randn(576, generator=g)
    expected = reference.fused_add_rms_norm(x, residual, weight, EPS)
    normed, summed = cpu_kernels.add_rms_norm(x, residual, weight, EPS)
    torch.testing.assert_close(normed, expected.normed)
    torch.testing.assert_close(summed, expected.residual)
    torch.testing.assert_close(
        cpu_kernels.rms_norm(x, weight, EPS),
        reference.fused_add_rms_norm(x, None, weight, EPS).normed,
    )


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("inner", [1536, 24])
def test_silu_and_mul_matches_torch(rows, inner):
    gate_up = torch.randn(rows, 2 * inner, generator=generator(rows + inner)) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_kernels.silu_and_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 2, 24)])
def test_q_k_head_norms_match_the_pytorch_form(rows, num_heads, num_kv_heads, head_dim):
    """Qwen3's q/k norms: each q and k head normalised in place, v untouched, as the split,
    per-head norm and concatenation of TorchLayerOps compute them; on a slice of wider rows
    too."""
    g = generator(rows * head_dim + num_heads)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    wide = torch.randn(rows, width + 40, generator=g) * 3
    q_weight, k_weight = torch.randn(2, head_dim, generator=g)
    module = cpu_kernels.load()
    for qkv in (wide[:, :width].contiguous(), wide[:, 40:]):
        expected = TorchLayerOps().rms_norm_qk_heads(
            qkv, q_weight, k_weight, num_heads, num_kv_heads, EPS
        )
        got = qkv.clone() if qkv.is_contiguous() else wide.clone()[:, 40:]
        module.rms_norm_qk_heads(got, q_weight, k_weight, num_heads, num_kv_heads, EPS)
        torch.testing.assert_close(got, expected)
        v_size = num_kv_heads * head_dim
        assert torch.equal(got[:, -v_size:], qkv[:, -v_size:])


def test_q_k_head_norms_refuse_a_mismatched_width():
    qkv = torch.randn(2, (4 + 2 * 2) * 24 + 1)
    with pytest.raises(RuntimeError, match="columns"):
        cpu_kernels.load().rms_norm_qk_heads(qkv, torch.ones(24), torch.ones(24), 4, 2, EPS)


def rotary_case(rows: int, num_heads: int, num_kv_heads: int, head_dim: int, seed: int):
    """A fused projection's output, the rows' positions, and the angles the model looks up."""
    g = generator(seed)
    qkv = torch.randn(rows, (num_heads + 2 * num_kv_heads) * head_dim, generator=g)
    positions = torch.randint(0, 4000, (rows,), generator=g)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    table = reference.rotary_cos_sin_cache(inv_freq, 4000)
    half = head_dim // 2
    cos = table[positions, :half].repeat(1, 2).unsqueeze(1).contiguous()  # [rows, 1, head_dim]
    sin = table[positions, half:].repeat(1, 2).unsqueeze(1).contiguous()
    return qkv, positions, table, RotaryAngles(cos, sin)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("heads", [(9, 3, 64), (8, 8, 32), (8, 1, 16)])
def test_rotary_split_qkv_matches_the_reference(rows, heads):
    num_heads, num_kv_heads, head_dim = heads
    qkv, positions, table, angles = rotary_case(rows, *heads, seed=rows)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    expected_q = qkv[:, :q_size].reshape(rows, num_heads, head_dim).clone()
    expected_k = qkv[:, q_size : q_size + kv_size].reshape(rows, num_kv_heads, head_dim).clone()
    reference.rotary_embedding(expected_q, expected_k, positions, table)
    q, k, v = cpu_kernels.rotary_split_qkv(qkv, angles.cos, angles.sin, num_heads, num_kv_heads)
    torch.testing.assert_close(q, expected_q)
    torch.testing.assert_close(k, expected_k)
    assert torch.equal(v, qkv[:, q_size + kv_size :].reshape(rows, num_kv_heads, head_dim))
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_rotary_into_cache_writes_what_write_kv_writes(rows):
    num_heads, num_kv_heads, head_dim, block_size, num_blocks = 9, 3, 64, 16, 8
    qkv, _, _, angles = rotary_case(rows, num_heads, num_kv_heads, head_dim, seed=rows + 50)
    g = generator(rows)
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    cache = torch.randn(shape, generator=g)
    expected_cache = cache.clone()
    slots = torch.randperm(num_blocks * block_size, generator=g)[:rows]
    slots[rows // 2] = -1  # a padding token: computed, not written
    q, k, v = cpu_kernels.rotary_split_qkv(qkv, angles.cos, angles.sin, num_heads, num_kv_heads)
    reference.write_kv(k, v, expected_cache[0], expected_cache[1], slots)
    got_q = cpu_kernels.rotary_split_qkv_into_cache(
        qkv, angles.cos, angles.sin, num_heads, num_kv_heads, cache, slots
    )
    assert torch.equal(got_q, q)
    assert torch.equal(cache, expected_cache)
    with pytest.raises(RuntimeError, match="outside"):
        cpu_kernels.rotary_split_qkv_into_cache(
            qkv, angles.cos, angles.sin, num_heads, num_kv_heads, cache, slots + 10_000
        )
    with pytest.raises(RuntimeError, match="layer_cache must be"):
        cpu_kernels.rotary_split_qkv_into_cache(
            qkv, angles.cos, angles.sin, num_heads, num_kv_heads, cache[:, :, :, :2], slots
        )


def test_the_kernel_ops_agree_with_the_torch_ops_they_replace():
    torch_ops, kernel_ops = TorchLayerOps(), select_layer_ops(torch.device("cpu"))
    assert isinstance(kernel_ops, CpuKernelLayerOps)
    qkv, _, _, angles = rotary_case(4, 9, 3, 64, seed=1)
    for got, expected in zip(
        kernel_ops.rotary_split_qkv(qkv, angles, 9, 3),
        torch_ops.rotary_split_qkv(qkv, angles, 9, 3),
        strict=True,
    ):
        torch.testing.assert_close(got, expected)
    x, residual = torch.randn(2, 4, 576, generator=generator(2))
    weight = torch.randn(576, generator=generator(3))
    for got, expected in zip(
        kernel_ops.add_rms_norm(x, residual, weight, EPS),
        torch_ops.add_rms_norm(x, residual, weight, EPS),
        strict=True,
    ):
        torch.testing.assert_close(got, expected)


def test_other_dtypes_take_the_torch_ops():
    # A bfloat16 model's activations: the C++ ops are float32 only.
    kernel_ops = select_layer_ops(torch.device("cpu"))
    x = torch.randn(3, 576, generator=generator(4)).bfloat16()
    weight = torch.randn(576, generator=generator(5)).bfloat16()
    assert torch.equal(
        kernel_ops.rms_norm(x, weight, EPS), TorchLayerOps().rms_norm(x, weight, EPS)
    )
    gate_up = torch.randn(3, 48, generator=generator(6)).bfloat16()
    assert torch.equal(kernel_ops.silu_and_mul(gate_up), TorchLayerOps().silu_and_mul(gate_up))


def test_bad_inputs_are_refused():
    x = torch.randn(3, 576)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernels.rms_norm(x.double(), torch.ones(576), EPS)
    with pytest.raises(RuntimeError, match="weight must be"):
        cpu_kernels.rms_norm(x, torch.ones(575), EPS)
    with pytest.raises(RuntimeError, match="differ"):
        cpu_kernels.add_rms_norm(x, x[:2], torch.ones(576), EPS)
    with pytest.raises(RuntimeError, match="odd number"):
        cpu_kernels.silu_and_mul(torch.randn(3, 7))
    with pytest.raises(RuntimeError, match="do not split"):
        cpu_kernels.rotary_split_qkv(torch.randn(2, 101), torch.ones(2, 4), torch.ones(2, 4), 3, 1)
    with pytest.raises(RuntimeError, match="cos and sin"):
        cpu_kernels.rotary_split_qkv(torch.randn(2, 60), torch.ones(2, 8), torch.ones(2, 12), 3, 1)
