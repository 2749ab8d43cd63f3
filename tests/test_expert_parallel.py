"""Mixture-of-experts models over 2 processes (shared/parallel/moe_shard.py, expert_parallel.py)
on tiny random Mixtral- and Qwen2-MoE-shaped checkpoints (tests/conftest.py builds them):

- expert parallel (`enable_expert_parallel`: 4 of the 8 experts per rank, rows exchanged by
  all-to-all over gloo): greedy tokens equal transformers' `generate`, through chunked prefill,
  a prefix-cache hit and batch-1 decodes (one rank routes no rows then);
- rank 0's per-expert counters count every rank's rows, equal to one process's;
- tensor-parallel MoE (each expert's intermediate size split), and expert parallel with the
  all-reduce dispatch (SPLITSERVE_EXPERT_DISPATCH): the same tokens;
- a disaggregated request with an expert-parallel prefill or decode engine equals colocated;
- sizes that do not split the experts are a ValueError naming the numbers, before any rank
  starts;
- the dispatch alone (two ranks as threads of this process on a real gloo group): the ranks'
  outputs add up to one process's fused step, for the CPU and the Triton expert products.

Ranks are real processes, one torch thread each.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.config import ParallelConfig
from splitserve.engine.model.moe import route_tokens, sort_by_expert, torch_experts, triton_experts
from splitserve.engine.model.moe_layer import moe_blocks, prepare_expert_weights
from splitserve.engine.parallel.comm import Communicator, connect_store, make_store
from splitserve.engine.parallel.expert_parallel import ExpertAllToAll, token_share
from tests.hf_reference import greedy_references
from tests.test_disaggregation_engine import disaggregated

# Starting the second rank and transformers' reference take ~40 s on a busy 2-core machine: the
# fast suite runs Mixtral, `make test-slow` adds Qwen2-MoE (its shared expert, q/k/v biases).
FAMILIES = ["mixtral", pytest.param("qwen2_moe", marks=pytest.mark.slow)]
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
EOS_TOKEN_ID = 2
ONE_THREAD = {"num_threads": 1, "adaptive_threads": False}
OPTIONS = {"kv_cache_bytes": 8 * 2**20, **ONE_THREAD}
EXPERT_PARALLEL = {"tensor_parallel_size": 2, "enable_expert_parallel": True}
NUM_LAYERS, TOP_K = 2, 2  # the tiny checkpoints' config
TEXTS = [
    "Hi",
    "def quicksort(items):",
    "The lighthouse keeper had lived on the island for thirty years. Every evening he climbed "
    "the spiral stairs, trimmed the wick and watched the beam sweep across the dark water.",
]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def checkpoint(family, make_tiny_moe_checkpoint) -> str:
    return make_tiny_moe_checkpoint(family)


@pytest.fixture(scope="module")
def single(checkpoint) -> LLM:
    return LLM(checkpoint, **OPTIONS)


@pytest.fixture(scope="module")
def expert_parallel(checkpoint):
    # Chunks of 16 tokens in blocks of 4: the long prompt takes several steps beside decodes.
    llm = LLM(checkpoint, block_size=4, max_num_batched_tokens=16, **EXPERT_PARALLEL, **OPTIONS)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def references(checkpoint, single) -> list[tuple[list[int], list[int]]]:
    """(prompt, transformers' greedy tokens up to EOS) per text."""
    prompts = [single.tokenizer.encode(text) for text in TEXTS]
    tokens = greedy_references(checkpoint, prompts, MAX_TOKENS, EOS_TOKEN_ID)
    return list(zip(prompts, tokens, strict=True))


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in llm.generate(prompts, GREEDY)]


def test_expert_parallel_greedy_matches_transformers(expert_parallel, references):
    prompts = [prompt for prompt, _ in references]
    assert _greedy(expert_parallel, prompts) == [tokens for _, tokens in references]
    # Alone, from the prefix cache: batch-1 decodes, where rank 1 routes no rows.
    hits = expert_parallel.stats().prefix_cache_hit_tokens
    assert _greedy(expert_parallel, prompts[-1:]) == [references[-1][1]]
    assert expert_parallel.stats().prefix_cache_hit_tokens > hits


def test_rank_zero_holds_half_the_experts_and_steps_exchange_rows(expert_parallel):
    blocks = moe_blocks(expert_parallel.engine.runner.model)
    assert len(blocks) == NUM_LAYERS
    for block in blocks:
        assert block.local_experts == range(0, 4)
        assert block.experts_gate_up.shape[0] == 4
        assert block.gate.weight.shape[0] == 8  # the router scores every expert
    assert expert_parallel.engine.parallel.comm.all_to_all_seconds > 0


def test_counters_count_every_ranks_rows(expert_parallel, single):
    """Each computed row is routed to TOP_K experts in each layer, whichever rank routed it;
    the per-expert counts equal one process's on the same request."""
    prompt = single.tokenizer.encode("A counted prompt about the sea, the wind and the keeper.")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    moved = []
    for llm in (single, expert_parallel):
        before = llm.stats().moe_expert_tokens or (0,) * 8  # () before the first forward
        llm.generate([prompt], params)
        moved.append([b - a for a, b in zip(before, llm.stats().moe_expert_tokens)])
    rows = len(prompt) + MAX_TOKENS - 1
    assert sum(moved[1]) == rows * TOP_K * NUM_LAYERS
    assert sum(moved[1][4:]) > 0, "experts held by rank 1 are counted on rank 0"
    assert moved[1] == moved[0]


@pytest.mark.parametrize("direction", ["expert_parallel->single", "single->expert_parallel"])
def test_disaggregated_request_equals_colocated(expert_parallel, checkpoint, references, direction):
    """Pages travel in the model's layout (attention is split by heads, as for dense models)."""
    other = LLM(checkpoint, block_size=4, **OPTIONS)
    prefill, decode = (
        (expert_parallel, other) if direction.startswith("expert") else (other, expert_parallel)
    )
    for i, (prompt, tokens) in enumerate(references[1:]):
        request_id = f"{direction}-{i}"
        _, final = disaggregated(prefill.engine, decode.engine, request_id, prompt, GREEDY)
        assert final.token_ids == tokens
    assert decode.stats().num_kv_blocks_free == decode.stats().num_kv_blocks_total


@pytest.mark.slow
def test_tensor_parallel_moe_matches_transformers(checkpoint, references):
    """Without expert parallel each rank holds half of every expert's intermediate size."""
    llm = LLM(checkpoint, tensor_parallel_size=2, **OPTIONS)
    try:
        blocks = moe_blocks(llm.engine.runner.model)
        assert blocks[0].experts_gate_up.shape[:2] == (8, 2 * 16)
        prompts = [prompt for prompt, _ in references]
        assert _greedy(llm, prompts) == [tokens for _, tokens in references]
    finally:
        llm.close()


@pytest.mark.slow
def test_all_reduce_dispatch_matches_transformers(checkpoint, references, monkeypatch):
    """SPLITSERVE_EXPERT_DISPATCH=all_reduce: the same experts per rank, no rows moved."""
    monkeypatch.setenv("SPLITSERVE_EXPERT_DISPATCH", "all_reduce")  # the ranks inherit it
    llm = LLM(checkpoint, **EXPERT_PARALLEL, **OPTIONS)
    try:
        blocks = moe_blocks(llm.engine.runner.model)
        assert blocks[0].experts_gate_up.shape[0] == 4 and blocks[0].expert_parallel is None
        prompts = [prompt for prompt, _ in references]
        assert _greedy(llm, prompts) == [tokens for _, tokens in references]
        assert llm.engine.parallel.comm.all_to_all_seconds == 0
    finally:
        llm.close()


def test_unknown_dispatch_is_refused_before_any_rank_starts(make_tiny_moe_checkpoint, monkeypatch):
    monkeypatch.setenv("SPLITSERVE_EXPERT_DISPATCH", "broadcast")
    with pytest.raises(ValueError, match="SPLITSERVE_EXPERT_DISPATCH must be one of"):
        LLM(make_tiny_moe_checkpoint("mixtral"), **EXPERT_PARALLEL, **OPTIONS)


@pytest.mark.parametrize(
    ("family_", "overrides", "options", "message"),
    [
        (
            "mixtral",
            {"num_local_experts": 6},
            EXPERT_PARALLEL | {"tensor_parallel_size": 4},
            "6 experts are not divisible by tensor_parallel_size 4",
        ),
        (
            "mixtral",
            {"intermediate_size": 30},
            {"tensor_parallel_size": 4},
            "tensor_parallel_size 4 must divide the experts' intermediate size 30",
        ),
        (
            "qwen2_moe",
            {"shared_expert_intermediate_size": 50},
            EXPERT_PARALLEL | {"tensor_parallel_size": 4},
            "tensor_parallel_size 4 must divide the shared expert's intermediate size 50",
        ),
        (
            "qwen2_moe",
            {},
            {"pipeline_parallel_size": 2},
            "pipeline_parallel_size 2 does not support mixture-of-experts",
        ),
    ],
)
def test_sizes_that_do_not_split_the_experts_are_refused(
    make_tiny_moe_checkpoint, family_, overrides, options, message
):
    checkpoint = make_tiny_moe_checkpoint(family_, **overrides)
    with pytest.raises(ValueError, match=message):
        LLM(checkpoint, **options, **OPTIONS)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"enable_expert_parallel": "yes"}, "enable_expert_parallel must be true or false"),
        (
            {"enable_expert_parallel": True, "pipeline_parallel_size": 2},
            "cannot be combined with pipeline_parallel_size 2",
        ),
    ],
)
def test_bad_expert_parallel_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**options)


def test_pod_flag_maps_to_the_engine_option():
    import argparse

    from splitserve.engine.config import EngineConfig
    from splitserve.pod.flags import add_engine_flags, engine_options

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    argv = ["--tensor-parallel-size", "2", "--enable-expert-parallel"]
    parallel = EngineConfig.from_options(**engine_options(parser.parse_args(argv))).parallel
    assert (parallel.tensor_parallel_size, parallel.enable_expert_parallel) == (2, True)
    default = EngineConfig.from_options(**engine_options(parser.parse_args([])))
    assert default.parallel.enable_expert_parallel is False


@pytest.mark.parametrize(("num_tokens", "world_size"), [(1, 2), (7, 2), (16, 2), (5, 4), (2, 3)])
def test_token_shares_cover_every_row_once(num_tokens, world_size):
    shares = [token_share(num_tokens, world_size, rank) for rank in range(world_size)]
    rows = [row for share in shares for row in range(num_tokens)[share]]
    assert rows == list(range(num_tokens))
    sizes = [share.stop - share.start for share in shares]
    assert max(sizes) - min(sizes) <= 1


def _on_two_ranks(action) -> list:
    """action(comm) on ranks 0 and 1 of a gloo group, each in a thread; their results."""
    store = make_store(2, timeout_s=30)
    results: list = [None, None]
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            rank_store = store if r == 0 else connect_store(store.port, 2, timeout_s=30)
            results[r] = action(Communicator(rank_store, r, 2, timeout_s=30))
        except BaseException as error:  # re-raised below, in the test's thread
            errors.append(error)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    if errors:
        raise errors[0]
    return results


EXPERT_FNS = [torch_experts]
if os.environ.get("TRITON_INTERPRET") == "1":  # the Triton grouped GEMM, in the interpreter
    EXPERT_FNS.append(triton_experts)


@pytest.mark.parametrize("experts_fn", EXPERT_FNS, ids=lambda fn: fn.__name__)
@pytest.mark.parametrize("num_tokens", [1, 7, 33])
@pytest.mark.parametrize("skewed", [False, True], ids=["spread", "all_to_rank_0"])
def test_dispatch_over_two_ranks_adds_up_to_one_process(experts_fn, num_tokens, skewed):
    """`skewed`: every row routed to rank 0's experts, so rank 1 receives none."""
    num_experts, hidden, inter, top_k = 8, 16, 12, 2
    generator = torch.Generator().manual_seed(num_tokens)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=generator) / hidden**0.5
    down = torch.randn(num_experts, hidden, inter, generator=generator) / inter**0.5
    router = torch.randn(num_experts, hidden, generator=generator)
    x = torch.randn(num_tokens, hidden, generator=generator)
    bias = torch.tensor([0.0] * 4 + [-1e4 if skewed else 0.0] * 4)

    def route(rows: torch.Tensor):
        return route_tokens(rows @ router.T + bias, top_k, renormalize=True)

    whole = sort_by_expert(route(x), num_experts)
    expected = torch_experts(x, prepare_expert_weights(gate_up, down), whole)

    # Triton's interpreter patches module state while it runs: one rank's thread at a time
    # (ranks are processes in the engine). The products hold no collective, so no deadlock.
    lock = threading.Lock()

    def one_at_a_time(*args):
        with lock:
            return experts_fn(*args)

    def run(comm: Communicator):
        held = slice(4 * comm.rank, 4 * comm.rank + 4)
        experts = prepare_expert_weights(gate_up[held], down[held], held.start)
        return ExpertAllToAll(comm, num_experts).run(x, route, experts, one_at_a_time)

    (out0, counts0), (out1, counts1) = _on_two_ranks(run)
    torch.testing.assert_close(out0 + out1, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(counts0, whole.counts) and torch.equal(counts1, whole.counts)
    if skewed:
        assert whole.counts[4:].sum() == 0, "rank 1's experts got rows"
    mine = token_share(num_tokens, 2, 0)
    assert not out1[mine].any(), "rank 1 writes only its own rows"
