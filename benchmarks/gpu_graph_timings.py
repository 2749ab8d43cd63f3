"""The Triton kernels' GPU time without the host's launch cost, beside that cost.

    python -m benchmarks.gpu_graph_timings [--json PATH] [--decode-only | --matmul-only]
        [--decode-launch '{"KV_HEADS": 4, "TILE_N": 256}' ...]

`triton.testing.do_bench` (benchmarks.kernels_bench, benchmarks.triton_tune) times each call
between two events; a kernel shorter than its Python wrapper and Triton's launcher then
measures the host, not the GPU (on the H100 a 576 x 3072 int8 product "took" 90-110 us that
way). Here each call is captured 20 times in a CUDA graph and the replays are timed: GPU time
alone, as the engine's decode steps run it with `cuda_graphs=True`. The host's time per eager
call (perf_counter over 200 calls) is printed beside it: what an eager step pays.

Shapes: decode attention at batch 64 over 4096-token contexts (SmolLM2's 9/3x64 heads, a
Llama-3-8B-like 32/8x128), bfloat16, with the GPU's tuned launch, the default, the kernel's
variants (kernels/_decode_variants.py) and each `--decode-launch` (laid over the tuned launch),
each checked against float32 SDPA before it is timed, beside SDPA on contiguous K/V and each
one's speed against it; the int8 and int4 matmuls of 1 and 16 rows on SmolLM2's gate_up and
down and Llama-3-8B-like 4096 x 4096 and 14336 x 4096 weights, tuned and default, beside the
dense bfloat16 product (`--decode-only` skips them). Weights small enough for the 50 MB L2 stay
there between the replays' calls, for the dense product and the kernels alike.
"""

# The timed lambdas read their loop's tensors, and each is timed within its own iteration.
# ruff: noqa: B023

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

CALLS_PER_GRAPH = 20
REPLAYS = 10
ROUNDS = 5  # decode rows: timings taken in turn, the median kept
HOST_CALLS = 200


def graph_us(fn: Callable[[], object]) -> float:
    """GPU microseconds per call of `fn`, from replays of a graph of CALLS_PER_GRAPH calls."""
    return replay_us(capture(fn))


def interleaved_graph_us(calls: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Each call's GPU microseconds, the median of ROUNDS timings taken in turn with the
    others': on the H200 the first launch timed after a layout's checks measured 5% slower
    than the same launch timed later (257.5 against 244.9 us), so one pass in order would
    favour whatever comes late."""
    graphs = {label: capture(fn) for label, fn in calls.items()}
    timings: dict[str, list[float]] = {label: [] for label in calls}
    for _ in range(ROUNDS):
        for label, graph in graphs.items():
            timings[label].append(replay_us(graph))
    return {label: statistics.median(values) for label, values in timings.items()}


def capture(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """A graph of CALLS_PER_GRAPH calls of `fn`, replayed once."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compiles and warms up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def replay_us(graph: torch.cuda.CUDAGraph) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / (CALLS_PER_GRAPH * REPLAYS)


def host_us(fn: Callable[[], object]) -> float:
    """Host microseconds per eager call (the GPU may lag behind; it is waited for after)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(HOST_CALLS):
        fn()
    seconds = time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e6 * seconds / HOST_CALLS


def decode_variant_launches(num_kv_heads: int, head_dim: int) -> dict[str, dict[str, object]]:
    """The decode kernel's variants (kernels/_decode_variants.py) over the default launch:
    all kv heads in one program, the fused merge, and both; the head blocks first in the grid,
    alone and with all kv heads in one program; partitions sized to fill whole waves of 2, 4
    or 8 programs per SM (kernels/_decode_waves.py). TILE_N counts (token, kv head)
    columns there: 16 KB of bfloat16 keys a step (128 columns of 64, 64 of 128), twice the
    default's 64 tokens of one kv head at 64 wide, as much at 128, where more would not fit
    three stages of K and V in shared memory."""
    from splitserve.kernels.decode_attention import DEFAULT_LAUNCH

    kv_heads = min(8, 1 << (num_kv_heads - 1).bit_length())
    heads = {**DEFAULT_LAUNCH, "KV_HEADS": kv_heads, "TILE_N": 8192 // head_dim}
    return {
        f"kv_heads={kv_heads}": heads,
        "fused_merge": {**DEFAULT_LAUNCH, "FUSED_MERGE": 1},
        f"kv_heads={kv_heads}+fused_merge": {**heads, "FUSED_MERGE": 1},
        "heads_first": {**DEFAULT_LAUNCH, "HEADS_FIRST": 1},
        **{f"waves={slots}": {**DEFAULT_LAUNCH, "WAVE_SLOTS": slots} for slots in (2, 4, 8)},
        f"kv_heads={kv_heads}+heads_first": {**heads, "HEADS_FIRST": 1},
    }


def decode_rows(extra_launches: list[dict[str, object]] | None = None) -> list[dict[str, object]]:
    """Per layout: the tuned launch, the default, each variant, each of `extra_launches`
    (--decode-launch), SDPA; then each one's speed against SDPA (issue 41's bar: >= 1.0)."""
    from splitserve.kernels.decode_attention import DEFAULT_LAUNCH, paged_decode_attention

    rows: list[dict[str, object]] = []
    batch, context, block_size = 64, 4096, 16
    for num_heads, num_kv_heads, head_dim in ((9, 3, 64), (32, 8, 128)):
        blocks = batch * context // block_size
        kv = torch.randn(2, blocks, block_size, num_kv_heads, head_dim, device="cuda")
        kv = kv.to(torch.bfloat16)
        tables = torch.randperm(blocks, device="cuda").int().view(batch, -1)
        lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        query = torch.randn(batch, num_heads, head_dim, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(query)
        scale = head_dim**-0.5
        pages = kv[:, tables.long()].reshape(2, batch, context, num_kv_heads, head_dim)
        keys, values = (pages[i].transpose(1, 2).contiguous() for i in range(2))
        name = f"decode {num_heads}/{num_kv_heads}x{head_dim} b{batch} ctx{context}"
        moved = 2 * kv.numel() * kv.element_size()
        expected = F.scaled_dot_product_attention(query[:, :, None].float(), keys.float(),
                                                   values.float(), scale=scale,
                                                   enable_gqa=True)[:, :, 0]  # fmt: skip
        launches: dict[str, dict[str, object] | None] = {"tuned": None,
                                                        "default": dict(DEFAULT_LAUNCH)}
        launches.update(decode_variant_launches(num_kv_heads, head_dim))
        launches.update({json.dumps(extra): extra for extra in extra_launches or []})
        calls = {
            label: lambda launch=launch: paged_decode_attention(query, kv[0], kv[1], tables,
                                                                lens, scale, out, launch=launch)
            for label, launch in launches.items()
        }  # fmt: skip
        calls["sdpa"] = lambda: F.scaled_dot_product_attention(
            query[:, :, None], keys, values, scale=scale, enable_gqa=True)  # fmt: skip
        checked = {label: fn for label, fn in calls.items()
                   if label == "sdpa" or _agrees(fn, expected, f"{name} {label}")}  # fmt: skip
        gpu = interleaved_graph_us(checked)
        layout_rows = [_row(f"{name} {label}", fn, moved // 2, gpu[label])
                       for label, fn in checked.items()]  # fmt: skip
        _print_against_sdpa(layout_rows)
        rows += layout_rows
    return rows


def _agrees(fn: Callable[[], torch.Tensor], expected: torch.Tensor, name: str) -> bool:
    """A launch that gives a wrong answer (or fails to compile) is reported, never timed."""
    try:
        error = float((fn().float() - expected).abs().max() / expected.abs().max())
    except Exception as failure:  # a launch the compiler or the device refuses
        print(f"{name:45s} FAILED {type(failure).__name__}: {str(failure)[:200]}", flush=True)
        return False
    if not error <= 2e-2:  # bfloat16's bound in benchmarks.triton_tune; NaN included
        print(f"{name:45s} WRONG: relative error {error:.3g}", flush=True)
        return False
    return True


def _print_against_sdpa(layout_rows: list[dict[str, object]]) -> None:
    sdpa = next(float(row["gpu_us"]) for row in layout_rows if str(row["name"]).endswith("sdpa"))
    for row in layout_rows:
        row["vs_sdpa"] = sdpa / float(row["gpu_us"])
        print(f"  {row['name']:60s} {row['vs_sdpa']:.3f}x SDPA's speed", flush=True)


def matmul_rows() -> list[dict[str, object]]:
    from splitserve.kernels import reference
    from splitserve.kernels.dequant_matmul import DEFAULT_LAUNCH, int4_group_matmul, int8_matmul

    rows: list[dict[str, object]] = []
    for out, inner in ((3072, 576), (576, 1536), (4096, 4096), (14336, 4096)):
        codes = torch.randint(-127, 128, (out, inner), dtype=torch.int8, device="cuda")
        scales = torch.rand(out, device="cuda").to(torch.bfloat16)
        packed = reference.pack_int4_groups(torch.randint(0, 16, (out, inner), device="cuda"))
        group_scales = torch.rand(out, inner // 32, device="cuda").half()
        minimums = -8 * group_scales
        dense = torch.randn(out, inner, device="cuda", dtype=torch.bfloat16)
        for num_rows in (1, 16):
            x = torch.randn(num_rows, inner, device="cuda", dtype=torch.bfloat16)
            default = dict(DEFAULT_LAUNCH)
            name = f"{num_rows}x{inner}->{out}"
            calls = {
                "int8 tuned": lambda: int8_matmul(x, codes, scales),
                "int8 default": lambda: int8_matmul(x, codes, scales, launch=default),
                "int4 tuned": lambda: int4_group_matmul(x, packed, group_scales, minimums),
                "int4 default": lambda: int4_group_matmul(x, packed, group_scales, minimums,
                                                          launch=default),
                # int4's other inner loops (kernels/dequant_matmul.py) over the tuned tiles.
                "int4 group_dot": lambda: int4_group_matmul(x, packed, group_scales, minimums,
                                                            launch={"INT4_LOOP": "group_dot"}),
                "int4 gemv": lambda: int4_group_matmul(x, packed, group_scales, minimums,
                                                       launch={"INT4_LOOP": "gemv"}),
                "dense bf16": lambda: F.linear(x, dense),
            }  # fmt: skip
            # Bytes of weight each reads: int4's codes plus a scale and minimum per 16 bytes.
            sizes = {"int8": codes.numel(), "int4": packed.numel() * 1.125,
                     "dense": 2 * out * inner}  # fmt: skip
            for label, fn in calls.items():
                rows.append(_row(f"{label} {name}", fn, int(sizes[label.split()[0]])))
    return rows


def _row(
    name: str, fn: Callable[[], object], weight_bytes: int, gpu: float | None = None
) -> dict[str, object]:
    """`gpu`: the call's GPU microseconds where already timed, else timed here."""
    gpu = graph_us(fn) if gpu is None else gpu
    row = {"name": name, "gpu_us": gpu, "host_us": host_us(fn),
           "gb_per_s": weight_bytes / gpu / 1e3}  # fmt: skip
    print(f"{name:45s} gpu {gpu:8.1f} us ({row['gb_per_s']:6.0f} GB/s)  host "
          f"{row['host_us']:6.1f} us per eager call", flush=True)  # fmt: skip
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", default="")
    parser.add_argument("--decode-launch", action="append", type=json.loads, default=[],
                        help="also time decode attention with this launch (JSON), repeatable")
    parser.add_argument("--decode-only", action="store_true", help="skip the matmuls")
    parser.add_argument("--matmul-only", action="store_true", help="skip decode attention")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_graph_timings needs a CUDA device", file=sys.stderr)
        return 2
    print(f"device: {torch.cuda.get_device_name()}", flush=True)
    rows = [] if args.matmul_only else decode_rows(args.decode_launch)
    rows += [] if args.decode_only else matmul_rows()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
