"""gRPC server bootstrap for every service: the standard `grpc.health.v1` health service, one
interceptor that maps bad input to INVALID_ARGUMENT, and a clean stop on SIGTERM / Ctrl-C."""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from splitserve.common.channels import SERVER_KEEPALIVE_OPTIONS
from splitserve.common.tls import TlsFiles, server_credentials

# grpc shares a port between servers by default (SO_REUSEPORT): a second process started on a
# port that is taken would bind it too, and the kernel would split the connections between
# the two. Health checks and calls meant for one pod then reach another (the likeliest reading
# of a CI run whose decode pod never turned healthy beside a prefill pod). A taken port must be
# an error at start.
SERVER_OPTIONS = [*SERVER_KEEPALIVE_OPTIONS, ("grpc.so_reuseport", 0)]

logger = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# Seconds in-flight calls get to finish when the server stops.
STOP_GRACE_SECONDS = 2.0


class StatusError(Exception):
    """A failure that is not the caller's input (no pod, a pod failed): answered with
    the status it carries."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code

    @property
    def trailers(self) -> tuple[tuple[str, str], ...]:
        """Trailing metadata sent with the status (a refusal's retry-after)."""
        return ()


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """ValueError (bad user input, by house rule) -> INVALID_ARGUMENT with its message;
    StatusError -> its own status.

    Anything else keeps grpc's default (UNKNOWN, logged): a bug must not look like bad input.
    """

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _guard_unary(handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _guard_stream(handler.unary_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler


def _guard_unary(behavior):
    async def guarded(request, context):
        try:
            return await behavior(request, context)
        except ValueError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except StatusError as error:
            await context.abort(error.code, str(error), error.trailers)

    return guarded


def _guard_stream(behavior):
    if not inspect.isasyncgenfunction(behavior):
        # A handler that writes through context.write (health's Watch) returns a coroutine.
        return _guard_unary(behavior)

    async def guarded(request, context):
        try:
            async for response in behavior(request, context):
                yield response
        except ValueError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except StatusError as error:
            await context.abort(error.code, str(error), error.trailers)

    return guarded


@dataclass
class GrpcServer:
    server: grpc.aio.Server
    health: HealthServicer
    port: int  # the bound port (the one asked for, or the one picked for port 0)
    service_names: tuple[str, ...]  # full names, e.g. "splitserve.v1.DecodeWorker"
    # A plaintext server with only grpc.health.v1 beside a TLS one: kubelet's gRPC probes
    # cannot speak TLS. None without TLS (the main port answers them) or when not asked for.
    health_server: grpc.aio.Server | None = None

    async def set_serving(self, serving: bool) -> None:
        """Overall health ("") and every named service together."""
        status = SERVING if serving else NOT_SERVING
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def stop(self, grace_s: float = STOP_GRACE_SECONDS) -> None:
        """Turns NOT_SERVING and refuses new calls at once; calls in flight get `grace_s`
        seconds to finish before they are cancelled."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        if self.health_server is not None:
            await self.health_server.stop(0)


async def start_server(
    host: str,
    port: int,
    service_names: Sequence[str],
    add_servicers,
    tls: TlsFiles | None = None,
    health_port: int = 0,
) -> GrpcServer:
    """Starts a grpc.aio server, NOT_SERVING until `set_serving(True)`; `add_servicers(server)`
    registers the service's own servicers before the server starts. With `tls` the port serves
    TLS only (mutual with a CA); `health_port` > 0 then also serves the health service alone in
    plaintext there, for probes."""
    server = grpc.aio.server(interceptors=[ErrorInterceptor()], options=SERVER_OPTIONS)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    add_servicers(server)
    bound = _bind(server, host, port, tls)
    health_server = None
    if tls is not None and health_port:
        health_server = grpc.aio.server(options=SERVER_OPTIONS)
        health_pb2_grpc.add_HealthServicer_to_server(health, health_server)
        try:
            _bind(health_server, host, health_port, None)
        except BindError:
            await server.stop(None)  # the main port is bound already: free it for a retry
            raise
    grpc_server = GrpcServer(server, health, bound, tuple(service_names), health_server)
    await grpc_server.set_serving(False)
    await server.start()
    if health_server is not None:
        await health_server.start()
    return grpc_server


class BindError(OSError):
    """A server could not listen where it was told to (the port is taken, the host is not this
    machine's, or grpc refused the TLS files): the process should say so and exit."""


def _bind(server: grpc.aio.Server, host: str, port: int, tls: TlsFiles | None) -> int:
    address = f"{host}:{port}"
    credentials = None if tls is None else server_credentials(tls)  # its own errors, not ours
    try:
        if credentials is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, credentials)
    except RuntimeError:  # how grpc says the bind failed; its log line above says why
        bound = 0
    if bound == 0:
        raise BindError(
            f"cannot bind gRPC port {address}: another process listens there, the host is not "
            "this machine's, or grpc refused the TLS files (see grpc's message above)"
        )
    return bound


def stop_event_on_signals() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT, so `main` can stop servers and exit 0."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop
