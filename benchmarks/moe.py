"""Tokens/s of the fused mixture-of-experts step against the naive per-token loop.

    python -m benchmarks.moe [--batch 1 16 64] [--repeats 5] [--threads 2] [--quick]
                             [--backend torch|triton] [--device cpu|cuda]

One "step" is one sparse layer (router, top-k, experts, combine) over `batch` tokens, with
Mixtral-8x7B's routing (8 experts, top 2) at a reduced width by default (hidden 1024, expert
intermediate 3584: the real 4096 x 14336 needs 3.5 GiB of float32 weights per layer). Paths
compared on the same inputs and routing:
- `fused`: shared/model/moe.py as the engine runs it: assignments sorted by expert, one batched
  SwiGLU product per expert that got tokens, combined with index_add_ (`--backend torch`, the
  CPU path with oneDNN layouts), or the Triton grouped GEMM (`--backend triton`, CUDA);
- `naive`: one token and one chosen expert at a time (`naive_experts`, the definition).
Prints the best of `--repeats` runs per batch size, and the fused path's speed-up. `--quick`
shrinks everything so the program can be checked in seconds (its figures mean nothing).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from splitserve.engine.model.moe import (
    ExpertWeights,
    naive_experts,
    route_tokens,
    sort_by_expert,
    torch_experts,
    triton_experts,
)
from splitserve.engine.model.moe_layer import prepare_expert_weights

NUM_EXPERTS, TOP_K = 8, 2


def make_experts(
    hidden: int, inter: int, device: torch.device
) -> tuple[ExpertWeights, torch.Tensor]:
    """Random experts (with oneDNN layouts on the CPU, as the engine prepares them) and a
    router [E, H]."""
    generator = torch.Generator().manual_seed(0)
    gate_up = torch.randn(NUM_EXPERTS, 2 * inter, hidden, generator=generator) / hidden**0.5
    down = torch.randn(NUM_EXPERTS, hidden, inter, generator=generator) / inter**0.5
    router = torch.randn(NUM_EXPERTS, hidden, generator=generator)
    return prepare_expert_weights(gate_up.to(device), down.to(device)), router.to(device)


def step_fn(path: str, backend: str, experts: ExpertWeights, router: torch.Tensor) -> Callable:
    fused = torch_experts if backend == "torch" else triton_experts

    def step(x: torch.Tensor) -> torch.Tensor:
        routing = route_tokens(x @ router.T, TOP_K, renormalize=True)
        if path == "naive":
            return naive_experts(x, experts, routing)
        return fused(x, experts, sort_by_expert(routing, NUM_EXPERTS))

    return step


def best_seconds(step: Callable, x: torch.Tensor, repeats: int) -> float:
    best = float("inf")
    with torch.inference_mode():
        step(x)  # warm-up: oneDNN primitives, Triton compilation
        for _ in range(repeats):
            if x.is_cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            step(x)
            if x.is_cuda:
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=3584)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--backend", choices=["torch", "triton"], default="torch")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, to check it runs")
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.intermediate, args.repeats = 64, 128, 1
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    experts, router = make_experts(args.hidden, args.intermediate, device)
    print(
        f"MoE layer: {NUM_EXPERTS} experts, top {TOP_K}, hidden {args.hidden}, expert "
        f"intermediate {args.intermediate}, {args.backend} on {device}, {args.threads} threads"
    )
    print(f"{'batch':>6} {'fused tok/s':>12} {'naive tok/s':>12} {'speed-up':>9}")
    generator = torch.Generator().manual_seed(1)
    for batch in args.batch:
        x = torch.randn(batch, args.hidden, generator=generator).to(device)
        fused = batch / best_seconds(
            step_fn("fused", args.backend, experts, router), x, args.repeats
        )
        naive = batch / best_seconds(
            step_fn("naive", args.backend, experts, router), x, args.repeats
        )
        print(f"{batch:>6} {fused:>12.0f} {naive:>12.0f} {fused / naive:>8.2f}x")


if __name__ == "__main__":
    main()
