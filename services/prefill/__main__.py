"""`python -m services.prefill`: one prefill pod (a gRPC PrefillWorker around the engine).

Every Prefill call computes a prompt (the engine batches concurrent ones with chunked prefill),
sends the KV pages of the blocks the decode pod asked for over --kv-transport, and answers with
the first token.
"""

from __future__ import annotations

import argparse
import asyncio
import os

from splitserve.v1 import worker_pb2, worker_pb2_grpc

from services.common.flags import engine_options, setup_logging
from services.common.model_files import default_model_name, resolve_model_path
from services.common.pod import WorkerIdentity, add_pod_flags, serve_pod, worker_id
from services.common.registry_publisher import pod_place
from services.prefill.servicer import PrefillWorkerServicer
from services.prefill.worker import PrefillSettings, PrefillWorkerCore

DEFAULT_PORT = 50071
SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["PrefillWorker"].full_name
# Turns the KV checksum on without a flag (a debug switch for deployed pods).
CHECKSUM_ENV = "SPLITSERVE_KV_CHECKSUM"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m services.prefill", description=__doc__)
    add_pod_flags(parser, DEFAULT_PORT)
    group = parser.add_argument_group("disaggregation")
    group.add_argument(
        "--kv-checksum",
        action=argparse.BooleanOptionalAction,
        default=os.environ.get(CHECKSUM_ENV, "").lower() in ("1", "true", "yes", "on"),
        help=f"CRC-32 every page buffer; the decode pod checks it (default: ${CHECKSUM_ENV})",
    )
    group.add_argument(
        "--kv-transfer-timeout",
        type=float,
        default=PrefillSettings().transfer_timeout_s,
        metavar="SECONDS",
        help="a KV transfer slower than this fails the prefill (the decode pod falls back)",
    )
    return parser


def settings_from_args(args: argparse.Namespace) -> PrefillSettings:
    return PrefillSettings(checksum=args.kv_checksum, transfer_timeout_s=args.kv_transfer_timeout)


def build_core(args: argparse.Namespace) -> PrefillWorkerCore:
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
        role="prefill",
        model_name=args.model_name or default_model_name(model_path),
        kv_transport=args.kv_transport,
        region=place.region,
        zone=place.zone,
    )
    return PrefillWorkerCore(llm, identity, transport, settings)


async def serve(args: argparse.Namespace) -> None:
    servicer = PrefillWorkerServicer()
    await serve_pod(
        args,
        SERVICE_NAME,
        servicer,
        lambda server: worker_pb2_grpc.add_PrefillWorkerServicer_to_server(servicer, server),
        lambda: build_core(args),
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings_from_args(args)
    except ValueError as error:
        parser.error(str(error))
    setup_logging(args.log_level, args.worker_id or "prefill")
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
