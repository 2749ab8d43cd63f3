"""What the engine-backed pods (prefill and decode) share: the flags every such pod takes, who it
is (`PodIdentity`), its stats as the `WorkerStats` proto, and the serve loop.

The serve loop answers health checks at once (NOT_SERVING), loads the model in a daemon thread,
lets the core start its async parts (KV transport) on the event loop, turns SERVING, and on
SIGTERM / Ctrl-C drains:

    leave the registry (routers stop picking the pod) ─▶ NOT_SERVING, refuse new calls
    ─▶ in-flight calls get --drain-timeout seconds to finish ─▶ cancel the rest, close the core

Torch-free like the rest of services/common: the engine is only named for type checking.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

from splitserve.common.background import in_daemon_thread, wait_first
from splitserve.common.channels import use_client_tls
from splitserve.common.grpc_server import start_server, stop_event_on_signals
from splitserve.common.pod_load import PodLoad
from splitserve.common.step_costs import StepCosts
from splitserve.common.tls import add_tls_flags, tls_from_args
from splitserve.common.tracing import configure_tracing, shutdown_tracing
from splitserve.engine.gc_heap import freeze_startup_heap
from splitserve.pod.flags import add_engine_flags, add_server_flags
from splitserve.pod.metrics import PodMetrics, serve_pod_metrics
from splitserve.pod.registry_publisher import add_registry_flags, start_registry
from splitserve.v1 import worker_pb2

if TYPE_CHECKING:
    from splitserve.engine.async_llm import AsyncLLM
    from splitserve.engine.core import EngineStats, LoRAInfo
    from splitserve.engine.step_costs_fit import FittedStepCosts

logger = logging.getLogger(__name__)

KV_TRANSPORTS = ("ucx", "tcp")
# Local runs (`splitserve up`, Ctrl-C) should not wait long; the Helm chart sets its own.
DEFAULT_DRAIN_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class PodIdentity:
    """What a pod says about itself in its stats; fixed for the life of the process."""

    pod_id: str  # the proto and the Redis hash call it worker_id
    role: str  # "prefill" or "decode"
    model_name: str  # the name the gateway validates requests against
    kv_transport: str  # "ucx" or "tcp": the KV transport this pod speaks
    kv_address: str = ""  # where prefill pods send pages (decode pods); empty otherwise
    region: str = ""  # where the pod runs, for proximity routing ("" = unknown)
    zone: str = ""


@dataclass(frozen=True)
class PodStats:
    identity: PodIdentity
    engine: EngineStats
    max_model_len: int
    block_size: int
    vocab_size: int
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    lora_adapters: tuple[str, ...] = ()  # the adapters requests may name here
    lora: LoRAInfo | None = None  # which are in slots now, and how many slots (None: no LoRA)
    step_costs: StepCosts = StepCosts()  # measured here (zeros until enough steps ran)

    @property
    def load(self) -> PodLoad:
        """What GetStats and the registry record report as the pod's load."""
        return PodLoad.from_engine(self.engine)


def pod_stats(
    llm: AsyncLLM,
    identity: PodIdentity,
    lora_adapters: tuple[str, ...] = (),
    fitted: FittedStepCosts | None = None,
) -> PodStats:
    """`fitted`: the step costs measured on this pod (None: not measured, reported as 0)."""
    return PodStats(
        identity=identity,
        engine=llm.stats(),
        max_model_len=llm.engine.max_model_len,
        block_size=llm.config.cache.block_size,
        vocab_size=llm.engine.architecture.vocab_size,
        tensor_parallel_size=llm.config.parallel.tensor_parallel_size,
        pipeline_parallel_size=llm.config.parallel.pipeline_parallel_size,
        lora_adapters=lora_adapters,
        lora=llm.lora_info() if llm.engine.lora is not None else None,
        step_costs=_step_costs(llm, fitted),
    )


def _step_costs(llm: AsyncLLM, fitted: FittedStepCosts | None) -> StepCosts:
    """The fitted line, with the scheduler's limits per step (which hold from the start)."""
    scheduler = llm.config.scheduler
    limits = StepCosts(
        max_num_seqs=scheduler.max_num_seqs,
        max_num_batched_tokens=scheduler.max_num_batched_tokens,
    )
    if fitted is None:
        return limits
    return dataclasses.replace(
        limits,
        step_base_ms=fitted.base_ms,
        step_row_ms=fitted.row_ms,
        step_prefill_token_ms=fitted.prefill_token_ms,
    )


def pod_stats_to_proto(stats: PodStats) -> worker_pb2.WorkerStats:
    identity, engine, costs = stats.identity, stats.engine, stats.step_costs
    return worker_pb2.WorkerStats(
        worker_id=identity.pod_id,
        role=identity.role,
        **stats.load.as_fields(),
        num_preemptions=engine.num_preemptions,
        prefix_cache_queried_tokens=engine.prefix_cache_queried_tokens,
        prefix_cache_hit_tokens=engine.prefix_cache_hit_tokens,
        kv_address=identity.kv_address,
        model=identity.model_name,
        max_model_len=stats.max_model_len,
        block_size=stats.block_size,
        vocab_size=stats.vocab_size,
        kv_transport=identity.kv_transport,
        region=identity.region,
        zone=identity.zone,
        spec_proposed_tokens=engine.num_spec_proposed_tokens,
        spec_accepted_tokens=engine.num_spec_accepted_tokens,
        spec_verify_steps=engine.num_spec_verify_steps,
        tensor_parallel_size=stats.tensor_parallel_size,
        pipeline_parallel_size=stats.pipeline_parallel_size,
        lora_adapters=stats.lora_adapters,
        resident_lora_adapters=stats.lora.resident_adapters if stats.lora else (),
        max_loras=stats.lora.max_loras if stats.lora else 0,
        step_base_ms=costs.step_base_ms,
        step_row_ms=costs.step_row_ms,
        step_prefill_token_ms=costs.step_prefill_token_ms,
        max_num_seqs=costs.max_num_seqs,
        max_num_batched_tokens=costs.max_num_batched_tokens,
    )


def token_text(llm: AsyncLLM, token_id: int) -> str:
    """The text of one token as a client sees it (special tokens spelled out)."""
    return llm.tokenizer.decode([token_id], skip_special_tokens=False)


# ---- flags ----------------------------------------------------------------------------------


def _niceness(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 19:
        raise argparse.ArgumentTypeError(f"--nice must be within 0..19, got {value}")
    return value


def add_pod_flags(parser: argparse.ArgumentParser, default_port: int) -> None:
    """The flags both engine pods take (`splitserve up` passes the same set to each)."""
    add_server_flags(parser, default_port)
    parser.add_argument("--worker-id", default=None, help="name in stats (default: host:port)")
    parser.add_argument(
        "--nice",
        type=_niceness,
        default=0,
        metavar="N",
        help="lower this process's CPU priority by N (0-19, as nice(1)) before it starts: a "
        "prefill pod that shares cores with decode pods yields to their steps (splitserve up "
        "sets --prefill-nice)",
    )
    parser.add_argument(
        "--model-name", default=None, help="served model name (default: the model file's name)"
    )
    parser.add_argument(
        "--kv-transport", default="tcp", choices=KV_TRANSPORTS, help="KV page transport"
    )
    parser.add_argument(
        "--kv-secret-file",
        default=os.environ.get("SPLITSERVE_KV_SECRET_FILE") or None,
        metavar="PATH",
        help="tcp transport: KV connections prove this per-deployment secret on connect; a "
        "peer without it is refused (default: $SPLITSERVE_KV_SECRET_FILE, else open)",
    )
    add_tls_flags(parser)
    parser.add_argument(
        "--health-port",
        type=int,
        default=0,
        help="with --tls-cert: also serve only grpc.health.v1, in plaintext, on this port "
        "(kubelet's gRPC probes cannot speak TLS; 0 = off)",
    )
    add_registry_flags(parser)
    parser.add_argument(
        "--drain-timeout",
        type=_seconds,
        default=DEFAULT_DRAIN_TIMEOUT_S,
        metavar="SECONDS",
        help="on SIGTERM, after leaving the registry, in-flight requests get this long to "
        f"finish before they are cancelled (default {DEFAULT_DRAIN_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="serve Prometheus metrics at http://HOST:PORT/metrics (0 = off)",
    )
    add_engine_flags(parser)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not (value >= 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def pod_id(args: argparse.Namespace) -> str:
    return args.worker_id or f"{socket.gethostname()}:{args.port}"


# ---- serving --------------------------------------------------------------------------------


class PodCore(Protocol):
    """A pod's engine side, built off the event loop and then started on it."""

    llm: AsyncLLM  # the registry publisher drains its prefix-cache events
    metrics: PodMetrics  # Prometheus series and the recent latencies the registry publishes

    def stats(self) -> PodStats:
        """Identity and load now (for GetStats and the registry record)."""

    async def start(self) -> None:
        """Starts what must run on the event loop (the KV transport)."""

    async def close(self) -> None:
        """Stops the transport and the engine; in-flight requests fail."""


CoreT = TypeVar("CoreT", bound=PodCore)


class PodServicer(Protocol[CoreT]):
    core: CoreT | None  # None until the model has loaded


async def serve_pod(
    args: argparse.Namespace,
    service_name: str,
    servicer: PodServicer[CoreT],
    register: Callable[[object], None],
    load_core: Callable[[], CoreT],
) -> bool:
    """Serves until SIGTERM / Ctrl-C, or until the engine is lost (then returns True: the
    process should exit with an error). `register(server)` adds the servicer to the gRPC
    server; `load_core()` runs in a daemon thread (it loads the model)."""
    configure_tracing(_trace_service_name(service_name))
    tls = tls_from_args(args)
    use_client_tls(tls)  # a decode pod dials prefill pods with the same files
    server = await start_server(
        args.host, args.port, [service_name], register, tls, args.health_port
    )
    if tls is not None:
        logger.info("gRPC over %s", tls.describe())
    metrics = None
    if args.metrics_port:
        metrics = serve_pod_metrics(args.host, args.metrics_port, lambda: servicer.core)
    logger.info("gRPC on port %d; loading the model", server.port)
    stop = stop_event_on_signals()
    loading = in_daemon_thread(load_core, "load-model")
    stopping = asyncio.ensure_future(stop.wait())
    await wait_first(loading, stopping)
    core = loading.result() if loading.done() else None
    is_engine_lost = False
    if core is not None and not stopping.done():
        await core.start()
        freeze_startup_heap()  # the engine's objects stay: no full collection walks them
        servicer.core = core
        registry = await start_registry(args, core, server.port)
        await server.set_serving(True)
        logger.info("serving as %s", pod_id(args))
        lost = in_daemon_thread(core.llm.engine_lost.wait, "engine-watch")
        await wait_first(stopping, lost)
        is_engine_lost = lost.done() and not stopping.done()
        if is_engine_lost:
            logger.error("the engine lost a rank of its parallel layout: stopping the pod")
        if registry is not None:
            await registry.close()  # out of the registry before the server stops answering
    logger.info("draining: in-flight requests get up to %g s", args.drain_timeout)
    await server.stop(args.drain_timeout)
    logger.info("stopping")
    if core is not None:
        await core.close()
    if metrics is not None:
        metrics.close()
    shutdown_tracing()  # flushes the spans still batched
    return is_engine_lost


def _trace_service_name(service_name: str) -> str:
    """OTEL_SERVICE_NAME's default: "splitserve.v1.DecodeWorker" -> "splitserve-decode"."""
    role = service_name.rsplit(".", 1)[-1].removesuffix("Worker").lower()
    return f"splitserve-{role}"
