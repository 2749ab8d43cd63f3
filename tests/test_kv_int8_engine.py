"""`kv_cache_dtype="int8"` through the engine (docs/quantization.md, "KV cache").

Fast, on the tiny random checkpoint of tests/conftest.py: the option and the flags refuse bad
values; the same budget holds >= 1.9x the blocks; greedy output equals the PyTorch path's with
the model's own KV within the bounds below; a P/D request whose pages travel int8 equals the
colocated int8 output; int8 blocks go down to the host tier and come back unchanged.

Slow, on the shipped SmolLM2 (float32 weights): perplexity on grpcio's LICENSE within 2% of
float KV, and greedy agreement over the parity prompts, with the first diverging position of
each prompt printed.
"""

from __future__ import annotations

import argparse
import math
from types import SimpleNamespace

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.config import CacheConfig, EngineConfig
from splitserve.engine.kv.cache import allocate_kv_cache, bytes_per_block
from splitserve.engine.kv.offload.layout import BlockLayout
from splitserve.engine.kv.tiers import Tier
from tests.test_disaggregation_engine import disaggregated

KV_BYTES = 8 * 2**20
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
TEXTS = [
    "The lighthouse keeper climbed the stairs every evening and",
    "def quicksort(items):\n    ",
    "List three colours, then three animals, then three countries:",
]


@pytest.fixture(scope="module")
def tiny(single_thread, tiny_hf_checkpoint):
    """Colocated int8, and an int8 prefill and decode pod; an auto engine for the budget."""
    options = dict(kv_cache_bytes=KV_BYTES, num_threads=1)
    int8 = dict(options, kv_cache_dtype="int8")
    return SimpleNamespace(
        auto=LLM(tiny_hf_checkpoint, **options),
        int8=LLM(tiny_hf_checkpoint, **int8),
        prefill=LLM(tiny_hf_checkpoint, **int8),
        decode=LLM(tiny_hf_checkpoint, **int8),
    )


# ---- the option -------------------------------------------------------------------------------


def test_bad_kv_cache_dtypes_are_refused_naming_the_value():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, got 'int4'"):
        CacheConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8' is not supported"):
        EngineConfig.from_options(kv_cache_dtype="fp8")
    assert EngineConfig.from_options(kv_cache_dtype="int8").cache.kv_cache_dtype == "int8"


def test_pod_flag_reaches_the_engine_and_refuses_fp8_at_start_up(capsys):
    from splitserve.pod.flags import add_engine_flags, engine_options

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    args = parser.parse_args(["--kv-cache-dtype", "int8"])
    assert EngineConfig.from_options(**engine_options(args)).cache.kv_cache_dtype == "int8"
    assert parser.parse_args([]).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "fp8"])
    assert "kv_cache_dtype 'fp8' is not supported" in capsys.readouterr().err


def test_splitserve_up_gives_every_engine_process_the_same_kv_cache_dtype():
    from splitserve.cli import build_parser
    from splitserve.launcher import plan

    args = build_parser().parse_args(["up", "--kv-cache-dtype", "int8"])
    specs = plan(args, prefill_available=True, redis_url="redis://127.0.0.1:1").specs
    engines = [spec.argv for spec in specs if "--kv-cache-dtype" in spec.argv]
    assert len(engines) >= 2  # a prefill and a decode process
    assert {argv[argv.index("--kv-cache-dtype") + 1] for argv in engines} == {"int8"}


# ---- capacity ---------------------------------------------------------------------------------

SMOLLM2 = SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64, mla=None)  # what sizing reads


def test_the_same_budget_holds_at_least_1_9x_the_blocks(tiny):
    auto, int8 = tiny.auto.stats().num_kv_blocks_total, tiny.int8.stats().num_kv_blocks_total
    # The tiny model's head_dim is 16: float32 rows of 64 bytes against int8 rows of 18.
    per_block = {kv: bytes_per_block(tiny.auto.engine.architecture, 16, torch.float32, kv)
                 for kv in ("auto", "int8")}
    assert (auto, int8) == (KV_BYTES // per_block["auto"], KV_BYTES // per_block["int8"])
    assert per_block["auto"] / per_block["int8"] == 64 / 18 and int8 / auto >= 1.9
    # SmolLM2 (head_dim 64): 3.88x against float32 and 1.94x against bfloat16 weights' KV.
    for dtype, expected in ((torch.float32, 256 / 66), (torch.bfloat16, 128 / 66)):
        ratio = bytes_per_block(SMOLLM2, 16, dtype) / bytes_per_block(SMOLLM2, 16, dtype, "int8")
        assert ratio == pytest.approx(expected) and ratio >= 1.9


def test_an_int8_pool_is_int8_rows_with_room_for_their_scales():
    cache = allocate_kv_cache(SimpleNamespace(num_blocks=3, block_size=16), SMOLLM2,
                              torch.float32, torch.device("cpu"), "int8")
    assert cache.dtype == torch.int8 and cache.shape == (30, 2, 3, 16, 3, 66)
    layout = BlockLayout.of_pool(cache, "ns")
    assert (layout.kv_cache_dtype, layout.head_dim, layout.dtype) == ("int8", 64, "int8")
    assert layout.block_bytes == cache[:, :, 0].numel()  # one block's codes and scales
    assert layout.to_dict()["kv_cache_dtype"] == "int8"  # layout.json names the format


def test_the_disk_tier_keeps_int8_blocks_and_empties_itself_for_another_kv_cache_dtype(
    tmp_path,
):
    from splitserve.engine.kv.block_hash import BlockHash
    from splitserve.engine.kv.offload.disk_store import DiskBlockStore
    from splitserve.kernels.kv_int8 import quantize_rows

    pool = quantize_rows(torch.randn(2, 2, 3, 4, 1, 8))  # [layers, 2, blocks, 4, heads, 8 + 2]
    layout = BlockLayout.of_pool(pool, "test")
    block, block_hash = pool[:, :, 1].contiguous(), BlockHash(bytes(16))
    store = DiskBlockStore(tmp_path, 4 * layout.block_bytes, layout)
    store.write_async(block_hash, block)
    store.flush()
    store.close()
    reopened = DiskBlockStore(tmp_path, 4 * layout.block_bytes, layout)
    assert torch.equal(reopened.read(block_hash), block)  # codes and scales, as they were
    reopened.close()
    auto = BlockLayout(2, 4, 1, 8, "float32", "test")  # the same model, kv_cache_dtype auto
    emptied = DiskBlockStore(tmp_path, 4 * auto.block_bytes, auto)
    assert len(emptied) == 0 and not list(tmp_path.glob("*.kv"))
    emptied.close()


# ---- output -----------------------------------------------------------------------------------


def _prompts(llm: LLM) -> list[list[int]]:
    return [llm.tokenizer.encode(text) for text in TEXTS]


def test_a_disaggregated_int8_request_equals_the_colocated_int8_output(tiny):
    for i, prompt in enumerate(_prompts(tiny.int8)):
        expected = tiny.int8.generate([prompt], GREEDY)[0].outputs[0]
        plan, got = disaggregated(tiny.prefill.engine, tiny.decode.engine, f"pd-{i}", prompt,
                                  GREEDY)
        assert plan.dtype == torch.int8 and plan.page_shape[-1] == 16 + 2  # codes and scale
        assert got.token_ids == expected.token_ids
    for llm in (tiny.prefill, tiny.decode):
        assert llm.stats().num_kv_blocks_free == llm.stats().num_kv_blocks_total


@pytest.mark.slow  # ~7 s (TP, PP groups); the fast suite measured 14:32 on a quiet evening
def test_int8_pages_cross_parallel_layouts(tiny, tiny_hf_checkpoint):
    """A TP=2 int8 prefill pod (each rank its KV head's rows, scales inside) and a PP=2 int8
    decode pod exchange pages through the model's layout: output equals colocated int8."""
    options = dict(kv_cache_bytes=KV_BYTES, kv_cache_dtype="int8", num_threads=1,
                   adaptive_threads=False)
    tp2 = LLM(tiny_hf_checkpoint, tensor_parallel_size=2, **options)
    pp2 = LLM(tiny_hf_checkpoint, pipeline_parallel_size=2, **options)
    try:
        for i, prompt in enumerate(_prompts(tiny.int8)[:2]):
            expected = tiny.int8.generate([prompt], GREEDY)[0].outputs[0].token_ids
            for prefill, decode, name in ((tp2, pp2, "tp-pp"), (tiny.prefill, tp2, "1-tp")):
                _, got = disaggregated(prefill.engine, decode.engine, f"{name}-{i}", prompt,
                                       GREEDY)
                assert got.token_ids == expected, name
    finally:
        tp2.close()
        pp2.close()


def test_a_draft_model_gets_an_int8_cache_too_and_greedy_output_is_unchanged(
    tiny, tiny_hf_checkpoint
):
    spec = LLM(tiny_hf_checkpoint, kv_cache_bytes=KV_BYTES, kv_cache_dtype="int8",
               num_threads=1, speculative_method="draft",
               speculative_draft_model=tiny_hf_checkpoint)
    prompts = _prompts(tiny.int8)
    expected = [r.outputs[0].token_ids for r in tiny.int8.generate(prompts, GREEDY)]
    assert [r.outputs[0].token_ids for r in spec.generate(prompts, GREEDY)] == expected
    draft_cache = spec.engine.speculator.proposer.draft_runner.kv_cache
    assert draft_cache.dtype == torch.int8 and draft_cache.shape[-1] == 16 + 2


def test_int8_kv_output_stays_close_to_float_kv(tiny):
    """A random tiny model has no meaning to keep, so this asks only what must hold: the first
    tokens agree (the prompt's logits barely move) and the runs are deterministic."""
    prompts = _prompts(tiny.auto)
    auto = [r.outputs[0].token_ids for r in tiny.auto.generate(prompts, GREEDY)]
    int8 = [r.outputs[0].token_ids for r in tiny.int8.generate(prompts, GREEDY)]
    assert [ids[0] for ids in int8] == [ids[0] for ids in auto]
    assert int8 == [r.outputs[0].token_ids for r in tiny.int8.generate(prompts, GREEDY)]


def test_a_bfloat16_model_over_an_int8_cache(tiny, tiny_hf_checkpoint):
    """bfloat16 queries through the float32 C++ decode kernel, bfloat16 keys through the
    PyTorch write: the first tokens agree with the bfloat16 model's own KV, as for float32."""
    options = dict(kv_cache_bytes=KV_BYTES, num_threads=1, dtype="bfloat16")
    auto = LLM(tiny_hf_checkpoint, **options)
    int8 = LLM(tiny_hf_checkpoint, kv_cache_dtype="int8", **options)
    assert int8.stats().num_kv_blocks_total / auto.stats().num_kv_blocks_total >= 1.7  # 32/18
    prompts = _prompts(tiny.auto)
    want = [r.outputs[0].token_ids[0] for r in auto.generate(prompts, GREEDY)]
    outputs = [r.outputs[0].token_ids for r in int8.generate(prompts, GREEDY)]
    assert [ids[0] for ids in outputs] == want and all(len(ids) == 12 for ids in outputs)


def test_int8_blocks_go_to_the_host_tier_and_come_back_unchanged(
    single_thread, tiny_hf_checkpoint
):
    llm = LLM(tiny_hf_checkpoint, kv_cache_bytes=2**20 // 4, kv_cache_dtype="int8",
              offload_host_bytes=64 * 2**20, num_threads=1)
    tok = llm.tokenizer
    session = tok.encode("You are a helpful assistant who answers questions on geography. " * 6)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    first = llm.generate([session], params)[0].outputs[0]
    num_blocks = llm.engine.kv_manager.num_blocks
    for i in range(4):  # a flood that pushes the session out of the pool
        story = tok.encode(f"Story number {i}: once upon a time a kingdom lay far away. " * 80)
        llm.generate([story[: num_blocks * 16 // 2]], params)
    again = llm.generate([session], params)[0].outputs[0]
    assert llm.engine.offloader.layout.kv_cache_dtype == "int8"
    assert again.token_ids == first.token_ids
    assert again.num_cached_tokens >= 16 * ((len(session) - 1) // 16 - 2) > 0
    assert llm.engine.offloader.counters.load_hits[Tier.HOST] > 0  # not kept by the pool


# ---- quality on the shipped model (slow) ------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2() -> dict[str, LLM]:
    threads = torch.get_num_threads()
    return {
        kv: LLM(kv_cache_bytes=64 * 2**20, kv_cache_dtype=kv, num_threads=threads)
        for kv in ("auto", "int8")
    }


@pytest.mark.slow  # two engines and 2 x 512 tokens in chunks of 64
def test_int8_kv_perplexity_within_two_percent_of_float_kv(smollm2, capsys):
    from tests.test_quantization_quality import NUM_TEXT_TOKENS, _license_text

    model = smollm2["auto"].engine.runner.model  # the same float32 weights either way
    tokens = smollm2["auto"].tokenizer.encode(_license_text())[:NUM_TEXT_TOKENS]
    perplexity = {kv: math.exp(_mean_nll(model, tokens, kv)) for kv in ("auto", "int8")}
    with capsys.disabled():
        print(f"\nperplexity by kv_cache_dtype (512 tokens, chunks of 64): {perplexity}")
    assert abs(perplexity["int8"] / perplexity["auto"] - 1) < 0.02, perplexity


def _mean_nll(model, token_ids: list[int], kv_cache_dtype: str, chunk: int = 64) -> float:
    """Each token's negative log-likelihood given the ones before, fed in prefill chunks that
    read the earlier chunks' keys and values back from a cache of `kv_cache_dtype`."""
    from splitserve.engine.kv.cache import KVCacheSpec
    from splitserve.engine.model.attention_backend import select_attention_backend
    from splitserve.engine.model.attention_metadata import AttentionMetadata, PrefillChunk

    num_tokens, block_size = len(token_ids), 16
    spec = KVCacheSpec(-(-num_tokens // block_size), block_size, 0)
    cache = allocate_kv_cache(spec, model.arch, torch.float32, torch.device("cpu"),
                              kv_cache_dtype)
    backend = select_attention_backend(torch.device("cpu"), cache.dtype)
    ids, log_probs = torch.tensor(token_ids), []
    for start in range(0, num_tokens, chunk):
        end = min(start + chunk, num_tokens)
        blocks = torch.arange(-(-end // block_size))
        meta = AttentionMetadata(torch.arange(start, end), 0,
                                 [PrefillChunk(0, end - start, end, blocks)])
        logits = model(ids[start:end], torch.arange(start, end), cache, meta, backend,
                       torch.arange(end - start))
        log_probs.append(torch.log_softmax(logits, dim=-1))
    predicted = torch.cat(log_probs)[:-1]
    return -predicted.gather(1, ids[1:, None]).mean().item()


@pytest.mark.slow  # eight prompts (one of 600+ tokens) through two engines
def test_greedy_agreement_with_float_kv_over_the_parity_prompts(smollm2, capsys):
    from benchmarks.parity_prompts import parity_prompts
    from tests.test_quantization_quality import NEAR_TIE, _first_divergence

    prompts = parity_prompts(smollm2["auto"].tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=20, logprobs=2)
    auto, int8 = (
        [r.outputs[0] for r in smollm2[kv].generate(prompts, params)] for kv in ("auto", "int8")
    )
    positions = [_first_divergence(a.token_ids, b.token_ids) for a, b in zip(auto, int8)]
    with capsys.disabled():
        print(f"\nKV int8: first diverging position per prompt (None: all 20 agree): {positions}")
    for want, got, position in zip(auto, int8, positions):
        if position is None:
            continue
        # A divergence must be a near tie with float KV: int8's token was float's runner-up.
        top = want.logprobs[position].top
        assert got.token_ids[position] == top[1][0], (position, top)
        assert top[0][1] - top[1][1] < NEAR_TIE, (position, top)
    assert sum(p is None for p in positions) >= len(positions) // 2, positions
