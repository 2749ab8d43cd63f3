"""Multi-LoRA in the engine: random PEFT adapters on a tiny random Llama, mixed with the base
model in one batch, each row token for token against transformers (adapter merged into the
weights, and peft's own model); the prefix cache per adapter; what is refused."""

from __future__ import annotations

import inspect
import json
import os

import pytest
import torch

from splitserve import LLM, LoRARequest, SamplingParams
from splitserve.engine.lora.batched import (
    LoRABatch,
    add_lora_delta,
    lora_delta_segmented,
    make_batch,
    slot_runs,
)
from splitserve.engine.model.fused_decode import FusedDecode
from splitserve.engine.request import RequestStatus
from tests.hf_reference import transformers_greedy
from tests.test_fused_decode import assert_same_tokens_and_logprobs
from tests.test_model_families import make_checkpoint  # noqa: F401 (a fixture)

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
KV_BYTES = 16 * 2**20
EOS_TOKEN_ID = 2
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, alpha, target modules, use_rslora, seed)
ADAPTERS = {
    "alpha": (8, 16, ALL_MODULES, False, 1),
    "beta": (4, 8, ["q_proj", "v_proj", "down_proj"], True, 2),
    "wide": (16, 16, ["q_proj"], False, 3),  # rank above the engines' max_lora_rank of 8
}
_STORY = (
    "The lighthouse keeper had lived on the island for thirty years. Every evening he climbed "
    "the spiral stairs, trimmed the wick and watched the beam sweep across the dark water."
)


def _peft():
    """peft, imported by the tests that write or run adapters: its import takes ~10 s, which
    every pytest worker would pay at collection if it stood at the top."""
    return pytest.importorskip("peft")


def _write_adapter(base_dir: str, out_dir: str, spec: tuple) -> None:
    from transformers import AutoModelForCausalLM

    peft = _peft()

    rank, alpha, targets, rslora, seed = spec
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, use_rslora=rslora
    )
    peft_model = peft.get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:  # B is zeros at init: make both random so the delta shows
                param.copy_(torch.randn(param.shape, generator=generator) * 0.15)
    peft_model.save_pretrained(out_dir)


@pytest.fixture(scope="module")
def base_dir(make_tiny_hf_checkpoint) -> str:
    return make_tiny_hf_checkpoint()


@pytest.fixture(scope="module")
def adapter_dirs(base_dir, tmp_path_factory) -> dict[str, str]:
    dirs = {}
    for name, spec in ADAPTERS.items():
        out = str(tmp_path_factory.mktemp(f"lora_{name}"))
        _write_adapter(base_dir, out, spec)
        dirs[name] = out
    return dirs


@pytest.fixture(scope="module")
def lora_llm(single_thread, base_dir) -> LLM:
    return LLM(base_dir, kv_cache_bytes=KV_BYTES, enable_lora=True, max_loras=2, max_lora_rank=8)


def _request(adapter_dirs: dict[str, str], name: str) -> LoRARequest:
    return LoRARequest(name, list(ADAPTERS).index(name) + 1, adapter_dirs[name])


def _references(base_dir: str, adapter_dir: str | None, prompts: list[list[int]]) -> dict:
    """Greedy tokens of transformers: {"merged": ..., "peft": ...} for an adapter (W + scale
    B A written into the weights, and peft's model running the adapter), {"base": ...}."""
    from transformers import AutoModelForCausalLM

    def greedy(model) -> list[list[int]]:
        out = []
        for prompt in prompts:
            tokens = transformers_greedy(model, prompt, MAX_TOKENS, eos_token_id=EOS_TOKEN_ID)
            if EOS_TOKEN_ID in tokens:
                tokens = tokens[: tokens.index(EOS_TOKEN_ID) + 1]
            out.append(tokens)
        return out

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    if adapter_dir is None:
        return {"base": greedy(model)}
    peft_model = _peft().PeftModel.from_pretrained(model, adapter_dir).eval()
    references = {"peft": greedy(peft_model)}
    merged = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    _merge_by_hand(merged, adapter_dir)
    references["merged"] = greedy(merged)
    return references


def _merge_by_hand(model, adapter_dir: str) -> None:
    """W += scale * B @ A for every adapted projection, from the files (not through peft)."""
    from safetensors.torch import load_file

    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        config = json.load(f)
    tensors = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    modules = dict(model.named_modules())
    for key, a in tensors.items():
        if ".lora_A." not in key:
            continue
        b = tensors[key.replace(".lora_A.", ".lora_B.")]
        rank = a.shape[0]
        alpha = config["lora_alpha"]
        scale = alpha / rank**0.5 if config.get("use_rslora") else alpha / rank
        name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        with torch.no_grad():
            modules[name].weight += scale * (b @ a)


def _prompts(llm: LLM) -> list[list[int]]:
    return [
        llm.tokenizer.encode("Hi"),
        llm.tokenizer.encode("def quicksort(items):"),
        llm.tokenizer.encode(_STORY),
    ]


def test_a_batch_mixing_two_adapters_and_the_base_matches_transformers(
    lora_llm, base_dir, adapter_dirs
):
    prompts = _prompts(lora_llm)
    alpha, beta = _request(adapter_dirs, "alpha"), _request(adapter_dirs, "beta")
    # Every prompt under each of the three, interleaved, in one generate call (one batch).
    rows = [(prompt, lora) for prompt in prompts for lora in (alpha, None, beta)]
    outputs = lora_llm.generate(
        [prompt for prompt, _ in rows], GREEDY, lora_request=[lora for _, lora in rows]
    )
    got = {
        (i, lora.lora_name if lora else None): out.outputs[0].token_ids
        for i, ((_, lora), out) in enumerate(zip(rows, outputs))
    }
    refs = {
        None: _references(base_dir, None, prompts),
        "alpha": _references(base_dir, adapter_dirs["alpha"], prompts),
        "beta": _references(base_dir, adapter_dirs["beta"], prompts),
    }
    for row, (prompt, lora) in enumerate(rows):
        name = lora.lora_name if lora else None
        tokens = got[(row, name)]
        for kind, reference in refs[name].items():
            assert tokens == reference[prompts.index(prompt)], (row, name, kind)
    # The adapters change the output, else the test above would prove little.
    for i in range(len(prompts)):
        base = refs[None]["base"][i]
        assert refs["alpha"]["peft"][i] != base and refs["beta"]["peft"][i] != base, i


def test_prefix_cache_is_shared_within_an_adapter_and_never_across(lora_llm, adapter_dirs):
    # A prompt no other test sends: nothing of it is cached yet.
    prompt = lora_llm.tokenizer.encode("Prefix test. " + _STORY[::-1])
    block_size = lora_llm.config.cache.block_size
    full_blocks_tokens = (len(prompt) - 1) // block_size * block_size
    assert full_blocks_tokens >= 2 * block_size
    one = SamplingParams(temperature=0.0, max_tokens=1)
    alpha, beta = _request(adapter_dirs, "alpha"), _request(adapter_dirs, "beta")

    def cached(lora: LoRARequest | None) -> int:
        return lora_llm.generate([prompt], one, lora_request=lora)[0].outputs[0].num_cached_tokens

    assert cached(None) == 0
    assert cached(alpha) == 0, "the base model's blocks are not the adapter's"
    assert cached(beta) == 0, "nor another adapter's"
    assert cached(alpha) == full_blocks_tokens
    assert cached(beta) == full_blocks_tokens
    assert cached(None) == full_blocks_tokens


def test_more_adapters_than_slots_take_turns(single_thread, base_dir, adapter_dirs):
    """max_loras=1: two adapters in one call run one after the other, each evicting the other
    from the slot, and both still give their own tokens."""
    llm = LLM(base_dir, kv_cache_bytes=KV_BYTES, enable_lora=True, max_loras=1, max_lora_rank=8)
    prompts = _prompts(llm)[:2]
    alpha, beta = _request(adapter_dirs, "alpha"), _request(adapter_dirs, "beta")
    mixed = llm.generate(prompts * 2, GREEDY, lora_request=[alpha, alpha, beta, beta])
    alone = [
        llm.generate([p], GREEDY, lora_request=lora)[0]
        for p, lora in zip(prompts * 2, [alpha, alpha, beta, beta])
    ]
    assert [m.outputs[0].token_ids for m in mixed] == [a.outputs[0].token_ids for a in alone]
    info = llm.engine.lora_info()
    assert info.num_slot_evictions >= 2 and info.max_loras == 1


def test_rank_above_max_lora_rank_is_refused(lora_llm, adapter_dirs):
    with pytest.raises(ValueError, match="rank 16, above this engine's max_lora_rank 8"):
        lora_llm.generate(["Hi"], GREEDY, lora_request=_request(adapter_dirs, "wide"))
    assert not lora_llm.engine.has_unfinished_requests()


def test_unsupported_adapters_are_refused(lora_llm, adapter_dirs, tmp_path):
    dora = tmp_path / "dora"
    dora.mkdir()
    with open(os.path.join(adapter_dirs["beta"], "adapter_config.json")) as f:
        config = json.load(f)
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match="DoRA"):
        lora_llm.generate(["Hi"], GREEDY, lora_request=LoRARequest("dora", 9, str(dora)))
    with pytest.raises(ValueError, match="adapter_config.json"):
        lora_llm.generate(["Hi"], GREEDY, lora_request=LoRARequest("none", 10, str(tmp_path)))


def test_an_engine_without_enable_lora_refuses_adapters(single_thread, base_dir, adapter_dirs):
    llm = LLM(base_dir, kv_cache_bytes=KV_BYTES)
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate(["Hi"], GREEDY, lora_request=_request(adapter_dirs, "alpha"))


# ---- the batched product against the segmented reference ----------------------------------


@pytest.mark.parametrize("num_rows,max_loras,rank", [(1, 1, 4), (7, 3, 8), (33, 4, 16)])
def test_batched_product_matches_the_segmented_reference(num_rows, max_loras, rank):
    generator = torch.Generator().manual_seed(num_rows)
    in_features, sizes = 24, (16, 8, 8)
    x = torch.randn(num_rows, in_features, generator=generator)
    a = torch.randn(max_loras, len(sizes), rank, in_features, generator=generator)
    b = [torch.randn(max_loras, rank, size, generator=generator) for size in sizes]
    row_slots = torch.randint(-1, max_loras, (num_rows,), generator=generator).tolist()
    row_slots[0] = max_loras - 1  # at least one adapter row
    base = torch.randn(num_rows, sum(sizes), generator=generator)
    out = base.clone()
    add_lora_delta(out, x, a, b, [0, 16, 24], make_batch(row_slots, torch.float32, x.device))
    slot_ids = torch.tensor(row_slots)
    expected = base + torch.cat(
        [lora_delta_segmented(x, a[:, s], b[s], slot_ids) for s in range(len(sizes))], dim=1
    )
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    base_rows = slot_ids < 0
    assert torch.equal(out[base_rows], base[base_rows]), "base rows are left exactly as they were"


def test_slot_runs_and_batch():
    assert slot_runs([0, 0, -1, 1, 1, 0]) == [(0, 2, 0), (2, 3, -1), (3, 5, 1), (5, 6, 0)]
    batch: LoRABatch = make_batch([-1, 2, 0], torch.float32, torch.device("cpu"))
    assert batch.num_slots == 3
    assert batch.mask[:, :, 0, 0].tolist() == [[0, 0, 0], [0, 0, 1], [1, 0, 0]]


# ---- disaggregation: the prefill pod's pages carry the adapter ------------------------------


def _run(engine) -> dict:
    finals = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if delta.final is not None:
                finals[delta.request_id] = delta.final
    return finals


def _disaggregated(prefill, decode, rid, prompt, params, lora, prefill_lora):
    """What the pods do over gRPC and the KV transport, done directly: the decode engine
    reserves, the prefill engine computes with `prefill_lora` and exports, the decode engine
    takes the pages (tagged with the prefill's adapter) and finishes."""
    from splitserve.engine.kv.disaggregation import RemotePrefillResult

    plan = decode.reserve_remote_prefill(rid, prompt, params, lora_request=lora)
    assert plan is not None and plan.lora_name == (lora.lora_name if lora else None)
    first_only = SamplingParams(temperature=0.0, max_tokens=1)
    prefill.add_request(
        rid,
        prompt,
        first_only,
        export_kv_from_block=plan.first_block_index,
        lora_request=prefill_lora,
    )
    final = _run(prefill)[rid]
    pages = prefill.take_exported_pages(rid)
    tag = prefill_lora.lora_name if prefill_lora else None
    result = RemotePrefillResult(final.token_ids[0], None, pages, lora_name=tag)
    deltas = decode.complete_remote_prefill(rid, result)
    was_taken = decode.scheduler.requests[rid].status == RequestStatus.RUNNING
    assert was_taken == bool(deltas), "taken pages come with the first token's delta"
    finals = {d.request_id: d.final for d in deltas if d.final is not None}
    finals.update(_run(decode))
    return finals[rid], was_taken


def test_disaggregated_with_an_adapter_equals_colocated_and_refuses_other_pages(
    single_thread, base_dir, adapter_dirs, lora_llm
):
    options = dict(kv_cache_bytes=KV_BYTES, enable_lora=True, max_loras=2, max_lora_rank=8)
    prefill, decode = LLM(base_dir, **options).engine, LLM(base_dir, **options).engine
    alpha, beta = _request(adapter_dirs, "alpha"), _request(adapter_dirs, "beta")
    prompt = lora_llm.tokenizer.encode("Disaggregated: " + _STORY)
    expected = lora_llm.generate([prompt], GREEDY, lora_request=alpha)[0].outputs[0].token_ids
    got, was_taken = _disaggregated(prefill, decode, "pd-1", prompt, GREEDY, alpha, alpha)
    assert was_taken and got.token_ids == expected
    # Pages computed with beta (or the base model) for a request of alpha are refused: the
    # decode pod prefills the prompt itself, so the output is still alpha's.
    for rid, wrong in [("pd-2", beta), ("pd-3", None)]:
        other_prompt = prompt[:-1] + [prompt[len(rid)]]
        got, was_taken = _disaggregated(prefill, decode, rid, other_prompt, GREEDY, alpha, wrong)
        reference = lora_llm.generate([other_prompt], GREEDY, lora_request=alpha)
        assert not was_taken and got.token_ids == reference[0].outputs[0].token_ids


# ---- pod flags ------------------------------------------------------------------------------


def test_pod_lora_flags_become_engine_options_and_adapters():
    import argparse

    from splitserve.engine.config import EngineConfig
    from splitserve.pod.flags import add_engine_flags, engine_options, lora_modules

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    args = parser.parse_args(["--lora-modules", "sql=/a/sql", "chat=/a/chat", "--max-loras", "2"])
    options = engine_options(args)
    config = EngineConfig.from_options(None, **options).lora
    assert (config.enable_lora, config.max_loras, config.max_lora_rank) == (True, 2, 16)
    assert lora_modules(args) == [
        LoRARequest("sql", 1, "/a/sql"),
        LoRARequest("chat", 2, "/a/chat"),
    ]
    assert engine_options(parser.parse_args([]))["enable_lora"] is False
    with pytest.raises(SystemExit):
        parser.parse_args(["--lora-modules", "no-path"])


def test_the_fused_decode_serves_adapter_steps_as_the_python_layers_do(
    lora_llm, adapter_dirs
):
    """Steps with adapter rows stay in the C++ layer loop (kernels/cpu/decode_layers.cpp adds
    each row's delta), and give the hooked Python layers' tokens and logprobs."""
    alpha, beta = _request(adapter_dirs, "alpha"), _request(adapter_dirs, "beta")
    assert_fused_lora_equals_python(lora_llm, _prompts(lora_llm), [alpha, None, beta])


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text"])
def test_the_fused_decode_serves_adapter_steps_of_the_other_families(
    single_thread,
    make_checkpoint,  # noqa: F811
    tmp_path,
    family,
):
    """Qwen3's and Gemma 3's adapter rows through the C++ loop: each delta lands on its
    projection before the q/k norms and Gemma's norms around the branches, as in the hooked
    Python layers."""
    directory = make_checkpoint(family)
    _write_adapter(directory, str(tmp_path / "alpha"), ADAPTERS["alpha"])
    llm = LLM(directory, kv_cache_bytes=KV_BYTES, enable_lora=True, max_loras=2, max_lora_rank=8)
    alpha = LoRARequest("alpha", 1, str(tmp_path / "alpha"))
    prompts = [[5, 9, 11], [(7 * i + 3) % 500 + 3 for i in range(20)]]
    assert_fused_lora_equals_python(llm, prompts, [alpha, None])


def assert_fused_lora_equals_python(
    llm: LLM, prompts: list[list[int]], loras: list[LoRARequest | None]
) -> None:
    """`prompts` with `loras` give the same tokens and logprobs through the fused layers (some
    step with adapter rows taking them) and through the hooked Python layers."""
    model = llm.engine.runner.model
    fused = model.fused_decode
    if fused is None:
        pytest.skip("no C++ kernels here: the Python layers serve every step")
    assert fused.has_lora, "build_lora hands the fused decode the slots"
    served = []
    real_run = fused.run

    def counting_run(*args, **kwargs):
        bound = inspect.signature(FusedDecode.run).bind(fused, *args, **kwargs)
        served.append(bound.arguments.get("lora"))
        return real_run(*args, **kwargs)

    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3)

    def run() -> list:
        results = llm.generate(prompts, params, lora_request=loras)
        return [(r.outputs[0].token_ids, r.outputs[0].logprobs) for r in results]

    fused.run = counting_run  # type: ignore[method-assign]
    try:
        with_fused = run()
    finally:
        del fused.run
    assert any(batch is not None for batch in served), "adapter steps took the fused layers"
    model.fused_decode = None
    try:
        python = run()
    finally:
        model.fused_decode = fused
    assert_same_tokens_and_logprobs(with_fused, python)


def test_speculation_and_a_grammar_keep_each_adapters_output(
    single_thread, lora_llm, base_dir, adapter_dirs
):
    """n-gram speculation with adapter rows: the drafts are verified through each row's
    adapter, so the greedy tokens equal the plain engine's for every adapter (and the base);
    a grammar under an adapter still holds: the answer is one of its choices."""
    from splitserve.engine.structured_output.spec import StructuredOutput

    speculating = LLM(
        base_dir,
        kv_cache_bytes=KV_BYTES,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        speculative_method="ngram",
    )
    prompt = lora_llm.tokenizer.encode(_STORY + " " + _STORY)  # repeats: the n-grams draft
    params = SamplingParams(temperature=0.0, max_tokens=24)
    loras = [_request(adapter_dirs, "alpha"), None, _request(adapter_dirs, "beta")]
    expected = lora_llm.generate([prompt] * 3, params, lora_request=loras)
    got = speculating.generate([prompt] * 3, params, lora_request=loras)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert speculating.stats().num_spec_verify_steps > 0
    choices = ["lighthouse", "island", "water"]
    constrained = SamplingParams(
        temperature=0.0, max_tokens=16, structured_output=StructuredOutput.choice(choices)
    )
    for lora in loras:
        answer = speculating.generate([prompt], constrained, lora_request=lora)[0].outputs[0]
        assert answer.text in choices, (lora, answer.text)
