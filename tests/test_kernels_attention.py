"""Paged decode and prefill attention kernels against their PyTorch references.

On the CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before Triton is
imported). `TRITON_INTERPRET=0 pytest tests/test_kernels_*.py` runs the same checks on a GPU.
The caches are poisoned with NaN wherever a kernel must not read (slots past a sequence's end,
unused block-table entries) and outputs are NaN-filled first, so a stray read or a missing
write fails the comparison. The interpreter rounds bfloat16 toward zero where a GPU rounds to
nearest, which the 1e-2 bfloat16 bound covers.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")  # Triton wheels exist for Linux only

import json  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from splitserve.kernels import decode_attention, kv_int8, reference  # noqa: E402
from splitserve.kernels._decode_waves import balanced_partition_size, program_slots  # noqa: E402
from splitserve.kernels.decode_attention import paged_decode_attention  # noqa: E402
from splitserve.kernels.prefill_attention import paged_prefill_attention  # noqa: E402
from tests.moved_to_slow import cases_by_variants  # noqa: E402

DEVICE = "cuda" if os.environ["TRITON_INTERPRET"] == "0" else "cpu"
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2}


@dataclass
class PagedKV:
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [num_seqs] int32


def make_paged_kv(
    seq_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
    gen: torch.Generator,
) -> PagedKV:
    """Random K/V for each sequence in shuffled, non-contiguous blocks; NaN everywhere else."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    max_blocks = max(blocks_per_seq) + 1  # a spare column the kernels must never read
    num_blocks = 2 * sum(blocks_per_seq) + 3  # room for gaps between the ids in use
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    poison_block = num_blocks - 1
    block_tables = torch.full((len(seq_lens), max_blocks), poison_block, dtype=torch.int32)
    free_ids = torch.randperm(num_blocks - 1, generator=gen)
    next_free = 0
    for s, (seq_len, n) in enumerate(zip(seq_lens, blocks_per_seq)):
        ids = free_ids[next_free : next_free + n]
        next_free += n
        block_tables[s, :n] = ids.int()
        for t in range(seq_len):
            block, offset = ids[t // block_size], t % block_size
            key_cache[block, offset] = torch.randn(num_kv_heads, head_dim, generator=gen)
            value_cache[block, offset] = torch.randn(num_kv_heads, head_dim, generator=gen)
    return PagedKV(key_cache.to(DEVICE), value_cache.to(DEVICE), block_tables.to(DEVICE),
                   torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE))


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert not actual.isnan().any(), "output holds NaN: an unwritten element or a stray read"
    diff = (actual.double() - expected.double()).norm()
    return (diff / expected.double().norm()).item()


def as_float(kv: PagedKV) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact answer for bfloat16 inputs is the float32 math on their upcast values."""
    return kv.key_cache.float(), kv.value_cache.float()


DECODE_CASES = [
    # dtype, block_size, head_dim, num_kv_heads, group, seq_lens, partition_size
    (torch.float32, 16, 64, 3, 3, [1, 17, 40, 100], 512),
    (torch.float32, 32, 128, 1, 8, [1, 33, 150, 64], 64),
    (torch.float32, 16, 128, 2, 1, [130, 5, 16, 97], 32),
    (torch.bfloat16, 32, 64, 2, 3, [1, 45, 160], 64),
    (torch.bfloat16, 16, 128, 1, 8, [31, 3], 512),
    (torch.float32, 32, 80, 2, 4, [77, 2], 32),  # head_dim not a power of two
]


# The launch keys of decode attention's variants (kernels/_decode_variants.py); {} is the
# default kernel. TILE_N 16 with 4 kv heads: 4 tokens a step, several steps a partition;
# KV_HEADS 2 over 3 kv heads: a last head block of one real kv head. HEADS_FIRST with the
# fused merge: its counters are indexed by the head-first grid's axes.
DECODE_VARIANTS = [
    {},
    {"KV_HEADS": 2},
    {"KV_HEADS": 4, "TILE_N": 16},
    {"FUSED_MERGE": 1},
    {"KV_HEADS": 8, "FUSED_MERGE": 1, "TILE_N": 32},
    {"HEADS_FIRST": 1},
    {"KV_HEADS": 2, "HEADS_FIRST": 1, "FUSED_MERGE": 1},
]


@pytest.mark.parametrize(
    ("dtype", "block_size", "head_dim", "num_kv_heads", "group", "seq_lens", "partition_size",
     "launch"),
    cases_by_variants(DECODE_CASES, DECODE_VARIANTS),
)  # fmt: skip
def test_decode_matches_reference(
    dtype, block_size, head_dim, num_kv_heads, group, seq_lens, partition_size, launch
):
    gen = torch.Generator().manual_seed(len(seq_lens) * 1000 + head_dim + group)
    kv = make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype, gen)
    num_heads = num_kv_heads * group
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(DEVICE, dtype)
    out = torch.full_like(query, float("nan"))
    scale = head_dim**-0.5

    result = paged_decode_attention(query, kv.key_cache, kv.value_cache, kv.block_tables,
                                    kv.seq_lens, scale, out, partition_size=partition_size,
                                    launch=launch)  # fmt: skip

    assert result is out
    expected = reference.paged_decode_attention(query.float(), *as_float(kv), kv.block_tables,
                                                kv.seq_lens, scale)
    assert relative_error(out, expected) < TOLERANCE[dtype]


def test_decode_strided_query_and_empty_sequence():
    """query as a view into a fused QKV tensor; a length-0 row (batch padding) gives zeros."""
    gen = torch.Generator().manual_seed(7)
    kv = make_paged_kv([70, 1, 9], 16, 2, 64, torch.float32, gen)
    kv.seq_lens[1] = 0
    qkv = torch.randn(3, 6 + 2 * 2, 64, generator=gen).to(DEVICE)
    query = qkv[:, :6]  # [3, 6, 64], token stride 10 * 64
    out = paged_decode_attention(query, kv.key_cache, kv.value_cache, kv.block_tables,
                                 kv.seq_lens, 0.125, partition_size=32)
    expected = reference.paged_decode_attention(query, kv.key_cache, kv.value_cache,
                                                kv.block_tables, kv.seq_lens, 0.125)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert relative_error(out, expected) < 1e-4


@pytest.mark.parametrize("launch", DECODE_VARIANTS, ids=str)
def test_decode_of_cuda_graph_padding_rows(launch):
    """The rows a CUDA-graph replay pads its batch with (shared/cuda_graphs.py): length 1 over
    block 0, in a block table as wide as the model's context, so most partitions are empty."""
    gen = torch.Generator().manual_seed(5)
    kv = make_paged_kv([70, 23], 16, 3, 64, torch.float32, gen)
    for cache in (kv.key_cache, kv.value_cache):  # block 0 is read: it must hold numbers
        cache[0] = torch.randn(cache.shape[1:], generator=gen).to(DEVICE)
    num_real, num_padding, width = 2, 3, 12
    tables = torch.zeros((num_real + num_padding, width), dtype=torch.int32, device=DEVICE)
    tables[:num_real, : kv.block_tables.shape[1]] = kv.block_tables
    seq_lens = torch.ones(num_real + num_padding, dtype=torch.int32, device=DEVICE)
    seq_lens[:num_real] = kv.seq_lens
    query = torch.randn(num_real + num_padding, 9, 64, generator=gen).to(DEVICE)
    out = torch.full_like(query, float("nan"))
    paged_decode_attention(query, kv.key_cache, kv.value_cache, tables, seq_lens, 0.125, out,
                           partition_size=32, launch=launch)  # fmt: skip
    expected = reference.paged_decode_attention(query, kv.key_cache, kv.value_cache, tables,
                                                seq_lens, 0.125)  # fmt: skip
    assert relative_error(out, expected) < 1e-4


@pytest.mark.parametrize("launch", DECODE_VARIANTS[1:], ids=str)
def test_decode_variants_over_int8_rows(launch):
    """The variants read an int8 cache's rows and scales as the default kernel does."""
    gen = torch.Generator().manual_seed(6)
    kv = make_paged_kv([90, 7, 33], 16, 3, 64, torch.float32, gen)
    key_cache, value_cache = (kv_int8.quantize_rows(c) for c in (kv.key_cache, kv.value_cache))
    query = torch.randn(3, 9, 64, generator=gen).to(DEVICE, torch.bfloat16)
    args = (key_cache, value_cache, kv.block_tables, kv.seq_lens, 0.125)
    out = paged_decode_attention(query, *args, partition_size=32, launch=launch)
    expected = reference.paged_decode_attention(query.float(), *args)
    assert relative_error(out, expected) < TOLERANCE[torch.bfloat16]


def test_fused_merge_leaves_its_counters_at_zero():
    """The next call (the next layer's) counts from zero again."""
    gen = torch.Generator().manual_seed(8)
    kv = make_paged_kv([100, 40], 16, 2, 64, torch.float32, gen)
    query = torch.randn(2, 6, 64, generator=gen).to(DEVICE)
    for kv_heads in (1, 2):
        paged_decode_attention(query, kv.key_cache, kv.value_cache, kv.block_tables,
                               kv.seq_lens, 0.125, partition_size=32,
                               launch={"FUSED_MERGE": 1, "KV_HEADS": kv_heads})  # fmt: skip
    counters = decode_attention._MERGE_COUNTERS[query.device]
    assert counters and not any(c.any() for c in counters)


@pytest.mark.parametrize("launch", [{}, {"KV_HEADS": 2}, {"FUSED_MERGE": 1}], ids=str)
def test_decode_with_wave_balanced_partitions_matches_reference(launch):
    """WAVE_SLOTS: partitions sized by the device's program slots (the interpreter's 4): 96
    tokens for 6 programs a partition, 48 for 3 (not powers of two: tiles of 16 tokens). On a
    GPU (TRITON_INTERPRET=0) the sizes follow its SMs; the result is checked alike."""
    gen = torch.Generator().manual_seed(11)
    seq_lens = [1, 45, 160]
    kv = make_paged_kv(seq_lens, 16, 2, 64, torch.float32, gen)
    query = torch.randn(len(seq_lens), 6, 64, generator=gen).to(DEVICE)
    launch = {"WAVE_SLOTS": 1, "TILE_N": 16, **launch}
    kv_heads_per_program = launch.get("KV_HEADS", 1)
    tile = max(16, 16 // kv_heads_per_program)
    row_programs = len(seq_lens) * (2 // kv_heads_per_program)
    max_context = kv.block_tables.shape[1] * 16
    size = balanced_partition_size(max_context, row_programs, program_slots(query.device, 1),
                                   tile)  # fmt: skip
    if DEVICE == "cpu":  # a GPU has its own SM count, so its own sizes
        assert size == (48 if kv_heads_per_program == 2 else 96)

    out = paged_decode_attention(query, kv.key_cache, kv.value_cache, kv.block_tables,
                                 kv.seq_lens, 0.125, launch=launch)  # fmt: skip

    expected = reference.paged_decode_attention(query, *as_float(kv), kv.block_tables,
                                                kv.seq_lens, 0.125)  # fmt: skip
    assert relative_error(out, expected) < TOLERANCE[torch.float32]


def test_balanced_partitions_fill_the_waves_with_the_fewest_partitions():
    """192 programs a partition on 528 slots (batch 64 x 3 kv heads, 132 SMs x 4): 5
    partitions fill 91% of their two waves, the first count within 85% of the best (11
    partitions: exactly 4 waves); 8 or 11 would merge more for little."""
    assert balanced_partition_size(4096, 192, 528, 64) == 832
    assert balanced_partition_size(4096, 528, 528, 64) == 4096  # one full wave unsplit
    assert balanced_partition_size(4096, 264, 528, 64) == 2048  # two halves fill one wave
    assert balanced_partition_size(40, 8, 528, 64) == 64  # shorter than a tile
    assert balanced_partition_size(4096, 192, 0, 64) == 4096  # no slots known: no split


def shipped_decode_launches() -> list[tuple[str, str, dict]]:
    tables = sorted((Path(decode_attention.__file__).parent / "configs").glob("*.json"))
    return [(path.stem, key, launch) for path in tables
            for key, launch in json.loads(path.read_text())["kernels"]
            .get("decode_attention", {}).items()]  # fmt: skip


@pytest.mark.parametrize(("table", "key", "launch"), shipped_decode_launches(),
                         ids=lambda v: v if isinstance(v, str) else "")  # fmt: skip
def test_every_shipped_decode_launch_matches_reference(table, key, launch):
    """A GPU's tuned table (kernels/configs) holds launches no CPU run has tried: each one
    on a small batch of several partitions, in its key's dtype and head size."""
    dtype = getattr(torch, key.split("/")[0])
    head_dim, group = int(key.split("/")[1][1:]), int(key.split("/")[2][1:])
    gen = torch.Generator().manual_seed(head_dim + group)
    seq_lens = [3, 150, 40]
    kv = make_paged_kv(seq_lens, 16, 2, head_dim, dtype, gen)
    query = torch.randn(len(seq_lens), 2 * group, head_dim, generator=gen).to(DEVICE, dtype)
    # Several partitions where the table's size would make one (WAVE_SLOTS sizes its own).
    launch = {**launch, "PARTITION_SIZE": 64}

    out = paged_decode_attention(query, kv.key_cache, kv.value_cache, kv.block_tables,
                                 kv.seq_lens, 0.125, launch=launch)  # fmt: skip

    expected = reference.paged_decode_attention(query.float(), *as_float(kv), kv.block_tables,
                                                kv.seq_lens, 0.125)  # fmt: skip
    assert relative_error(out, expected) < TOLERANCE[dtype]


def test_decode_rejects_a_kv_heads_not_a_power_of_two(small_decode_args):
    with pytest.raises(ValueError, match="KV_HEADS"):
        paged_decode_attention(**small_decode_args, launch={"KV_HEADS": 3})


def make_query_layout(query_lens: list[int]) -> torch.Tensor:
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return torch.tensor(starts, dtype=torch.int32, device=DEVICE)


PREFILL_CASES = [
    # dtype, block_size, head_dim, num_kv_heads, group, seq_lens, query_lens
    (torch.float32, 16, 64, 3, 3, [1, 17, 40], [1, 17, 40]),  # whole prompts
    (torch.float32, 32, 128, 1, 8, [20, 100, 35, 1], [3, 37, 35, 1]),  # cached prefixes
    (torch.float32, 16, 128, 2, 1, [70, 33, 9], [66, 0, 9]),  # a sequence with no new token
    (torch.bfloat16, 32, 64, 2, 3, [50, 17], [20, 17]),
    (torch.bfloat16, 16, 128, 1, 8, [40], [40]),
    (torch.float32, 16, 96, 1, 4, [90, 15], [45, 15]),  # head_dim not a power of two
]


@pytest.mark.parametrize(
    ("dtype", "block_size", "head_dim", "num_kv_heads", "group", "seq_lens", "query_lens"),
    PREFILL_CASES,
)
def test_prefill_matches_reference(
    dtype, block_size, head_dim, num_kv_heads, group, seq_lens, query_lens
):
    gen = torch.Generator().manual_seed(sum(seq_lens) + head_dim + group)
    kv = make_paged_kv(seq_lens, block_size, num_kv_heads, head_dim, dtype, gen)
    query_start_loc = make_query_layout(query_lens)
    num_heads = num_kv_heads * group
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(DEVICE, dtype)
    out = torch.full_like(query, float("nan"))
    scale = head_dim**-0.5

    paged_prefill_attention(query, kv.key_cache, kv.value_cache, kv.block_tables,
                            query_start_loc, kv.seq_lens, scale, out)

    expected = reference.paged_prefill_attention(query.float(), *as_float(kv), kv.block_tables,
                                                 query_start_loc, kv.seq_lens, scale)
    assert relative_error(out, expected) < TOLERANCE[dtype]


# A window of one position, shorter than a partition (leading partitions left empty), longer
# than every row; Gemma 2's cap with and without a window.
WINDOWS_AND_CAPS = [(1, 0.0), (23, 0.0), (70, 3.0), (500, 0.0), (0, 2.0)]


WINDOW_VARIANTS = [{}, {"KV_HEADS": 2}, {"FUSED_MERGE": 1},
                   {"KV_HEADS": 2, "HEADS_FIRST": 1, "FUSED_MERGE": 1}]  # fmt: skip


@pytest.mark.parametrize(
    ("window", "softcap", "launch"), cases_by_variants(WINDOWS_AND_CAPS, WINDOW_VARIANTS)
)
def test_decode_with_a_window_and_a_cap_matches_reference(launch, window, softcap):
    """Mistral's and Gemma's sliding windows (the query sees the last `window` positions; the
    partitions before them stay empty, and the merge, fused or not, weighs them zero) and
    Gemma 2's soft-capped scores."""
    gen = torch.Generator().manual_seed(window + int(softcap))
    seq_lens = [1, 45, 160, 97]
    kv = make_paged_kv(seq_lens, 16, 2, 64, torch.float32, gen)
    query = 4 * torch.randn(len(seq_lens), 6, 64, generator=gen).to(DEVICE)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.125)

    out = paged_decode_attention(*args, partition_size=32, launch=launch, window=window,
                                 softcap=softcap)  # fmt: skip

    expected = reference.paged_decode_attention(*args, window=window, softcap=softcap)
    assert relative_error(out, expected) < TOLERANCE[torch.float32]
    if window < 160 or softcap:  # the window or the cap changed the answer
        assert relative_error(reference.paged_decode_attention(*args), expected) > 1e-2


def test_bfloat16_decode_with_a_window_and_a_cap_matches_reference():
    gen = torch.Generator().manual_seed(31)
    kv = make_paged_kv([33, 150], 16, 2, 64, torch.bfloat16, gen)
    query = (4 * torch.randn(2, 6, 64, generator=gen)).to(DEVICE, torch.bfloat16)
    args = (kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.125)
    out = paged_decode_attention(query, *args, partition_size=64, window=40, softcap=3.0)
    expected = reference.paged_decode_attention(query.float(), *as_float(kv), kv.block_tables,
                                                kv.seq_lens, 0.125, window=40, softcap=3.0)
    assert relative_error(out, expected) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize(("window", "softcap"), [(1, 0.0), (7, 0.0), (40, 2.0), (0, 3.0)])
def test_prefill_with_a_window_and_a_cap_matches_reference(window, softcap):
    """A window shorter than a tile of rows (its later rows see none of the first key tile)
    and than the cached prefix (whose early blocks are not read)."""
    gen = torch.Generator().manual_seed(40 + window)
    seq_lens, query_lens = [70, 9, 130], [70, 5, 60]
    kv = make_paged_kv(seq_lens, 16, 3, 64, torch.float32, gen)
    query = 4 * torch.randn(sum(query_lens), 9, 64, generator=gen).to(DEVICE)
    layout = make_query_layout(query_lens)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, layout, kv.seq_lens, 0.125)

    out = paged_prefill_attention(*args, window=window, softcap=softcap)

    expected = reference.paged_prefill_attention(*args, window=window, softcap=softcap)
    assert relative_error(out, expected) < TOLERANCE[torch.float32]
    assert relative_error(reference.paged_prefill_attention(*args), expected) > 1e-2


def test_prefill_of_one_token_per_sequence_equals_decode():
    gen = torch.Generator().manual_seed(11)
    kv = make_paged_kv([1, 29, 80], 16, 3, 64, torch.float32, gen)
    query = torch.randn(3, 9, 64, generator=gen).to(DEVICE)
    args = (kv.key_cache, kv.value_cache, kv.block_tables)
    prefill = paged_prefill_attention(query, *args, make_query_layout([1, 1, 1]), kv.seq_lens,
                                      0.125, max_query_len=1)
    decode = paged_decode_attention(query, *args, kv.seq_lens, 0.125, partition_size=32)
    assert relative_error(prefill, decode) < 1e-5


def test_prefill_leaves_rows_outside_every_sequence_untouched():
    gen = torch.Generator().manual_seed(12)
    kv = make_paged_kv([24], 16, 1, 64, torch.float32, gen)
    query = torch.randn(8, 1, 64, generator=gen).to(DEVICE)  # rows 5.. are batch padding
    out = torch.full_like(query, float("nan"))
    paged_prefill_attention(query, kv.key_cache, kv.value_cache, kv.block_tables,
                            make_query_layout([5]), kv.seq_lens, 0.125, out)
    expected = reference.paged_prefill_attention(query[:5], kv.key_cache, kv.value_cache,
                                                 kv.block_tables, make_query_layout([5]),
                                                 kv.seq_lens, 0.125)
    assert relative_error(out[:5], expected) < 1e-4
    assert out[5:].isnan().all()


@pytest.fixture
def small_decode_args():
    gen = torch.Generator().manual_seed(3)
    kv = make_paged_kv([5, 20], 16, 2, 64, torch.float32, gen)
    query = torch.randn(2, 4, 64, generator=gen).to(DEVICE)
    return dict(query=query, key_cache=kv.key_cache, value_cache=kv.value_cache,
                block_tables=kv.block_tables, seq_lens=kv.seq_lens, scale=0.125)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: a.update(query=a["query"][0]), "query must have 3 dims"),
        (lambda a: a.update(query=a["query"][:, :3]), "multiple of"),
        (lambda a: a.update(query=a["query"].double()), "query must have dtype"),
        (lambda a: a.update(query=a["query"].bfloat16()), "key_cache must have the dtype"),
        (lambda a: a.update(query=a["query"][..., :32]), "head_dim"),
        (lambda a: a.update(value_cache=a["value_cache"][:-1]), "value_cache must have shape"),
        (lambda a: a.update(block_tables=a["block_tables"].long()), "block_tables must have dtype"),
        (lambda a: a.update(block_tables=a["block_tables"][:1]), "one row per sequence"),
        (lambda a: a.update(seq_lens=a["seq_lens"][:1]), "seq_lens must have shape"),
        (lambda a: a.update(scale=0.0), "scale"),
        (lambda a: a.update(out=torch.empty(2, 4, 32, device=DEVICE)), "out must have shape"),
        (lambda a: a.update(partition_size=40), "partition_size"),
        (lambda a: a.update(window=-1), "window"),
        (lambda a: a.update(softcap=-1.0), "softcap"),
    ],
)
def test_decode_rejects_bad_arguments(small_decode_args, change, message):
    change(small_decode_args)
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(**small_decode_args)


def test_prefill_rejects_bad_arguments(small_decode_args):
    args = dict(small_decode_args, query_start_loc=make_query_layout([1, 1]))
    with pytest.raises(ValueError, match="query_start_loc must have shape"):
        paged_prefill_attention(**dict(args, query_start_loc=make_query_layout([1])))
    with pytest.raises(ValueError, match="query_start_loc must have dtype"):
        paged_prefill_attention(**dict(args, query_start_loc=args["query_start_loc"].long()))
    with pytest.raises(ValueError, match="max_query_len"):
        paged_prefill_attention(**args, max_query_len=-1)


@pytest.mark.skipif(DEVICE != "cpu", reason="about CPU tensors")
def test_cpu_tensors_without_the_interpreter_are_refused(small_decode_args, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="splitserve.kernels.reference"):
        paged_decode_attention(**small_decode_args)


@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(3, 64), (8, 128)])
def test_the_launches_gpu_graph_timings_compares_match_reference(num_kv_heads, head_dim):
    """What the GPU run times beside SDPA (benchmarks.gpu_graph_timings) is a correct kernel."""
    from benchmarks.gpu_graph_timings import decode_variant_launches

    gen = torch.Generator().manual_seed(num_kv_heads)
    kv = make_paged_kv([300, 41], 16, num_kv_heads, head_dim, torch.bfloat16, gen)
    query = torch.randn(2, 3 * num_kv_heads, head_dim, generator=gen).to(DEVICE, torch.bfloat16)
    args = (kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.125)
    expected = reference.paged_decode_attention(query.float(), *as_float(kv), *args[2:])
    for launch in decode_variant_launches(num_kv_heads, head_dim).values():
        out = paged_decode_attention(query, *args, partition_size=128, launch=launch)
        assert relative_error(out, expected) < TOLERANCE[torch.bfloat16], launch
