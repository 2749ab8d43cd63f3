"""Quality gates of weight-only quantization on the shipped SmolLM2 Q4_1 GGUF, docs/quantization.md.

- Perplexity on a fixed English text that ships with an installed package (grpcio's LICENSE,
  the Apache License 2.0; grpcio is a dependency): float32 (the file dequantized, the engine's
  default) against int8 (within 2%) and int4 / gguf (within llama.cpp's own gap on the
  file, 0.41%: GGUF_BOUND), through one prefill and through the packed kernels.
- Greedy output of the engine against float32 over the parity prompts of
  test_engine_parity.py: the first diverging position of each prompt is reported.
- Resident weight memory: int4 and gguf at most a third of float32's checkpoint size.
"""

from __future__ import annotations

import importlib.metadata
import math

import pytest
import torch

from benchmarks.parity_prompts import parity_prompts as _prompts
from splitserve import LLM, SamplingParams
from splitserve.engine.model.attention_backend import select_attention_backend
from splitserve.engine.model.attention_metadata import AttentionMetadata, PrefillChunk
from splitserve.engine.model.llama import LlamaForCausalLM
from splitserve.engine.model.loader import load_checkpoint
from splitserve.engine.model.quantization import weight_nbytes
from splitserve.engine.model.quantized_linear import plain_input_activation_passes

METHODS = ("none", "int8", "int4", "gguf")
NUM_TEXT_TOKENS = 512
KERNEL_TEXT_TOKENS = 256  # fed 8 at a time: 32 forwards per model
INT8_BOUND = 0.02  # the gate
# int4 / gguf: the yardstick is the gap llama.cpp's own Q4 shows on the same file.
# The float32 reference *is* the file's Q4_1 dequantized (the original weights do not ship),
# so that gap is what llama.cpp's kernels add on top of the exact Q4_1 values: llama-cpp-python
# 0.3.36 (benchmarks/peer/llamacpp_venv.py) scores these 512 tokens at 16.011 against our
# float32 15.945: +0.41%. It cannot run here (it is no dependency), so the figure is a constant.
# Measured for ours (AVX-512 / forced AVX2, tests/test_forced_avx2.py): one prefill +0.06% / -0.06%,
# chunks of 8 +0.29% / +0.29%; since, chunks of 8 +0.24% with VNNI (o and gate_up in two activation
# passes there: in one, +0.60% on a Zen 5 EPYC) and +0.06% forced to AVX2
# (quantized_linear.plain_input_activation_passes). The int4 decoder's products are float32-exact to
# ~1e-5 there (int4_gemm: the file's d and m as they are, two int8 activation passes below 16 rows);
# what is left is the int8 vocabulary matrix (per row: +0.45% one prefill while its product
# multiplied the codes alone; the lookup's 4-bit refinement, QuantizedEmbedding). int4 equals gguf,
# because re-quantizing Q4_1 values with min/max groups of 32 finds the same codes.
GGUF_BOUND = 0.0041
MAX_TOKENS = 20
NEAR_TIE = 0.5  # nats between float32's first and second choice


def _license_text() -> str:
    return importlib.metadata.distribution("grpcio").read_text("licenses/LICENSE") or ""


@pytest.fixture(scope="module")
def models() -> dict[str, LlamaForCausalLM]:
    """The four models, built the engine's way from two reads of the file (quicker than four
    engines: the perplexity and memory gates need only the model)."""
    dense, blocks = load_checkpoint(None), load_checkpoint(None, keep_quantized=True)
    built = {}
    for method in METHODS:
        checkpoint = blocks if method == "gguf" else dense
        model = LlamaForCausalLM(checkpoint.architecture, 2048, torch.device("cpu"), method)
        model.materialize(torch.device("cpu"), torch.float32)
        model.load_hf_weights(checkpoint.weights)
        built[method] = model
    built["tokenizer"] = dense.tokenizer
    return built


@pytest.fixture(scope="module")
def engines() -> dict[str, LLM]:
    threads = torch.get_num_threads()
    return {
        method: LLM(quantization=method, kv_cache_bytes=64 * 2**20, num_threads=threads)
        for method in METHODS
    }


def _mean_nll(model: LlamaForCausalLM, token_ids: list[int], chunk: int) -> float:
    """Mean negative log-likelihood of each token given the ones before, the text fed as
    prefill chunks of `chunk` tokens over one KV cache: one chunk of the whole text takes the
    dequantize-on-the-fly path of the quantized layers (int4 / gguf: int4_gemm's int8
    activations where the CPU has AVX512-VNNI), chunks of 8 rows their packed kernels (the path
    small decode batches take)."""
    arch = model.arch
    num_tokens, block_size = len(token_ids), 16
    num_blocks = -(-num_tokens // block_size)
    shape = (arch.num_layers, 2, num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
    kv_cache = torch.zeros(shape)
    backend = select_attention_backend(torch.device("cpu"), torch.float32)
    ids = torch.tensor(token_ids)
    log_probs = []
    for start in range(0, num_tokens, chunk):
        end = min(start + chunk, num_tokens)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(start, end),
            num_decodes=0,
            prefills=[PrefillChunk(0, end - start, end, torch.arange(-(-end // block_size)))],
        )
        logits = model(
            ids[start:end],
            torch.arange(start, end),
            kv_cache,
            meta,
            backend,
            torch.arange(end - start),
        )
        log_probs.append(torch.log_softmax(logits, dim=-1))
    predicted = torch.cat(log_probs)[:-1]  # the last row predicts past the text
    return -predicted.gather(1, ids[1:, None]).mean().item()


@pytest.fixture(scope="module")
def text_tokens(models) -> list[int]:
    tokens = models["tokenizer"].encode(_license_text())[:NUM_TEXT_TOKENS]
    assert len(tokens) == NUM_TEXT_TOKENS, "the license text is shorter than expected"
    return tokens


@pytest.fixture(scope="module")
def perplexities(models, text_tokens) -> dict[str, float]:
    """One prefill of the whole text: the quantized layers' dequantized path."""
    return {m: math.exp(_mean_nll(models[m], text_tokens, NUM_TEXT_TOKENS)) for m in METHODS}


@pytest.fixture(scope="module")
def kernel_perplexities(models, text_tokens) -> dict[str, float]:
    """The text in chunks of 8 tokens: the packed kernels, as decode steps run them."""
    tokens = text_tokens[:KERNEL_TEXT_TOKENS]
    return {m: math.exp(_mean_nll(models[m], tokens, 8)) for m in METHODS}


def test_float32_perplexity_is_that_of_a_working_model(perplexities, kernel_perplexities, capsys):
    with capsys.disabled():
        rounded = {m: round(p, 3) for m, p in perplexities.items()}
        print(f"\nperplexity, one prefill: {rounded}")
        rounded = {m: round(p, 3) for m, p in kernel_perplexities.items()}
        print(f"perplexity, chunks of 8 (kernels): {rounded}")
    # An English license text: a working 135M model is far below a uniform guess (49152).
    assert 2 < perplexities["none"] < 40, perplexities


def test_every_int4_product_takes_the_passes_its_isa_calls_for(models):
    """qkv and down two activation passes always; o and gate_up two with VNNI, else one."""
    plain = plain_input_activation_passes()
    for layer in models["int4"].layers:
        assert layer.self_attn.qkv_proj.activation_passes == 2
        assert layer.mlp.down_proj.activation_passes == 2
        assert layer.self_attn.o_proj.activation_passes == plain
        assert layer.mlp.gate_up_proj.activation_passes == plain


def test_int8_perplexity_within_two_percent(perplexities):
    gap = perplexities["int8"] / perplexities["none"] - 1
    assert abs(gap) < INT8_BOUND, perplexities


@pytest.mark.parametrize("method", ["int4", "gguf"])
def test_int4_and_gguf_perplexity_within_the_bound(perplexities, method):
    gap = perplexities[method] / perplexities["none"] - 1
    assert abs(gap) < GGUF_BOUND, perplexities


def test_kernel_path_perplexity_within_the_same_bounds(kernel_perplexities):
    reference = kernel_perplexities["none"]
    assert abs(kernel_perplexities["int8"] / reference - 1) < INT8_BOUND, kernel_perplexities
    for method in ("int4", "gguf"):
        assert abs(kernel_perplexities[method] / reference - 1) < GGUF_BOUND, kernel_perplexities


def _first_divergence(want: list[int], got: list[int]) -> int | None:
    for position, (a, b) in enumerate(zip(want, got, strict=False)):
        if a != b:
            return position
    return None if len(want) == len(got) else min(len(want), len(got))


@pytest.mark.slow  # eight prompts (one of 600+ tokens) through four engines
def test_greedy_agreement_with_float32(engines, capsys):
    prompts = _prompts(engines["none"].tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5)
    outputs = {
        m: [r.outputs[0] for r in llm.generate(prompts, params)] for m, llm in engines.items()
    }
    reference = outputs.pop("none")
    report = {
        method: [
            _first_divergence(want.token_ids, got.token_ids) for want, got in zip(reference, outs)
        ]
        for method, outs in outputs.items()
    }
    with capsys.disabled():
        print(f"\nfirst diverging position per prompt (None: all {MAX_TOKENS} agree): {report}")
    for method, positions in report.items():
        for want, got, position in zip(reference, outputs[method], positions):
            if position is None:
                continue
            # A divergence must be a near tie: the quantized model's token within NEAR_TIE nats
            # of float32's choice in float32's top 5 (measured: 0.002 to 0.37), or float32's
            # token within NEAR_TIE of the quantized model's choice in its top 5. The second
            # covers int8, whose vocabulary projection rounds logits to bfloat16: it meets exact
            # three-way ties, and which of them argmax takes moves with the last bit upstream.
            assert _near_tie(want, got, position), (method, position, want.logprobs[position])
        # At least half the prompts agree throughout, or part ways at an exact tie in the
        # quantized model's logits (argmax's pick among equal values is arbitrary).
        agreeing = [
            position is None or _exact_tie(got, want, position)
            for want, got, position in zip(reference, outputs[method], positions)
        ]
        assert sum(agreeing) >= len(positions) // 2, (method, report)
    assert report["int4"] == report["gguf"], report  # the same codes, the same tokens


def _near_tie(want, got, position: int) -> bool:
    """Whether either model ranks the other's token at `position` within NEAR_TIE of its own."""
    for chooser, other in ((want, got), (got, want)):
        top = dict(chooser.logprobs[position].top)
        token = other.token_ids[position]
        if token in top and max(top.values()) - top[token] < NEAR_TIE:
            return True
    return False


def _exact_tie(quantized, reference, position: int) -> bool:
    """Whether the quantized model gave the reference's token exactly its own choice's logprob."""
    top = dict(quantized.logprobs[position].top)
    token = reference.token_ids[position]
    return token in top and top[token] == top[quantized.token_ids[position]]


def test_resident_weights_shrink(models):
    sizes = {method: weight_nbytes(models[method]) for method in METHODS}
    checkpoint_float32 = 134_515_008 * 4  # SmolLM2-135M's parameters in float32 (513 MiB)
    assert sizes["int4"] <= checkpoint_float32 / 3, sizes
    assert sizes["gguf"] <= checkpoint_float32 / 3, sizes
    assert sizes["int8"] < sizes["none"] / 4, sizes
