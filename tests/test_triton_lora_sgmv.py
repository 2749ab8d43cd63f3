"""The Triton SGMV shrink/expand (kernels/lora_sgmv.py) against the engine's PyTorch reference
(shared/lora/batched.py's segmented and batched products), in Triton's interpreter on the CPU:
fresh random weights and rows, several shapes, runs of one slot, the base model between them."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")  # Triton wheels exist for Linux only

import torch  # noqa: E402

from splitserve.engine.lora.batched import (  # noqa: E402
    LoRABatch,
    add_lora_delta,
    add_lora_delta_sgmv,
    lora_delta_segmented,
    make_batch,
)
from splitserve.kernels.lora_sgmv import add_lora_sgmv, lora_shrink, make_segments  # noqa: E402

DEVICE = "cuda" if os.environ["TRITON_INTERPRET"] == "0" else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert not actual.isnan().any()
    diff = (actual.double() - expected.double()).norm()
    return (diff / expected.double().norm()).item()


def random_slots(rows: int, max_loras: int, gen: torch.Generator) -> list[int]:
    """Runs of equal slots (as a scheduler's rows come), the base (-1) among them."""
    slots: list[int] = []
    while len(slots) < rows:
        slot = int(torch.randint(-1, max_loras, (1,), generator=gen))
        slots += [slot] * int(torch.randint(1, 5, (1,), generator=gen))
    slots = slots[:rows]
    slots[0] = max_loras - 1  # the highest slot always in use, the base always present
    slots[-1] = -1
    return slots


@pytest.mark.parametrize(
    ("dtype", "rows", "in_features", "slice_sizes", "max_loras", "rank"),
    [
        (torch.float32, 16, 576, (576, 192, 192), 8, 8),  # SmolLM2-135M's q/k/v, 8 adapters
        (torch.float32, 5, 100, (70,), 3, 4),  # nothing a power of two or a block multiple
        (torch.float32, 33, 64, (1536, 1536), 2, 16),  # more rows than one block
        (torch.bfloat16, 16, 128, (96, 64), 4, 8),
    ],
)
def test_sgmv_matches_the_segmented_reference(
    dtype, rows, in_features, slice_sizes, max_loras, rank
):
    gen = torch.Generator().manual_seed(rows * 31 + rank)
    num_slices = len(slice_sizes)
    x = torch.randn(rows, in_features, generator=gen).to(DEVICE, dtype)
    a = (torch.randn(max_loras, num_slices, rank, in_features, generator=gen) / 8).to(DEVICE, dtype)
    b = [(torch.randn(max_loras, rank, size, generator=gen) / 8).to(DEVICE, dtype)
         for size in slice_sizes]  # fmt: skip
    offsets = [sum(slice_sizes[:s]) for s in range(num_slices)]
    base = torch.randn(rows, sum(slice_sizes), generator=gen).to(DEVICE, dtype)
    slots = random_slots(rows, max_loras, gen)
    slot_ids = torch.tensor(slots, device=DEVICE)

    got = base.clone()
    add_lora_sgmv(got, x, a, b, offsets, make_segments(slots, torch.device(DEVICE)))

    x64 = x.double()
    for s, (b_s, offset) in enumerate(zip(b, offsets)):
        delta = lora_delta_segmented(x64, a[:, s].double(), b_s.double(), slot_ids)
        want = base[:, offset : offset + b_s.shape[2]].double() + delta
        assert relative_error(got[:, offset : offset + b_s.shape[2]], want) < TOLERANCE[dtype]
        base_rows = slot_ids < 0  # untouched, bit for bit
        assert torch.equal(got[base_rows, offset : offset + b_s.shape[2]],
                           base[base_rows, offset : offset + b_s.shape[2]])  # fmt: skip
    if dtype == torch.float32:  # and the engine's batched CPU form agrees
        batched = base.clone()
        add_lora_delta(batched, x, a, b, offsets, make_batch(slots, dtype, torch.device(DEVICE)))
        assert relative_error(got, batched) < TOLERANCE[dtype]


def test_segments_are_the_runs_of_equal_slots():
    segments = make_segments([2, 2, -1, 0, 0, 0, 2], torch.device("cpu"))
    assert segments.starts.tolist() == [0, 2, 3, 6, 7]
    assert segments.slots.tolist() == [2, -1, 0, 2]
    assert segments.max_length == 3


def test_shrink_rejects_bad_arguments():
    x = torch.randn(4, 32)
    a = torch.randn(2, 1, 4, 32)
    segments = make_segments([0, 0, 1, 1], torch.device("cpu"))
    with pytest.raises(ValueError, match="in features"):
        lora_shrink(x[:, :16].contiguous(), a, segments)
    with pytest.raises(ValueError, match="must have 4 dims"):
        lora_shrink(x, a[0], segments)
    with pytest.raises(ValueError, match="segments for"):
        lora_shrink(x[:1], a, segments)


def test_the_engine_hooks_take_sgmv_when_the_batch_has_segments():
    """The engine's CUDA path (a LoRABatch with segments, as make_batch builds on CUDA) gives
    what its CPU form gives."""
    gen = torch.Generator().manual_seed(7)
    slots = [1, 1, -1, 0, 2, 2, 2, -1]
    x = torch.randn(len(slots), 48, generator=gen)
    a = torch.randn(3, 2, 4, 48, generator=gen)
    b = [torch.randn(3, 4, 40, generator=gen), torch.randn(3, 4, 24, generator=gen)]
    base = torch.randn(len(slots), 64, generator=gen)
    cpu_batch = make_batch(slots, torch.float32, torch.device("cpu"))
    assert cpu_batch.segments is None, "the CPU keeps the masked PyTorch form"
    want = base.clone()
    add_lora_delta(want, x, a, b, [0, 40], cpu_batch)
    sgmv_batch = LoRABatch(
        cpu_batch.slot_ids, cpu_batch.mask, cpu_batch.num_slots,
        make_segments(slots, torch.device("cpu")),
    )  # fmt: skip
    got = base.clone()
    add_lora_delta_sgmv(got, x, a, b, [0, 40], sgmv_batch)
    assert relative_error(got, want) < TOLERANCE[torch.float32]
