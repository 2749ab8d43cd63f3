"""`python -m splitserve.prefill`: one prefill pod (a gRPC PrefillWorker around the engine).

Every Prefill call computes a prompt (the engine batches concurrent ones with chunked prefill),
sends the KV pages of the blocks the decode pod asked for over --kv-transport, and answers with
the first token.
"""

from __future__ import annotations

import argparse
import functools
import os

from splitserve.pod.main import EngineParts, PodRole, build_pod_parser, run_pod
from splitserve.prefill.core import PrefillPodCore, PrefillSettings
from splitserve.prefill.servicer import PrefillWorkerServicer
from splitserve.v1 import worker_pb2, worker_pb2_grpc

# Turns the KV checksum on without a flag (a debug switch for deployed pods).
CHECKSUM_ENV = "SPLITSERVE_KV_CHECKSUM"


def add_prefill_flags(group: argparse._ArgumentGroup) -> None:
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


def settings_from_args(args: argparse.Namespace) -> PrefillSettings:
    return PrefillSettings(checksum=args.kv_checksum, transfer_timeout_s=args.kv_transfer_timeout)


def build_core(args: argparse.Namespace, parts: EngineParts) -> PrefillPodCore:
    return PrefillPodCore(parts.llm, parts.identity, parts.transport, settings_from_args(args))


ROLE = PodRole(
    name="prefill",
    description=__doc__,
    default_port=50071,
    service_name=worker_pb2.DESCRIPTOR.services_by_name["PrefillWorker"].full_name,
    add_flags=add_prefill_flags,
    check_flags=settings_from_args,
    build_core=build_core,
    make_servicer=PrefillWorkerServicer,
    add_servicer=worker_pb2_grpc.add_PrefillWorkerServicer_to_server,
)

build_parser = functools.partial(build_pod_parser, ROLE)
main = functools.partial(run_pod, ROLE)


if __name__ == "__main__":
    raise SystemExit(main())
