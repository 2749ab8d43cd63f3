"""Layer groups bound the window layers of a model that mixes windows and full attention
(issue 36, shared/kv/groups.py): Gemma 2 and 3 keep each kind of layer in its own groups of one
block pool, and a window group holds only its window's blocks while the full groups hold every
position.

- the plan: which layers share a group and slot, for Gemma 2's and Gemma 3's patterns;
- the manager: window groups release, full groups keep, hits need only what each group reads,
  only group 0's hashes are published, every block comes back once;
- tiny Gemma 2 and Gemma 3 generating far past their windows: the window group's blocks stay
  bounded, greedy tokens and top logprobs equal transformers', through chunked prefill, async
  scheduling, a prefix hit, the fused C++ decode and the PyTorch and Triton paths, preemption
  and a disaggregated request.

torch runs single-threaded (see tests/test_engine_api.py for why).
"""

from __future__ import annotations

import argparse

import pytest

from splitserve import LLM, SamplingParams
from splitserve.engine.config import EngineConfig
from splitserve.engine.kv.cache import KVCacheSpec
from splitserve.engine.kv.disaggregation import RemotePrefillResult
from splitserve.engine.kv.events import BlockRemoved, BlockStored
from splitserve.engine.kv.grouped_manager import GroupedKVManager
from splitserve.engine.kv.groups import KVGroups, plan_kv_groups
from splitserve.engine.kv.manager import KVCacheManager
from splitserve.engine.kv.transfer.base import KVTransferError
from splitserve.engine.model.architecture import ModelArchitecture
from splitserve.engine.request import Request
from splitserve.kernels import cpu as cpu_kernels
from splitserve.pod.flags import add_engine_flags, engine_options
from tests.test_disaggregation_engine import disaggregated, run_until_done
from tests.test_model_families import _reference, make_checkpoint  # noqa: F401
from tests.test_window_blocks import (
    ATTENTION_BACKENDS,
    BLOCK_SIZE,
    NEW_TOKENS,
    PROMPT,
    _assert_matches,
    _engine,
    _params,
    _running,
)

WINDOWS = {"gemma2": 8, "gemma3_text": 12}  # the tiny checkpoints' (tests/test_model_families.py)


def _bound(window: int, extra: int = 0) -> int:
    """Blocks a window group may hold: the window's keys, `extra` positions being written, and
    the block the next one opens."""
    return -(-(window + extra) // BLOCK_SIZE) + 1


# ---- the plan -------------------------------------------------------------------------------


def _arch(windows: tuple[int, ...]) -> ModelArchitecture:
    return ModelArchitecture(
        name="gemma2",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=len(windows),
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_ids=(0,),
        layer_windows=windows,
    )


def test_groups_of_equal_slots_one_kind_each() -> None:
    gemma2 = plan_kv_groups(_arch((8, 0) * 3))  # alternating: two groups of three
    assert gemma2 == KVGroups(3, (0, 8), ((1, 0), (0, 0), (1, 1), (0, 1), (1, 2), (0, 2)))
    # Gemma 3's five local to one global, 12 layers: slots of 2, one global group (layers 5
    # and 11) and five local ones.
    gemma3 = plan_kv_groups(_arch(((16,) * 5 + (0,)) * 2))
    assert gemma3 is not None
    assert (gemma3.slots_per_block, gemma3.group_windows) == (2, (0, 16, 16, 16, 16, 16))
    assert [gemma3.place(layer) for layer in (5, 11, 0, 1, 2, 10)] == [
        (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (5, 1)
    ]  # fmt: skip
    places = set(gemma3.layer_places)
    assert len(places) == 12, "no two layers share a slot of one group"
    # One group where nothing would be bounded, or where every layer releases already.
    assert plan_kv_groups(_arch((0, 0))) is None
    assert plan_kv_groups(_arch((8, 8))) is None
    # One window layer among 28 would make 28 groups of one slot: past MAX_GROUPS, one group.
    assert plan_kv_groups(_arch((0,) * 27 + (8,))) is None
    assert plan_kv_groups(_arch((0,) * 8 + (8,) * 2)) is not None  # 4 + 1 groups of 2


# ---- the manager ----------------------------------------------------------------------------


def _manager(num_blocks: int = 32, window: int = 6) -> GroupedKVManager:
    groups = KVGroups(1, (0, window), ((0, 0), (1, 0)))
    return GroupedKVManager(groups, num_blocks, BLOCK_SIZE, hash_namespace="g")


def test_the_window_group_releases_while_the_full_group_keeps_every_block() -> None:
    manager = _manager(window=6)
    request = _running(manager, "a", list(range(20)))  # 5 blocks in each group
    assert manager.held_blocks_by_group("a") == [5, 5]
    assert manager.num_free_blocks == 32 - 10
    # The next query (position 20) reads keys 15..20: the window group's blocks 0-2 are out.
    assert manager.release_out_of_window(request, 20) == 3
    assert manager.held_blocks_by_group("a") == [5, 2]
    window_ids = manager.get_group_block_ids("a")[0]
    assert window_ids[:3] == [window_ids[3]] * 3  # released positions name a held block
    assert len(set(manager.get_block_ids("a"))) == 5  # the full group's table is whole
    # Pages move every group's blocks, group by group.
    assert manager.page_block_ids("a", 3) == manager.get_block_ids("a")[3:] + window_ids[3:]
    manager.free(request)
    assert manager.num_free_blocks == 32


def test_a_hit_needs_only_the_blocks_each_group_still_reads() -> None:
    manager = _manager(num_blocks=14, window=6)
    tokens = list(range(20))
    first = _running(manager, "a", tokens)
    manager.release_out_of_window(first, 20)
    manager.free(first)
    # 4 blocks were never used; the window group's released ones (2, 1, 0) went back first,
    # so a request taking 6 blocks evicts its blocks 2 and 1: the chain has a hole.
    filler = Request("filler", list(range(100, 112)), SamplingParams())
    assert manager.allocate_slots(filler, 12)
    manager.free(filler)
    again = Request("b", tokens + [99], SamplingParams())
    computed = manager.get_computed_blocks(again)
    # 5 blocks of the prompt's 21 tokens may hit; the window group needs keys 15..20 from the
    # first position after the hit (20): its blocks 3 and 4, not 0-2.
    assert computed.num_tokens == 20
    assert manager.allocate_slots(again, 1, computed)
    assert manager.held_blocks_by_group("b") == [6, 3]
    manager.free(again)
    assert manager.num_free_blocks == 14


def test_only_the_first_groups_blocks_are_published() -> None:
    manager = _manager(num_blocks=12, window=6)
    request = _running(manager, "a", list(range(20)))
    stored = [e for e in manager.take_events() if isinstance(e, BlockStored)]
    assert [h for e in stored for h in e.block_hashes] == request.block_hashes
    assert sorted(manager.cached_block_hashes()) == sorted(request.block_hashes)
    manager.free(request)
    # Taking every block evicts both groups' cached blocks; only group 0's are announced.
    other = Request("b", list(range(200, 224)), SamplingParams())
    assert manager.allocate_slots(other, 24)  # 6 blocks in each group: all 12
    events = manager.take_events()
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert sorted(removed) == sorted(request.block_hashes)


def test_every_groups_hit_is_taken_before_any_group_takes_new_blocks() -> None:
    """Freed tail first, the window group's last blocks lead the eviction order: had group 0
    taken its new block before group 1 touched its hit, it would have evicted that hit."""
    manager = _manager(num_blocks=10, window=6)
    tokens = list(range(20))
    manager.free(_running(manager, "a", tokens))  # every block cached and free
    again = Request("b", tokens + [99], SamplingParams())
    computed = manager.get_computed_blocks(again)
    assert computed.num_tokens == 20
    assert manager.allocate_slots(again, 1, computed)  # 5 + 2 hits revived, 2 new blocks
    assert manager.held_blocks_by_group("b") == [6, 3]
    again.num_computed_tokens = 21
    manager.cache_blocks(again, 21)
    manager.free(again)
    assert manager.num_free_blocks == 10


def test_a_step_gets_blocks_in_every_group_or_in_none() -> None:
    manager = _manager(num_blocks=9, window=6)
    request = Request("a", list(range(20)), SamplingParams())
    assert not manager.can_allocate(request, 20)  # 5 + 5 blocks > 9
    assert not manager.allocate_slots(request, 20)
    assert manager.num_free_blocks == 9  # nothing taken by the group that would fit
    assert manager.allocate_slots(request, 16)
    assert manager.held_blocks_by_group("a") == [4, 4]


# ---- tiny Gemma 2 and Gemma 3, far past their windows ------------------------------------


@pytest.fixture(scope="module")
def references(make_checkpoint):  # noqa: F811 (the fixture imported above)
    cache = {}

    def reference(family: str):
        if family not in cache:
            directory = make_checkpoint(family)
            cache[family] = (
                directory,
                _reference(directory, PROMPT, max_new_tokens=NEW_TOKENS, eos_token_id=None),
            )
        return cache[family]

    return reference


def _generate_counting_blocks(llm: LLM, rid: str, params: SamplingParams):
    """Steps one request to its end: its output and the most blocks each group held while
    decoding (past the prompt and the step after it, when async scheduling releases)."""
    core = llm.engine
    core.add_request(rid, PROMPT, params)
    most: list[int] = []
    final = None
    while core.has_unfinished_requests():
        for delta in core.step():
            final = delta.final if delta.final is not None else final
        request = core.scheduler.requests.get(rid)
        if request is not None and request.num_computed_tokens > len(PROMPT):
            held = core.kv_manager.held_blocks_by_group(rid)
            most = [max(a, b) for a, b in zip(most, held)] if most else held
    assert final is not None
    return final, most


@pytest.mark.parametrize("family", list(WINDOWS))
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["in-order", "async"])
def test_window_groups_hold_bounded_blocks_and_equal_transformers(
    single_thread, references, monkeypatch, family, async_scheduling
):
    directory, reference = references(family)
    llm = _engine(directory, async_scheduling=async_scheduling)
    kv = llm.engine.kv_manager
    assert isinstance(kv, GroupedKVManager)
    assert kv.groups.group_windows == (0, WINDOWS[family])
    fused = llm.engine.runner.model.fused_decode
    assert (fused is not None) == (cpu_kernels.load() is not None)
    grouped_steps = []
    if fused is not None:  # the decode steps go through the C++ layers, with the groups
        run = type(fused).run

        def counting_run(self, hidden, angles, kv_cache, meta, *args, **kwargs):
            grouped_steps.append(meta.kv_groups is not None)
            return run(self, hidden, angles, kv_cache, meta, *args, **kwargs)

        monkeypatch.setattr(type(fused), "run", counting_run)
    params = _params() if async_scheduling else _params(logprobs=5)
    output, most = _generate_counting_blocks(llm, "long", params)
    _assert_matches(output, reference)
    if fused is not None:
        assert len(grouped_steps) >= NEW_TOKENS - 1 and all(grouped_steps)
    # Every position but the newest token's (never computed) in the global layers.
    total = -(-(len(PROMPT) + NEW_TOKENS - 1) // BLOCK_SIZE)
    assert most[0] == total
    assert most[1] <= _bound(WINDOWS[family]) < total
    assert kv.num_free_blocks == kv.num_blocks  # nothing leaked, nothing freed twice
    hits = llm.stats().prefix_cache_hit_tokens
    again, _ = _generate_counting_blocks(llm, "again", params)
    assert llm.stats().prefix_cache_hit_tokens - hits >= 40
    _assert_matches(again, reference)


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
def test_the_python_layers_read_each_groups_tables(single_thread, references, monkeypatch, backend):
    """The test above decodes through the fused C++ layers where they are built; here every
    step goes through the Python layers on the PyTorch or Triton attention."""
    directory, reference = references("gemma3_text")
    monkeypatch.setenv("SPLITSERVE_FUSED_DECODE", "0")
    monkeypatch.setenv("SPLITSERVE_ATTENTION_BACKEND", backend)
    llm = _engine(directory)
    assert llm.engine.runner.model.fused_decode is None
    output, most = _generate_counting_blocks(llm, backend, _params(logprobs=5))
    _assert_matches(output, reference)
    assert most[1] <= _bound(WINDOWS["gemma3_text"])


def test_one_group_when_turned_off_or_where_groups_are_not_taken(single_thread, references):
    directory, (tokens, _) = references("gemma2")
    plain = _engine(directory, group_window_layers=False)
    assert isinstance(plain.engine.kv_manager, KVCacheManager)
    assert plain.engine.runner.kv_cache.shape[0] == 2  # every layer in every block
    assert plain.generate([PROMPT], _params())[0].outputs[0].token_ids == tokens
    # A self-draft reads the cache through its own tables: one group.
    drafted = _engine(directory, speculative_method="self", speculative_draft_layers=1)
    assert isinstance(drafted.engine.kv_manager, KVCacheManager)
    assert drafted.generate([PROMPT], _params())[0].outputs[0].token_ids == tokens


def test_preemption_ngram_speculation_and_disaggregation_keep_the_tokens(single_thread, references):
    directory, (tokens, _) = references("gemma2")
    # 12 blocks in each group hold one whole prompt (what admission checks); three in
    # 24-token steps preempt one another while the window group's blocks come back.
    cramped = _engine(
        directory, num_blocks_override=12, enable_prefix_caching=False, max_num_batched_tokens=24
    )
    assert cramped.engine.kv_spec.num_blocks == 24
    results = cramped.generate([PROMPT] * 3, _params())
    assert [r.outputs[0].token_ids for r in results] == [tokens] * 3
    assert cramped.stats().num_preemptions > 0
    # n-gram drafts in the same cramped pool: drafts take slots in every group, and never
    # cause a preemption of their own (the reserve counts a block per group).
    ngram = _engine(
        directory,
        num_blocks_override=12,
        enable_prefix_caching=False,
        max_num_batched_tokens=24,
        speculative_method="ngram",
        num_speculative_tokens=3,
    )
    assert isinstance(ngram.engine.kv_manager, GroupedKVManager)
    results = ngram.generate([PROMPT] * 3, _params())
    assert [r.outputs[0].token_ids for r in results] == [tokens] * 3
    assert ngram.stats().num_spec_proposed_tokens > 0
    # Pages of every group travel; the decode engine releases the window group's after.
    prefill, decode = _engine(directory), _engine(directory)
    _, got = disaggregated(prefill.engine, decode.engine, "pd", PROMPT, _params(logprobs=2))
    assert got.token_ids == tokens
    for engine in (prefill, decode):
        assert engine.stats().num_kv_blocks_free == engine.stats().num_kv_blocks_total


def test_a_pod_in_one_group_refuses_grouped_pages_by_name(single_thread, references):
    directory, _ = references("gemma2")
    prefill, decode = (
        _engine(directory).engine,
        _engine(directory, group_window_layers=False).engine,
    )
    plan = decode.reserve_remote_prefill("mixed", PROMPT, _params())
    assert plan is not None
    prefill.add_request("mixed", PROMPT, _params(max_tokens=1), export_kv_from_block=0)
    final = run_until_done(prefill)["mixed"]
    pages = prefill.take_exported_pages("mixed")
    assert pages is not None and tuple(pages.shape) != plan.page_shape
    result = RemotePrefillResult(final.token_ids[0], None, pages)
    with pytest.raises(KVTransferError, match="group_window_layers"):
        decode.complete_remote_prefill("mixed", result)
    # What a decode pod does then (services/decode/remote_prefill.py): prefill here.
    decode.scheduler.fall_back_to_local_prefill("mixed")
    assert len(run_until_done(decode)["mixed"].token_ids) == NEW_TOKENS
    stats = decode.stats()
    assert stats.num_kv_blocks_free == stats.num_kv_blocks_total


def test_a_prompt_must_fit_in_every_group(single_thread, references):
    """The pool's blocks hold one group's layers each: a prompt whose positions need more
    blocks than each group can have is refused at once, not left waiting for room."""
    directory, _ = references("gemma2")
    llm = _engine(directory, num_blocks_override=4)  # 8 blocks: 4 positions' blocks per group
    assert (llm.engine.kv_spec.num_blocks, llm.engine.kv_spec.num_tokens) == (8, 16)
    with pytest.raises(ValueError, match="cache holds only 4"):
        llm.engine.validate_prompt(list(range(3, 19)))  # 16 tokens and one output: 5 blocks
    longest = list(range(3, 18))  # 15 tokens and one output: 4 blocks in each group
    llm.engine.validate_prompt(longest)
    params = _params(max_tokens=1)
    assert len(llm.generate([longest], params)[0].outputs[0].token_ids) == 1
    # A budget of fewer than 2 blocks in each group is refused at start, naming the groups.
    with pytest.raises(ValueError, match="in each of its 2 layer groups"):
        _engine(
            directory,
            num_blocks_override=None,
            kv_cache_bytes=3 * llm.engine.kv_spec.bytes_per_block,
        )


def test_pods_take_the_setting_from_a_flag() -> None:
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    for argv, expected in (([], True), (["--no-window-layer-groups"], False)):
        config = EngineConfig.from_options(**engine_options(parser.parse_args(argv)))
        assert config.cache.group_window_layers is expected


def test_the_spec_counts_a_positions_block_once_in_each_group() -> None:
    spec = KVCacheSpec(num_blocks=14, block_size=4, bytes_per_block=100, groups=2)
    assert (spec.num_position_blocks, spec.num_tokens, spec.total_bytes) == (7, 28, 1400)
    assert "14 blocks of 4 tokens in 2 layer groups (28 tokens in every layer" in spec.describe()
    plain = KVCacheSpec(num_blocks=14, block_size=4, bytes_per_block=100)
    assert (plain.num_position_blocks, plain.num_tokens) == (14, 56)
