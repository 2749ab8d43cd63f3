"""CUDA graphs for decode-only steps (shared/cuda_graphs.py): which steps replay in which
captured size, the padding of their inputs, the un-padding of their logits, and that the
engine's tokens do not change.

On the CPU the "capture" is eager (the recorded function itself), over the Triton attention
path in Triton's interpreter, so everything but the graph itself runs here;
`TRITON_INTERPRET=0 pytest tests/test_cuda_graphs.py` on a GPU captures real graphs
(`CudaGraphCapture`) through the same tests.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")  # Triton wheels exist for Linux only

import torch  # noqa: E402

from splitserve import LLM, SamplingParams  # noqa: E402
from splitserve.engine.cuda_graphs import (  # noqa: E402
    CudaGraphCapture,
    DecodeGraphs,
    StaticDecodeInputs,
    graph_batch_size,
    pick_batch_size,
)
from splitserve.engine.model.attention_metadata import (  # noqa: E402
    AttentionMetadata,
    PrefillChunk,
)
from splitserve.engine.request import Request  # noqa: E402
from splitserve.engine.step import ScheduledChunk  # noqa: E402

DEVICE = "cuda" if os.environ["TRITON_INTERPRET"] == "0" else "cpu"
SIZES = (1, 2, 4)
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


def test_pick_batch_size_takes_the_smallest_that_holds_the_rows():
    sizes = (1, 2, 4, 8, 16, 32, 64)
    assert [pick_batch_size(n, sizes) for n in (1, 2, 3, 5, 8, 33, 64)] == [1, 2, 4, 8, 8, 64, 64]
    assert pick_batch_size(65, sizes) is None


def _decode_meta(num_rows: int, width: int) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=torch.arange(10, 10 + num_rows),
        num_decodes=num_rows,
        prefills=[],
        block_tables=torch.arange(1, 1 + num_rows * width, dtype=torch.int32).view(num_rows, -1),
        seq_lens=torch.arange(3, 3 + num_rows, dtype=torch.int32),
        query_start_loc=torch.arange(num_rows + 1, dtype=torch.int32),
    )


def test_graph_batch_size_replays_only_decode_only_steps_that_fit():
    ids, rows = torch.zeros(3, dtype=torch.int64), torch.arange(3)
    meta = _decode_meta(3, width=2)
    assert graph_batch_size(ids, meta, rows, SIZES, max_blocks=8) == 4
    # Five decodes: past the largest size.
    five = _decode_meta(5, width=2)
    assert graph_batch_size(torch.zeros(5), five, torch.arange(5), SIZES, 8) is None
    # Block tables wider than captured: a context past the model length the graphs cover.
    assert graph_batch_size(ids, meta, rows, SIZES, max_blocks=1) is None
    # A prefill chunk in the step.
    mixed = _decode_meta(3, width=2)
    mixed.num_decodes = 2
    mixed.prefills = [PrefillChunk(2, 1, 3, torch.tensor([0]))]
    assert graph_batch_size(ids, mixed, rows, SIZES, 8) is None
    # A row whose logits are not taken, and a backend without block tables.
    assert graph_batch_size(ids, meta, rows[:2], SIZES, 8) is None
    meta.block_tables = None
    assert graph_batch_size(ids, meta, rows, SIZES, 8) is None


def test_fill_copies_the_rows_and_pads_the_rest():
    static = StaticDecodeInputs(batch_size=4, max_blocks=5, device=torch.device("cpu"))
    static.fill(torch.tensor([7, 8]), torch.tensor([30, 40]), _decode_meta(2, width=3))
    assert static.input_ids.tolist() == [7, 8, 0, 0]
    assert static.positions.tolist() == [30, 40, 0, 0]
    assert static.meta.slot_mapping.tolist() == [10, 11, -1, -1]  # -1: the KV write skips it
    assert static.meta.seq_lens.tolist() == [3, 4, 1, 1]
    assert static.meta.block_tables.tolist() == [
        [1, 2, 3, 0, 0],
        [4, 5, 6, 0, 0],
        [0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0],
    ]
    # A narrower, smaller step afterwards leaves nothing of the first behind.
    static.fill(torch.tensor([9]), torch.tensor([50]), _decode_meta(1, width=1))
    assert static.input_ids.tolist() == [9, 0, 0, 0]
    assert static.meta.slot_mapping.tolist() == [10, -1, -1, -1]
    assert static.meta.block_tables[0].tolist() == [1, 0, 0, 0, 0]
    assert static.logits_indices.tolist() == [0, 1, 2, 3]


class CountingCapture:
    """Eager on the CPU, CUDA graphs on CUDA; counts the replays."""

    def __init__(self) -> None:
        self.inner = CudaGraphCapture() if DEVICE == "cuda" else None
        self.replays = 0

    def __call__(self, run):
        replay = self.inner(run) if self.inner is not None else run

        def counted():
            self.replays += 1
            return replay()

        return counted


@pytest.fixture(scope="module")
def triton_llm(tiny_hf_checkpoint: str) -> LLM:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPLITSERVE_ATTENTION_BACKEND", "triton")
        return LLM(tiny_hf_checkpoint, kv_cache_bytes=16 * 2**20, device=DEVICE)


def _graphs(llm: LLM, capture: CountingCapture, max_blocks: int = 16) -> DecodeGraphs:
    runner = llm.engine.runner
    return DecodeGraphs(runner.forward_eager, SIZES, max_blocks, runner.device, capture)


def _decode_chunks(seq_lens: list[int]) -> list[ScheduledChunk]:
    """Decodes over disjoint blocks, block ids shuffled."""
    chunks, next_block = [], 0
    for i, seq_len in enumerate(seq_lens):
        num_blocks = -(-seq_len // 16)
        block_ids = list(range(next_block, next_block + num_blocks))[::-1]
        next_block += num_blocks
        request = Request(f"g{i}", list(range(3, 3 + seq_len)), GREEDY)
        chunks.append(ScheduledChunk(request, seq_len - 1, 1, block_ids, True))
    return chunks


def test_a_padded_replay_gives_the_eager_logits_of_each_row(triton_llm):
    runner = triton_llm.engine.runner
    capture = CountingCapture()
    graphs = _graphs(triton_llm, capture)
    inputs = runner.prepare_inputs(_decode_chunks([20, 37, 5]))  # 3 rows: replayed in 4
    args = (inputs.input_ids, inputs.positions, inputs.meta, inputs.logits_indices)

    expected = runner.forward_eager(*args)
    replays_before = capture.replays
    logits = graphs.run(*args)

    assert capture.replays == replays_before + 1
    assert logits.shape == expected.shape == (3, expected.shape[1])
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def test_a_step_that_does_not_fit_runs_eagerly(triton_llm):
    runner = triton_llm.engine.runner
    capture = CountingCapture()
    graphs = _graphs(triton_llm, capture)
    replays = capture.replays
    for chunks in (_decode_chunks([20, 37, 5, 9, 12]), _decode_chunks([300])):
        # Five rows (past 4); a 300-token context (19 blocks, past the 16 captured).
        inputs = runner.prepare_inputs(chunks)
        args = (inputs.input_ids, inputs.positions, inputs.meta, inputs.logits_indices)
        assert graphs.run(*args) is None
    assert capture.replays == replays


def test_the_engine_with_graphs_generates_the_same_tokens(triton_llm, monkeypatch):
    prompts = [[5, 6, 7, 8, 9] * i for i in range(1, 6)]  # five: steps of 5 decodes run eagerly
    expected = [r.outputs[0].token_ids for r in triton_llm.generate(prompts, GREEDY)]
    capture = CountingCapture()
    monkeypatch.setattr(triton_llm.engine.runner, "decode_graphs", _graphs(triton_llm, capture))
    replays = capture.replays

    tokens = [r.outputs[0].token_ids for r in triton_llm.generate(prompts, GREEDY)]
    tokens_of_three = [r.outputs[0].token_ids for r in triton_llm.generate(prompts[:3], GREEDY)]

    assert tokens == expected
    assert tokens_of_three == expected[:3]
    assert capture.replays > replays  # the three prompts' decode steps replayed


def test_the_flag_is_off_by_default_and_refused_off_cuda(triton_llm):
    assert triton_llm.config.model.cuda_graphs is False
    assert triton_llm.engine.runner.decode_graphs is None
    with pytest.raises(ValueError, match="cuda_graphs needs a CUDA device"):
        LLM(cuda_graphs=True, device="cpu")
