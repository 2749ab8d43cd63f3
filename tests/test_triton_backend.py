"""The Triton attention backend inside the engine equals the PyTorch one.

On the CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before Triton is
imported) and SPLITSERVE_ATTENTION_BACKEND=triton forces the Triton path, which would otherwise
be picked only for CUDA. `TRITON_INTERPRET=0 pytest tests/test_triton_backend.py` runs the same
checks with the Triton engine on a GPU. The model is the tiny random checkpoint: shapes small
enough for the interpreter, and logits with no near-ties, so both paths pick the same tokens.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")  # Triton wheels exist for Linux only

import torch  # noqa: E402

from splitserve import LLM, SamplingParams  # noqa: E402
from splitserve.engine.model.attention import TorchPagedAttention  # noqa: E402
from splitserve.engine.model.attention_backend import select_attention_backend  # noqa: E402
from splitserve.engine.model.decode_groups import group_decodes  # noqa: E402
from splitserve.engine.model.triton_attention import TritonPagedAttention  # noqa: E402
from splitserve.engine.request import Request  # noqa: E402
from splitserve.engine.step import ScheduledChunk  # noqa: E402

DEVICE = "cuda" if os.environ["TRITON_INTERPRET"] == "0" else "cpu"
BACKEND_ENV = "SPLITSERVE_ATTENTION_BACKEND"
BLOCK_SIZE = 16
# Different lengths: 45 spans three blocks, 33 is one token past two full blocks (its cached
# second pass computes a single token, which the runner batches with the decodes).
PROMPT_LENS = [5, 12, 45, 33, 20]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)


def _make_llm(checkpoint: str, backend: str, kv_cache_dtype: str = "auto") -> LLM:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(BACKEND_ENV, backend)
        # A 32-token budget chunks the 45-token prompt and puts decodes and prefill chunks in the
        # same steps.
        return LLM(
            checkpoint,
            kv_cache_bytes=16 * 2**20,
            max_num_batched_tokens=32,
            device=DEVICE,
            kv_cache_dtype=kv_cache_dtype,
        )


@pytest.fixture(scope="module")
def torch_llm(tiny_hf_checkpoint: str) -> LLM:
    return _make_llm(tiny_hf_checkpoint, "torch")


@pytest.fixture(scope="module")
def triton_llm(tiny_hf_checkpoint: str) -> LLM:
    return _make_llm(tiny_hf_checkpoint, "triton")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def test_backend_override_picks_the_implementation(monkeypatch, torch_llm, triton_llm):
    assert isinstance(triton_llm.engine.runner.backend, TritonPagedAttention)
    assert isinstance(torch_llm.engine.runner.backend, TorchPagedAttention)
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert isinstance(select_attention_backend(torch.device("cpu")), TorchPagedAttention)
    monkeypatch.setenv(BACKEND_ENV, "flash")
    with pytest.raises(ValueError, match=BACKEND_ENV):
        select_attention_backend(torch.device("cpu"))


def _record_batch_shapes(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(num_decodes, num_prefill_chunks) of every step the runner prepares from now on."""
    runner = llm.engine.runner
    prepare = runner.prepare_inputs
    shapes: list[tuple[int, int]] = []

    def recording(chunks):
        inputs = prepare(chunks)
        shapes.append((inputs.meta.num_decodes, len(inputs.meta.prefills)))
        return inputs

    monkeypatch.setattr(runner, "prepare_inputs", recording)
    return shapes


def _generate(llm: LLM, prompts: list[list[int]]):
    results = llm.generate(prompts, GREEDY)
    outputs = [result.outputs[0] for result in results]
    token_ids = [output.token_ids for output in outputs]
    logprobs = torch.tensor([[lp.logprob for lp in output.logprobs] for output in outputs])
    cached = [output.num_cached_tokens for output in outputs]
    return token_ids, logprobs, cached


def test_engine_greedy_tokens_match_torch_backend(monkeypatch, torch_llm, triton_llm, prompts):
    shapes = _record_batch_shapes(triton_llm, monkeypatch)
    for pass_index in range(2):  # the second pass is served from the prefix cache
        expected_ids, expected_lp, expected_cached = _generate(torch_llm, prompts)
        token_ids, logprobs, cached = _generate(triton_llm, prompts)
        assert token_ids == expected_ids, f"pass {pass_index}"
        torch.testing.assert_close(logprobs, expected_lp, rtol=1e-4, atol=1e-4)
        assert cached == expected_cached
    # Full blocks but the one holding the last prompt token come from the cache.
    assert cached == [(n - 1) // BLOCK_SIZE * BLOCK_SIZE for n in PROMPT_LENS]
    assert any(decodes and prefills for decodes, prefills in shapes), "no mixed step ran"
    stats = triton_llm.stats()
    assert stats.num_kv_blocks_free == stats.num_kv_blocks_total


# ---- one step's attention, both backends on the same inputs ---------------------------------

# (seq_len, num_new_tokens, block ids): decodes first, as the scheduler orders them. The block
# ids are shuffled and shared by no two sequences.
MIXED_BATCH = [
    (37, 1, [7, 2, 11]),  # decode reaching into a third block
    (5, 1, [3]),  # decode inside its first block
    (20, 20, [9, 0]),  # whole prompt, no cached prefix
    (45, 13, [4, 12, 1]),  # chunk after a 32-token cached prefix
    (21, 3, [5, 10]),  # chunk that starts mid-block
]
NUM_BLOCKS = 14


def _mixed_chunks() -> list[ScheduledChunk]:
    chunks = []
    for i, (seq_len, num_new, block_ids) in enumerate(MIXED_BATCH):
        request = Request(f"r{i}", list(range(seq_len)), GREEDY)
        chunks.append(ScheduledChunk(request, seq_len - num_new, num_new, block_ids, True))
    return chunks


def test_attend_matches_torch_backend_on_a_mixed_step(triton_llm):
    runner = triton_llm.engine.runner  # builds block tables: its backend uses them
    inputs = runner.prepare_inputs(_mixed_chunks())
    meta = inputs.meta
    assert (meta.num_decodes, len(meta.prefills)) == (2, 3)
    num_tokens = sum(num_new for _, num_new, _ in MIXED_BATCH)
    gen = torch.Generator().manual_seed(0)
    num_heads, num_kv_heads, head_dim = 4, 2, 16
    # The Triton runner leaves out the decode groups only the PyTorch path reads; add them so
    # both backends attend over the very same metadata.
    decodes = MIXED_BATCH[: meta.num_decodes]
    meta.decode_groups = group_decodes(
        [seq_len for seq_len, _, _ in decodes],
        [block_ids for _, _, block_ids in decodes],
        BLOCK_SIZE,
        2 * BLOCK_SIZE * num_kv_heads * head_dim * 4,
        torch.device(DEVICE),
    )
    # Every slot random, the cached prefixes included; then this step's tokens written on top.
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen)
    key, value = torch.randn(2, num_tokens, num_kv_heads, head_dim, generator=gen)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    cache, key, value, query = (t.to(DEVICE) for t in (cache, key, value, query))

    triton_cache, torch_cache = cache.clone(), cache.clone()
    TritonPagedAttention().write_kv(key, value, triton_cache, meta)
    TorchPagedAttention().write_kv(key, value, torch_cache, meta)
    assert torch.equal(triton_cache, torch_cache)
    assert not torch.equal(triton_cache, cache)

    scale = head_dim**-0.5
    out = TritonPagedAttention().attend(query, triton_cache, meta, scale)
    expected = TorchPagedAttention().attend(query, torch_cache, meta, scale)
    assert out.shape == query.shape
    error = ((out.double() - expected.double()).norm() / expected.double().norm()).item()
    assert error < 1e-4
    # Per row as well: a wrong row would hide in the norm of the whole batch.
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("window", "softcap"), [(4, 0.0), (13, 2.0), (0, 1.5)])
def test_attend_with_a_window_and_a_cap_matches_masked_attention(triton_llm, window, softcap):
    """Window and soft-capped layers (Mistral, Gemma) on the Triton path: the kernels take
    them, against shared/model/masked_attention.py, which the PyTorch path runs for them and
    the family tests hold to transformers. Windows shorter than the chunks and the cached
    prefixes."""
    from splitserve.engine.model.masked_attention import masked_attention

    runner = triton_llm.engine.runner
    meta = runner.prepare_inputs(_mixed_chunks()).meta
    num_tokens = sum(num_new for _, num_new, _ in MIXED_BATCH)
    gen = torch.Generator().manual_seed(window)
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, 2, 16, generator=gen).to(DEVICE)
    query = (3 * torch.randn(num_tokens, 4, 16, generator=gen)).to(DEVICE)
    backend = TritonPagedAttention()
    assert backend.takes_window_and_softcap and not TorchPagedAttention.takes_window_and_softcap

    out = backend.attend(query, cache, meta, 0.25, window=window, softcap=softcap)

    expected = masked_attention(query, cache, meta, 0.25, window, softcap)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    plain = backend.attend(query, cache, meta, 0.25)
    assert not torch.allclose(out, plain, rtol=1e-3, atol=1e-3)


def test_attend_over_an_int8_cache_matches_torch_backend_on_a_mixed_step(triton_llm):
    """kv_cache_dtype int8: both backends write the same codes and scales, and attend alike."""
    from splitserve.kernels.kv_int8 import quantize_rows

    meta = triton_llm.engine.runner.prepare_inputs(_mixed_chunks()).meta
    decodes = MIXED_BATCH[: meta.num_decodes]
    num_heads, num_kv_heads, head_dim = 4, 2, 16
    meta.decode_groups = group_decodes(
        [seq_len for seq_len, _, _ in decodes],
        [block_ids for _, _, block_ids in decodes],
        BLOCK_SIZE,
        2 * BLOCK_SIZE * num_kv_heads * (head_dim + 2),
        torch.device(DEVICE),
    )
    num_tokens = meta.slot_mapping.shape[0]
    gen = torch.Generator().manual_seed(2)
    cache = quantize_rows(torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim,
                                      generator=gen))
    key, value = torch.randn(2, num_tokens, num_kv_heads, head_dim, generator=gen)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    cache, key, value, query = (t.to(DEVICE) for t in (cache, key, value, query))

    triton_cache, torch_cache = cache.clone(), cache.clone()
    TritonPagedAttention().write_kv(key, value, triton_cache, meta)
    TorchPagedAttention(torch.int8).write_kv(key, value, torch_cache, meta)
    assert torch.equal(triton_cache, torch_cache) and not torch.equal(triton_cache, cache)

    out = TritonPagedAttention().attend(query, triton_cache, meta, head_dim**-0.5)
    expected = TorchPagedAttention().attend(query, torch_cache, meta, head_dim**-0.5)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


def test_int8_kv_engine_greedy_tokens_match_torch_backend(tiny_hf_checkpoint, prompts):
    torch_int8 = _make_llm(tiny_hf_checkpoint, "torch", "int8")
    triton_int8 = _make_llm(tiny_hf_checkpoint, "triton", "int8")
    expected_ids, expected_lp, _ = _generate(torch_int8, prompts)
    token_ids, logprobs, _ = _generate(triton_int8, prompts)
    assert token_ids == expected_ids
    torch.testing.assert_close(logprobs, expected_lp, rtol=1e-4, atol=1e-4)


def test_write_kv_accepts_value_as_a_view_of_fused_qkv(triton_llm):
    """The model's value is a strided view of the fused qkv projection; the key is not."""
    meta = triton_llm.engine.runner.prepare_inputs(_mixed_chunks()).meta
    num_tokens = meta.slot_mapping.shape[0]
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(num_tokens, 3, 2, 16, generator=gen).to(DEVICE)
    key, value = qkv[:, 1].contiguous(), qkv[:, 2]
    cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, 2, 16, device=DEVICE)
    TritonPagedAttention().write_kv(key, value, cache, meta)
    flat = cache.view(2, -1, 2, 16)
    assert torch.equal(flat[0, meta.slot_mapping], key)
    assert torch.equal(flat[1, meta.slot_mapping], value)
