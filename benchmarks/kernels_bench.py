"""GPU benchmark of every kernel: `python -m benchmarks.kernels_bench [--dtype
bfloat16|float16|float32]`.

For each kernel: check the result on CUDA against `splitserve.kernels.reference`, time it with
`triton.testing.do_bench` (median, L2 flushed between runs), and print the bandwidth it
achieves (bytes it must move / time) next to the device's copy bandwidth measured the same way,
so "% of copy" says how close a memory-bound kernel is to the roofline. Decode attention is also
checked and timed against `torch.nn.functional.scaled_dot_product_attention` on contiguous K/V
of the same sizes: the same bytes without paging, a bar the paged kernel should meet; the
dequantizing matmuls beside a dense product of the same sizes in the run's dtype at 1, 16 and
256 rows (benchmarks/kernels_bench_dequant.py). Prints figures; never asserts a speed. Exits 1
if any result disagrees with its reference. `--json PATH` also writes every row, every check
and the copy bandwidth there (what `python -m benchmarks.gpu_check` collects).

`--smoke` runs the same steps and checks with tiny shapes on whatever device there is: CUDA
(still timed by do_bench), or the CPU under Triton's interpreter (TRITON_INTERPRET=1, timed by
a wall clock; those timings mean nothing). It exists so that a CPU test runs every line of this
program before a scarce GPU session does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from benchmarks.kernels_bench_dequant import bench_dequant_matmul
from benchmarks.kernels_bench_harness import (  # noqa: F401 (TOLERANCE: tests read it here)
    TOLERANCE,
    BenchContext,
    Checker,
    Timing,
    TimingFigures,
    do_bench_ms,
    nbytes,
    wall_clock_ms,
)
from splitserve.kernels import reference

MIN_PARTITION_SIZE = 16  # paged_decode_attention's smallest partition
RMS_EPS = 1e-5


@dataclass(frozen=True)
class BenchShapes:
    """Every size the benchmark uses: FULL for a GPU run, SMOKE for a quick run of each path."""

    name: str
    head_layouts: tuple[tuple[int, int, int], ...]  # (num_heads, num_kv_heads, head_dim)
    block_size: int
    decode_batch: int
    decode_context: int
    # Split partition sizes, each checked and timed; one partition covering the whole context
    # (no split, no merge kernel) is always added.
    decode_partition_sizes: tuple[int, ...]
    prefill_seqs: int
    prefill_shapes: tuple[tuple[int, int], ...]  # (context, query_len) of every sequence
    num_tokens: int  # rows of write_kv, rms norm and rotary
    write_kv_layout: tuple[int, int]  # (num_kv_heads, head_dim)
    max_position: int  # rows of the rotary table
    norm_hidden_sizes: tuple[int, ...]
    page_layers: int
    page_layout: tuple[int, int]  # (num_kv_heads, head_dim)
    page_cache_blocks: int  # blocks in the cache
    page_blocks: int  # blocks packed and unpacked
    copy_buffer_bytes: int  # the copy-bandwidth reference moves twice this (read + write)
    # Dequantizing matmuls (benchmarks/kernels_bench_dequant.py): weights (out, in) and rows of x.
    dequant_shapes: tuple[tuple[int, int], ...]
    dequant_rows: tuple[int, ...]

    def __post_init__(self) -> None:
        for size in self.decode_partition_sizes:
            if not _is_valid_partition(size):
                raise ValueError(f"decode partition size {size} is not a power of two >= 16")
        for context, query_len in self.prefill_shapes:
            if not 0 < query_len <= context:
                raise ValueError(f"prefill shape ({context}, {query_len}) needs 0 < q <= ctx")
        if self.page_blocks > self.page_cache_blocks:
            raise ValueError("page_blocks must not exceed page_cache_blocks")
        if 2 * self.num_tokens > self.write_kv_num_blocks * self.block_size:
            raise ValueError("write_kv's cache must have room for twice num_tokens")

    @property
    def single_partition_size(self) -> int:
        """The smallest valid partition holding the whole decode context."""
        return max(MIN_PARTITION_SIZE, 1 << (self.decode_context - 1).bit_length())

    @property
    def write_kv_num_blocks(self) -> int:
        return 2 * -(-self.num_tokens // self.block_size)  # half the slots get written


def _is_valid_partition(size: int) -> bool:
    return size >= MIN_PARTITION_SIZE and not size & (size - 1)


# Peak GPU memory, float32 (bfloat16 needs less): about 12 GiB in decode 32/8x128 (a 2 GiB
# paged cache, 2 GiB of contiguous K/V for SDPA, 8 GiB while SDPA's math backend repeats K/V
# for 32 heads) and about 14 GiB in pack/unpack (three 1.4 GiB caches, plus the checker's
# float64 copies of the whole cache); every other step stays under 2 GiB. Each step's tensors
# are freed before the next, so an 80 GB GPU has room to spare.
FULL = BenchShapes(
    name="full",
    head_layouts=((9, 3, 64), (32, 8, 128)),  # SmolLM2-135M, and a Llama-3-8B-like layout
    block_size=16,
    decode_batch=64,
    decode_context=4096,
    decode_partition_sizes=(256, 512, 1024),  # around the wrapper's default of 512
    prefill_seqs=8,
    prefill_shapes=((1024, 1024), (4096, 512)),  # whole prompts, then chunks after a prefix
    num_tokens=8192,
    write_kv_layout=(8, 128),
    max_position=8192,
    norm_hidden_sizes=(576, 4096),
    page_layers=30,  # SmolLM2-135M's cache: 30 layers of 3 kv heads x 64
    page_layout=(3, 64),
    page_cache_blocks=2048,
    page_blocks=512,
    copy_buffer_bytes=1 << 29,
    # SmolLM2-135M's gate_up and down, a Llama-3-8B-like q/o and gate (or up); decode rows,
    # a decode batch, a prefill chunk.
    dequant_shapes=((3072, 576), (576, 1536), (4096, 4096), (14336, 4096)),
    dequant_rows=(1, 16, 256),
)

# Odd sizes on purpose: a context that ends mid-block and mid-partition, a GQA group of 3
# (padded to 4), a prefix longer than its chunk and than one key tile, hidden sizes that are
# not powers of two.
SMOKE = BenchShapes(
    name="smoke",
    head_layouts=((6, 2, 32), (8, 2, 16)),
    block_size=16,
    decode_batch=3,
    decode_context=72,
    decode_partition_sizes=(16, 32),
    prefill_seqs=2,
    prefill_shapes=((40, 40), (100, 24)),
    num_tokens=24,
    write_kv_layout=(2, 16),
    max_position=64,
    norm_hidden_sizes=(40, 96),
    page_layers=2,
    page_layout=(2, 16),
    page_cache_blocks=8,
    page_blocks=3,
    copy_buffer_bytes=1 << 20,
    dequant_shapes=((100, 64),),  # 100: not a multiple of the kernels' 64-column tile
    dequant_rows=(1, 3),
)


def copy_bandwidth_gbps(ctx: BenchContext) -> float:
    src = torch.empty(ctx.shapes.copy_buffer_bytes, dtype=torch.uint8, device=ctx.device)
    src.random_()
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of dst's pages, which the wall clock would otherwise count
    ms = ctx.time_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / ms / 1e6  # read + write


@dataclass
class PagedCache:
    kv: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor  # [num_seqs, blocks_per_seq] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, all equal to the context


def paged_cache(
    ctx: BenchContext, num_seqs: int, context: int, num_kv_heads: int, head_dim: int
) -> PagedCache:
    """Every sequence's blocks shuffled over the whole cache, as a long-running server's would
    be; every block belongs to some sequence, so the cache's size is what attention must read
    (up to the unused tail of each sequence's last block)."""
    block_size = ctx.shapes.block_size
    blocks_per_seq = -(-context // block_size)
    num_blocks = num_seqs * blocks_per_seq
    kv = ctx.randn(2, num_blocks, block_size, num_kv_heads, head_dim)
    block_tables = torch.randperm(num_blocks, device=ctx.device).int().view(num_seqs, -1)
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32, device=ctx.device)
    return PagedCache(kv, block_tables, seq_lens)


def contiguous_kv(cache: torch.Tensor, block_tables: torch.Tensor, context: int) -> torch.Tensor:
    """The same keys laid out `[num_seqs, kv_heads, context, head_dim]`, for SDPA."""
    num_seqs = block_tables.shape[0]
    pages = cache[block_tables.long()]  # [num_seqs, blocks, block_size, kv_heads, head_dim]
    tokens = pages.reshape(num_seqs, -1, *cache.shape[2:])[:, :context]
    return tokens.transpose(1, 2).contiguous()


def sdpa_decode(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float):
    """query [num_seqs, num_heads, head_dim] as one token `[num_seqs, num_heads, 1, head_dim]`.

    enable_gqa repeats each kv head for `num_heads // num_kv_heads` consecutive query heads
    (repeat_interleave), so query head h reads kv head h // group, as the kernels and the
    reference do; the "vs sdpa" check would catch any other pairing."""
    out = torch.nn.functional.scaled_dot_product_attention(
        query[:, :, None], keys, values, scale=scale, enable_gqa=True
    )
    return out[:, :, 0]


def bench_decode(ctx: BenchContext, layout: tuple[int, int, int]) -> list[Timing]:
    from splitserve.kernels.decode_attention import paged_decode_attention

    num_heads, num_kv_heads, head_dim = layout
    shapes = ctx.shapes
    batch, context = shapes.decode_batch, shapes.decode_context
    cache = paged_cache(ctx, batch, context, num_kv_heads, head_dim)
    key_cache, value_cache = cache.kv[0], cache.kv[1]
    query = ctx.randn(batch, num_heads, head_dim)
    scale = head_dim**-0.5
    args = (query, key_cache, value_cache, cache.block_tables, cache.seq_lens, scale)
    name = f"decode {num_heads}/{num_kv_heads}x{head_dim} b{batch} ctx{context}"
    expected = reference.paged_decode_attention(
        query.float(),
        key_cache.float(),
        value_cache.float(),
        cache.block_tables,
        cache.seq_lens,
        scale,
    )
    # Every timed partition size is checked too: a size the kernel gets wrong must not
    # produce a figure.
    sizes = (*shapes.decode_partition_sizes, shapes.single_partition_size)
    for size in sizes:
        ctx.checker.check(
            f"{name} part{size}", paged_decode_attention(*args, partition_size=size), expected
        )
    out = paged_decode_attention(*args)
    keys = contiguous_kv(key_cache, cache.block_tables, context)
    values = contiguous_kv(value_cache, cache.block_tables, context)
    ctx.checker.check(f"{name} vs sdpa", out, sdpa_decode(query, keys, values, scale).float())
    # Paged: K and V of every context token once (the whole cache), query, output, block table.
    moved = nbytes(key_cache, value_cache, query, out, cache.block_tables)
    flops = 4 * batch * num_heads * context * head_dim  # q.k and p.v: 2 flops per mul-add
    timings = [
        Timing(
            f"{name} part{size}",
            ctx.time_ms(lambda s=size: paged_decode_attention(*args, partition_size=s)),
            moved,
            flops,
        )
        for size in sizes
    ]
    timings.append(
        Timing(
            f"{name} sdpa contiguous",
            ctx.time_ms(lambda: sdpa_decode(query, keys, values, scale)),
            nbytes(keys, values, query, out),
            flops,
        )
    )
    return timings


def bench_decode_int8(ctx: BenchContext, layout: tuple[int, int, int]) -> list[Timing]:
    """Decode attention over an int8 cache (kv_cache_dtype int8: codes and a bfloat16 scale per
    row, kernels/kv_int8.py) of the same keys: about half the bytes of bfloat16 to read."""
    from splitserve.kernels.decode_attention import paged_decode_attention
    from splitserve.kernels.kv_int8 import quantize_rows

    num_heads, num_kv_heads, head_dim = layout
    batch, context = ctx.shapes.decode_batch, ctx.shapes.decode_context
    cache = paged_cache(ctx, batch, context, num_kv_heads, head_dim)
    kv = quantize_rows(cache.kv)
    query = ctx.randn(batch, num_heads, head_dim)
    args = (query, kv[0], kv[1], cache.block_tables, cache.seq_lens, head_dim**-0.5)
    name = f"decode {num_heads}/{num_kv_heads}x{head_dim} b{batch} ctx{context} int8"
    out = paged_decode_attention(*args)
    expected = reference.paged_decode_attention(query.float(), *args[1:])
    ctx.checker.check(name, out, expected)
    moved = nbytes(kv, query, out, cache.block_tables)
    flops = 4 * batch * num_heads * context * head_dim
    return [Timing(name, ctx.time_ms(lambda: paged_decode_attention(*args)), moved, flops)]


def bench_prefill(ctx: BenchContext, layout: tuple[int, int, int]) -> list[Timing]:
    return [
        bench_prefill_shape(ctx, layout, context, query_len)
        for context, query_len in ctx.shapes.prefill_shapes
    ]


def bench_prefill_shape(
    ctx: BenchContext, layout: tuple[int, int, int], context: int, query_len: int
) -> Timing:
    from splitserve.kernels.prefill_attention import paged_prefill_attention

    num_heads, num_kv_heads, head_dim = layout
    num_seqs = ctx.shapes.prefill_seqs
    cache = paged_cache(ctx, num_seqs, context, num_kv_heads, head_dim)
    key_cache, value_cache = cache.kv[0], cache.kv[1]
    query = ctx.randn(num_seqs * query_len, num_heads, head_dim)
    starts = torch.arange(num_seqs + 1, device=ctx.device, dtype=torch.int32) * query_len
    scale = head_dim**-0.5
    args = (query, key_cache, value_cache, cache.block_tables, starts, cache.seq_lens, scale)
    name = f"prefill {num_heads}/{num_kv_heads}x{head_dim} {num_seqs}x{query_len} ctx{context}"
    out = paged_prefill_attention(*args, max_query_len=query_len)
    ctx.checker.check(
        name,
        out,
        reference.paged_prefill_attention(
            query.float(),
            key_cache.float(),
            value_cache.float(),
            cache.block_tables,
            starts,
            cache.seq_lens,
            scale,
        ),
    )
    # | prefix: every new token sees all of it | new tokens: causal triangle |
    prefix = context - query_len
    visible = num_seqs * (query_len * prefix + query_len * (query_len + 1) // 2)
    # Compulsory bytes only (K/V once, query, output): the kernel rereads K/V once per query
    # tile, and prefill is compute-bound, so TFLOP/s is the figure to read.
    moved = nbytes(key_cache, value_cache, query, out)
    ms = ctx.time_ms(lambda: paged_prefill_attention(*args, max_query_len=query_len))
    return Timing(name, ms, moved, 4 * visible * num_heads * head_dim)


def bench_write_kv(ctx: BenchContext) -> list[Timing]:
    from splitserve.kernels.kv_cache_ops import write_kv

    num_tokens, block_size = ctx.shapes.num_tokens, ctx.shapes.block_size
    num_kv_heads, head_dim = ctx.shapes.write_kv_layout
    num_blocks = ctx.shapes.write_kv_num_blocks
    cache = ctx.randn(2, num_blocks, block_size, num_kv_heads, head_dim)
    key, value = ctx.randn(2, num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, device=ctx.device)[:num_tokens]  # int64
    expected = cache.clone()
    reference.write_kv(key, value, expected[0], expected[1], slots)
    write_kv(key, value, cache[0], cache[1], slots)
    ctx.checker.check("write_kv", cache, expected)
    ms = ctx.time_ms(lambda: write_kv(key, value, cache[0], cache[1], slots))
    # Reads key and value, writes them into the cache; plus the slot ids.
    moved = 2 * nbytes(key, value) + nbytes(slots)
    return [Timing(f"write_kv {num_tokens} tok {num_kv_heads}x{head_dim}", ms, moved)]


def bench_pages(ctx: BenchContext) -> list[Timing]:
    from splitserve.kernels.kv_cache_ops import pack_kv_pages, unpack_kv_pages

    shapes = ctx.shapes
    kv = ctx.randn(
        shapes.page_layers, 2, shapes.page_cache_blocks, shapes.block_size, *shapes.page_layout
    )
    block_ids = torch.randperm(shapes.page_cache_blocks, device=ctx.device)[: shapes.page_blocks]
    buffer = pack_kv_pages(kv, block_ids)
    ctx.checker.check("pack_kv_pages", buffer, reference.pack_kv_pages(kv, block_ids))
    target = torch.randn_like(kv)
    expected = target.clone()
    reference.unpack_kv_pages(buffer, expected, block_ids)
    unpack_kv_pages(buffer, target, block_ids)
    # The whole cache: the blocks not unpacked into must be left as they were.
    ctx.checker.check("unpack_kv_pages", target, expected)
    moved = 2 * nbytes(buffer)  # every page read once and written once
    what = f"{shapes.page_blocks} blocks x {shapes.page_layers} layers"
    return [
        Timing(f"pack_kv_pages {what}", ctx.time_ms(lambda: pack_kv_pages(kv, block_ids)), moved),
        Timing(
            f"unpack_kv_pages {what}",
            ctx.time_ms(lambda: unpack_kv_pages(buffer, target, block_ids)),
            moved,
        ),
        Timing(
            "reference pack (one torch copy per block)",
            ctx.time_ms(lambda: reference.pack_kv_pages(kv, block_ids)),
            moved,
        ),
    ]


def bench_rms_norm(ctx: BenchContext) -> list[Timing]:
    from splitserve.kernels.rms_norm import fused_add_rms_norm

    timings, num_tokens = [], ctx.shapes.num_tokens
    for hidden in ctx.shapes.norm_hidden_sizes:
        x, residual = ctx.randn(2, num_tokens, hidden)
        weight = ctx.randn(hidden)
        normed, new_residual = fused_add_rms_norm(x, residual, weight, RMS_EPS)
        # The reference in x's dtype: it rounds x + residual to that dtype, as the kernel does.
        expected = reference.fused_add_rms_norm(x, residual, weight, RMS_EPS)
        ctx.checker.check(f"fused_add_rms_norm h{hidden}", normed, expected.normed)
        ctx.checker.check(f"fused_add_rms_norm h{hidden} residual", new_residual, expected.residual)
        ms = ctx.time_ms(lambda a=x, r=residual, w=weight: fused_add_rms_norm(a, r, w, RMS_EPS))
        # Reads x and residual, writes normed and the new residual; plus the weight.
        moved = 2 * nbytes(x, residual) + nbytes(weight)
        timings.append(Timing(f"fused_add_rms_norm {num_tokens}x{hidden}", ms, moved))
    return timings


def bench_rotary(ctx: BenchContext) -> list[Timing]:
    from splitserve.kernels.rotary import rotary_embedding

    timings, num_tokens = [], ctx.shapes.num_tokens
    for num_heads, num_kv_heads, head_dim in ctx.shapes.head_layouts:
        inv_freq = 1.0 / 10000 ** (
            torch.arange(0, head_dim, 2, device=ctx.device, dtype=torch.float32) / head_dim
        )
        table = reference.rotary_cos_sin_cache(inv_freq, ctx.shapes.max_position)
        query = ctx.randn(num_tokens, num_heads, head_dim)
        key = ctx.randn(num_tokens, num_kv_heads, head_dim)
        positions = torch.randint(0, ctx.shapes.max_position, (num_tokens,), device=ctx.device)
        # clone(): for float32, .float() returns the tensor itself, which both calls would
        # rotate in place, and the check would compare a tensor with itself.
        expected_q, expected_k = query.float().clone(), key.float().clone()
        reference.rotary_embedding(expected_q, expected_k, positions, table)
        rotary_embedding(query, key, positions, table)
        name = f"rotary {num_heads}/{num_kv_heads}x{head_dim}"
        ctx.checker.check(f"{name} query", query, expected_q)
        ctx.checker.check(f"{name} key", key, expected_k)
        ms = ctx.time_ms(lambda q=query, k=key, p=positions, t=table: rotary_embedding(q, k, p, t))
        # Reads and writes query and key in place; per token its position and one table row.
        moved = 2 * nbytes(query, key) + nbytes(positions) + num_tokens * nbytes(table[0])
        timings.append(
            Timing(f"rotary {num_tokens} tok {num_heads}/{num_kv_heads}x{head_dim}", ms, moved)
        )
    return timings


def bench_steps(ctx: BenchContext) -> list[tuple[str, Callable[[], list[Timing]]]]:
    layouts = ctx.shapes.head_layouts
    return [
        *[(f"decode {lay}", lambda lay=lay: bench_decode(ctx, lay)) for lay in layouts],
        *[(f"decode int8 {lay}", lambda lay=lay: bench_decode_int8(ctx, lay)) for lay in layouts],
        *[(f"prefill {lay}", lambda lay=lay: bench_prefill(ctx, lay)) for lay in layouts],
        ("write_kv", lambda: bench_write_kv(ctx)),
        ("pack/unpack", lambda: bench_pages(ctx)),
        ("rms norm", lambda: bench_rms_norm(ctx)),
        ("rotary", lambda: bench_rotary(ctx)),
        ("dequantizing matmul", lambda: bench_dequant_matmul(ctx)),
    ]


def pick_device(is_smoke: bool) -> torch.device:
    """CUDA with compiled kernels; for --smoke only, the CPU under Triton's interpreter."""
    interpret = os.environ.get("TRITON_INTERPRET")
    if torch.cuda.is_available() and interpret != "1":
        return torch.device("cuda")
    if not is_smoke:
        if interpret == "1":
            sys.exit(
                "benchmarks.kernels_bench times compiled kernels: unset TRITON_INTERPRET "
                "(or pass --smoke for a check of every path on the CPU)"
            )
        sys.exit(
            "benchmarks.kernels_bench needs a CUDA GPU and none is visible; on the CPU, run "
            "`python -m benchmarks.kernels_bench --smoke` or the kernel tests "
            "(TRITON_INTERPRET=1 pytest tests/test_kernels_*.py)"
        )
    if interpret == "0":
        sys.exit(
            "benchmarks.kernels_bench --smoke: no CUDA device, and TRITON_INTERPRET=0 forbids the "
            "CPU interpreter"
        )
    # Read when a kernel module is first imported (triton.jit), which has not happened yet.
    os.environ["TRITON_INTERPRET"] = "1"
    return torch.device("cpu")


def describe(device: torch.device, dtype: torch.dtype, shapes: BenchShapes) -> str:
    if device.type == "cuda":
        where = torch.cuda.get_device_name()
    else:
        where = "cpu under Triton's interpreter (wall-clock timings: they mean nothing)"
    return f"device: {where}, dtype {dtype}, shapes {shapes.name}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.kernels_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny shapes, any device: runs every check and code path quickly",
    )
    parser.add_argument(
        "--step",
        default="",
        help="only the steps whose title contains this (e.g. 'dequant', 'decode')",
    )
    parser.add_argument("--json", default="", help="also write the rows and checks here")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    shapes = SMOKE if args.smoke else FULL
    device = pick_device(args.smoke)
    if device.type == "cpu":
        # The interpreter runs one program at a time anyway; idle OpenMP threads spinning on a
        # few shared cores made small torch ops 100x slower.
        torch.set_num_threads(1)
    torch.manual_seed(0)
    print(describe(device, dtype, shapes), flush=True)
    time_ms = do_bench_ms if device.type == "cuda" else wall_clock_ms
    ctx = BenchContext(shapes, dtype, device, Checker(dtype), time_ms)
    copy_gbps = copy_bandwidth_gbps(ctx)
    print(
        f"copy bandwidth ({shapes.copy_buffer_bytes / 2**20:.0f} MiB read + write, median): "
        f"{copy_gbps:.1f} GB/s",
        flush=True,
    )
    steps = [(title, step) for title, step in bench_steps(ctx) if args.step in title]
    if not steps:
        titles = ", ".join(title for title, _ in bench_steps(ctx))
        parser.error(f"--step {args.step!r} matches no step (steps: {titles})")
    rows = run_steps(ctx, steps, copy_gbps)
    status = ctx.checker.report()
    if args.json:
        record = BenchRecord(describe(device, dtype, shapes), copy_gbps, rows, ctx.checker)
        record.write(args.json)
    return status


def run_steps(
    ctx: BenchContext, steps: list[tuple[str, Callable[[], list[Timing]]]], copy_gbps: float
) -> list[TimingFigures]:
    rows = []
    for i, (title, step) in enumerate(steps, 1):
        print(f"[{i}/{len(steps)}] {title}", flush=True)
        for timing in step():
            print(timing.row(copy_gbps), flush=True)
            rows.append(timing.figures(copy_gbps))
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


@dataclass(frozen=True)
class BenchRecord:
    """Everything one run printed, as JSON."""

    device: str
    copy_gb_per_s: float
    rows: list[TimingFigures]
    checker: Checker

    def write(self, path: str) -> None:
        record = {
            "device": self.device,
            "copy_gb_per_s": self.copy_gb_per_s,
            "rows": [asdict(row) for row in self.rows],
            "checks": [asdict(check) for check in self.checker.results],
            "failed_checks": self.checker.failed,
        }
        with open(path, "w") as f:
            # inf / nan relative errors are written as JSON's Infinity / NaN extensions,
            # which Python's json reads back.
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
