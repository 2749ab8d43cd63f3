"""DeepSeek-V2 (`deepseek_v2`): multi-head latent attention over the latent KV page layout,
grouped top-k routing with shared experts, dense layers first; DeepSeek-V3 (`deepseek_v3`):
the same with its biased sigmoid routing ("noaux_tc", a random bias that moves the choice);
against transformers on random tiny checkpoints built with its own config and model classes
(docs/models.md):

- greedy 12 tokens and every step's top-5 logprobs equal transformers', with and without
  q_lora_rank, with group-limited and plain greedy routing, with no sparse layer at all, through
  chunked prefill (16-token budget), then again through prefix-cache hits (decode rows attend
  with the absorbed projections, prefill chunks decompress the latents);
- the cache holds (kv_lora_rank + qk_rope_head_dim) values per token per layer, nothing per head;
- a disaggregated request (pages packed by the prefill engine, unpacked by the decode engine)
  equals the colocated one;
- each special part moves transformers' logprobs far past the tolerance (so it is tested);
- over 2 tensor-parallel ranks (heads split, the latent cache whole on each): greedy tokens
  and logprobs equal transformers', a disaggregated request equals the colocated one both
  ways between 2 ranks and one process, DeepSeek-V3 with expert parallel (slow);
- an int8 cache: each part an int8 row with its scale, greedy tokens equal the float cache's,
  pages travel disaggregated and through the host tier.

torch runs single-threaded (see tests/test_engine_api.py for why).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.kv.cache import bytes_per_block
from tests.test_disaggregation_engine import disaggregated
from tests.test_model_families import (
    _COMMON,
    CHUNK,
    KV_BYTES,
    MAX_TOKENS,
    TOLERANCE,
    TOP,
    _assert_matches,
    _prompts,
    _reference,
    assert_disaggregated_equals_colocated,
    assert_speculation_and_preemption_keep_the_tokens,
)

_MLA = dict(
    num_hidden_layers=3,
    num_key_value_heads=4,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    first_k_dense_replace=1,
    n_group=2,
    topk_group=1,
    topk_method="group_limited_greedy",
    routed_scaling_factor=1.5,
)
# name -> the options on top of _MLA.
CONFIGS: dict[str, dict[str, Any]] = {
    "q_lora": {},
    "no_q_lora": {"q_lora_rank": None, "topk_method": "greedy", "n_group": 1, "topk_group": 1},
    "dense": {"first_k_dense_replace": 3, "q_lora_rank": None},
    # DeepSeek-V3: sigmoid scores plus a per-expert bias choose within groups ranked by their
    # two best experts; the chosen scores, renormalised, weigh them.
    "v3": {
        "model_type": "deepseek_v3",
        "n_routed_experts": 8,
        "n_group": 4,
        "topk_group": 2,
        "norm_topk_prob": True,
    },  # fmt: skip
    # DeepSeek-V2's own rope: yarn with mscale (cos/sin and the softmax scale).
    "yarn": {
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "original_max_position_embeddings": 16,
            "mscale": 1.0,  # DeepSeek-V2 has 0.707 for both: here cos/sin are scaled too
            "mscale_all_dim": 0.707,
            "beta_fast": 32,
            "beta_slow": 1,
        }
    },
}


def _hf_model(options: dict[str, Any]) -> Any:
    import transformers

    settings = {**_COMMON, **_MLA, **options}
    if settings.pop("model_type", "deepseek_v2") == "deepseek_v3":
        del settings["topk_method"]  # V3's routing has no name in transformers' config
        config = transformers.DeepseekV3Config(**settings)
    else:
        config = transformers.DeepseekV2Config(**settings)
    return transformers.AutoModelForCausalLM.from_config(config).float().eval()


def _randomize(model: Any) -> None:
    """Norm weights off one (the latent norms included), q and the latent's projection scaled
    up so attention depends on position, the router scaled so routing is decisive."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.3)
            elif name.endswith(("q_proj.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight")):
                param.mul_(8.0)
            elif name.endswith("mlp.gate.weight"):
                param.mul_(20.0)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # V3: as large as the scores
                buffer.copy_(torch.randn_like(buffer) * 0.5)


@pytest.fixture(scope="module")
def make_checkpoint(
    tmp_path_factory: pytest.TempPathFactory, hf_reference_tokenizer: Any
) -> Callable[[str], str]:
    built: dict[str, str] = {}

    def make(name: str) -> str:
        if name not in built:
            torch.manual_seed(0)
            model = _hf_model(CONFIGS[name])
            _randomize(model)
            directory = str(tmp_path_factory.mktemp(name))
            model.save_pretrained(directory)
            hf_reference_tokenizer.save_pretrained(directory)
            built[name] = directory
        return built[name]

    return make


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_and_logprobs_match_transformers(single_thread, make_checkpoint, name):
    directory = make_checkpoint(name)
    llm = LLM(directory, kv_cache_bytes=KV_BYTES, max_num_batched_tokens=CHUNK)
    assert llm.engine.architecture.name == CONFIGS[name].get("model_type", "deepseek_v2")
    prompts = _prompts()
    references = [_reference(directory, prompt) for prompt in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=TOP)
    for prompt, (tokens, logprobs) in zip(prompts, references):  # one at a time: no hit yet
        _assert_matches(llm.generate([prompt], params)[0].outputs[0], tokens, logprobs)
    assert llm.stats().prefix_cache_hit_tokens >= 32, "the third prompt reuses the second's"
    hits = llm.stats().prefix_cache_hit_tokens
    results = llm.generate(prompts, params)  # batched, every prompt a prefix hit now
    assert llm.stats().prefix_cache_hit_tokens - hits >= 2 * 32
    for result, (tokens, logprobs) in zip(results, references):
        _assert_matches(result.outputs[0], tokens, logprobs)


def test_latent_pages_hold_the_latent_and_rope_key_only(make_checkpoint):
    llm = LLM(make_checkpoint("q_lora"), kv_cache_bytes=KV_BYTES)
    arch = llm.engine.architecture
    assert arch.mla is not None and arch.moe is not None
    cache = llm.engine.runner.kv_cache
    block_size = cache.shape[3]
    # [layers, 1, blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]
    assert cache.shape[:2] == (3, 1) and cache.shape[4:] == (1, 16 + 8)
    per_token_per_layer = bytes_per_block(arch, block_size, torch.float32) / block_size / 3
    assert per_token_per_layer == (16 + 8) * 4
    assert [arch.is_sparse_layer(i) for i in range(3)] == [False, True, True]
    assert llm.engine.runner.model.fused_decode is None


def test_disaggregated_equals_colocated(single_thread, make_checkpoint):
    assert_disaggregated_equals_colocated(make_checkpoint("q_lora"))


@pytest.mark.parametrize(
    ("name", "part"),
    [
        ("q_lora", {"routed_scaling_factor": 1.0}),
        ("q_lora", {"topk_method": "greedy"}),
        ("v3", {"norm_topk_prob": False}),
        ("v3", {"n_group": 1, "topk_group": 1}),
        ("yarn", {"rope_parameters": {"rope_type": "default"}}),
        ("yarn", {"rope_parameters": {"mscale_all_dim": 0.0}}),
    ],
)
def test_each_special_part_changes_the_reference(make_checkpoint, name, part):
    """Without the part transformers' logprobs move far past the tolerance: the equality
    test above would catch an engine that skipped it."""
    directory = make_checkpoint(name)
    prompt = _prompts()[1]
    _, logprobs = _reference(directory, prompt)
    _, without = _reference(directory, prompt, part)
    assert (logprobs[0] - without[0]).abs().max() > 100 * TOLERANCE


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"norm_topk_prob": True}, "norm_topk_prob"),
        ({"topk_method": "noaux_tc"}, "topk_method"),
        ({"attention_bias": True}, "attention_bias"),
        ({"scoring_func": "sigmoid"}, "scoring_func"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic'"),
    ],
)
def test_unsupported_settings_are_refused(make_checkpoint, tmp_path, setting, message):
    import json
    import os

    source = make_checkpoint("q_lora")
    for name in os.listdir(source):
        if name != "config.json":
            os.symlink(os.path.join(source, name), tmp_path / name)
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    with open(tmp_path / "config.json", "w") as f:
        json.dump(config | setting, f)
    with pytest.raises(ValueError, match=message):
        LLM(str(tmp_path), kv_cache_bytes=KV_BYTES)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"pipeline_parallel_size": 3}, "does not support pipeline parallel"),
    ],
)
def test_engine_options_mla_lacks_are_refused(make_checkpoint, options, message):
    with pytest.raises(ValueError, match=message):
        LLM(make_checkpoint("q_lora"), kv_cache_bytes=KV_BYTES, **options)


def test_int8_latent_pages_hold_each_part_with_its_scale_and_keep_the_greedy_tokens(
    single_thread, make_checkpoint
):
    """kv_cache_dtype int8: a row is the latent's 16 codes and scale, then the rope key's 8
    and its scale (28 bytes against 96 in float32: 3.4x the blocks in the same budget); on
    these weights every greedy token equals the float cache's."""
    directory = make_checkpoint("q_lora")
    exact = LLM(directory, kv_cache_bytes=KV_BYTES)
    int8 = LLM(directory, kv_cache_bytes=KV_BYTES, kv_cache_dtype="int8")
    cache = int8.engine.runner.kv_cache
    assert cache.dtype == torch.int8 and cache.shape[4:] == (1, 16 + 2 + 8 + 2)
    assert cache.shape[2] >= 3.4 * exact.engine.runner.kv_cache.shape[2]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    for prompt in _prompts():
        want = exact.generate([prompt], params)[0].outputs[0].token_ids
        assert int8.generate([prompt], params)[0].outputs[0].token_ids == want


def test_int8_latent_pages_need_even_part_widths():
    from splitserve.engine.kv.cache import latent_row_width
    from splitserve.engine.model.architecture import MLAConfig

    odd = MLAConfig(kv_lora_rank=15, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    assert latent_row_width(odd, "auto") == 23
    with pytest.raises(ValueError, match="even kv_lora_rank"):
        latent_row_width(odd, "int8")


def test_int8_latent_pages_travel_disaggregated(single_thread, make_checkpoint):
    assert_disaggregated_equals_colocated(make_checkpoint("q_lora"), kv_cache_dtype="int8")


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_latent_pages_go_to_host_memory_and_come_back(
    single_thread, make_checkpoint, kv_cache_dtype
):
    """The host tier keeps blocks in the pool's layout, MLA's latent pages too (int8: one
    part of int8 rows, each with its scales)."""
    from splitserve.engine.kv.tiers import Tier

    options = {
        "num_blocks_override": 8,
        "offload_host_bytes": 64 * 2**20,
        "kv_cache_dtype": kv_cache_dtype,
    }
    llm = LLM(make_checkpoint("q_lora"), kv_cache_bytes=KV_BYTES, **options)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    session = _prompts()[1]
    first = llm.generate([session], params)[0].outputs[0]
    for i in range(4):  # other prompts push the session's blocks out of the pool
        llm.generate([[(13 * j + 7 * i) % 400 + 50 for j in range(45)]], params)
    resumed = llm.generate([session], params)[0].outputs[0]
    assert resumed.token_ids == first.token_ids
    assert resumed.num_cached_tokens == 32
    assert llm.engine.offloader is not None
    assert llm.engine.offloader.counters.load_hits[Tier.HOST] >= 1


def test_latent_pages_cross_a_tcp_transport(single_thread, make_checkpoint):
    """The pods' path, in one process: the decode engine plans, the prefill engine exports, the
    pages go over the TCP KV transport (real sockets) and the decode engine finishes; tokens
    equal one engine's. The descriptor carries the latent shape; a destination of the per-head
    K/V layout refuses them before any payload."""
    import asyncio

    from splitserve.engine.kv.disaggregation import (
        RemotePrefillResult,
        receive_pages,
        send_pages,
    )
    from splitserve.engine.kv.transfer import KVTransferConfig, KVTransferError, create_kv_transport
    from tests.test_disaggregation_engine import run_until_done

    directory = make_checkpoint("q_lora")
    options = {"kv_cache_bytes": KV_BYTES, "max_num_batched_tokens": CHUNK}
    reference, prefill, decode = (LLM(directory, **options) for _ in range(3))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    prompt = _prompts()[1]
    expected = reference.generate([prompt], params)[0].outputs[0]
    plan = decode.engine.reserve_remote_prefill("tcp", prompt, params)
    assert plan is not None and plan.page_shape[2:] == (1, 16, 1, 16 + 8)  # latent pages
    first_only = SamplingParams(temperature=0.0, max_tokens=1)
    prefill.engine.add_request("tcp", prompt, first_only, export_kv_from_block=0)
    first = run_until_done(prefill.engine)["tcp"]
    pages = prefill.engine.take_exported_pages("tcp")
    assert pages is not None

    async def transfer() -> tuple[torch.Tensor, BaseException | None]:
        transport = create_kv_transport(KVTransferConfig(backend="tcp"))
        receiver = await transport.start_receiver()
        sender = transport.create_sender()
        try:
            (received, _), _ = await asyncio.gather(
                receive_pages(receiver, plan, 20.0),
                send_pages(sender, receiver.address, "tcp", pages, plan.block_ids, 20.0),
            )
            per_head = torch.zeros(len(plan.block_ids), 3, 2, 16, 4, 24)  # K/V pages
            refused = await asyncio.gather(
                receiver.receive("kv", per_head, 5.0),
                send_pages(sender, receiver.address, "kv", pages, plan.block_ids, 5.0),
                return_exceptions=True,
            )
            return received, refused[0]
        finally:
            await sender.close()
            await receiver.close()

    received, refused = asyncio.run(transfer())
    assert torch.equal(received, pages)
    assert isinstance(refused, KVTransferError) and "does not match" in str(refused)
    result = RemotePrefillResult(first.token_ids[0], None, received)
    finals = {d.request_id: d.final for d in decode.engine.complete_remote_prefill("tcp", result)}
    finals.update(run_until_done(decode.engine))
    assert finals["tcp"] is not None and finals["tcp"].token_ids == expected.token_ids


@pytest.fixture(scope="module")
def tensor_parallel(make_checkpoint):
    """The q_lora model over two tensor-parallel ranks: each holds two of the four heads of
    q_b_proj, kv_b_proj and o_proj, half of the dense layer's MLP and of every expert, and the
    whole latent cache."""
    llm = LLM(make_checkpoint("q_lora"), tensor_parallel_size=2, **TP_OPTIONS)
    yield llm
    llm.close()


TP_OPTIONS = {
    "kv_cache_bytes": KV_BYTES,
    "max_num_batched_tokens": CHUNK,
    "num_threads": 1,
    "adaptive_threads": False,
}


def test_tensor_parallel_greedy_and_logprobs_match_transformers(make_checkpoint, tensor_parallel):
    """Through chunked prefill, then prefix hits (decode rows in latent space on each rank)."""
    directory = make_checkpoint("q_lora")
    prompts = _prompts()
    references = [_reference(directory, prompt) for prompt in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=TOP)
    for prompt, (tokens, logprobs) in zip(prompts, references):
        _assert_matches(tensor_parallel.generate([prompt], params)[0].outputs[0], tokens, logprobs)
    hits = tensor_parallel.stats().prefix_cache_hit_tokens
    results = tensor_parallel.generate(prompts, params)
    assert tensor_parallel.stats().prefix_cache_hit_tokens - hits >= 2 * 32
    for result, (tokens, logprobs) in zip(results, references):
        _assert_matches(result.outputs[0], tokens, logprobs)


def test_tensor_parallel_ranks_hold_their_heads_and_the_whole_latent_cache(tensor_parallel):
    runner = tensor_parallel.engine.runner
    attention = runner.model.decoder_layers()[0].self_attn
    assert attention.num_heads == 2 and attention.kv_b_proj.weight.shape == (2 * (16 + 16), 16)
    assert runner.kv_cache.shape[4:] == (1, 16 + 8)  # the latent and rope key, whole
    # The pod's budget pays for both ranks' copies: half the blocks of one process.
    single = LLM(tensor_parallel.engine.config.model.model, kv_cache_bytes=KV_BYTES)
    assert runner.kv_cache.shape[2] == single.engine.runner.kv_cache.shape[2] // 2
    # A page travels once: the planner's bytes per token are one copy's.
    spec = tensor_parallel.engine.kv_spec
    assert spec.copies == 2 and spec.page_bytes_per_block == single.engine.kv_spec.bytes_per_block


@pytest.mark.parametrize("direction", ["tensor_parallel->single", "single->tensor_parallel"])
def test_tensor_parallel_disaggregated_equals_colocated(
    make_checkpoint, tensor_parallel, direction
):
    """Latent pages leave a tensor-parallel pod from rank 0's copy and reach every rank of
    one whole: either way the tokens are one engine's."""
    directory = make_checkpoint("q_lora")
    single = LLM(directory, kv_cache_bytes=KV_BYTES, max_num_batched_tokens=CHUNK)
    prefill, decode = (
        (tensor_parallel, single) if direction.startswith("tensor") else (single, tensor_parallel)
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    for i, prompt in enumerate(_prompts()):
        expected = _reference(directory, prompt)[0]
        _, got = disaggregated(prefill.engine, decode.engine, f"{direction}-{i}", prompt, params)
        assert got.token_ids == expected
    assert decode.stats().num_kv_blocks_free == decode.stats().num_kv_blocks_total


@pytest.mark.slow  # two more ranks started
def test_expert_parallel_deepseek_v3_matches_transformers(make_checkpoint):
    """DeepSeek-V3's routing over experts split by range (four of eight per rank), MLA's heads
    split as above."""
    directory = make_checkpoint("v3")
    llm = LLM(directory, tensor_parallel_size=2, enable_expert_parallel=True, **TP_OPTIONS)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=TOP)
        for prompt in _prompts():
            tokens, logprobs = _reference(directory, prompt)
            _assert_matches(llm.generate([prompt], params)[0].outputs[0], tokens, logprobs)
    finally:
        llm.close()


def test_self_speculative_decoding_and_preemption_keep_the_tokens(single_thread, make_checkpoint):
    """A one-layer self-draft (DeepSeek's dense first layer) and a pool too small for the batch
    change the schedule only."""
    assert_speculation_and_preemption_keep_the_tokens(make_checkpoint("q_lora"))


def test_dense_and_sparse_layers_follow_first_k_dense_replace_and_moe_layer_freq():
    from splitserve.engine.model.hf_deepseek import moe_config

    config = {**_MLA, "num_hidden_layers": 6, "moe_layer_freq": 2}
    moe = moe_config(config)
    assert [moe.is_sparse(i) for i in range(6)] == [False, False, True, False, True, False]
    assert (moe.shared_expert_intermediate_size, moe.shared_expert_gated) == (32, False)
    assert (moe.num_groups, moe.topk_groups, moe.routed_scaling_factor) == (2, 1, 1.5)


# DeepSeek-V2-Lite's config.json as published (DeepSeek's remote-code spelling: rope_scaling with
# "type", no head_dim), trimmed to what the loader reads.
_V2_LITE = {
    "model_type": "deepseek_v2",
    "architectures": ["DeepseekV2ForCausalLM"],
    "vocab_size": 102400,
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_shared_experts": 2,
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
    "routed_scaling_factor": 1.0,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 1,
    "norm_topk_prob": False,
    "scoring_func": "softmax",
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "tie_word_embeddings": False,
}


def test_deepseek_v2_lite_config_reads_as_published():
    import math
    from types import SimpleNamespace

    from splitserve.engine.model.hf_loader import architecture_from_config

    tokenizer = SimpleNamespace(bos_token_id=None, eos_token_ids=())
    arch = architecture_from_config(dict(_V2_LITE), tokenizer)  # type: ignore[arg-type]
    assert arch.mla is not None and arch.moe is not None
    assert (arch.head_dim, arch.num_kv_heads, arch.mla.q_lora_rank) == (64, 16, None)
    assert arch.mla.latent_width == 576
    assert arch.rope_scaling.rope_type == "yarn" and arch.rope_scaling.factor == 40
    assert arch.rope_scaling.attention_factor == 1.0  # mscale / mscale_all_dim
    mscale = 0.1 * 0.707 * math.log(40) + 1.0
    assert arch.mla.softmax_scale == pytest.approx(192**-0.5 * mscale**2)
    assert [arch.is_sparse_layer(i) for i in (0, 1, 26)] == [False, True, True]
    assert bytes_per_block(arch, 16, torch.bfloat16) == 27 * 16 * 576 * 2
