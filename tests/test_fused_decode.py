"""Decode steps through the C++ layer loop (shared/model/fused_decode.py) against the Python
layers they replace, on the shipped SmolLM2 weights: the same tokens and the same logprobs,
for each weight format and KV dtype, through batched and batch-1 decode; and the steps it must
leave to the Python layers."""

from __future__ import annotations

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.model.fused_decode import FusedDecode
from splitserve.engine.model.quantized_linear import INT4_ONE_PASS_FROM_ROWS, QuantizedLinear
from splitserve.kernels import cpu as cpu_kernels
from tests.test_model_families import _prompts, make_checkpoint  # noqa: F401 (a fixture)

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C++ compiler here")

PROMPTS = [
    "The lighthouse keeper climbed the stairs",
    "def parse_and_sum(text):\n",
    "Photosynthesis turns sunlight into",
    "Once upon a time",
]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3)


class CountingFusedDecode(FusedDecode):
    """The engine's own fused layers, counting the steps they serve."""

    def __init__(self, fused: FusedDecode) -> None:
        self.__dict__.update(fused.__dict__)
        self.steps = 0

    def run(self, *args, **kwargs) -> torch.Tensor:
        self.steps += 1
        return super().run(*args, **kwargs)


def outputs(llm: LLM, prompts: list[str] | list[list[int]]) -> list[tuple[list[int], list]]:
    results = llm.generate(prompts, PARAMS)
    return [(r.outputs[0].token_ids, r.outputs[0].logprobs) for r in results]


def compare_fused_with_python(
    quantization: str,
    kv_cache_dtype: str,
    prompts: list[str] | list[list[int]] = PROMPTS,
    model: str | None = None,
    enable_prefix_caching: bool = True,
    tolerance: float = 1e-4,
) -> None:
    llm = LLM(
        model,
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
        kv_cache_bytes=64 * 2**20,
        num_threads=torch.get_num_threads(),
        enable_prefix_caching=enable_prefix_caching,
    )
    model = llm.engine.runner.model
    assert model.fused_decode is not None, "the model should take the fused layers"
    counting = CountingFusedDecode(model.fused_decode)
    model.fused_decode = counting
    fused = outputs(llm, prompts) + outputs(llm, prompts[:1])  # a batch, then batch 1
    assert counting.steps >= 2 * (PARAMS.max_tokens - 1)
    model.fused_decode = None
    python = outputs(llm, prompts) + outputs(llm, prompts[:1])
    assert_same_tokens_and_logprobs(fused, python, tolerance)


def assert_same_tokens_and_logprobs(
    got_outputs: list, want_outputs: list, tolerance: float = 1e-4
) -> None:
    """Each (token ids, logprobs) pair: the same tokens, the same top ids, logprobs within
    `tolerance` (the fused loop and the Python layers differ only in float rounding)."""
    for (got_ids, got_logprobs), (want_ids, want_logprobs) in zip(got_outputs, want_outputs):
        assert got_ids == want_ids
        for got, want in zip(got_logprobs, want_logprobs, strict=True):
            for (got_id, got_lp), (want_id, want_lp) in zip(got.top, want.top, strict=True):
                assert got_id == want_id
                assert got_lp == pytest.approx(want_lp, abs=tolerance)


@pytest.mark.parametrize(("quantization", "kv_cache_dtype"), [("none", "int8"), ("gguf", "auto")])
def test_fused_decode_equals_the_python_layers(quantization, kv_cache_dtype):
    compare_fused_with_python(quantization, kv_cache_dtype)


def test_fused_decode_adds_qwen2_biases_as_the_python_layers_do(make_checkpoint):  # noqa: F811
    """Qwen2's q/k/v bias in the C++ loop, over an int8 cache too (the bias comes before the
    rows are quantized)."""
    directory = make_checkpoint("qwen2")
    for kv_cache_dtype in ("auto", "int8"):
        # Token ids: the tiny checkpoint's vocabulary is 512 of the tokenizer's ids.
        compare_fused_with_python("none", kv_cache_dtype, _prompts(), model=directory)


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "gemma3_text"])
def test_fused_decode_takes_each_familys_parts_as_the_python_layers_do(
    make_checkpoint,  # noqa: F811
    family,
):
    """Qwen3's q/k norms (head_dim apart from hidden / heads); Gemma 2's sandwich norms, GeGLU,
    soft-capping and window layers; Gemma 3's q/k norms and its window layers' own rotary
    base: the tiny checkpoints' windows are shorter than the prompts. Within 1e-5: the two
    differ only where window and capped layers attend (the Python layers in explicit scores,
    masked_attention.py; the loop in the C++ kernel)."""
    directory = make_checkpoint(family)
    compare_fused_with_python("none", "auto", _prompts(), model=directory, tolerance=1e-5)


@pytest.mark.parametrize(
    ("family", "quantization", "kv_cache_dtype"),
    [
        ("qwen3", "int8", "int8"),
        ("qwen3", "int4", "auto"),
        ("qwen2", "int8", "int8"),  # the q/k/v bias on a quantized product
        ("qwen2", "int4", "auto"),
        ("gemma2", "int8", "auto"),
        ("gemma3_text", "int8", "auto"),
    ],
)
def test_fused_decode_takes_quantized_families_as_the_python_layers_do(
    make_checkpoint,  # noqa: F811
    family,
    quantization,
    kv_cache_dtype,
):
    """The families' parts around quantized products. Without prefix caching: the second
    run's prompts would hit the first run's blocks and prefill in fewer rows, and from 32 rows
    (int8) or 16 (int4) the products quantize activations, so a prefill of other length
    differs in rounding that these random weights amplify past the tolerance. (Int4 Gemma 3
    and int8 Mistral over an int8 cache differ by 2-4e-3 even so: docs/models.md.)"""
    directory = make_checkpoint(family)
    compare_fused_with_python(
        quantization, kv_cache_dtype, _prompts(), model=directory, enable_prefix_caching=False
    )


def test_int8_qwen2_packs_its_q_k_v_and_adds_the_bias(make_checkpoint):  # noqa: F811
    """Qwen2's q/k/v product is packed like every other (it was dense for its bias), the bias
    added after it: int8's greedy tokens equal float32's on the test prompts and its
    first-step top-5 logprobs stay within 0.02 of them (0.006-0.008 here); with the bias
    zeroed they move more than ten times as far (other tokens take the top five). No prefix
    caching: a hit would reuse KV computed with the bias."""
    directory = make_checkpoint("qwen2")
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=5)
    options = {"kv_cache_bytes": 64 * 2**20, "enable_prefix_caching": False}
    exact = LLM(directory, **options)
    int8 = LLM(directory, quantization="int8", **options)
    qkv = int8.engine.runner.model.decoder_layers()[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantizedLinear) and qkv.bias is not None

    def first_step(llm: LLM, prompt: list[int]) -> tuple[list[int], dict[int, float]]:
        out = llm.generate([prompt], params)[0].outputs[0]
        return out.token_ids, dict(out.logprobs[0].top)

    def distance(got: dict[int, float], want: dict[int, float]) -> float:
        return max(abs(got.get(token, -99.0) - lp) for token, lp in want.items())

    wants = [first_step(exact, prompt) for prompt in _prompts()]
    for prompt, (want_ids, want) in zip(_prompts(), wants):
        got_ids, got = first_step(int8, prompt)
        assert got_ids == want_ids
        assert distance(got, want) < 0.02
    for layer in int8.engine.runner.model.decoder_layers():
        layer.self_attn.qkv_proj.bias.zero_()
    moved = [distance(first_step(int8, p)[1], want) for p, (_, want) in zip(_prompts(), wants)]
    assert min(moved) > 0.2


@pytest.mark.slow  # another engine of the shipped model, 16 sequences
def test_fused_decode_equals_the_python_layers_with_one_activation_pass():
    # Decode steps of 16 rows or more take int4_gemm's one-pass mode in both.
    prompts = [
        f"{prompt} ({n})" for n in range(INT4_ONE_PASS_FROM_ROWS // 4) for prompt in PROMPTS
    ]
    compare_fused_with_python("gguf", "auto", prompts)


@pytest.mark.slow  # two more engines of the shipped model
@pytest.mark.parametrize(("quantization", "kv_cache_dtype"), [("none", "auto"), ("int8", "int8")])
def test_fused_decode_equals_the_python_layers_in_other_formats(quantization, kv_cache_dtype):
    compare_fused_with_python(quantization, kv_cache_dtype)


def test_steps_with_prefill_rows_or_bfloat16_take_the_python_layers():
    llm = LLM(kv_cache_bytes=32 * 2**20, num_threads=1)
    fused = llm.engine.runner.model.fused_decode
    assert fused is not None

    class Meta:  # the fields serves() reads, as a mixed step's metadata has them
        prefills = [object()]
        num_decodes = 2
        decode_block_tables = torch.zeros(2, 1, dtype=torch.int32)

    hidden = torch.zeros(2, 576)
    assert not fused.serves(hidden, Meta)
    Meta.prefills = []
    assert fused.serves(hidden, Meta)
    assert not fused.serves(hidden.bfloat16(), Meta)
    Meta.decode_block_tables = None  # decodes gathered for SDPA: not this kernel's layout
    assert not fused.serves(hidden, Meta)


def test_a_bfloat16_model_keeps_the_python_layers():
    llm = LLM(kv_cache_bytes=32 * 2**20, num_threads=1, dtype="bfloat16")
    assert llm.engine.runner.model.fused_decode is None


def test_a_layer_with_activation_passes_other_than_one_or_two_is_refused():
    """add_layer checks each product's decode passes before it holds any tensor."""
    module = cpu_kernels.load()
    if module is None:
        pytest.skip(f"the CPU kernels are not loaded: {cpu_kernels.unavailable_reason()}")
    layers = module.DecodeLayers(2, 9, 3, 1e-5, 0.125)
    unused = [torch.empty(0)] * 10
    with pytest.raises(RuntimeError, match="activation passes must be 1 or 2"):
        layers.add_layer(unused, [0] * 8, passes=[2, 1, 3, 2])
    with pytest.raises(RuntimeError, match="none or one per product"):
        layers.add_layer(unused, [0] * 8, passes=[2, 1])
    assert layers.num_layers == 0
