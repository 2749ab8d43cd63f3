"""GPU benchmark of every kernel: `python -m kernels.bench [--dtype bfloat16|float16|float32]`.

For each kernel: check the result on CUDA against `kernels.reference`, time it with
`triton.testing.do_bench` (median, L2 flushed between runs), and print the bandwidth it
achieves (bytes it must move / time) next to the device's copy bandwidth measured the same way,
so "% of copy" says how close a memory-bound kernel is to the roofline. Decode attention is also
timed against `torch.nn.functional.scaled_dot_product_attention` on contiguous K/V of the same
sizes: the same bytes without paging, a bar the paged kernel should meet. Prints figures; never
asserts a speed. Exits 1 if any result disagrees with its reference.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import reference

GIB = 1 << 30
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 5e-3}
# (num_heads, num_kv_heads, head_dim): SmolLM2-135M, and a Llama-3-8B-like layout.
HEAD_LAYOUTS = [(9, 3, 64), (32, 8, 128)]
DECODE_BATCH, DECODE_CONTEXT, BLOCK_SIZE = 64, 4096, 16
# (context, query_len) of 8 sequences: whole prompts, then chunks after a long prefix.
PREFILL_SEQS, PREFILL_SHAPES = 8, ((1024, 1024), (4096, 512))
NUM_TOKENS = 8192  # rows of write_kv, rms norm and rotary
MAX_POSITION = 8192
NUM_PAGE_BLOCKS, NUM_PAGE_LAYERS = 512, 30
DEVICE = "cuda"


@dataclass
class Timing:
    name: str
    ms: float
    num_bytes: int
    flops: int = 0

    def row(self, copy_gbps: float) -> str:
        gbps = self.num_bytes / self.ms / 1e6
        line = (f"  {self.name:<44} {self.ms * 1e3:10.1f} us {gbps:8.0f} GB/s "
                f"{100 * gbps / copy_gbps:5.0f}% of copy")
        if self.flops:
            line += f" {self.flops / self.ms / 1e9:7.1f} TFLOP/s"
        return line


class Checker:
    """Compares results with references; remembers whether any failed."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.tolerance = TOLERANCE[dtype]
        self.failed: list[str] = []

    def check(self, name: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
        diff = (actual.double() - expected.double()).norm()
        error = (diff / expected.double().norm()).item()
        verdict = "ok" if error < self.tolerance else "MISMATCH"
        if verdict != "ok":
            self.failed.append(name)
        print(f"  check {name}: relative error {error:.2e} ({verdict})", flush=True)


def time_ms(fn: Callable[[], object]) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def copy_bandwidth_gbps() -> float:
    src = torch.empty(GIB // 2, dtype=torch.uint8, device=DEVICE).random_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / ms / 1e6  # read + write


def paged_cache(
    num_seqs: int, context: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kv [2, num_blocks, BLOCK_SIZE, kv_heads, head_dim], block_tables, seq_lens), with every
    sequence's blocks shuffled over the whole cache as a long-running server's would be."""
    blocks_per_seq = context // BLOCK_SIZE
    num_blocks = num_seqs * blocks_per_seq
    kv = torch.randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, device=DEVICE,
                     dtype=dtype)
    block_tables = torch.randperm(num_blocks, device=DEVICE).int().view(num_seqs, -1)
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32, device=DEVICE)
    return kv, block_tables, seq_lens


def contiguous_kv(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """The same keys laid out `[num_seqs, kv_heads, context, head_dim]`, for SDPA."""
    num_seqs = block_tables.shape[0]
    pages = cache[block_tables.long()]  # [num_seqs, blocks, BLOCK_SIZE, kv_heads, head_dim]
    return pages.reshape(num_seqs, -1, *cache.shape[2:]).transpose(1, 2).contiguous()


def sdpa_decode(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float):
    """query [num_seqs, num_heads, head_dim] as [num_seqs, num_heads, 1, head_dim]."""
    out = torch.nn.functional.scaled_dot_product_attention(
        query[:, :, None], keys, values, scale=scale, enable_gqa=True
    )
    return out[:, :, 0]


def bench_decode(layout: tuple[int, int, int], dtype: torch.dtype, checker: Checker):
    from kernels.decode_attention import paged_decode_attention

    num_heads, num_kv_heads, head_dim = layout
    kv, block_tables, seq_lens = paged_cache(DECODE_BATCH, DECODE_CONTEXT, num_kv_heads,
                                             head_dim, dtype)
    query = torch.randn(DECODE_BATCH, num_heads, head_dim, device=DEVICE, dtype=dtype)
    scale = head_dim**-0.5
    args = (query, kv[0], kv[1], block_tables, seq_lens, scale)
    name = f"decode {num_heads}/{num_kv_heads}x{head_dim} b{DECODE_BATCH} ctx{DECODE_CONTEXT}"
    out = paged_decode_attention(*args)
    checker.check(name, out, reference.paged_decode_attention(
        query.float(), kv[0].float(), kv[1].float(), block_tables, seq_lens, scale))
    keys, values = contiguous_kv(kv[0], block_tables), contiguous_kv(kv[1], block_tables)
    checker.check(name + " vs sdpa", out, sdpa_decode(query, keys, values, scale).float())
    moved = nbytes(kv[0], kv[1], query, out, block_tables)
    flops = 4 * DECODE_BATCH * num_heads * DECODE_CONTEXT * head_dim
    # Partition sizes around the default, and one partition (no split, no merge kernel).
    timings = [
        Timing(f"{name} part{size}", time_ms(lambda s=size: paged_decode_attention(
            *args, partition_size=s)), moved, flops)
        for size in (256, 512, 1024, DECODE_CONTEXT)
    ]
    timings.append(Timing(f"{name} sdpa contiguous",
                          time_ms(lambda: sdpa_decode(query, keys, values, scale)),
                          nbytes(keys, values, query, out), flops))
    return timings


def bench_prefill(layout: tuple[int, int, int], dtype: torch.dtype, checker: Checker):
    from kernels.prefill_attention import paged_prefill_attention

    num_heads, num_kv_heads, head_dim = layout
    timings = []
    for context, query_len in PREFILL_SHAPES:
        num_seqs = PREFILL_SEQS
        kv, block_tables, seq_lens = paged_cache(num_seqs, context, num_kv_heads, head_dim, dtype)
        query = torch.randn(num_seqs * query_len, num_heads, head_dim, device=DEVICE, dtype=dtype)
        starts = torch.arange(0, num_seqs + 1, device=DEVICE, dtype=torch.int32) * query_len
        scale = head_dim**-0.5
        args = (query, kv[0], kv[1], block_tables, starts, seq_lens, scale)
        name = f"prefill {num_heads}/{num_kv_heads}x{head_dim} {num_seqs}x{query_len} ctx{context}"
        out = paged_prefill_attention(*args, max_query_len=query_len)
        checker.check(name, out, reference.paged_prefill_attention(
            query.float(), kv[0].float(), kv[1].float(), block_tables, starts, seq_lens, scale))
        prefix = context - query_len
        visible = num_seqs * (query_len * prefix + query_len * (query_len + 1) // 2)
        timings.append(Timing(name, time_ms(lambda a=args, q=query_len: paged_prefill_attention(
            *a, max_query_len=q)), nbytes(kv[0], kv[1], query, out), 4 * visible * num_heads
            * head_dim))
    return timings


def bench_write_kv(dtype: torch.dtype, checker: Checker):
    from kernels.kv_cache_ops import write_kv

    num_tokens, num_kv_heads, head_dim = NUM_TOKENS, 8, 128
    num_blocks = 2 * NUM_TOKENS // BLOCK_SIZE
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, device=DEVICE,
                        dtype=dtype)
    key, value = torch.randn(2, num_tokens, num_kv_heads, head_dim, device=DEVICE, dtype=dtype)
    slots = torch.randperm(cache[0].shape[0] * BLOCK_SIZE, device=DEVICE)[:num_tokens]
    expected = cache.clone()
    reference.write_kv(key, value, expected[0], expected[1], slots)
    write_kv(key, value, cache[0], cache[1], slots)
    checker.check("write_kv", cache, expected)
    ms = time_ms(lambda: write_kv(key, value, cache[0], cache[1], slots))
    return [Timing(f"write_kv {num_tokens} tok 8x128", ms, 2 * nbytes(key, value))]


def bench_pages(dtype: torch.dtype, checker: Checker):
    from kernels.kv_cache_ops import pack_kv_pages, unpack_kv_pages

    # SmolLM2-135M's cache: 30 layers, 3 kv heads x 64.
    num_blocks = 4 * NUM_PAGE_BLOCKS
    kv = torch.randn(NUM_PAGE_LAYERS, 2, num_blocks, BLOCK_SIZE, 3, 64, device=DEVICE,
                     dtype=dtype)
    block_ids = torch.randperm(num_blocks, device=DEVICE)[:NUM_PAGE_BLOCKS]
    buffer = pack_kv_pages(kv, block_ids)
    checker.check("pack_kv_pages", buffer, reference.pack_kv_pages(kv, block_ids))
    target = torch.randn_like(kv)
    unpack_kv_pages(buffer, target, block_ids)
    checker.check("unpack_kv_pages", target[:, :, block_ids], kv[:, :, block_ids])
    moved = 2 * nbytes(buffer)
    what = f"{NUM_PAGE_BLOCKS} blocks x {NUM_PAGE_LAYERS} layers"
    return [
        Timing(f"pack_kv_pages {what}", time_ms(lambda: pack_kv_pages(kv, block_ids)), moved),
        Timing(f"unpack_kv_pages {what}", time_ms(
            lambda: unpack_kv_pages(buffer, target, block_ids)), moved),
        Timing("torch index + permute (reference pack)", time_ms(
            lambda: reference.pack_kv_pages(kv, block_ids)), moved),
    ]


def bench_norm_rope(dtype: torch.dtype, checker: Checker):
    from kernels.rms_norm import fused_add_rms_norm
    from kernels.rotary import rotary_embedding

    timings, num_tokens = [], NUM_TOKENS
    for hidden in (576, 4096):
        x, residual = torch.randn(2, num_tokens, hidden, device=DEVICE, dtype=dtype)
        weight = torch.randn(hidden, device=DEVICE, dtype=dtype)
        normed, _ = fused_add_rms_norm(x, residual, weight, 1e-5)
        expected = reference.fused_add_rms_norm(x.float(), residual.float(), weight, 1e-5)
        checker.check(f"fused_add_rms_norm h{hidden}", normed, expected.normed)
        ms = time_ms(lambda a=x, r=residual, w=weight: fused_add_rms_norm(a, r, w, 1e-5))
        timings.append(Timing(f"fused_add_rms_norm {num_tokens}x{hidden}", ms,
                              2 * nbytes(x, residual)))
    for num_heads, num_kv_heads, head_dim in HEAD_LAYOUTS:
        inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, device=DEVICE) / head_dim)
        table = reference.rotary_cos_sin_cache(inv_freq, MAX_POSITION)
        query = torch.randn(num_tokens, num_heads, head_dim, device=DEVICE, dtype=dtype)
        key = torch.randn(num_tokens, num_kv_heads, head_dim, device=DEVICE, dtype=dtype)
        positions = torch.randint(0, MAX_POSITION, (num_tokens,), device=DEVICE)
        expected_q, expected_k = query.float(), key.float()
        reference.rotary_embedding(expected_q, expected_k, positions, table)
        rotary_embedding(query, key, positions, table)
        checker.check(f"rotary {num_heads}/{num_kv_heads}x{head_dim}", query, expected_q)
        ms = time_ms(lambda q=query, k=key, p=positions, t=table: rotary_embedding(q, k, p, t))
        moved = 2 * nbytes(query, key) + num_tokens * head_dim * 4
        timings.append(Timing(f"rotary {num_tokens} tok {num_heads}/{num_kv_heads}x{head_dim}",
                              ms, moved))
    return timings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels.bench", description=__doc__)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    dtype = getattr(torch, parser.parse_args(argv).dtype)
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("kernels.bench times compiled kernels: unset TRITON_INTERPRET")
    if not torch.cuda.is_available():
        sys.exit("kernels.bench needs a CUDA GPU and none is visible; on the CPU, run the "
                 "kernel tests instead (TRITON_INTERPRET=1 pytest tests/test_kernels_*.py)")
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}, dtype {dtype}", flush=True)
    copy_gbps = copy_bandwidth_gbps()
    print(f"copy bandwidth (1 GiB read + write, median): {copy_gbps:.0f} GB/s", flush=True)
    checker = Checker(dtype)
    steps: list[tuple[str, Callable[[], list[Timing]]]] = [
        *[(f"decode {lay}", lambda lay=lay: bench_decode(lay, dtype, checker))
          for lay in HEAD_LAYOUTS],
        *[(f"prefill {lay}", lambda lay=lay: bench_prefill(lay, dtype, checker))
          for lay in HEAD_LAYOUTS],
        ("write_kv", lambda: bench_write_kv(dtype, checker)),
        ("pack/unpack", lambda: bench_pages(dtype, checker)),
        ("norm + rope", lambda: bench_norm_rope(dtype, checker)),
    ]
    for i, (title, step) in enumerate(steps, 1):
        print(f"[{i}/{len(steps)}] {title}", flush=True)
        for timing in step():
            print(timing.row(copy_gbps), flush=True)
        torch.cuda.empty_cache()
    if checker.failed:
        print(f"MISMATCH against the reference: {', '.join(checker.failed)}")
        return 1
    print("all results match their references")
    return 0


if __name__ == "__main__":
    sys.exit(main())
