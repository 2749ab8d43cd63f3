"""Building an engine's parts from its config, each with what it needs in its constructor.

    load_model    checkpoint -> model, tokenizer, the paged KV tensor (one rank or several)
    build_kv      the tiers below the pool -> the KV manager -> the scheduler's loads
    build_parts   the scheduler, runner, speculator, grammars, page I/O and step observers

Nothing is wired after construction: a part that talks to another takes it as an argument
(the KV manager its lower tiers, the scheduler its loads, the exporter its page I/O), so the
order below is the order of what depends on what. `EngineCore` (shared/core.py) only drives
the parts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from splitserve.engine.config import CacheConfig, EngineConfig
from splitserve.engine.cuda_graphs import DecodeGraphsOptions
from splitserve.engine.kv.cache import KVCacheSpec, allocate_kv_cache, size_kv_cache
from splitserve.engine.kv.disaggregation import KVPageExporter, LocalPages, PageIO
from splitserve.engine.kv.grouped_manager import GroupedKVManager
from splitserve.engine.kv.groups import KVGroups, plan_kv_groups
from splitserve.engine.kv.loads import KVLoads
from splitserve.engine.kv.manager import KVCacheManager
from splitserve.engine.kv.offload.build import build_offloader
from splitserve.engine.kv.offload.offloader import KVOffloader
from splitserve.engine.lora.build import build_lora
from splitserve.engine.lora.slots import LoRASlots
from splitserve.engine.model.architecture import LoadedCheckpoint, ModelArchitecture
from splitserve.engine.model.llama import LlamaForCausalLM
from splitserve.engine.model.loader import load_checkpoint, release_freed_memory
from splitserve.engine.model.moe_layer import SparseMoeBlock, moe_blocks
from splitserve.engine.output_processor import OutputProcessor
from splitserve.engine.parallel.group import ParallelGroup
from splitserve.engine.parallel.pages import ParallelPages
from splitserve.engine.parallel.setup import start_parallel
from splitserve.engine.runner import ModelRunner
from splitserve.engine.scheduler import Scheduler
from splitserve.engine.spec_decode.adaptive import SpeculationPolicy
from splitserve.engine.spec_decode.speculator import Speculator, build_policy, build_speculator
from splitserve.engine.step import StepObserver
from splitserve.engine.step_log import StepLog
from splitserve.engine.structured_output.matcher import GrammarCompiler
from splitserve.engine.thread_tuner import ThreadTuner
from splitserve.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    """The checkpoint turned into this process's model and KV tensor."""

    architecture: ModelArchitecture
    tokenizer: Tokenizer
    model_name: str  # the file or directory the weights came from
    max_model_len: int
    eos_token_ids: tuple[int, ...]  # the model's and the tokenizer's, sorted
    model: LlamaForCausalLM  # this rank's part with parallel ranks
    kv_spec: KVCacheSpec  # the pod's: with parallel ranks, every rank's pages
    kv_cache: torch.Tensor  # this rank's part
    parallel: ParallelGroup | None  # rank 0's handle on the other ranks; None for one process
    # A mixed-window model's layer groups (shared/kv/groups.py); None: one group.
    kv_groups: KVGroups | None = None


@dataclass(frozen=True)
class KVParts:
    manager: KVCacheManager | GroupedKVManager
    offloader: KVOffloader | None  # the host and disk tiers, when the config asks for them
    loads: KVLoads | None  # the scheduler's side of the tiers; None without them


@dataclass(frozen=True)
class EngineParts:
    model: LoadedModel
    kv: KVParts
    thread_tuner: ThreadTuner | None
    speculation: SpeculationPolicy | None
    scheduler: Scheduler
    runner: ModelRunner
    speculator: Speculator | None
    output_processor: OutputProcessor
    grammars: GrammarCompiler
    pages: PageIO  # pages in and out in the model's layout, whatever the parallel layout
    kv_exporter: KVPageExporter
    step_observers: list[StepObserver]
    moe_blocks: list[SparseMoeBlock]  # their expert counters, for stats
    lora: LoRASlots | None  # multi-LoRA's slots (enable_lora), hooked into the model


def build_parts(config: EngineConfig, progress=None) -> EngineParts:
    """Loads the model (reporting to `progress`) and builds every part around it. Sets torch's
    thread count first when the config names one."""
    thread_tuner = _configure_threads(config)
    loaded = load_model(config, progress)
    kv = build_kv(config.cache, loaded, config.parallel.world_size, _kv_window(config, loaded))
    speculation = build_policy(config.speculative)
    lora = build_lora(config, loaded.model)
    scheduler = Scheduler(
        config.scheduler,
        kv.manager,
        loaded.max_model_len,
        loaded.eos_token_ids,
        speculation,
        kv.loads,
        config.lora.max_loras if lora is not None else None,
    )
    runner = ModelRunner(
        loaded.model,
        loaded.kv_cache,
        config.cache.block_size,
        loaded.eos_token_ids,
        loaded.parallel,
        DecodeGraphsOptions(loaded.max_model_len) if config.model.cuda_graphs else None,
        lora,
        kv_groups=loaded.kv_groups,
    )
    speculator = None
    if speculation is not None:
        speculator = build_speculator(config, speculation, runner, loaded.max_model_len)
    pages = _page_io(loaded)
    kv_exporter = KVPageExporter(pages)
    _log_kv_cache(loaded.kv_spec, config.cache)
    parts = EngineParts(
        model=loaded,
        kv=kv,
        thread_tuner=thread_tuner,
        speculation=speculation,
        scheduler=scheduler,
        runner=runner,
        speculator=speculator,
        output_processor=OutputProcessor(loaded.tokenizer),
        # Structured outputs: grammars compiled per constraint, matched per sequence.
        grammars=GrammarCompiler(
            loaded.tokenizer.to_json, loaded.architecture.vocab_size, loaded.eos_token_ids
        ),
        pages=pages,
        kv_exporter=kv_exporter,
        step_observers=_step_observers(kv_exporter, speculator, kv.offloader),
        moe_blocks=moe_blocks(loaded.model),
        lora=lora,
    )
    # The checkpoint went with load_model's frame, and building freed its temporaries: give
    # that memory back, or glibc keeps it resident (shared/model/loader.py).
    release_freed_memory()
    return parts


def _configure_threads(config: EngineConfig) -> ThreadTuner | None:
    """Before the model loads, so loading runs on the threads the engine will use."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    num_threads = torch.get_num_threads()
    if config.adaptive_threads and num_threads > 1:
        return ThreadTuner(num_threads)
    return None


# ---- the model and its KV tensor ----------------------------------------------------------


def load_model(config: EngineConfig, progress=None) -> LoadedModel:
    """With parallel ranks (shared/parallel/) this process is rank 0 and holds one part."""
    checkpoint = load_checkpoint(
        config.model.model, progress, keep_quantized=config.model.quantization == "gguf"
    )
    arch, tokenizer = checkpoint.architecture, checkpoint.tokenizer
    max_model_len = _max_model_len(arch.max_position_embeddings, config)
    parallel = None
    kv_groups = None
    if config.parallel.world_size > 1:
        _check_parallel_model(arch, config.parallel.pipeline_parallel_size)
        rank0 = start_parallel(config, checkpoint, max_model_len)
        parallel, model, kv_spec, kv_cache = (
            rank0.group, rank0.model, rank0.kv_spec, rank0.kv_cache
        )
    else:
        kv_groups = _kv_groups(config, arch)
        model, kv_spec, kv_cache = _load_one_process(config, checkpoint, max_model_len, kv_groups)
    return LoadedModel(
        architecture=arch,
        tokenizer=tokenizer,
        model_name=checkpoint.source,
        max_model_len=max_model_len,
        eos_token_ids=tuple(sorted(set(arch.eos_token_ids) | set(tokenizer.eos_token_ids))),
        model=model,
        kv_spec=kv_spec,
        kv_cache=kv_cache,
        parallel=parallel,
        kv_groups=kv_groups,
    )


def _load_one_process(
    config: EngineConfig,
    checkpoint: LoadedCheckpoint,
    max_model_len: int,
    kv_groups: KVGroups | None = None,
) -> tuple[LlamaForCausalLM, KVCacheSpec, torch.Tensor]:
    """The whole model and the KV tensor sized from what memory is left after its weights."""
    arch, device = checkpoint.architecture, torch.device(config.model.device)
    dtype = getattr(torch, config.model.dtype)
    model = LlamaForCausalLM(arch, max_model_len, device, config.model.quantization)
    model.materialize(device, dtype)
    model.load_hf_weights(checkpoint.weights, consume=True)  # the checkpoint goes as it loads
    release_freed_memory()  # before the KV cache is sized from what memory is free
    kv_spec = size_kv_cache(arch, config.cache, dtype, device, groups=kv_groups)
    kv_dtype = config.cache.kv_cache_dtype
    kv_cache = allocate_kv_cache(kv_spec, arch, dtype, device, kv_dtype, kv_groups)
    return model, kv_spec, kv_cache


def _kv_groups(config: EngineConfig, arch: ModelArchitecture) -> KVGroups | None:
    """Layer groups for a mixed-window model (shared/kv/groups.py), where this engine's parts
    take them: one process (the caller's), no offload tiers, no CUDA graphs, and no draft
    model or self-draft (they read the cache through tables of their own)."""
    cache = config.cache
    if not cache.group_window_layers or cache.has_offload or config.model.cuda_graphs:
        return None
    if config.speculative.speculative_method not in (None, "ngram"):
        return None
    groups = plan_kv_groups(arch)
    if groups is not None:
        logger.info(
            "KV cache: %d layer groups of %d layers (windows %s), one pool",
            groups.num_groups,
            groups.slots_per_block,
            list(groups.group_windows),
        )
    return groups


def _check_parallel_model(arch: ModelArchitecture, pipeline_parallel_size: int) -> None:
    """Before any rank starts: mixture-of-experts models split over tensor-parallel ranks
    (their experts by range with enable_expert_parallel), not over pipeline stages yet; nor do
    MLA models (DeepSeek), whose latent cache every tensor-parallel rank holds whole."""
    if arch.mla is not None and pipeline_parallel_size > 1:
        raise ValueError(
            f"{arch.name} (multi-head latent attention) does not support pipeline parallel "
            "yet: use tensor_parallel_size"
        )
    if arch.moe is not None and pipeline_parallel_size > 1:
        raise ValueError(
            f"pipeline_parallel_size {pipeline_parallel_size} does not support "
            f"mixture-of-experts models ({arch.family}) yet: use tensor_parallel_size, with "
            "enable_expert_parallel to spread the experts"
        )


def _max_model_len(model_limit: int, config: EngineConfig) -> int:
    if config.model.max_model_len is None:
        return model_limit
    return min(model_limit, config.model.max_model_len)


# ---- the KV parts -------------------------------------------------------------------------


def build_kv(
    cache: CacheConfig, loaded: LoadedModel, world_size: int = 1, sliding_window: int = 0
) -> KVParts:
    """The offload tiers first (they need only the pool's tensor), then the manager that
    evicts into them and looks prefixes up in them, then the loads that bring blocks back."""
    if loaded.kv_groups is not None:  # no tiers with groups (_kv_groups)
        grouped = GroupedKVManager.from_config(loaded.kv_groups, cache, loaded.kv_spec.num_blocks)
        return KVParts(grouped, None, None)
    offloader = build_offloader(cache, loaded.kv_cache, world_size)
    manager = KVCacheManager.from_config(
        cache, loaded.kv_spec.num_blocks, lower_tiers=offloader, sliding_window=sliding_window
    )
    loads = KVLoads(manager, offloader) if offloader is not None else None
    return KVParts(manager, offloader, loads)


# Speculation that reads no other KV than the target's own layers (n-gram drafts read none, a
# self-draft runs the target's first layers with their windows). A method added later releases
# nothing until it is listed here.
_METHODS_WITHIN_THE_WINDOW = (None, "ngram", "self")


def _kv_window(config: EngineConfig, loaded: LoadedModel) -> int:
    """The window past which the KV manager releases a running request's blocks: the model's
    (shared/model/architecture.py), unless a separate draft model shares the block tables, which
    may attend to every position."""
    if config.speculative.speculative_method not in _METHODS_WITHIN_THE_WINDOW:
        return 0
    return loaded.architecture.kv_window


def _page_io(loaded: LoadedModel) -> PageIO:
    if loaded.parallel is not None:
        return ParallelPages(loaded.parallel, loaded.kv_cache)
    return LocalPages(loaded.kv_cache)


def _step_observers(
    kv_exporter: KVPageExporter, speculator: Speculator | None, offloader: KVOffloader | None
) -> list[StepObserver]:
    """Called after every forward pass with what it computed and when: the exporter (a prefill
    pod's pages), the speculation policy's step-cost curve, the tiers' prefill cost; a pod adds
    its per-request timings (shared/telemetry.py)."""
    observers: list[StepObserver] = [kv_exporter]
    if speculator is not None:
        observers.append(speculator)
    if offloader is not None:  # measures what recomputing a prefix costs
        observers.append(offloader.costs)
    step_log = StepLog.from_environment()  # SPLITSERVE_STEP_LOG: one JSON line per step
    if step_log is not None:
        observers.append(step_log)
    return observers


def _log_kv_cache(kv_spec: KVCacheSpec, cache: CacheConfig) -> None:
    logger.info(
        "KV cache: %s, %.1f MiB, kv_cache_dtype %s",
        kv_spec.describe(),
        kv_spec.total_bytes / 2**20,
        cache.kv_cache_dtype,
    )
