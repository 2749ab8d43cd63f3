"""What the decoder's matrix products cost per step at 1 to 16 rows, by kernel, beside the floor.

    python -m benchmarks.matmul_rows [--rows 1 2 3 4 6 8 12 16] [--repeats 5] [--threads 2]

One "step" is every layer's four products (qkv, o, gate_up, down) over SmolLM2-135M's shapes,
each layer with its own weights (420 MiB in all, far past the caches, as in a real decode
step). Kernels compared, on the same inputs:
- `linear`: F.linear on W [out, in] (MKL sgemm, transposed B);
- `transposed`: x @ Wt with Wt [in, out] stored contiguous;
- `mkl_packed`: MKL's packed-weight sgemm (`torch.ops.mkl._mkl_linear`, weight packed once by
  `_mkl_reorder_linear_weight`), what torch's compiler uses for frozen float32 linears;
- `onednn`: oneDNN's inner product (`torch.ops.mkldnn._linear_pointwise`, weight reordered once).
The floor is reading every weight once at the read bandwidth measured in this process.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.step_breakdown import read_bandwidth

HIDDEN, INTERMEDIATE, Q_SIZE, KV_SIZE, LAYERS = 576, 1536, 576, 192, 30
SHAPES = {  # name -> (in_features, out_features)
    "qkv": (HIDDEN, Q_SIZE + 2 * KV_SIZE),
    "o": (Q_SIZE, HIDDEN),
    "gate_up": (HIDDEN, 2 * INTERMEDIATE),
    "down": (INTERMEDIATE, HIDDEN),
}
PACK_BATCH_HINT = 1  # MKL packs for a batch size; the product works for any number of rows


def make_weights() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        {name: torch.randn(out, inp, generator=generator) for name, (inp, out) in SHAPES.items()}
        for _ in range(LAYERS)
    ]


def kernels(weights: list[dict[str, torch.Tensor]]) -> dict[str, list[Callable]]:
    """Per kernel: one callable per product of a step, in step order."""
    flat = [layer[name] for layer in weights for name in SHAPES]
    transposed = [w.t().contiguous() for w in flat]
    packed = [torch.ops.mkl._mkl_reorder_linear_weight(w, PACK_BATCH_HINT) for w in flat]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in flat]
    return {
        "linear": [lambda x, w=w: F.linear(x, w) for w in flat],
        "transposed": [lambda x, wt=wt: x @ wt for wt in transposed],
        "mkl_packed": [
            lambda x, p=p, w=w: torch.ops.mkl._mkl_linear(x, p, w, None, PACK_BATCH_HINT)
            for p, w in zip(packed, flat)
        ],
        "onednn": [
            lambda x, w=w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
            for w in onednn
        ],
    }


def step_ms(products: list[Callable], rows: int, repeats: int) -> float:
    inputs = {n: torch.randn(rows, inp) for n, (inp, _) in SHAPES.items()}
    order = [inputs[name] for _ in range(LAYERS) for name in SHAPES]
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            for product, x in zip(products, order):
                product(x)
            best = min(best, time.perf_counter() - start)
    return 1000 * best


def floor_ms(weights: list[dict[str, torch.Tensor]]) -> tuple[float, float]:
    num_bytes = sum(w.numel() * 4 for layer in weights for w in layer.values())
    bandwidth = read_bandwidth()
    return 1000 * num_bytes / bandwidth, bandwidth / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print("building 30 layers of weights (420 MiB) and packing them...", flush=True)
    weights = make_weights()
    by_kernel = kernels(weights)
    floor, bandwidth = floor_ms(weights)
    print(f"{'rows':>5}" + "".join(f"{name:>14}" for name in by_kernel) + f"{'floor':>10}")
    for rows in args.rows:
        cells = [step_ms(products, rows, args.repeats) for products in by_kernel.values()]
        print(f"{rows:>5}" + "".join(f"{ms:>14.2f}" for ms in cells) + f"{floor:>10.2f}")
    print(f"(ms per step of 120 products; floor: weights read once at {bandwidth:.1f} GB/s read)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
