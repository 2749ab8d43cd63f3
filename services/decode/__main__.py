"""`python -m services.decode`: one decode pod (a gRPC DecodeWorker around the engine).

Today it prefills every prompt itself; the remote-prefill path slots into
`services.decode.worker.DecodeWorkerCore._prefill`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket

from splitserve.v1 import worker_pb2, worker_pb2_grpc

from services.common.background import in_daemon_thread
from services.common.flags import add_engine_flags, add_server_flags, engine_options, setup_logging
from services.common.grpc_server import start_server, stop_event_on_signals
from services.common.model_files import default_model_name, resolve_model_path
from services.decode.servicer import DecodeWorkerServicer
from services.decode.worker import DecodeWorkerCore, WorkerIdentity

logger = logging.getLogger("services.decode")

DEFAULT_PORT = 50061
SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m services.decode", description=__doc__)
    add_server_flags(parser, DEFAULT_PORT)
    parser.add_argument("--worker-id", default=None, help="name in stats (default: host:port)")
    parser.add_argument(
        "--model-name", default=None, help="served model name (default: the model file's name)"
    )
    parser.add_argument(
        "--kv-transport", default="tcp", choices=["ucx", "tcp"], help="KV page transport"
    )
    add_engine_flags(parser)
    return parser


def build_core(args: argparse.Namespace) -> DecodeWorkerCore:
    from shared.async_llm import AsyncLLM  # torch: only once the server answers health checks

    model_path = resolve_model_path(args.model)
    llm = AsyncLLM(model_path, **engine_options(args))
    identity = WorkerIdentity(
        worker_id=args.worker_id or f"{socket.gethostname()}:{args.port}",
        role="decode",
        model_name=args.model_name or default_model_name(model_path),
        kv_transport=args.kv_transport,
    )
    return DecodeWorkerCore(llm, identity)


async def serve(args: argparse.Namespace) -> None:
    servicer = DecodeWorkerServicer()
    server = await start_server(
        args.host,
        args.port,
        [SERVICE_NAME],
        lambda grpc_server: worker_pb2_grpc.add_DecodeWorkerServicer_to_server(
            servicer, grpc_server
        ),
    )
    logger.info("gRPC on port %d; loading the model", server.port)
    stop = stop_event_on_signals()
    loading = in_daemon_thread(lambda: build_core(args), "load-model")
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait([loading, stopping], return_when=asyncio.FIRST_COMPLETED)
    if loading.done():
        servicer.core = loading.result()
        await server.set_serving(True)
        logger.info(
            "serving %s as %s", servicer.core.identity.model_name, servicer.core.identity.worker_id
        )
        await stopping
    logger.info("stopping")
    await server.stop()
    if servicer.core is not None:
        servicer.core.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level, args.worker_id or "decode")
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
