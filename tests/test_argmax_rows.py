"""Greedy sampling's argmax (shared/sampler.py argmax_rows): our kernel
(kernels/cpu/step_lookups.cpp) against torch's `max(dim=-1).indices`, which it replaces for
float32 rows on the CPU: first index among ties, the first NaN where a row has one."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.sampler import argmax_rows
from splitserve.kernels import cpu as cpu_kernels


@pytest.fixture(scope="module")
def module():
    loaded = cpu_kernels.load()
    if loaded is None:
        pytest.skip(f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")
    return loaded


def _logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("vocab", [1, 7, 8, 9, 49152, 49157])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_the_same_indices_as_torch(module, rows, vocab):
    logits = _logits(rows, vocab, seed=rows * vocab)
    assert torch.equal(module.argmax_rows(logits), logits.max(dim=-1).indices)


def test_ties_nan_and_infinities_as_torch_gives_them(module):
    logits = _logits(6, 300, seed=1)
    logits[0, 10] = logits[0, 250] = 50.0  # a tie: the first
    logits[1, 299] = 50.0  # the largest last (past the vector loop's last full block)
    logits[2, 40] = logits[2, 7] = float("nan")  # the first NaN, wherever the largest is
    logits[2, 5] = float("inf")
    logits[3] = float("-inf")  # a fully masked row: index 0
    logits[4, 123] = float("inf")
    logits[5, 299] = float("nan")  # a NaN in the scalar tail
    want = logits.max(dim=-1).indices
    assert torch.equal(module.argmax_rows(logits), want)
    assert want.tolist()[:6] == [10, 299, 7, 0, 123, 299]


def test_the_sampler_takes_it_for_float32_cpu_rows_and_torch_elsewhere(module):
    logits = _logits(3, 1000, seed=2)
    assert torch.equal(argmax_rows(logits), logits.max(dim=-1).indices)
    halves = logits.to(torch.bfloat16)
    assert torch.equal(argmax_rows(halves), halves.max(dim=-1).indices)
    strided = _logits(1000, 3, seed=3).t()  # not contiguous: copied first
    assert torch.equal(argmax_rows(strided), strided.max(dim=-1).indices)


def test_refuses_what_it_cannot_read(module):
    with pytest.raises(RuntimeError, match="float32"):
        module.argmax_rows(torch.zeros(2, 5, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="empty"):
        module.argmax_rows(torch.zeros(2, 0))
