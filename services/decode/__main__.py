"""`python -m services.decode`: one decode pod (a gRPC DecodeWorker around the engine).

It listens for KV pages on its --kv-transport from the start; a request that names a prefill
pod and has at least --local-prefill-threshold uncached prompt tokens is prefilled there.
"""

from __future__ import annotations

import argparse
import asyncio

from splitserve.v1 import worker_pb2, worker_pb2_grpc

from services.common.flags import engine_options, setup_logging
from services.common.model_files import default_model_name, resolve_model_path
from services.common.pod import WorkerIdentity, add_pod_flags, reachable_host, serve_pod, worker_id
from services.common.registry_publisher import pod_place
from services.decode.remote_prefill import RemotePrefillSettings
from services.decode.servicer import DecodeWorkerServicer
from services.decode.worker import DecodeWorkerCore

DEFAULT_PORT = 50061
SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m services.decode", description=__doc__)
    add_pod_flags(parser, DEFAULT_PORT)
    group = parser.add_argument_group("disaggregation")
    defaults = RemotePrefillSettings()
    group.add_argument(
        "--local-prefill-threshold",
        type=int,
        default=defaults.local_prefill_threshold,
        metavar="TOKENS",
        help="prefill here when fewer prompt tokens than this are uncached on this pod",
    )
    group.add_argument(
        "--prefill-timeout",
        type=float,
        default=defaults.timeout_s,
        metavar="SECONDS",
        help="a remote prefill (queueing, compute, KV transfer) slower than this falls back",
    )
    group.add_argument(
        "--kv-host",
        default=None,
        help="the address prefill pods send KV pages to (default: --host, or this machine's)",
    )
    group.add_argument("--kv-port", type=int, default=0, help="KV receiver port (0 = any free)")
    return parser


def settings_from_args(args: argparse.Namespace) -> RemotePrefillSettings:
    return RemotePrefillSettings(args.local_prefill_threshold, args.prefill_timeout)


def build_core(args: argparse.Namespace) -> DecodeWorkerCore:
    # torch, ucxx: only once the server answers health checks
    from shared.async_llm import AsyncLLM
    from shared.kv_transfer import create_kv_transport

    settings = settings_from_args(args)
    transport = create_kv_transport(args.kv_transport)
    model_path = resolve_model_path(args.model)
    llm = AsyncLLM(model_path, **engine_options(args))
    place = pod_place(args)
    identity = WorkerIdentity(
        worker_id=worker_id(args),
        role="decode",
        model_name=args.model_name or default_model_name(model_path),
        kv_transport=args.kv_transport,
        region=place.region,
        zone=place.zone,
    )
    kv_host = args.kv_host or reachable_host(args.host)
    return DecodeWorkerCore(llm, identity, transport, settings, kv_host, args.kv_port)


async def serve(args: argparse.Namespace) -> None:
    servicer = DecodeWorkerServicer()
    await serve_pod(
        args,
        SERVICE_NAME,
        servicer,
        lambda server: worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server),
        lambda: build_core(args),
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings_from_args(args)
    except ValueError as error:
        parser.error(str(error))
    setup_logging(args.log_level, args.worker_id or "decode")
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
