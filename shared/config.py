"""Engine configuration: one frozen dataclass per concern, composed into `EngineConfig`.

Values discovered at run time (how many KV blocks fit, the model's real context length) live in
`shared.kv.memory.KVCacheSpec` and in the loaded model's `ModelArchitecture`, never written back
here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")


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

    def __post_init__(self) -> None:
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache sizing and prefix caching."""

    block_size: int = 16
    # Exactly one budget applies: bytes if given, else a fraction of currently free memory.
    kv_cache_bytes: int | None = None
    kv_cache_memory_fraction: float = 0.25
    # A hard cap on the block count, mostly for tests that want preemption to happen.
    num_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    # Namespaces the chained block hashes, so two models never share cache entries.
    hash_namespace: str = "splitserve-v1"

    def __post_init__(self) -> None:
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


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step budgets of the continuous-batching scheduler."""

    # Tokens computed in one forward pass: decode tokens first, prefill chunks fill the rest.
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 128
    # Longest prefill chunk of one request in one step (chunked prefill); None = the budget.
    long_prefill_token_threshold: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 1:
            raise ValueError("long_prefill_token_threshold must be >= 1")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # torch intra-op threads; None = all cores.
    num_threads: int | None = None

    @classmethod
    def from_options(cls, model: str | None = None, **options: object) -> EngineConfig:
        """Builds the config from flat keyword options, the way `LLM(...)` takes them.

        Each option name belongs to exactly one concern; an unknown name is a `ValueError`
        naming it, so a typo never silently falls back to a default.
        """
        groups: dict[type, dict[str, object]] = {ModelConfig: {"model": model}}
        for name, value in options.items():
            owner = _OPTION_OWNERS.get(name)
            if owner is None:
                raise ValueError(f"unknown engine option {name!r}")
            groups.setdefault(owner, {})[name] = value
        num_threads = groups.pop(EngineConfig, {}).get("num_threads")
        return cls(
            model=ModelConfig(**groups.get(ModelConfig, {})),
            cache=CacheConfig(**groups.get(CacheConfig, {})),
            scheduler=SchedulerConfig(**groups.get(SchedulerConfig, {})),
            num_threads=num_threads,  # type: ignore[arg-type]
        )


def _field_names(cls: type) -> list[str]:
    return list(cls.__dataclass_fields__)


_OPTION_OWNERS: dict[str, type] = {
    **{name: ModelConfig for name in _field_names(ModelConfig)},
    **{name: CacheConfig for name in _field_names(CacheConfig)},
    **{name: SchedulerConfig for name in _field_names(SchedulerConfig)},
    "num_threads": EngineConfig,
}
