"""The fused mixture-of-experts step (shared/model/moe.py) and its Triton grouped GEMM
(kernels/moe_gemm.py), on random inputs of several shapes:

- routing equals transformers' own Mixtral and Qwen2-MoE routers (top-k, renormalised or not);
- the sort puts each expert's assignments in one contiguous slice, counted per expert;
- the CPU path (one product per expert) equals the per-token loop, including experts that get
  no token and uneven counts;
- the grouped GEMM, run in Triton's interpreter (TRITON_INTERPRET=1), equals its PyTorch
  reference, with and without the per-row scale, and its wrapper refuses bad arguments;
- the CUDA path (grouped GEMMs) equals the CPU path; the backend choice follows
  SPLITSERVE_MOE_BACKEND.
"""

from __future__ import annotations

import os

import pytest
import torch

from splitserve.engine.model.moe import (
    ExpertWeights,
    Routing,
    naive_experts,
    route_tokens,
    select_moe_experts,
    sort_by_expert,
    torch_experts,
    triton_experts,
)
from splitserve.kernels import reference

needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="the Triton kernels need a GPU or TRITON_INTERPRET=1",
)

# The Triton tests run on the GPU when TRITON_INTERPRET=0 (benchmarks.gpu_check), as the other
# kernel tests do; their references run on the same device.
DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") == "0" else "cpu"

# (num_tokens, hidden, intermediate, num_experts, top_k)
SHAPES = [(1, 32, 16, 4, 2), (7, 64, 32, 8, 2), (33, 48, 40, 8, 1), (70, 64, 96, 6, 3)]


def random_experts(
    num_experts: int, hidden: int, inter: int, seed: int, device: str = "cpu"
) -> ExpertWeights:
    generator = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=generator) / hidden**0.5
    down = torch.randn(num_experts, hidden, inter, generator=generator) / inter**0.5
    return ExpertWeights(gate_up.to(device), down.to(device))


def random_routing(
    num_tokens: int, num_experts: int, top_k: int, seed: int, device: str = "cpu"
) -> Routing:
    """Routing from random logits, with expert 1 never chosen (an expert with no tokens)."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=generator)
    logits[:, 1] = -1e9
    return route_tokens(logits.to(device), top_k, renormalize=True)


def random_activations(num_tokens: int, hidden: int, device: str = "cpu") -> torch.Tensor:
    return torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(7)).to(device)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_routing_equals_transformers_router(family):
    torch.manual_seed(0)
    if family == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

        config = MixtralConfig(hidden_size=32, num_local_experts=8, num_experts_per_tok=2)
        router, renormalize = MixtralTopKRouter(config), True
    else:
        from transformers import Qwen2MoeConfig
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

        config = Qwen2MoeConfig(hidden_size=32, num_experts=8, num_experts_per_tok=2)
        router, renormalize = Qwen2MoeTopKRouter(config), False
    torch.nn.init.normal_(router.weight)  # transformers leaves it empty or zero until loading
    hidden = torch.randn(19, 32)
    with torch.no_grad():
        logits, weights, expert_ids = router(hidden)
    routing = route_tokens(logits, 2, renormalize)
    assert torch.equal(routing.expert_ids, expert_ids)
    torch.testing.assert_close(routing.weights, weights.to(routing.weights.dtype))
    sums = routing.weights.sum(-1)
    assert torch.allclose(sums, torch.ones_like(sums)) == renormalize


def test_sort_gives_each_expert_one_contiguous_slice():
    routing = random_routing(25, 8, 2, seed=3)
    order = sort_by_expert(routing, 8)
    flat = routing.expert_ids.flatten()
    assert order.counts.tolist() == [int((flat == e).sum()) for e in range(8)]
    assert order.counts[1] == 0
    assert order.offsets[0] == 0 and order.offsets[-1] == 25 * 2
    for expert in range(8):
        start, end = order.offsets[expert], order.offsets[expert + 1]
        tokens = order.token_ids[start:end]
        assert bool((routing.expert_ids[tokens] == expert).any(dim=1).all())
        assert torch.equal(tokens, tokens.sort().values)  # stable: token order kept


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fused_torch_step_equals_per_token_loop(shape):
    num_tokens, hidden, inter, num_experts, top_k = shape
    experts = random_experts(num_experts, hidden, inter, seed=num_tokens)
    routing = random_routing(num_tokens, num_experts, top_k, seed=num_tokens + 1)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(7))
    expected = naive_experts(x, experts, routing)
    got = torch_experts(x, experts, sort_by_expert(routing, num_experts))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert expected.abs().mean() > 0.01  # not a comparison of zeros


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("counts", [[5, 0, 17, 1], [0, 0, 40, 3, 16, 1], [1, 1]], ids=str)
@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "row_scale"])
def test_grouped_gemm_equals_reference(counts, dtype, scaled):
    from splitserve.kernels import grouped_gemm

    generator = torch.Generator().manual_seed(sum(counts))
    num_rows, k, n = sum(counts), 48, 80
    x = torch.randn(num_rows, k, generator=generator).to(DEVICE, dtype)
    weights = torch.randn(len(counts), n, k, generator=generator).to(DEVICE, dtype)
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], device=DEVICE)
    scale = torch.rand(num_rows, generator=generator).to(DEVICE, dtype) if scaled else None
    got = grouped_gemm(x, weights, offsets, scale)
    expected = reference.grouped_gemm(x, weights, offsets, scale)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), rtol=tolerance, atol=tolerance)


@needs_interpreter
def test_grouped_gemm_refuses_bad_arguments():
    from splitserve.kernels import grouped_gemm

    x, weights = torch.randn(6, 16), torch.randn(2, 8, 16)
    offsets = torch.tensor([0, 2, 6])
    with pytest.raises(ValueError, match="weights must be"):
        grouped_gemm(x, torch.randn(2, 8, 12), offsets)
    with pytest.raises(ValueError, match="expert_offsets must have shape"):
        grouped_gemm(x, weights, torch.tensor([0, 6]))
    with pytest.raises(ValueError, match="dtype"):
        grouped_gemm(x, weights.to(torch.bfloat16), offsets)
    with pytest.raises(ValueError, match="row_scale must have shape"):
        grouped_gemm(x, weights, offsets, torch.ones(5))


@needs_interpreter
@pytest.mark.parametrize("shape", SHAPES[:3], ids=str)
def test_triton_step_equals_torch_step(shape):
    num_tokens, hidden, inter, num_experts, top_k = shape
    experts = random_experts(num_experts, hidden, inter, seed=num_tokens, device=DEVICE)
    routing = random_routing(num_tokens, num_experts, top_k, seed=num_tokens + 1, device=DEVICE)
    x = random_activations(num_tokens, hidden, DEVICE)
    order = sort_by_expert(routing, num_experts)
    expected = torch_experts(x, experts, order)
    torch.testing.assert_close(triton_experts(x, experts, order), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "path",
    ["torch", pytest.param("triton", marks=needs_interpreter)],
)
def test_experts_split_in_ranges_sum_to_the_whole(path):
    """What expert parallelism relies on (docs/moe.md): a layer holding a contiguous range of
    experts computes exactly their share, so the ranks' outputs add up to the whole layer."""
    experts_fn = torch_experts if path == "torch" else triton_experts
    device = "cpu" if path == "torch" else DEVICE
    num_tokens, hidden, inter, num_experts, top_k = SHAPES[1]
    whole = random_experts(num_experts, hidden, inter, seed=5, device=device)
    routing = random_routing(num_tokens, num_experts, top_k, seed=6, device=device)
    x = random_activations(num_tokens, hidden, device)
    order = sort_by_expert(routing, num_experts)
    expected = torch_experts(x, whole, order)
    total = torch.zeros_like(expected)
    for first, end in [(0, 3), (3, 8)]:
        part = ExpertWeights(whole.gate_up[first:end], whole.down[first:end], first_expert=first)
        share = experts_fn(x, part, order)
        assert share.abs().sum() > 0
        total += share
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-5)


def test_backend_choice_follows_the_device_and_the_environment(monkeypatch):
    monkeypatch.delenv("SPLITSERVE_MOE_BACKEND", raising=False)
    assert select_moe_experts(torch.device("cpu")) is torch_experts
    assert select_moe_experts(torch.device("cuda")) is triton_experts
    monkeypatch.setenv("SPLITSERVE_MOE_BACKEND", "triton")
    assert select_moe_experts(torch.device("cpu")) is triton_experts
    monkeypatch.setenv("SPLITSERVE_MOE_BACKEND", "torch")
    assert select_moe_experts(torch.device("cuda")) is torch_experts
    monkeypatch.setenv("SPLITSERVE_MOE_BACKEND", "cutlass")
    with pytest.raises(ValueError, match="cutlass"):
        select_moe_experts(torch.device("cpu"))
