"""`python -m splitserve.decode`: one decode pod (a gRPC DecodeWorker around the engine).

It listens for KV pages on its --kv-transport from the start; a request that names a prefill
pod and has at least --local-prefill-threshold uncached prompt tokens is prefilled there,
unless --max-remote-prefill-tokens of ours are in flight there already.
"""

from __future__ import annotations

import argparse
import functools

from splitserve.decode.core import DecodePodCore
from splitserve.decode.overload import add_overload_flags, overload_bound
from splitserve.decode.remote_prefill import RemotePrefillSettings
from splitserve.decode.servicer import DecodeWorkerServicer
from splitserve.pod.addresses import reachable_host
from splitserve.pod.main import EngineParts, PodRole, build_pod_parser, run_pod
from splitserve.v1 import worker_pb2, worker_pb2_grpc


def add_decode_flags(group: argparse._ArgumentGroup) -> None:
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
        "--max-remote-prefill-tokens",
        type=int,
        default=defaults.max_remote_tokens,
        metavar="TOKENS",
        help="prefill here while this many uncached prompt tokens are already in flight at the "
        "request's prefill pod (conditional disaggregation; 0 = no limit)",
    )
    group.add_argument(
        "--neighbor-prefill-threads",
        type=int,
        default=defaults.neighbor_prefill_threads,
        metavar="THREADS",
        help="threads each prefill pod computes with when it shares this pod's cores: while one "
        "prefills a prompt of ours, steps here leave it that many (0 = cores of their own)",
    )
    group.add_argument(
        "--kv-host",
        default=None,
        help="the address prefill pods send KV pages to (default: --host, or this machine's)",
    )
    group.add_argument("--kv-port", type=int, default=0, help="KV receiver port (0 = any free)")
    add_overload_flags(group)


def settings_from_args(args: argparse.Namespace) -> RemotePrefillSettings:
    return RemotePrefillSettings(
        args.local_prefill_threshold,
        args.prefill_timeout,
        args.max_remote_prefill_tokens,
        args.neighbor_prefill_threads,
    )


def check_flags(args: argparse.Namespace) -> None:
    """Raises ValueError for flags out of range, before the model loads."""
    settings_from_args(args)
    overload_bound(args)


def build_core(args: argparse.Namespace, parts: EngineParts) -> DecodePodCore:
    kv_host = args.kv_host or reachable_host(args.host)
    return DecodePodCore(
        parts.llm,
        parts.identity,
        parts.transport,
        settings_from_args(args),
        kv_host,
        args.kv_port,
        overload=overload_bound(args),
    )


ROLE = PodRole(
    name="decode",
    description=__doc__,
    default_port=50061,
    service_name=worker_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name,
    add_flags=add_decode_flags,
    check_flags=check_flags,
    build_core=build_core,
    make_servicer=DecodeWorkerServicer,
    add_servicer=worker_pb2_grpc.add_DecodeWorkerServicer_to_server,
)

build_parser = functools.partial(build_pod_parser, ROLE)
main = functools.partial(run_pod, ROLE)


if __name__ == "__main__":
    raise SystemExit(main())
