"""KV offload tiers (shared/kv/offload/): the host and disk stores' exact behaviour, and the
engine serving prompts whose prefix was pushed out of its pool from host memory and from disk
(also after a restart), with the same tokens as transformers and nothing leaked.
"""

from __future__ import annotations

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.kv.block_hash import BlockHash
from splitserve.engine.kv.offload.disk_store import DiskBlockStore
from splitserve.engine.kv.offload.host_store import HostBlockStore
from splitserve.engine.kv.offload.layout import BlockLayout
from splitserve.engine.kv.tiers import Tier
from splitserve.engine.request import RequestStatus
from tests.hf_reference import transformers_greedy

LAYOUT = BlockLayout(2, 4, 1, 8, "float32", "test")
POOL_BYTES = 24 * 2**20  # 34 blocks of SmolLM2: a few prompts push a session out
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def _hash(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "big"))


def _block(seed: int) -> torch.Tensor:
    return torch.randn(LAYOUT.block_shape, generator=torch.Generator().manual_seed(seed))


# ---- the host store ----------------------------------------------------------------------------


def test_host_store_pushes_out_the_least_recently_used_and_keeps_data_only_of_reused_blocks():
    store = HostBlockStore(2, LAYOUT, spill_min_hits=1)
    assert store.save(_hash(0), _block(0), num_hits=0) == (True, [])
    assert store.save(_hash(1), _block(1), num_hits=3) == (True, [])
    destination = torch.zeros(LAYOUT.block_shape)
    assert store.load_into(_hash(0), destination)  # 0 is now the most recently used
    assert torch.equal(destination, _block(0))
    is_new, spilled = store.save(_hash(2), _block(2), num_hits=0)
    assert is_new and [s.block_hash for s in spilled] == [_hash(1)]
    assert torch.equal(spilled[0].data, _block(1))  # reused (3 hits): its KV goes to disk
    _, spilled = store.save(_hash(3), _block(3), num_hits=0)
    # 0 was hit once here (the load), so it too keeps its data; 2 then has none to give.
    assert [s.block_hash for s in spilled] == [_hash(0)] and spilled[0].data is not None
    _, spilled = store.save(_hash(4), _block(4), num_hits=0)
    assert [s.block_hash for s in spilled] == [_hash(2)] and spilled[0].data is None
    assert _hash(2) not in store and not store.load_into(_hash(2), destination)


def test_host_store_saving_a_known_hash_only_refreshes_it():
    store = HostBlockStore(2, LAYOUT)
    store.save(_hash(0), _block(0), 0)
    store.save(_hash(1), _block(1), 0)
    assert store.save(_hash(0), _block(9), 0) == (False, [])  # same hash: same KV, no copy
    _, spilled = store.save(_hash(2), _block(2), 0)
    assert [s.block_hash for s in spilled] == [_hash(1)]
    destination = torch.zeros(LAYOUT.block_shape)
    assert store.load_into(_hash(0), destination) and torch.equal(destination, _block(0))


# ---- the disk store ----------------------------------------------------------------------------


def test_disk_store_round_trips_blocks_under_its_cap_and_reports_events(tmp_path):
    store = DiskBlockStore(tmp_path, 2 * LAYOUT.block_bytes, LAYOUT)
    for i in range(3):
        assert store.write_async(_hash(i), _block(i))
        store.flush()
    assert store.take_events() == ([_hash(0), _hash(1), _hash(2)], [_hash(0)])
    assert store.read(_hash(0)) is None and _hash(0) not in store
    assert torch.equal(store.read(_hash(2)), _block(2))
    assert sorted(p.name for p in tmp_path.glob("*.kv")) == sorted(
        f"{_hash(i).hex()}.kv" for i in (1, 2)
    )
    assert not store.write_async(_hash(2), _block(2))  # already there
    store.close()


def test_disk_store_reopened_serves_its_files_and_a_new_layout_empties_it(tmp_path):
    store = DiskBlockStore(tmp_path, 8 * LAYOUT.block_bytes, LAYOUT)
    store.write_async(_hash(5), _block(5))
    store.flush()
    store.close()
    (tmp_path / f"{_hash(6).hex()}.kv").write_bytes(b"short")  # a bad file is dropped
    reopened = DiskBlockStore(tmp_path, 8 * LAYOUT.block_bytes, LAYOUT)
    assert reopened.take_events() == ([_hash(5)], [])
    assert torch.equal(reopened.read(_hash(5)), _block(5)) and _hash(6) not in reopened
    reopened.close()
    other = BlockLayout(2, 4, 1, 8, "float32", "another-namespace")
    emptied = DiskBlockStore(tmp_path, 8 * other.block_bytes, other)
    assert len(emptied) == 0 and not list(tmp_path.glob("*.kv"))
    emptied.close()


# ---- the engine --------------------------------------------------------------------------------


def _session_and_flood(llm: LLM) -> tuple[list[int], list[list[int]]]:
    tok = llm.tokenizer
    system = tok.encode("You are a helpful assistant who answers questions on geography. " * 12)
    session = system + tok.encode("Question: what is the capital of France?")
    flood = [
        tok.encode(f"Story number {i}: once upon a time a kingdom lay far away. " * 10)
        for i in range(5)
    ]
    return session, flood


def _resume_after_flood(llm: LLM, session: list[int], flood: list[list[int]]):
    """The session's first turn, a flood that pushes it out of the pool, the session again."""
    first = llm.generate([session], GREEDY)[0].outputs[0]
    for prompt in flood:
        llm.generate([prompt], GREEDY)
    return first, llm.generate([session], GREEDY)[0].outputs[0]


def _disk_tier(directory, **extra) -> dict:
    """Engine options: the small pool and a 512 MiB disk tier in `directory`, no host tier."""
    options = dict(
        kv_cache_bytes=POOL_BYTES, offload_disk_dir=str(directory), offload_disk_bytes=512 * 2**20
    )
    return {**options, **extra}


def _all_blocks_free(llm: LLM) -> bool:
    return llm.engine.kv_manager.num_free_blocks == llm.engine.kv_manager.num_blocks


def test_a_session_pushed_out_of_the_pool_comes_back_from_host_memory(
    single_thread, hf_reference_model
):
    llm = LLM(kv_cache_bytes=POOL_BYTES, offload_host_bytes=256 * 2**20)
    session, flood = _session_and_flood(llm)
    first, resumed = _resume_after_flood(llm, session, flood)
    expected = transformers_greedy(hf_reference_model, session, GREEDY.max_tokens)
    assert first.token_ids == resumed.token_ids == expected
    counters = llm.engine.offloader.counters
    num_blocks = (len(session) - 1) // 16
    assert counters.load_hits[Tier.HOST] >= num_blocks - 2  # the pool may keep a few
    assert resumed.num_cached_tokens == num_blocks * 16
    assert counters.load_failures == 0 and _all_blocks_free(llm)


@pytest.mark.slow  # make test stays well under 15 min: the contrast run, ~8 s
def test_without_offload_the_session_is_computed_again(single_thread):
    llm = LLM(kv_cache_bytes=POOL_BYTES)
    session, flood = _session_and_flood(llm)
    _, resumed = _resume_after_flood(llm, session, flood)
    assert resumed.num_cached_tokens < 32  # the pool lost it: what the tiers are for


@pytest.mark.slow  # ~13 s (two engines); make test measured 14:33 on 2026-11-25
def test_reused_blocks_reach_the_disk_and_a_restarted_engine_serves_them(
    single_thread, tmp_path
):
    options = _disk_tier(tmp_path)
    llm = LLM(**options)
    session, flood = _session_and_flood(llm)
    llm.generate([session], GREEDY)
    first, resumed = _resume_after_flood(llm, session, flood)  # hit once: reused
    for prompt in flood:
        llm.generate([prompt], GREEDY)  # pushes the reused blocks out, to disk
    llm.engine.close()
    assert len(list(tmp_path.glob("*.kv"))) >= (len(session) - 1) // 16 - 2
    one_shot_blocks = sum(len(p) // 16 for p in flood)
    assert len(list(tmp_path.glob("*.kv"))) < one_shot_blocks  # one-shot floods stayed off

    restarted = LLM(**options)
    events = restarted.engine.take_kv_events()
    assert any(e.tier == Tier.DISK for e in events)  # republished for the index
    again = restarted.generate([session], GREEDY)[0].outputs[0]
    assert again.token_ids == first.token_ids == resumed.token_ids
    assert again.num_cached_tokens >= 16 * ((len(session) - 1) // 16 - 2)
    assert restarted.engine.offloader.counters.load_hits[Tier.DISK] > 0
    restarted.engine.close()


@pytest.mark.slow  # an engine of its own (~10 s); the abort-while-loading case stays in make test
def test_a_failed_disk_load_falls_back_to_computing_the_prefix(single_thread, tmp_path):
    llm = LLM(**_disk_tier(tmp_path, offload_disk_min_hits=0))
    session, flood = _session_and_flood(llm)
    first = llm.generate([session], GREEDY)[0].outputs[0]
    for prompt in flood:
        llm.generate([prompt], GREEDY)
    llm.engine.offloader.disk.flush()
    for path in tmp_path.glob("*.kv"):
        path.write_bytes(b"damaged")  # the index still lists them; reading them fails
    again = llm.generate([session], GREEDY)[0].outputs[0]
    assert again.token_ids == first.token_ids
    assert llm.engine.offloader.counters.load_failures == 1
    assert again.num_cached_tokens < 32 and _all_blocks_free(llm)
    llm.engine.close()


# make test stays well under 15 min: an abort mid-load, ~10 s
@pytest.mark.slow
def test_aborting_a_request_while_its_blocks_load_frees_them(single_thread):
    llm = LLM(kv_cache_bytes=POOL_BYTES, offload_host_bytes=256 * 2**20)
    session, flood = _session_and_flood(llm)
    _resume_after_flood(llm, session, flood)
    for prompt in flood:
        llm.generate([prompt], GREEDY)
    engine = llm.engine
    engine.add_request("loading", session, GREEDY)
    engine.scheduler.schedule()  # admits it: the load starts
    assert engine.scheduler.requests["loading"].status == RequestStatus.WAITING_FOR_KV_LOAD
    engine.abort_requests(["loading"])
    assert not engine.has_unfinished_requests() and _all_blocks_free(llm)


# ---- a P/D decode pod: its tiers hold the prefix, the prefill pod sends only the rest ---------


@pytest.mark.slow  # ~20 s (three engines); the fast suite is near its 15 minutes
def test_a_restarted_decode_pod_serves_its_disk_tier_and_asks_only_for_the_rest(
    single_thread, tmp_path
):
    from tests.test_disaggregation_engine import prefill_remotely, run_until_done

    options = _disk_tier(tmp_path, offload_disk_min_hits=0)
    prefill, reference = LLM(kv_cache_bytes=POOL_BYTES), LLM(kv_cache_bytes=POOL_BYTES)
    session, flood = _session_and_flood(reference)
    expected = reference.generate([session], GREEDY)[0].outputs[0].token_ids
    decode = LLM(**options)
    _, deltas = prefill_remotely(prefill.engine, decode.engine, "turn-1", session, GREEDY)
    run_until_done(decode.engine)
    for prompt in flood:
        decode.generate([prompt], GREEDY)  # writes the session's blocks down to disk
    decode.engine.close()

    restarted = LLM(**options)
    plan, deltas = prefill_remotely(prefill.engine, restarted.engine, "turn-2", session, GREEDY)
    finals = {d.request_id: d.final for d in deltas if d.final is not None}
    finals.update(run_until_done(restarted.engine))
    num_prefix_blocks = (len(session) - 1) // 16
    assert plan.first_block_index >= num_prefix_blocks - 2  # pages only for the tail
    assert finals["turn-2"].token_ids == expected
    assert finals["turn-2"].cached_tokens_by_tier["disk"] >= 16 * (num_prefix_blocks - 2)
    assert _all_blocks_free(restarted)

    for path in tmp_path.glob("*.kv"):
        path.write_bytes(b"damaged")  # its load fails: the pod computes the prompt itself
    for prompt in flood:
        restarted.generate([prompt], GREEDY)
    plan, deltas = prefill_remotely(prefill.engine, restarted.engine, "turn-3", session, GREEDY)
    finals = {d.request_id: d.final for d in deltas if d.final is not None}
    finals.update(run_until_done(restarted.engine))
    assert finals["turn-3"].token_ids == expected and _all_blocks_free(restarted)
    assert restarted.engine.offloader.counters.load_failures >= 1
    restarted.engine.close()


def _write_quietly(fifo) -> None:
    import contextlib

    with contextlib.suppress(OSError):  # the reader may be gone already
        fifo.write_bytes(b"late")


@pytest.mark.slow  # an engine of its own (~10 s)
def test_a_load_stuck_on_the_disk_is_cut_short_and_the_prefix_computed(single_thread, tmp_path):
    import os
    import threading

    from splitserve.engine.kv.block_hash import hash_full_blocks

    llm = LLM(**_disk_tier(tmp_path, offload_disk_min_hits=0, kv_load_timeout_s=0.5))
    session, flood = _session_and_flood(llm)
    first = llm.generate([session], GREEDY)[0].outputs[0]
    for prompt in flood:
        llm.generate([prompt], GREEDY)
    llm.engine.offloader.disk.flush()
    first_hash = hash_full_blocks(session, 16, llm.config.cache.hash_namespace)[0]
    stuck = tmp_path / f"{first_hash.hex()}.kv"
    assert stuck.exists()
    stuck.unlink()
    os.mkfifo(stuck)  # reading it blocks until someone writes: a disk that does not answer
    try:
        again = llm.generate([session], GREEDY)[0].outputs[0]
    finally:
        # Unblock the load thread's read (it was given up on; what it reads is discarded).
        threading.Thread(target=_write_quietly, args=(stuck,), daemon=True).start()
    assert again.token_ids == first.token_ids
    assert llm.engine.offloader.counters.load_failures == 1
    assert again.num_cached_tokens == 0 and _all_blocks_free(llm)
    llm.engine.close()


def test_parallel_engines_refuse_explicit_tiers_and_leave_auto_off():
    import pytest

    from splitserve.engine.config import EngineConfig

    with pytest.raises(ValueError, match="not supported with tensor_parallel_size 2"):
        EngineConfig.from_options(tensor_parallel_size=2, offload_host_bytes=2**20)
    with pytest.raises(ValueError, match="not supported with tensor_parallel_size 1 / pipeline"):
        EngineConfig.from_options(
            pipeline_parallel_size=2, offload_disk_dir="/tmp/x", offload_disk_bytes=2**20
        )
    with pytest.raises(ValueError, match="quantization 'int8' does not support"):
        EngineConfig.from_options(tensor_parallel_size=2, quantization="int8")
    config = EngineConfig.from_options(tensor_parallel_size=2, offload_host_bytes="auto")
    assert config.cache.offload_host_bytes == "auto"  # accepted: build_offloader leaves it off
    from splitserve.engine.kv.offload.build import build_offloader

    pool = torch.zeros(2, 2, 4, 16, 1, 8)
    assert build_offloader(config.cache, pool, world_size=2) is None
    single = build_offloader(config.cache, pool, world_size=1)
    assert single is not None and single.host is not None
    single.close()
