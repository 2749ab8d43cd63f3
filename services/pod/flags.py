"""Command-line flags the engine-backed services (decode, prefill) share, and their parsing.

Flag names are rendered into Helm charts as they are, so they stay plain `--kebab-case`
spellings of the engine's config fields.
"""

from __future__ import annotations

import argparse

from splitserve.common.cli_args import parse_size
from splitserve.engine.config import (
    EVICTION_POLICIES,
    KV_CACHE_DTYPES,
    QUANTIZATION_METHODS,
    CacheConfig,
)
from splitserve.engine.lora.request import LoRARequest


def parse_tier_size(text: str) -> int | str:
    """An offload tier's size: a size as parse_size reads it, "0" / "off" (no tier), or
    "auto" (sized from free memory at start-up)."""
    if text.strip().lower() in ("0", "off"):
        return 0
    if text.strip().lower() == "auto":
        return "auto"
    return parse_size(text)


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model", default=None, help="a .gguf file or HF directory (default: SmolLM2)"
    )
    group.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    add_quantization_flag(group)
    add_kv_cache_dtype_flag(group)
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    group.add_argument(
        "--kv-cache-bytes",
        type=parse_size,
        default=None,
        help="KV cache budget, e.g. 128MiB (default: --kv-cache-memory-fraction of free memory)",
    )
    group.add_argument("--kv-cache-memory-fraction", type=float, default=0.25)
    group.add_argument("--max-num-batched-tokens", type=int, default=512)
    group.add_argument("--max-num-seqs", type=int, default=128)
    group.add_argument(
        "--max-prefill-tokens-while-decoding",
        type=int,
        default=None,
        help="prompt tokens in a step that also decodes (stall-free batching); default: the "
        "whole --max-num-batched-tokens",
    )
    group.add_argument(
        "--max-background-prefill-tokens",
        type=_positive_int,
        default=None,
        metavar="N",
        help="prompt tokens in a step holding only prompts less important (a higher priority) "
        "than one sent in the last 30 s; such a prompt also stays out of an important one's "
        "step (admission control sends tenants within their share ahead). Default: every "
        "prompt alike",
    )
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    group.add_argument(
        "--window-layer-groups",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep a model's window layers (Gemma 2/3) in layer groups of their own, so they hold "
        "only their window's KV blocks; prefill and decode pods must agree",
    )
    group.add_argument(
        "--eviction-policy",
        default="lru",
        choices=EVICTION_POLICIES,
        help="which cached blocks go first (shared/kv/eviction.py)",
    )
    group.add_argument(
        "--idle-ttl",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="retention window of requests that ask for none (idle_ttl, priority)",
    )
    group.add_argument(
        "--max-retention",
        type=float,
        default=86400.0,
        metavar="SECONDS",
        help="the longest retention a request may ask for (longer: a 400)",
    )
    group.add_argument(
        "--tenant-cache-quota",
        type=float,
        default=1.0,
        metavar="FRACTION",
        help="largest share of the KV cache one tenant (cache_salt) keeps cached; past it its "
        "own blocks go first (default 1.0: no bound)",
    )
    _add_offload_flags(parser)
    group.add_argument("--num-threads", type=int, default=None, help="torch threads (default: all)")
    group.add_argument(
        "--adaptive-threads",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="each step measures whether 1 thread or --num-threads is faster now (another "
        "process may hold a core)",
    )
    group.add_argument(
        "--tensor-parallel-size",
        type=_positive_int,
        default=1,
        help="processes that each hold a slice of every layer's heads (must divide the "
        "model's attention and KV heads; docs/parallelism.md)",
    )
    group.add_argument(
        "--pipeline-parallel-size",
        type=_positive_int,
        default=1,
        help="pipeline stages that each hold consecutive layers (must divide the model's "
        "layers); each stage is --tensor-parallel-size processes",
    )
    group.add_argument(
        "--enable-expert-parallel",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="mixture-of-experts models: partition the experts over the --tensor-parallel-size "
        "ranks (their count must divide the experts), tokens exchanged by all-to-all; off, "
        "each expert's intermediate size is split (docs/moe.md)",
    )
    _add_speculative_flags(parser)
    _add_lora_flags(parser)


def _add_offload_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("KV offload tiers (shared/kv/offload/)")
    group.add_argument(
        "--kv-offload-host-bytes",
        type=parse_tier_size,
        default=0,
        metavar="SIZE|auto|0",
        help="host memory for KV blocks the cache evicts, loaded back on a prefix hit "
        "(auto: half of the memory left after the KV cache; default: 0, off)",
    )
    group.add_argument(
        "--kv-offload-disk-dir", default=None, help="directory of the disk tier's block files"
    )
    group.add_argument(
        "--kv-offload-disk-bytes",
        type=parse_tier_size,
        default=0,
        metavar="SIZE|0",
        help="size cap of the disk tier (default: 0, off); blocks survive a restart",
    )
    group.add_argument(
        "--kv-offload-disk-min-hits",
        type=int,
        default=1,
        help="prefix-cache hits a block needs before it is written to disk",
    )
    group.add_argument(
        "--kv-load-timeout",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="a load from the tiers still running after this is cut short; the rest is computed",
    )


def add_quantization_flag(parser: argparse._ActionsContainer) -> None:
    parser.add_argument(
        "--quantization",
        default="none",
        choices=QUANTIZATION_METHODS,
        help="weight-only quantization (CPU, or CUDA through Triton): int8 per channel, int4 "
        "in groups of 32, or gguf (a .gguf model's Q4_0/Q4_1 blocks as they are); "
        "docs/quantization.md",
    )


def add_kv_cache_dtype_flag(parser: argparse._ActionsContainer) -> None:
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        type=_kv_cache_dtype,
        metavar="{" + ",".join(KV_CACHE_DTYPES) + "}",
        help="KV cache storage: auto (the model's dtype) or int8 (codes and a scale per token "
        "and head: about 2x the tokens, 3.9x against float32); prefill and decode pods must "
        "agree; docs/quantization.md",
    )


def _kv_cache_dtype(text: str) -> str:
    """The engine's own check, so the flag refuses what the engine would, in its words."""
    try:
        CacheConfig(kv_cache_dtype=text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _add_speculative_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("speculative decoding")
    group.add_argument(
        "--speculative-method",
        choices=["ngram", "draft", "self"],
        default=None,
        help="propose tokens by n-gram prompt lookup, a draft model, or the model's first "
        "layers (default: off)",
    )
    group.add_argument(
        "--num-speculative-tokens", type=int, default=4, help="most draft tokens per step"
    )
    group.add_argument(
        "--speculative-draft-model", default=None, help="draft .gguf or HF directory (draft)"
    )
    group.add_argument(
        "--speculative-draft-layers", type=int, default=None, help="draft layers (self)"
    )


def _add_lora_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("LoRA adapters (vLLM's flags)")
    group.add_argument(
        "--lora-modules",
        nargs="+",
        type=_lora_module,
        default=[],
        metavar="NAME=PATH",
        help="PEFT adapters served by name (clients put the name in \"model\"); implies "
        "--enable-lora",
    )
    group.add_argument(
        "--enable-lora", action="store_true", help="serve adapters (also loaded at run time)"
    )
    group.add_argument("--max-loras", type=_positive_int, default=1, help="active adapter slots")
    group.add_argument("--max-lora-rank", type=_positive_int, default=16)
    group.add_argument(
        "--max-cpu-loras", type=_positive_int, default=None, help="host copies (default: slots)"
    )


def _lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, path


def lora_modules(args: argparse.Namespace) -> list[LoRARequest]:
    """The --lora-modules adapters, with ids 1, 2, ... in flag order."""
    return [
        LoRARequest(name, index, path) for index, (name, path) in enumerate(args.lora_modules, 1)
    ]


def engine_options(args: argparse.Namespace) -> dict[str, object]:
    """Keyword options for `AsyncLLM(model, **options)` from `add_engine_flags`' flags."""
    return {
        "dtype": args.dtype,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "block_size": args.block_size,
        "kv_cache_bytes": args.kv_cache_bytes,
        "kv_cache_memory_fraction": args.kv_cache_memory_fraction,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.max_num_seqs,
        "max_prefill_tokens_while_decoding": args.max_prefill_tokens_while_decoding,
        "max_background_prefill_tokens": args.max_background_prefill_tokens,
        "max_model_len": args.max_model_len,
        "enable_prefix_caching": args.prefix_caching,
        "group_window_layers": args.window_layer_groups,
        "eviction_policy": args.eviction_policy,
        "idle_ttl_s": args.idle_ttl,
        "max_retention_s": args.max_retention,
        "tenant_cache_quota": args.tenant_cache_quota,
        "offload_host_bytes": args.kv_offload_host_bytes,
        "offload_disk_dir": args.kv_offload_disk_dir,
        "offload_disk_bytes": args.kv_offload_disk_bytes,
        "offload_disk_min_hits": args.kv_offload_disk_min_hits,
        "kv_load_timeout_s": args.kv_load_timeout,
        "num_threads": args.num_threads,
        "adaptive_threads": args.adaptive_threads,
        "tensor_parallel_size": args.tensor_parallel_size,
        "pipeline_parallel_size": args.pipeline_parallel_size,
        "enable_expert_parallel": args.enable_expert_parallel,
        "speculative_method": args.speculative_method,
        "num_speculative_tokens": args.num_speculative_tokens,
        "speculative_draft_model": args.speculative_draft_model,
        "speculative_draft_layers": args.speculative_draft_layers,
        "enable_lora": args.enable_lora or bool(args.lora_modules),
        "max_loras": args.max_loras,
        "max_lora_rank": args.max_lora_rank,
        "max_cpu_loras": args.max_cpu_loras,
    }


def add_server_flags(parser: argparse.ArgumentParser, default_port: int) -> None:
    parser.add_argument("--host", default="0.0.0.0", help="address to bind")
    parser.add_argument("--port", type=int, default=default_port, help="gRPC port")
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )

