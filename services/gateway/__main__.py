"""`python -m splitserve.gateway`: the OpenAI HTTP API and the gRPC Generation API in front of
the decode (and prefill) pods. Loads the tokenizer and chat template only: no model, no torch."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os

import uvicorn

from splitserve.common.background import in_daemon_thread, wait_first
from splitserve.common.channels import use_client_tls
from splitserve.common.cli_args import setup_logging
from splitserve.common.grpc_server import (
    BindError,
    GrpcServer,
    start_server,
    stop_event_on_signals,
)
from splitserve.common.model_files import default_model_name, load_tokenizer, resolve_model_path
from splitserve.common.redis_auth import add_redis_password_flag, use_redis_password_file
from splitserve.common.tls import add_tls_flags, tls_from_args
from splitserve.common.tracing import configure_tracing
from splitserve.engine.gc_heap import freeze_startup_heap
from splitserve.gateway.admission.controller import AdmissionController
from splitserve.gateway.admission.flags import add_admission_flags, admission_settings
from splitserve.gateway.admission.metrics import AdmissionMetrics
from splitserve.gateway.api.grpc_service import GenerationServicer
from splitserve.gateway.api.http_app import create_app
from splitserve.gateway.api.messages import MessagesSettings
from splitserve.gateway.auth.gate import Gate
from splitserve.gateway.auth.http import DEFAULT_MAX_BODY_BYTES
from splitserve.gateway.auth.keys import KeyRing
from splitserve.gateway.core import GatewayCore
from splitserve.gateway.http_protocol import BoundedHttpToolsProtocol
from splitserve.gateway.metrics import GatewayMetrics
from splitserve.gateway.migration import add_migration_flags, migration_policy
from splitserve.gateway.routing.pods import POLL_INTERVAL_SECONDS, PodPool
from splitserve.gateway.routing.router import Router, RouterSettings
from splitserve.gateway.routing.scoring import POLICIES, LatencyMatrix, Location, RoutingWeights
from splitserve.v1 import generate_pb2, generate_pb2_grpc

logger = logging.getLogger("splitserve.gateway")

DEFAULT_HTTP_PORT = 8000
DEFAULT_GRPC_PORT = 50051
SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m splitserve.gateway", description=__doc__)
    parser.add_argument("--host", default="0.0.0.0", help="address to bind (HTTP and gRPC)")
    parser.add_argument("--port", type=int, default=DEFAULT_HTTP_PORT, help="HTTP port")
    parser.add_argument("--grpc-port", type=int, default=DEFAULT_GRPC_PORT, help="gRPC port")
    parser.add_argument(
        "--decode",
        action="append",
        default=[],
        metavar="ADDR",
        help="a decode pod's gRPC address host:port (repeat for more; required without Redis)",
    )
    parser.add_argument(
        "--prefill",
        action="append",
        default=[],
        metavar="ADDR",
        help="a prefill pod's gRPC address host:port (repeat for more; none = decode prefills)",
    )
    parser.add_argument(
        "--model", default=None, help="the .gguf file or HF directory to take the tokenizer from"
    )
    parser.add_argument(
        "--model-name", default=None, help="served model name (default: the model file's name)"
    )
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    add_messages_flags(parser)
    add_auth_flags(parser)
    add_routing_flags(parser)
    add_migration_flags(parser)
    add_admission_flags(parser)
    add_tls_flags(parser)  # the gateway's calls to the pods (its own ports: docs/security.md)
    return parser


def add_messages_flags(parser: argparse.ArgumentParser) -> None:
    """Anthropic's /v1/messages (docs/api.md)."""
    parser.add_argument(
        "--strip-system-line-prefix",
        action="append",
        default=[],
        metavar="PREFIX",
        help="/v1/messages: drop the system prompt's first line when it starts with PREFIX "
        "(repeatable), e.g. 'x-anthropic-billing-header:', the line Claude Code changes on "
        "every request, which would defeat prefix caching",
    )


def add_auth_flags(parser: argparse.ArgumentParser) -> None:
    """Keys, tenants, limits and request bounds (docs/security.md, docs/api.md)."""
    group = parser.add_argument_group("access")
    group.add_argument(
        "--api-keys",
        default=os.environ.get("SPLITSERVE_API_KEYS_FILE") or None,
        metavar="FILE",
        help="JSON or YAML list of {key | key_sha256, tenant, requests_per_minute, "
        "tokens_per_minute, concurrent_requests}: every route but /health then needs a key "
        "(default: $SPLITSERVE_API_KEYS_FILE; none = open to anyone)",
    )
    group.add_argument(
        "--metrics-public",
        action="store_true",
        help="serve /metrics without a key (with --api-keys; else it is open anyway)",
    )
    group.add_argument(
        "--server-timing",
        action="store_true",
        help="generation responses carry a Server-Timing header: the gateway's and the pods' "
        "milliseconds to the response's start (docs/api.md)",
    )
    group.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        metavar="N",
        help=f"largest request body; larger is a 400 (default {DEFAULT_MAX_BODY_BYTES})",
    )


def load_keys(args: argparse.Namespace) -> KeyRing | None:
    """Raises ValueError naming the flag for a key file that cannot be used."""
    if args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be positive, got {args.max_request_bytes}")
    return KeyRing.from_file(args.api_keys) if args.api_keys else None


def add_routing_flags(parser: argparse.ArgumentParser) -> None:
    """How pods are found and chosen (README "Routing" explains the score)."""
    group = parser.add_argument_group("routing")
    group.add_argument(
        "--redis-url",
        default=os.environ.get("REDIS_URL") or None,
        help="discover pods and their cached prefixes here (default: $REDIS_URL, else the "
        "--decode/--prefill addresses only); password: services/common/redis_auth.py",
    )
    add_redis_password_flag(group)
    group.add_argument("--region", default=os.environ.get("SPLITSERVE_REGION", ""))
    group.add_argument("--zone", default=os.environ.get("SPLITSERVE_ZONE", ""))
    group.add_argument("--routing-policy", default="cache_aware", choices=POLICIES)
    defaults = RoutingWeights()
    for name, help_text in WEIGHT_FLAGS.items():
        group.add_argument(
            f"--weight-{name}",
            type=float,
            default=getattr(defaults, name),
            metavar="W",
            help=f"{help_text} (default {getattr(defaults, name)})",
        )
    group.add_argument(
        "--max-queue",
        type=int,
        default=defaults.max_queue,
        help="requests queued on a pod at which it counts as saturated (spill-over)",
    )
    group.add_argument(
        "--region-latency-file",
        default=None,
        metavar="JSON",
        help='region-to-region round trips in ms: {"us-east": {"eu-west": 80}}',
    )


WEIGHT_FLAGS = {
    "prefix": "weight of the prompt fraction a pod has cached",
    "load": "weight of 1 / (1 + requests queued on the pod)",
    "kv": "weight of the pod's free KV fraction",
    "proximity": "weight of nearness to the client (zone, region, latency, round trip)",
    "pair": "weight of a decode pod's nearness to the chosen prefill pod",
}


def router_settings(args: argparse.Namespace) -> RouterSettings:
    """Raises ValueError (naming the flag) for bad weights or a bad latency file."""
    weights = RoutingWeights(
        **{name: getattr(args, f"weight_{name}") for name in WEIGHT_FLAGS},
        max_queue=args.max_queue,
    )
    latency = LatencyMatrix()
    if args.region_latency_file:
        with open(args.region_latency_file) as file:
            latency = LatencyMatrix.from_json(file.read())
    return RouterSettings(
        policy=args.routing_policy,
        weights=weights,
        latency=latency,
        place=Location(args.region, args.zone),
        redis_url=args.redis_url,
        freeze_heap_after_index_sync=True,
    )


class _HttpServer(uvicorn.Server):
    """uvicorn without its own signal handling: the gateway's handlers stop HTTP and gRPC
    together (uvicorn's would re-raise the signal and kill the process before gRPC stops)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def serve(args: argparse.Namespace) -> int:
    stop = stop_event_on_signals()
    model_path = resolve_model_path(args.model)
    loading = in_daemon_thread(lambda: load_tokenizer(model_path), "load-tokenizer")
    stopping = asyncio.ensure_future(stop.wait())
    await wait_first(loading, stopping)
    if not loading.done():
        return 0  # stopped while loading: nothing was started yet
    tokenizer = loading.result()
    model_name = args.model_name or default_model_name(model_path)
    use_client_tls(tls_from_args(args))  # before the pools open their channels
    # Whatever started is closed in reverse when serving ends, and also when a later part
    # fails to start (a taken gRPC port), so that no pool's channels or poll tasks outlive it.
    async with contextlib.AsyncExitStack() as started_parts:
        decode_pool = PodPool("decode", args.decode, model_name)
        # With a registry, prefill pods may join at any time: keep a pool to follow them.
        has_prefill = bool(args.prefill or args.redis_url)
        prefill_pool = PodPool("prefill", args.prefill, model_name) if has_prefill else None
        for pool in (decode_pool, prefill_pool):
            if pool is not None:
                # Registered first: a start that fails midway has opened channels already.
                started_parts.push_async_callback(pool.close)
                await pool.start()
        router = Router(decode_pool, prefill_pool, router_settings(args))
        started_parts.push_async_callback(router.close)
        await router.start()
        keys, metrics = load_keys(args), GatewayMetrics()
        admission = _admission(args, decode_pool, prefill_pool, metrics, keys)
        if admission is not None:
            started_parts.push_async_callback(admission.close)
        core = GatewayCore(
            tokenizer,
            model_name,
            decode_pool,
            prefill_pool,
            metrics,
            router,
            migration_policy(args),
            admission,
        )
        gate = Gate(keys, core.metrics.registry, args.redis_url, args.metrics_public)
        started_parts.push_async_callback(gate.close)
        if gate.is_open:
            logger.warning(
                "no --api-keys: serving anyone who reaches it, without tenants or limits"
            )
        grpc_server = await start_server(
            args.host,
            args.grpc_port,
            [SERVICE_NAME],
            lambda server: generate_pb2_grpc.add_GenerationServicer_to_server(
                GenerationServicer(core, gate), server
            ),
        )
        started_parts.push_async_callback(grpc_server.stop)
        code = await _serve_http(args, core, gate, grpc_server, decode_pool, model_name, stopping)
    return code


async def _serve_http(
    args: argparse.Namespace,
    core: GatewayCore,
    gate: Gate,
    grpc_server: GrpcServer,
    decode_pool: PodPool,
    model_name: str,
    stopping: asyncio.Future,
) -> int:
    """HTTP beside the started gRPC server until a stop signal; 1 when HTTP never started."""
    health = asyncio.create_task(_follow_decode_health(grpc_server, decode_pool))
    try:
        return await _run_http(args, core, gate, grpc_server.port, model_name, stopping)
    finally:
        health.cancel()  # also when HTTP fails to start: the gRPC server stops after this


async def _run_http(
    args: argparse.Namespace,
    core: GatewayCore,
    gate: Gate,
    grpc_port: int,
    model_name: str,
    stopping: asyncio.Future,
) -> int:
    http = _HttpServer(
        uvicorn.Config(
            create_app(
                core,
                MessagesSettings(tuple(args.strip_system_line_prefix)),
                gate,
                args.max_request_bytes,
                send_server_timing=args.server_timing,
            ),
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            access_log=False,
            lifespan="off",
            # httptools' parser with a bound on request heads (http_protocol.py), named so the
            # parser measured is the one that runs: uvicorn's "auto" falls back to h11.
            http=BoundedHttpToolsProtocol,
        )
    )
    http.config.load()  # uvicorn's protocol imports, before the freeze
    freeze_startup_heap()  # the tokenizer and the app stay: no full collection walks them
    http_task = asyncio.create_task(http.serve())
    logger.info("serving %s: HTTP on %d, gRPC on %d", model_name, args.port, grpc_port)
    await asyncio.wait([http_task, stopping], return_when=asyncio.FIRST_COMPLETED)
    started = http.started
    http.should_exit = True
    await _quietly(http_task)
    logger.info("stopped")
    return 0 if started else 1


def _admission(
    args: argparse.Namespace,
    decode_pool: PodPool,
    prefill_pool: PodPool | None,
    metrics: GatewayMetrics,
    keys: KeyRing | None,
) -> AdmissionController | None:
    settings = admission_settings(args)
    if settings is None:
        return None
    weight_of = keys.weight_of if keys is not None else None
    return AdmissionController(
        settings, decode_pool, prefill_pool, AdmissionMetrics(metrics.registry), weight_of
    )


async def _follow_decode_health(server: GrpcServer, decode_pool: PodPool) -> None:
    """gRPC health is SERVING while at least one decode pod is available, like /health."""
    serving = None
    while True:
        available = bool(decode_pool.available())
        if available != serving:
            await server.set_serving(available)
            serving = available
        await asyncio.sleep(POLL_INTERVAL_SECONDS)


async def _quietly(task: asyncio.Task) -> None:
    """Awaits uvicorn's serve task; a failed bind makes it exit the process its own way."""
    with contextlib.suppress(SystemExit):
        await task


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.decode and not args.redis_url:
        parser.error("give --decode ADDR (repeatable) or --redis-url to discover pods")
    try:
        router_settings(args)
        migration_policy(args)
        tls_from_args(args)
        load_keys(args)
        admission_settings(args)
        use_redis_password_file(args.redis_password_file)
    except (OSError, ValueError) as error:
        parser.error(str(error))
    setup_logging(args.log_level, "gateway")
    try:
        configure_tracing("splitserve-gateway")  # from OTEL_* (see services/common/tracing.py)
    except ValueError as error:
        parser.error(str(error))
    try:
        return asyncio.run(serve(args))
    except BindError as error:
        logger.error("%s", error)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
