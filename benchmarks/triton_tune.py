"""Tunes the Triton kernels' launch configurations on this GPU and writes its table.

    python -m benchmarks.triton_tune [--out FILE] [--record FILE] [--budget-s 150] [--smoke]
        [--only decode_attention ...]

For each shape that serving runs (decode attention at batch 64 over 4096-token contexts for
SmolLM2's 9/3x64 heads and a Llama-3-8B-like 32/8x128, in bfloat16 and float32; the int8 and
int4 dequantizing matmuls of 1, 16 and 256 rows on SmolLM2's and Llama-3-8B's weight shapes,
in bfloat16), a coordinate search from the kernel's default (for bfloat16 attention it also
tries the kernel's variants, `decode_space`): each meta-parameter in turn takes
each of its values, the candidate is checked against the PyTorch reference (a wrong result
disqualifies it and is printed: a kernel bug at that configuration) and timed from CUDA-graph
replays (`Timer`); the fastest correct one stays, and a second pass starts from it. The table
(`--out`, default kernels/configs/<gpu>.json, read by kernels/launch_configs.py) gets each
shape's winner, and each matmul row bucket the winner of its largest weight, for weights not
tuned here. The shapes go in order of what serving needs most, and the run stops at
`--budget-s`, writing what it has: the table after every shape, so a killed run keeps its part.

`--smoke` runs the plumbing on the CPU in Triton's interpreter with tiny shapes and two
candidates per shape; its timings mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

Launch = dict[str, Any]


@dataclass
class Shape:
    """One table entry to tune: how to run the kernel with a launch, and its reference."""

    kernel: str  # the table's kernel name
    key: str  # the table's key
    run: Callable[[Launch], torch.Tensor]
    expected: torch.Tensor  # float32
    space: dict[str, list[Any]]  # meta-parameter -> values to try
    default: Launch
    tolerance: float
    bucket_key: str = ""  # a matmul's row-bucket key, which its largest weight's winner fills
    weight_size: int = 0
    passes: int | None = None  # None: the plan's


@dataclass
class Outcome:
    kernel: str
    key: str
    default_ms: float
    best_ms: float
    best: Launch
    tried: int
    wrong: list[Launch] = field(default_factory=list)  # candidates that disagreed with reference
    failed: list[str] = field(default_factory=list)  # candidates that did not compile or run

    @property
    def speedup(self) -> float:
        return self.default_ms / self.best_ms


@dataclass(frozen=True)
class Plan:
    device: torch.device
    decode_layouts: tuple[tuple[int, int, int], ...]
    decode_batch: int
    decode_context: int
    attention_dtypes: tuple[torch.dtype, ...]
    variant_dtypes: tuple[torch.dtype, ...]  # whose decode shapes also search KV_HEADS, FUSED_MERGE
    matmul_shapes: tuple[tuple[int, int], ...]  # (out, in)
    matmul_rows: tuple[int, ...]
    passes: int
    max_values: int | None  # smoke: at most this many values per parameter


FULL = Plan(
    device=torch.device("cuda"),
    decode_layouts=((9, 3, 64), (32, 8, 128)),
    decode_batch=64,
    decode_context=4096,
    attention_dtypes=(torch.bfloat16, torch.float32),
    variant_dtypes=(torch.bfloat16,),  # issue 41's bar; float32 keeps its budget as it was
    # SmolLM2-135M: qkv, o, gate_up, down; a Llama-3-8B-like q/o and gate.
    matmul_shapes=((960, 576), (576, 576), (3072, 576), (576, 1536), (4096, 4096), (14336, 4096)),
    matmul_rows=(1, 16, 256),
    passes=2,
    max_values=None,
)
SMOKE = Plan(
    device=torch.device("cpu"),
    decode_layouts=((6, 2, 32),),
    decode_batch=2,
    decode_context=40,
    attention_dtypes=(torch.float32,),
    variant_dtypes=(torch.float32,),
    matmul_shapes=((40, 64),),
    matmul_rows=(1,),
    passes=1,
    max_values=2,
)
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def decode_shapes(plan: Plan, dtype: torch.dtype) -> Iterator[Shape]:
    from splitserve.kernels import reference
    from splitserve.kernels.decode_attention import (
        DEFAULT_LAUNCH,
        decode_launch_key,
        paged_decode_attention,
    )

    block_size = 16
    for num_heads, num_kv_heads, head_dim in plan.decode_layouts:
        batch, context = plan.decode_batch, plan.decode_context
        blocks_per_seq = -(-context // block_size)
        num_blocks = batch * blocks_per_seq
        generator = torch.Generator(device=plan.device).manual_seed(head_dim)
        kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, device=plan.device,
                         generator=generator).to(dtype)  # fmt: skip
        tables = torch.randperm(num_blocks, device=plan.device, generator=generator)
        tables = tables.int().view(batch, -1)
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device=plan.device)
        query = torch.randn(batch, num_heads, head_dim, device=plan.device, generator=generator)
        query = query.to(dtype)
        scale = head_dim**-0.5
        expected = reference.paged_decode_attention(
            query.float(), kv[0].float(), kv[1].float(), tables, seq_lens, scale
        )

        def run(launch: Launch, q=query, kv=kv, tables=tables, lens=seq_lens, s=scale):
            # The partition size from the launch: PARTITION_SIZE, or WAVE_SLOTS's choice.
            return paged_decode_attention(q, kv[0], kv[1], tables, lens, s, launch=launch)

        group = num_heads // num_kv_heads
        yield Shape(
            kernel="decode_attention",
            key=decode_launch_key(dtype, head_dim, group, block_size, kv_int8=False),
            run=run,
            expected=expected,
            space=decode_space(plan, dtype, num_kv_heads),
            default=dict(DEFAULT_LAUNCH),
            tolerance=TOLERANCE[dtype],
        )


def decode_space(plan: Plan, dtype: torch.dtype, num_kv_heads: int) -> dict[str, list[Any]]:
    """Decode attention's coordinates, in search order. For `plan.variant_dtypes` the variants'
    keys too (kernels/_decode_variants.py): KV_HEADS and HEADS_FIRST first, so that the tiles,
    warps and partitions after them are searched for the kernel picked; TILE_N 256, which only a
    several-kv-head program needs for a step as long as the one-kv-head kernel's 64 tokens
    (TILE_N counts (token, kv head) columns); WAVE_SLOTS after PARTITION_SIZE, which it
    replaces when not 0; FUSED_MERGE after the partition size that sets how much there is to
    merge. One coordinate each, not a product. num_stages=1 gave up its
    place: it won no decode shape on the H100 (docs/benchmarks.md), as one stage keeps no load
    in flight during the math of a loop bound by its loads."""
    variants = dtype in plan.variant_dtypes
    space: dict[str, list[Any]] = {}
    if variants:
        space["KV_HEADS"] = [n for n in (1, 2, 4, 8) if n < 2 * num_kv_heads]
        space["HEADS_FIRST"] = [0, 1]
    space.update(TILE_N=[32, 64, 128, 256] if variants else [32, 64, 128], num_warps=[2, 4, 8],
                 num_stages=[2, 3, 4], PARTITION_SIZE=[256, 512, 1024])  # fmt: skip
    if variants:
        # 0: PARTITION_SIZE as searched; else partitions sized to fill whole waves of
        # WAVE_SLOTS programs per SM (kernels/_decode_waves.py).
        space["WAVE_SLOTS"] = [0, 2, 3, 4, 6, 8]
        space["FUSED_MERGE"] = [0, 1]
    return space


def matmul_shapes(plan: Plan, kind: str, rows: int, dtype: torch.dtype) -> Iterator[Shape]:
    from splitserve.kernels import reference
    from splitserve.kernels.dequant_matmul import (
        DEFAULT_LAUNCH,
        default_block_m,
        int4_group_matmul,
        int8_matmul,
        matmul_launch_key,
    )

    for out, inner in plan.matmul_shapes:
        generator = torch.Generator(device=plan.device).manual_seed(out * 7 + inner)
        x = torch.randn(rows, inner, device=plan.device, generator=generator).to(dtype)
        if kind == "int8":
            codes = torch.randint(-127, 128, (out, inner), dtype=torch.int8, device=plan.device,
                                  generator=generator)  # fmt: skip
            scales = ((torch.rand(out, device=plan.device, generator=generator) + 0.5) / 127).to(
                torch.bfloat16
            )
            expected = reference.int8_matmul(x.float(), codes, scales)

            def run(launch: Launch, x=x, codes=codes, scales=scales) -> torch.Tensor:
                return int8_matmul(x, codes, scales, launch=launch)
        else:
            groups = inner // reference.INT4_GROUP_SIZE
            codes = torch.randint(0, 16, (out, inner), device=plan.device, generator=generator)
            group_scales = (torch.rand(out, groups, device=plan.device, generator=generator)
                            + 0.5) / 15  # fmt: skip
            minimums = -8 * group_scales
            packed = reference.pack_int4_groups(codes)
            group_scales, minimums = group_scales.half(), minimums.half()
            expected = reference.int4_group_matmul(x.float(), packed, group_scales, minimums)

            def run(launch: Launch, x=x, p=packed, s=group_scales, m=minimums) -> torch.Tensor:
                return int4_group_matmul(x, p, s, m, launch=launch)

        # Most telling first: with one pass, what comes first is searched from the default.
        space: dict[str, list[Any]] = dict(
            SPLIT_K=[1, 2, 4, 8],
            BLOCK_N=[16, 32, 64, 128],
            BLOCK_K=[64, 128, 256],
            num_warps=[2, 4, 8],
            num_stages=[2, 3, 4],
        )
        if kind == "int4":
            space["SCALE_BROADCAST"] = [0, 1]
            # The inner loop first, so that the tiles after it are searched for the loop it
            # picks (H100, 1 x 4096 -> 4096 without split-K: group_dot 58 us, dequant 123);
            # gemv for one row only: without tensor cores 16 rows took it 200+ us (dequant 36).
            space = {"INT4_LOOP": ["group_dot", "gemv"] if rows == 1 else ["group_dot"], **space}
        if rows > 16:
            space["BLOCK_M"] = [16, 32, 64, 128]
        # The kernel's own row tile made explicit: an entry then means the same if that
        # choice changes later.
        default = {**DEFAULT_LAUNCH, "BLOCK_M": default_block_m(rows)}
        yield Shape(
            kernel=f"{kind}_matmul",
            key=matmul_launch_key(kind, dtype, rows, out, inner),
            run=run,
            expected=expected,
            space=space,
            default=default,
            tolerance=TOLERANCE[dtype],
            bucket_key=matmul_launch_key(kind, dtype, rows),
            weight_size=out * inner,
            passes=1,  # 24 shapes share the budget with attention's four
        )


def all_shapes(plan: Plan) -> Iterator[Shape]:
    """In the order serving needs them: half-precision decode attention, then the matmuls of
    a decode step (1, 16 rows), float32 attention, prefill-sized matmuls."""
    half = [dtype for dtype in plan.attention_dtypes if dtype != torch.float32]
    for dtype in half:
        yield from decode_shapes(plan, dtype)
    matmul_dtype = half[0] if half else torch.float32
    for rows in plan.matmul_rows:
        if rows <= 16:
            for kind in ("int4", "int8"):  # int4 first: it lost most to dense on the H100
                yield from matmul_shapes(plan, kind, rows, matmul_dtype)
    if torch.float32 in plan.attention_dtypes:
        yield from decode_shapes(plan, torch.float32)
    for rows in plan.matmul_rows:
        if rows > 16:
            for kind in ("int4", "int8"):
                yield from matmul_shapes(plan, kind, rows, matmul_dtype)


class Timer:
    """Milliseconds per call: GPU time from CUDA-graph replays on CUDA, wall clock elsewhere.

    Not `do_bench`: its events around each eager call measured the Python wrapper and the
    launcher (50-110 us on the H100) rather than kernels of 3-40 us, and the first tuned table
    kept some winners of that noise (docs/benchmarks.md, "GPU (issue 41)")."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self, fn: Callable[[], object]) -> float:
        if self.device.type == "cuda":
            from benchmarks.gpu_graph_timings import graph_us

            return graph_us(fn) / 1e3
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    difference = (got.float() - expected).abs().max()
    return float(difference / expected.abs().max().clamp(min=1e-6))


def search(shape: Shape, plan: Plan, timer: Timer, deadline: float) -> Outcome:
    """Coordinate search from the default (module docstring)."""
    timings: dict[str, float] = {}
    outcome = Outcome(shape.kernel, shape.key, float("nan"), float("inf"), dict(shape.default), 0)

    def measure(launch: Launch) -> float:
        name = json.dumps(launch, sort_keys=True)
        if name not in timings:
            timings[name] = _measure_one(shape, launch, timer, outcome)
            outcome.tried += 1
        return timings[name]

    best = dict(shape.default)
    best_ms = outcome.default_ms = measure(best)
    for _ in range(shape.passes or plan.passes):
        for param, values in shape.space.items():
            for value in values[: plan.max_values]:
                if time.monotonic() > deadline:
                    break
                candidate = {**best, param: value}
                ms = measure(candidate)
                if ms < best_ms:
                    best, best_ms = candidate, ms
    outcome.best, outcome.best_ms = best, best_ms
    return outcome


def _measure_one(shape: Shape, launch: Launch, timer: Timer, outcome: Outcome) -> float:
    try:
        got = shape.run(launch)
    except Exception as error:  # a configuration the compiler or the device refuses
        outcome.failed.append(f"{launch}: {type(error).__name__}: {str(error)[:200]}")
        return float("inf")
    error = relative_error(got, shape.expected)
    if not error <= shape.tolerance:  # NaN included
        outcome.wrong.append({**launch, "error": error})
        print(f"  WRONG {shape.kernel} {shape.key} {launch}: error {error:.3g}", flush=True)
        return float("inf")
    return timer(lambda: shape.run(launch))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="", help="the table (default kernels/configs/<gpu>.json)")
    parser.add_argument("--record", default="", help="every shape's outcome, as JSON")
    parser.add_argument("--budget-s", type=float, default=150.0)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--only", action="append", default=[], metavar="KERNEL",
                        help="tune this kernel's shapes only (decode_attention, int8_matmul, "
                        "int4_matmul), repeatable; needs --out: a partial table must not "
                        "replace the shipped one")  # fmt: skip
    args = parser.parse_args(argv)
    if args.only and not args.out:
        parser.error("--only needs --out")
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    plan = SMOKE if args.smoke else FULL
    if plan.device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to tune (--smoke runs the plumbing on the CPU)")
        return 1
    from splitserve.kernels import launch_configs

    device_name = torch.cuda.get_device_name() if plan.device.type == "cuda" else "cpu"
    out = Path(args.out) if args.out else launch_configs.table_path(device_name)
    deadline = time.monotonic() + args.budget_s
    print(f"tuning the Triton kernels on {device_name} for {args.budget_s:.0f} s", flush=True)
    return run_search(plan, device_name, out, Path(args.record) if args.record else None,
                      deadline, tuple(args.only))  # fmt: skip


def run_search(
    plan: Plan,
    device_name: str,
    out: Path,
    record: Path | None,
    deadline: float,
    only: tuple[str, ...] = (),  # kernels to tune; () all
) -> int:
    from splitserve.kernels import launch_configs

    timer = Timer(plan.device)
    table: dict[str, dict[str, Launch]] = {}
    outcomes: list[Outcome] = []
    bucket_sizes: dict[tuple[str, str], int] = {}
    for shape in all_shapes(plan):
        if only and shape.kernel not in only:
            continue
        if time.monotonic() > deadline:
            print(f"budget spent: {shape.kernel} {shape.key} and after not tuned", flush=True)
            break
        outcome = search(shape, plan, timer, deadline)
        outcomes.append(outcome)
        print(f"{shape.kernel} {shape.key}: default {outcome.default_ms:.4f} ms -> "
              f"{outcome.best_ms:.4f} ms ({outcome.speedup:.2f}x) {outcome.best} "
              f"[{outcome.tried} tried, {len(outcome.wrong)} wrong, {len(outcome.failed)} "
              "failed]", flush=True)  # fmt: skip
        entries = table.setdefault(shape.kernel, {})
        entries[shape.key] = dict(outcome.best)
        bucket = (shape.kernel, shape.bucket_key)
        if shape.bucket_key and shape.weight_size >= bucket_sizes.get(bucket, 0):
            bucket_sizes[bucket] = shape.weight_size
            entries[shape.bucket_key] = dict(outcome.best)
        launch_configs.write_table(out, device_name, table)
        if record is not None:
            record.write_text(json.dumps([asdict(o) for o in outcomes], indent=1, default=str))
    print(f"table: {out}")
    return 0 if not any(outcome.wrong for outcome in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
