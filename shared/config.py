"""Engine configuration: one frozen dataclass per concern, composed into `EngineConfig`.

Values discovered at run time (how many KV blocks fit, the model's real context length) live in
`splitserve.engine.kv.memory.KVCacheSpec` and in the loaded model's `ModelArchitecture`, never
written back
here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
# ModelConfig.quantization's values; shared/model/quantization.py says what each does.
QUANTIZATION_METHODS = ("none", "int8", "int4", "gguf")


# CacheConfig.eviction_policy's values; shared/kv/eviction.py says what each does.
EVICTION_POLICIES = ("lru", "idle_ttl", "priority")
# CacheConfig.kv_cache_dtype's values (vLLM's name): "auto" = the model's dtype; "int8" = int8
# codes with a scale per token and KV head (kernels/kv_int8.py, docs/quantization.md).
KV_CACHE_DTYPES = ("auto", "int8")


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to load and how to run them."""

    # Path to a .gguf file or a Hugging Face directory; None means the shipped SmolLM2 GGUF.
    model: str | None = None
    dtype: str = "float32"
    # Overrides the model's own context length when smaller (never larger: RoPE was not
    # trained past it).
    max_model_len: int | None = None
    device: str = "cpu"
    # Weight-only quantization (vLLM's name): "none", "int8" (per output channel), "int4"
    # (groups of 32), "gguf" (a GGUF file's Q4_0/Q4_1 blocks kept as they are). CPU (torch's
    # packed kernels) or CUDA (Triton dequantizing matmuls).
    quantization: str = "none"
    # Decode-only steps of up to 64 rows replayed from CUDA graphs captured at start-up
    # (shared/cuda_graphs.py); CUDA and the Triton attention path only.
    cuda_graphs: bool = False

    def __post_init__(self) -> None:
        if self.cuda_graphs and not self.device.startswith("cuda"):
            raise ValueError(f"cuda_graphs needs a CUDA device, device is {self.device!r}")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, "
                f"got {self.quantization!r}"
            )
        if self.quantization != "none" and not self.device.startswith(("cpu", "cuda")):
            raise ValueError(
                f"quantization {self.quantization!r} runs on the CPU or CUDA only, device is "
                f"{self.device!r}"
            )
        if self.quantization == "gguf" and not str(self.model or ".gguf").endswith(".gguf"):
            raise ValueError(
                f"quantization 'gguf' keeps a GGUF file's blocks, but model {self.model!r} is "
                "not a .gguf file (use 'int8' or 'int4')"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache sizing and prefix caching."""

    block_size: int = 16
    # Exactly one budget applies: bytes if given, else a fraction of currently free memory.
    kv_cache_bytes: int | None = None
    kv_cache_memory_fraction: float = 0.25
    # A hard cap on the block count, mostly for tests that want preemption to happen (blocks
    # of every layer: with layer groups, shared/kv/groups.py, this many in each group).
    num_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    # Namespaces the chained block hashes, so two models never share cache entries.
    hash_namespace: str = "splitserve-v1"
    # Which cached blocks go first when blocks are needed (shared/kv/eviction.py): "lru";
    # "idle_ttl" (blocks idle past their window go first); "priority" (also lower request
    # priority classes before higher ones, LRU inside a class).
    eviction_policy: str = "lru"
    # The retention window of a request that asks for none (idle_ttl and priority).
    idle_ttl_s: float = 600.0
    # The longest window a request may ask for (SamplingParams.cache_retention_s).
    max_retention_s: float = 86400.0
    # The largest share of the pool one tenant (a cache_salt) keeps cached once its requests
    # end; past it, that tenant's own cached blocks are evicted first. 1.0 = no bound.
    tenant_cache_quota: float = 1.0
    # Offload tiers (shared/kv/offload/): host memory for blocks the pool evicts (0 = no host
    # tier; "auto" = half of the memory left after the pool, shared/kv/offload/sizing.py), and
    # a directory with a size cap for the disk tier (None or 0 bytes = no disk tier).
    offload_host_bytes: int | str = 0
    offload_disk_dir: str | None = None
    offload_disk_bytes: int = 0
    # A block reaches the disk only after this many prefix-cache hits: one-shot prompts stay in
    # host memory until pushed out and never churn the disk.
    offload_disk_min_hits: int = 1
    # A load from the lower tiers still running after this long ends where it stands; the
    # blocks it did not load are computed instead.
    kv_load_timeout_s: float = 2.0
    # How keys and values are stored (KV_CACHE_DTYPES): "int8" fits about 2x (bfloat16 model)
    # or 3.9x (float32) the tokens in the same budget. A prefill pod and its decode pods must
    # agree: pages travel as they are stored.
    kv_cache_dtype: str = "auto"
    # A model whose layers mix sliding windows and full attention (Gemma 2 and 3) keeps each
    # kind in its own layer groups, so its window layers hold only their window's blocks
    # (shared/kv/groups.py). Off: one group, every layer holding every position. Pods that
    # exchange pages must agree (the pages' shape differs).
    group_window_layers: bool = True

    def tenant_quota_blocks(self, num_blocks: int) -> int | None:
        """`tenant_cache_quota` in blocks of a pool of `num_blocks`; None without a bound."""
        if self.tenant_cache_quota >= 1.0:
            return None
        return int(self.tenant_cache_quota * num_blocks)

    @property
    def has_offload(self) -> bool:
        return self.offload_host_bytes != 0 or self.has_disk_tier

    @property
    def has_disk_tier(self) -> bool:
        return self.offload_disk_dir is not None and self.offload_disk_bytes > 0

    def __post_init__(self) -> None:
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(
                f"eviction_policy must be one of {', '.join(EVICTION_POLICIES)}, "
                f"got {self.eviction_policy!r}"
            )
        if not self.idle_ttl_s > 0 or not self.max_retention_s > 0:
            raise ValueError(
                f"idle_ttl_s and max_retention_s must be > 0, got {self.idle_ttl_s} and "
                f"{self.max_retention_s}"
            )
        _check_offload(self)
        _check_kv_cache_dtype(self.kv_cache_dtype)
        if not 0.0 < self.tenant_cache_quota <= 1.0:
            raise ValueError(f"tenant_cache_quota must be in (0, 1], got {self.tenant_cache_quota}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be > 0, got {self.kv_cache_bytes}")
        if not 0.0 < self.kv_cache_memory_fraction <= 0.95:
            raise ValueError(
                "kv_cache_memory_fraction must be in (0, 0.95], "
                f"got {self.kv_cache_memory_fraction}"
            )
        if self.num_blocks_override is not None and self.num_blocks_override < 2:
            raise ValueError(f"num_blocks_override must be >= 2, got {self.num_blocks_override}")


def _check_kv_cache_dtype(kv_cache_dtype: object) -> None:
    if kv_cache_dtype == "fp8":
        # vLLM's fp8 KV needs a GPU with fp8 arithmetic; the CPU has none and no fp8 path is
        # built here, so it is refused rather than emulated.
        raise ValueError(
            "kv_cache_dtype 'fp8' is not supported: the CPU has no fp8 arithmetic and no fp8 "
            "KV path is built yet; use 'int8' (or 'auto')"
        )
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}"
        )


def _check_offload(cache: CacheConfig) -> None:
    host = cache.offload_host_bytes
    if host != "auto" and (isinstance(host, bool) or not isinstance(host, int) or host < 0):
        raise ValueError(f"offload_host_bytes must be an int >= 0 or 'auto', got {host!r}")
    for name in ("offload_disk_bytes", "offload_disk_min_hits"):
        value = getattr(cache, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if cache.offload_disk_bytes and not cache.offload_disk_dir:
        raise ValueError("offload_disk_bytes needs offload_disk_dir (where the files go)")
    if not cache.kv_load_timeout_s > 0:
        raise ValueError(f"kv_load_timeout_s must be > 0, got {cache.kv_load_timeout_s}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step budgets of the continuous-batching scheduler."""

    # Tokens computed in one forward pass: decode tokens first, prefill chunks fill the rest.
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 128
    # Longest prefill chunk of one request in one step (chunked prefill); None = the budget.
    long_prefill_token_threshold: int | None = None
    # Prompt tokens in a step that also decodes (stall-free batching, as Sarathi-Serve): a
    # burst of prompts cannot stretch every running stream's next token past what this many
    # tokens cost. Steps with nothing decoding still take the whole budget. None = no cap.
    max_prefill_tokens_while_decoding: int | None = None
    # Prompt tokens in a step that computes only prompts less important (a higher priority
    # value) than one the pod was sent in the last `importance_window_s` (shared/
    # step_importance.py): an important prompt arriving mid-step waits for a short step, and
    # its own step takes no less important prompt. None = every prompt alike.
    max_background_prefill_tokens: int | None = None
    importance_window_s: float = 30.0
    # Schedule and launch the next step while the device runs this one (shared/overlap.py):
    # a GPU's decode steps stop waiting on the host. Nothing to gain on the CPU, where the
    # forward itself runs on the host.
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.async_scheduling, bool):
            value = self.async_scheduling
            raise ValueError(f"async_scheduling must be true or false, got {value!r}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 1:
            raise ValueError("long_prefill_token_threshold must be >= 1")
        cap = self.max_prefill_tokens_while_decoding
        if cap is not None and cap < 1:
            raise ValueError(f"max_prefill_tokens_while_decoding must be >= 1, got {cap}")
        background = self.max_background_prefill_tokens
        if background is not None and background < 1:
            raise ValueError(f"max_background_prefill_tokens must be >= 1, got {background}")
        if not self.importance_window_s > 0:
            raise ValueError(f"importance_window_s must be > 0, got {self.importance_window_s}")


SPECULATIVE_METHODS = ("ngram", "draft", "self")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (shared/spec_decode/): who proposes tokens and how many."""

    # None = off; "ngram" = prompt lookup; "draft" = a smaller model sharing the tokenizer;
    # "self" = the target's first `speculative_draft_layers` layers and its head.
    speculative_method: str | None = None
    # The most draft tokens one request verifies per step (adaptive k stays at or below it).
    num_speculative_tokens: int = 4
    speculative_draft_model: str | None = None  # for "draft": a .gguf file or HF directory
    speculative_draft_layers: int | None = None  # for "self"
    # Speculation pauses in steps with more decoding requests than this: a large batch already
    # keeps the CPU busy, so verifying 1 + k tokens per request costs more than it saves
    # (measured with benchmarks/speculative.py, see docs/benchmarks.md).
    speculative_max_batch_size: int = 4
    # k follows each request's acceptance rate; False = always num_speculative_tokens.
    speculative_adaptive: bool = True

    def __post_init__(self) -> None:
        method = self.speculative_method
        if method is not None and method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_method must be one of {SPECULATIVE_METHODS} or None, got {method!r}"
            )
        _check_count("num_speculative_tokens", self.num_speculative_tokens, 1)
        _check_count("speculative_max_batch_size", self.speculative_max_batch_size, 0)
        if not isinstance(self.speculative_adaptive, bool):
            raise ValueError(
                f"speculative_adaptive must be a bool, got {self.speculative_adaptive!r}"
            )
        self._check_draft_options()

    def _check_draft_options(self) -> None:
        method, path = self.speculative_method, self.speculative_draft_model
        if method == "draft" and not (isinstance(path, str) and path):
            raise ValueError("speculative_draft_model (a path) is required with method 'draft'")
        if method != "draft" and path is not None:
            raise ValueError("speculative_draft_model is only used with method 'draft'")
        layers = self.speculative_draft_layers
        if method == "self":
            if layers is None:
                raise ValueError("speculative_draft_layers is required with method 'self'")
            _check_count("speculative_draft_layers", layers, 1)
        elif layers is not None:
            raise ValueError("speculative_draft_layers is only used with method 'self'")

    @property
    def is_enabled(self) -> bool:
        return self.speculative_method is not None


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA (shared/lora/, vLLM's names): adapters in PEFT's format, each request with
    one of them or none, mixed in one batch."""

    enable_lora: bool = False
    # Adapters in active slots at once (so at most this many distinct ones per step).
    max_loras: int = 1
    # Every slot holds this rank (smaller adapters are zero-padded); larger ones are refused.
    max_lora_rank: int = 16
    # Host copies kept, least recently used out first; None = max_loras.
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be true or false, got {self.enable_lora!r}")
        _check_count("max_loras", self.max_loras, 1)
        _check_count("max_lora_rank", self.max_lora_rank, 1)
        if self.max_cpu_loras is not None:
            _check_count("max_cpu_loras", self.max_cpu_loras, self.max_loras)

    @property
    def num_cpu_loras(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


@dataclass(frozen=True)
class ParallelConfig:
    """How one engine splits the model over processes (shared/parallel/, docs/parallelism.md).
    Whether a size divides the model's heads is checked once the model is loaded."""

    # Ranks that each hold a slice of every layer's heads and MLP columns (vLLM's name).
    tensor_parallel_size: int = 1
    # Ranks that each hold consecutive layers (a stage); vLLM's name.
    pipeline_parallel_size: int = 1
    # Mixture-of-experts models: the experts are partitioned over the tensor_parallel_size
    # ranks (rank r of n holds a contiguous E/n range), tokens dispatched and combined with
    # all-to-all; attention and a shared expert stay tensor-parallel (vLLM's name). Off, each
    # expert's intermediate size is split over the ranks instead. No effect on dense models.
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        _check_count("tensor_parallel_size", self.tensor_parallel_size, 1)
        _check_count("pipeline_parallel_size", self.pipeline_parallel_size, 1)
        if not isinstance(self.enable_expert_parallel, bool):
            value = self.enable_expert_parallel
            raise ValueError(f"enable_expert_parallel must be true or false, got {value!r}")
        if self.enable_expert_parallel and self.pipeline_parallel_size > 1:
            raise ValueError(
                "enable_expert_parallel partitions experts over the tensor_parallel_size ranks; "
                f"it cannot be combined with pipeline_parallel_size {self.pipeline_parallel_size}"
            )

    @property
    def world_size(self) -> int:
        """Processes per engine: a grid of pipeline stages, each tensor_parallel_size ranks
        (rank = stage * tensor_parallel_size + tp_rank, vLLM's layout)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


def _check_count(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    # torch intra-op threads (of each tensor-parallel rank); None = all cores (shared out
    # among the ranks).
    num_threads: int | None = None
    # Each step measures whether one thread or num_threads is faster right now (another
    # process may hold a core: shared/thread_tuner.py); False keeps num_threads throughout.
    adaptive_threads: bool = True

    def __post_init__(self) -> None:
        if self.num_threads is not None:
            _check_count("num_threads", self.num_threads, 1)
        if not isinstance(self.adaptive_threads, bool):
            value = self.adaptive_threads
            raise ValueError(f"adaptive_threads must be true or false, got {value!r}")
        if self.parallel.world_size > 1 and self.speculative.speculative_method == "self":
            # The early-exit draft would run the target's sharded layers on rank 0 alone.
            raise ValueError(
                "speculative_method 'self' does not support tensor_parallel_size "
                f"{self.parallel.tensor_parallel_size} / pipeline_parallel_size "
                f"{self.parallel.pipeline_parallel_size} (use 'ngram' or 'draft')"
            )
        if self.scheduler.async_scheduling and self.parallel.world_size > 1:
            # The other ranks rebuild each step's inputs from token ids the host has not read.
            raise ValueError(
                "async_scheduling does not support tensor_parallel_size "
                f"{self.parallel.tensor_parallel_size} / pipeline_parallel_size "
                f"{self.parallel.pipeline_parallel_size} yet"
            )
        explicit_tier = self.cache.offload_host_bytes not in (0, "auto") or self.cache.has_disk_tier
        if self.parallel.world_size > 1 and explicit_tier:
            # The tiers copy one process's pool; a parallel engine's KV is spread over ranks.
            raise ValueError(
                "KV offload tiers (offload_host_bytes, offload_disk_dir) are not supported with "
                f"tensor_parallel_size {self.parallel.tensor_parallel_size} / "
                f"pipeline_parallel_size {self.parallel.pipeline_parallel_size} yet; set them "
                "to 0 (the default 'auto' host tier is left off by itself)"
            )
        if self.parallel.world_size > 1 and self.lora.enable_lora:
            # The ranks' projections are slices; adapter weights are not sliced yet.
            raise ValueError(
                "enable_lora does not support tensor_parallel_size "
                f"{self.parallel.tensor_parallel_size} / pipeline_parallel_size "
                f"{self.parallel.pipeline_parallel_size} yet"
            )
        if self.parallel.world_size > 1 and self.model.quantization != "none":
            # The ranks load and slice Hugging Face weights; packed weights are not sliced yet.
            raise ValueError(
                f"quantization {self.model.quantization!r} does not support "
                f"tensor_parallel_size {self.parallel.tensor_parallel_size} / "
                f"pipeline_parallel_size {self.parallel.pipeline_parallel_size} yet "
                "(use quantization 'none')"
            )

    @classmethod
    def from_options(cls, model: str | None = None, **options: Any) -> EngineConfig:
        """Builds the config from flat keyword options, the way `LLM(...)` takes them.

        Each option name belongs to exactly one concern; an unknown name is a `ValueError`
        naming it, so a typo never silently falls back to a default. The values are typed
        `Any` because they are the caller's, unchecked: each concern's `__post_init__` checks them.
        """
        groups: dict[type, dict[str, Any]] = {ModelConfig: {"model": model}}
        for name, value in options.items():
            owner = _OPTION_OWNERS.get(name)
            if owner is None:
                raise ValueError(f"unknown engine option {name!r}")
            groups.setdefault(owner, {})[name] = value
        engine = groups.pop(EngineConfig, {})
        return cls(
            model=ModelConfig(**groups.get(ModelConfig, {})),
            cache=CacheConfig(**groups.get(CacheConfig, {})),
            scheduler=SchedulerConfig(**groups.get(SchedulerConfig, {})),
            speculative=SpeculativeConfig(**groups.get(SpeculativeConfig, {})),
            parallel=ParallelConfig(**groups.get(ParallelConfig, {})),
            lora=LoRAConfig(**groups.get(LoRAConfig, {})),
            num_threads=engine.get("num_threads"),
            adaptive_threads=engine.get("adaptive_threads", True),
        )


_CONCERNS = (
    ModelConfig,
    CacheConfig,
    SchedulerConfig,
    SpeculativeConfig,
    ParallelConfig,
    LoRAConfig,
)

_OPTION_OWNERS: dict[str, type] = {
    **{option.name: concern for concern in _CONCERNS for option in fields(concern)},
    "num_threads": EngineConfig,
    "adaptive_threads": EngineConfig,
}
