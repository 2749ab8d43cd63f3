"""The one entry point of the engine pods: `run_pod(role, argv)` parses the flags every pod takes
plus the role's own, checks them, sets up logging and serves (services/pod/server.py) until
SIGTERM. `python -m splitserve.prefill` and `python -m splitserve.decode` are a `PodRole` each.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from splitserve.common.cli_args import setup_logging
from splitserve.common.grpc_server import BindError
from splitserve.common.model_files import default_model_name, resolve_model_path
from splitserve.common.redis_auth import use_redis_password_file
from splitserve.common.tls import tls_from_args
from splitserve.pod.flags import engine_options, lora_modules
from splitserve.pod.registry_publisher import pod_place
from splitserve.pod.server import PodIdentity, PodServicer, add_pod_flags, pod_id, serve_pod

if TYPE_CHECKING:
    from splitserve.engine.async_llm import AsyncLLM
    from splitserve.engine.kv.transfer import KVTransport
    from splitserve.engine.kv.transfer.config import KVTransferConfig
    from splitserve.pod.core import EnginePodCore

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineParts:
    """What every pod core is built from: the engine, who the pod is, its KV transport."""

    llm: AsyncLLM
    identity: PodIdentity
    transport: KVTransport


CoreT = TypeVar("CoreT", bound="EnginePodCore")


@dataclass(frozen=True)
class PodRole(Generic[CoreT]):
    name: str  # "prefill" | "decode": the role in stats, logs and the registry
    description: str  # the module's docstring, for --help
    default_port: int
    service_name: str  # the gRPC service's full name, e.g. "splitserve.v1.DecodeWorker"
    add_flags: Callable[[argparse._ArgumentGroup], None]  # the role's own flags
    # Raises ValueError for flag values that cannot work (reported as a usage error).
    check_flags: Callable[[argparse.Namespace], object]
    build_core: Callable[[argparse.Namespace, EngineParts], CoreT]
    make_servicer: Callable[[], PodServicer[CoreT]]
    add_servicer: Callable[[PodServicer[CoreT], object], None]  # (servicer, grpc server)


def build_pod_parser(role: PodRole) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"python -m splitserve.{role.name}", description=role.description
    )
    add_pod_flags(parser, role.default_port)
    role.add_flags(parser.add_argument_group("disaggregation"))
    return parser


def run_pod(role: PodRole, argv: list[str] | None = None) -> int:
    parser = build_pod_parser(role)
    args = parser.parse_args(argv)
    try:
        role.check_flags(args)
        tls_from_args(args)
        kv_transfer_config(args)
        use_redis_password_file(args.redis_password_file)
    except (OSError, ValueError) as error:
        parser.error(str(error))
    setup_logging(args.log_level, args.worker_id or role.name)
    if args.nice:
        # Before any thread starts: threads inherit the niceness of the thread creating them.
        os.nice(args.nice)
    try:
        is_engine_lost = asyncio.run(_serve(role, args))
    except BindError as error:
        logger.error("%s", error)
        return 1
    return 1 if is_engine_lost else 0


async def _serve(role: PodRole[CoreT], args: argparse.Namespace) -> bool:
    servicer = role.make_servicer()
    return await serve_pod(
        args,
        role.service_name,
        servicer,
        lambda server: role.add_servicer(servicer, server),
        lambda: role.build_core(args, _engine_parts(role, args)),
    )


def kv_transfer_config(args: argparse.Namespace) -> KVTransferConfig:
    """--kv-transport with --kv-secret-file's secret; ValueError/OSError naming a bad file."""
    # lazy: the engine package, which this module imports only once health checks answer
    from splitserve.engine.kv.transfer.config import KVTransferConfig
    from splitserve.engine.kv.transfer.peer_auth import read_secret

    if args.kv_secret_file is None:
        return KVTransferConfig(backend=args.kv_transport)
    try:
        secret = read_secret(args.kv_secret_file)
        return KVTransferConfig(backend=args.kv_transport, auth_secret=secret)
    except ValueError as error:
        raise ValueError(f"--kv-secret-file: {error}") from None


def _engine_parts(role: PodRole, args: argparse.Namespace) -> EngineParts:
    """Loads the model; runs off the event loop, once the server answers health checks."""
    # lazy: torch (and ucxx), loaded only once the server answers health checks
    from splitserve.engine.async_llm import AsyncLLM
    from splitserve.engine.kv.transfer import create_kv_transport
    from splitserve.environment import log_environment

    transport = create_kv_transport(kv_transfer_config(args))
    model_path = resolve_model_path(args.model)
    llm = AsyncLLM(model_path, **engine_options(args))
    for adapter in lora_modules(args):  # before any request: the engine's thread is idle
        llm.engine.add_lora(adapter)
    log_environment()  # what `splitserve env --json` prints here: the paths this pod runs
    place = pod_place(args)
    identity = PodIdentity(
        pod_id=pod_id(args),
        role=role.name,
        model_name=args.model_name or default_model_name(model_path),
        kv_transport=args.kv_transport,
        region=place.region,
        zone=place.zone,
    )
    return EngineParts(llm, identity, transport)
