"""Sliding windows bound a sequence's KV blocks (issue 36): when every layer has a window
(Mistral, Phi-3) the KV manager gives back the blocks no query will read again, and the tokens
stay those of transformers.

- the manager: which blocks a window releases, the table positions they leave, the prefix cache
  keeping them, freeing the rest once, the last block kept;
- a tiny Mistral (window 8, 4-token blocks) generating far past its window: its blocks stay
  bounded while greedy tokens and top logprobs equal transformers', through chunked prefill,
  async scheduling, a prefix hit on released blocks, self-speculation, a disaggregated request
  and preemption;
- where nothing may be released: a model with a global layer (Gemma 2) in one group, a
  separate draft model.

torch runs single-threaded (see tests/test_engine_api.py for why).
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from splitserve import LLM, SamplingParams
from splitserve.engine.kv.manager import KVCacheManager
from splitserve.engine.model import llama
from splitserve.engine.request import Request
from tests.test_disaggregation_engine import disaggregated
from tests.test_model_families import TOLERANCE, _reference, make_checkpoint  # noqa: F401

BLOCK_SIZE = 4
WINDOW = 8  # the tiny Mistral's sliding_window (tests/test_model_families.py)
CHUNK = 16
NEW_TOKENS = 40
KV_BYTES = 8 * 2**20
PROMPT = [(7 * i + 3) % 500 + 3 for i in range(45)]
# Blocks a decoding request can hold: the window's keys and the block its next token opens.
DECODE_BOUND = -(-WINDOW // BLOCK_SIZE) + 1
# While a prompt chunk runs, the chunk's blocks come on top of the window's.
PREFILL_BOUND = -(-(WINDOW + CHUNK) // BLOCK_SIZE) + 1


# ---- the manager ----------------------------------------------------------------------------


def _manager(num_blocks: int = 16, window: int = 6) -> KVCacheManager:
    return KVCacheManager(num_blocks, BLOCK_SIZE, hash_namespace="w", sliding_window=window)


def _running(manager: KVCacheManager, rid: str, tokens: list[int]) -> Request:
    """A request whose whole prompt was computed and cached."""
    request = Request(rid, list(tokens), SamplingParams())
    computed = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - computed.num_tokens, computed)
    request.num_computed_tokens = request.num_tokens
    manager.cache_blocks(request, request.num_tokens)
    return request


def test_a_window_releases_the_blocks_before_its_first_key() -> None:
    manager = _manager(window=6)
    request = _running(manager, "a", list(range(20)))  # blocks 0-4
    ids = manager.get_block_ids("a")
    # The next query (position 20) reads keys 15..20: blocks 0-2 (tokens 0-11) are out.
    assert manager.release_out_of_window(request, 20) == 3
    assert manager.num_held_blocks("a") == 2
    assert manager.num_free_blocks == 16 - 2
    # Released positions name the first held block, so a table stays valid memory.
    assert manager.get_block_ids("a") == [ids[3]] * 4 + [ids[4]]
    assert manager.release_out_of_window(request, 20) == 0  # nothing more until it moves on
    assert manager.release_out_of_window(request, 23) == 1  # first key 18: block 3 is out
    # Every released position names a block still held, not block 3, free now.
    assert manager.get_block_ids("a") == [ids[4]] * 5
    manager.free(request)
    assert manager.num_free_blocks == 16  # every block back exactly once


def test_released_blocks_stay_in_the_prefix_cache_head_last_to_go() -> None:
    manager = _manager(window=6)
    tokens = list(range(20))
    first = _running(manager, "a", tokens)
    ids = manager.get_block_ids("a")
    manager.release_out_of_window(first, 20)
    again = Request("b", tokens + [99], SamplingParams())
    assert manager.get_computed_blocks(again).num_tokens == 20
    # Freed tail first, as a finished request's are: the chain's head is evicted last.
    queue = [block.block_id for block in manager.block_pool.free_block_queue]
    assert queue.index(ids[2]) < queue.index(ids[1]) < queue.index(ids[0])


def test_the_last_block_is_kept_and_no_window_releases_nothing() -> None:
    manager = _manager(window=1)
    request = _running(manager, "a", list(range(8)))
    assert manager.release_out_of_window(request, 8) == 1  # block 1 (tokens 4-7) is kept
    assert manager.num_held_blocks("a") == 1
    plain = KVCacheManager(16, BLOCK_SIZE, hash_namespace="w")
    request = _running(plain, "b", list(range(20)))
    assert plain.release_out_of_window(request, 20) == 0
    assert plain.num_held_blocks("b") == 5
    with pytest.raises(ValueError, match="sliding_window"):
        KVCacheManager(16, BLOCK_SIZE, sliding_window=-1)


def test_dense_qwen_windows_the_layers_transformers_does() -> None:
    """Without layer_types, Qwen2/3 window the layers from max_window_layers on (transformers
    derives layer_types so); a model with global layers releases nothing."""
    import transformers

    from splitserve.engine.model.hf_families import layer_windows

    for model_type, config_class in (("qwen2", "Qwen2Config"), ("qwen3", "Qwen3Config")):
        options = dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=64)
        for first in (2, 0, None):  # None: the default, 28, past every layer
            extra = {} if first is None else {"max_window_layers": first}
            unsized = {k: v for k, v in options.items() if k != "sliding_window"}
            config = {"model_type": model_type, **unsized, **extra}  # the default window
            defaults = getattr(transformers, config_class)(**unsized, **extra)
            assert (layer_windows(config) or (0,) * 4) == tuple(
                defaults.sliding_window if t == "sliding_attention" else 0
                for t in defaults.layer_types
            )
            expected = getattr(transformers, config_class)(**options, **extra).layer_types
            config = {"model_type": model_type, **options, **extra}
            windows = layer_windows(config) or (0,) * 4
            assert ["sliding_attention" if w else "full_attention" for w in windows] == expected


# ---- a tiny Mistral, far past its window ---------------------------------------------------


@pytest.fixture(scope="module")
def mistral(make_checkpoint):  # noqa: F811 (the fixture imported above)
    directory = make_checkpoint("mistral")
    return directory, _reference(directory, PROMPT, max_new_tokens=NEW_TOKENS, eos_token_id=None)


def _engine(directory: str, **options: Any) -> LLM:
    settings = {"kv_cache_bytes": KV_BYTES, "max_num_batched_tokens": CHUNK}
    return LLM(directory, block_size=BLOCK_SIZE, **{**settings, **options})


def _params(**options: Any) -> SamplingParams:
    defaults = {"temperature": 0.0, "max_tokens": NEW_TOKENS, "ignore_eos": True}
    return SamplingParams(**{**defaults, **options})


def _generate_counting_blocks(llm: LLM, rid: str, params: SamplingParams):
    """Steps the engine to the end of one request; its output and the most blocks it held
    while prefilling and while decoding."""
    core = llm.engine
    core.add_request(rid, PROMPT, params)
    most = {"prefill": 0, "decode": 0}
    final = None
    while core.has_unfinished_requests():
        for delta in core.step():
            final = delta.final if delta.final is not None else final
        request = core.scheduler.requests.get(rid)
        if request is not None:
            # Past the prompt's end: with async scheduling the last chunk's blocks go back
            # one step after its count reached the prompt's length.
            phase = "decode" if request.num_computed_tokens > len(PROMPT) else "prefill"
            held = core.kv_manager.num_held_blocks(rid)
            most[phase] = max(most[phase], held)
    assert final is not None
    return final, most


def _assert_matches(output: Any, reference) -> None:
    tokens, logprobs = reference
    assert output.token_ids == tokens
    for step, entry in enumerate(output.logprobs or []):
        for token_id, value in entry.top:
            assert value == pytest.approx(logprobs[step][token_id].item(), abs=TOLERANCE)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["in-order", "async"])
def test_a_long_sequence_holds_bounded_blocks_and_equals_transformers(
    single_thread, mistral, async_scheduling
):
    directory, reference = mistral
    llm = _engine(directory, async_scheduling=async_scheduling)
    assert llm.engine.kv_manager.sliding_window == WINDOW
    # Logprobs make the steps run in order; the async run checks the tokens alone.
    params = _params() if async_scheduling else _params(logprobs=5)
    output, most = _generate_counting_blocks(llm, "long", params)
    _assert_matches(output, reference)
    total = -(-(len(PROMPT) + NEW_TOKENS) // BLOCK_SIZE)
    assert most["decode"] <= DECODE_BOUND < total
    assert most["prefill"] <= PREFILL_BOUND
    kv = llm.engine.kv_manager
    assert kv.num_free_blocks == kv.num_blocks  # nothing leaked, nothing freed twice
    # The released blocks stayed cached: the same prompt again is a prefix hit.
    hits = llm.stats().prefix_cache_hit_tokens
    again, _ = _generate_counting_blocks(llm, "again", params)
    assert llm.stats().prefix_cache_hit_tokens - hits >= 40
    _assert_matches(again, reference)


# The Python layers' attention paths (tests/test_window_groups.py takes them too).
ATTENTION_BACKENDS = [
    "torch",
    pytest.param(
        "triton",
        marks=pytest.mark.skipif(
            os.environ.get("TRITON_INTERPRET") != "1",
            reason="the Triton path runs in Triton's interpreter on the CPU",
        ),
    ),
]


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
def test_the_other_attention_paths_read_the_tables_the_window_leaves(
    single_thread, mistral, monkeypatch, backend
):
    """The test above decodes through the fused C++ layers where they are built; here decode
    steps go through masked_attention.py (PyTorch) or the Triton kernels."""
    directory, reference = mistral
    monkeypatch.setenv("SPLITSERVE_FUSED_DECODE", "0")
    monkeypatch.setenv("SPLITSERVE_ATTENTION_BACKEND", backend)
    llm = _engine(directory)
    chosen = type(llm.engine.runner.backend)
    assert chosen.__name__ == {"torch": "TorchPagedAttention", "triton": "TritonPagedAttention"}[
        backend
    ]
    # Windowed layers attend in the Triton kernels, or in masked_attention.py beside SDPA.
    owner, name = (chosen, "attend") if backend == "triton" else (llama, "masked_attention")
    decode_calls = []
    attend = getattr(owner, name)

    def counting_attend(*args, **kwargs):
        meta = args[3] if owner is chosen else args[2]  # a method's first is self
        decode_calls.append(meta.num_decodes)
        return attend(*args, **kwargs)

    monkeypatch.setattr(owner, name, counting_attend)
    output, most = _generate_counting_blocks(llm, backend, _params(logprobs=5))
    _assert_matches(output, reference)
    assert most["decode"] <= DECODE_BOUND
    # The decode steps went through this path, not some other.
    assert sum(1 for count in decode_calls if count > 0) >= NEW_TOKENS - 1


def test_self_speculation_preemption_and_disaggregation_keep_the_tokens(single_thread, mistral):
    directory, (tokens, _) = mistral
    speculative = _engine(directory, speculative_method="self", speculative_draft_layers=1)
    assert speculative.engine.kv_manager.sliding_window == WINDOW
    assert speculative.generate([PROMPT], _params())[0].outputs[0].token_ids == tokens
    assert speculative.stats().num_spec_proposed_tokens > 0
    # 12 blocks hold one whole prompt (what admission checks); three in 24-token steps
    # preempt one another while released blocks come back.
    cramped = _engine(
        directory, num_blocks_override=12, enable_prefix_caching=False, max_num_batched_tokens=24
    )
    results = cramped.generate([PROMPT] * 3, _params())
    assert [r.outputs[0].token_ids for r in results] == [tokens] * 3
    assert cramped.stats().num_preemptions > 0
    # The prefill engine keeps every block for the pages it sends; the decode engine, which
    # caches them all, releases after they landed.
    prefill, decode = _engine(directory), _engine(directory)
    params = _params(logprobs=2)
    _, got = disaggregated(prefill.engine, decode.engine, "pd", PROMPT, params)
    assert got.token_ids == tokens
    for engine in (prefill, decode):
        assert engine.stats().num_kv_blocks_free == engine.stats().num_kv_blocks_total


def test_nothing_is_released_beside_a_global_layer_or_a_separate_draft(
    single_thread, make_checkpoint, mistral  # noqa: F811
):
    # Window 8 on one layer, the other global: in one group (with layer groups off) nothing
    # is released (tests/test_window_groups.py has the groups).
    gemma = _engine(make_checkpoint("gemma2"), group_window_layers=False)
    assert gemma.engine.architecture.kv_window == 0
    assert gemma.engine.kv_manager.sliding_window == 0
    directory, (tokens, _) = mistral
    # A draft model shares the block tables and may attend to every position.
    drafted = _engine(directory, speculative_method="draft", speculative_draft_model=directory)
    assert drafted.engine.kv_manager.sliding_window == 0
    assert drafted.generate([PROMPT], _params())[0].outputs[0].token_ids == tokens
