"""The gateway's admission flags (`splitserve up` passes the same ones) and what they make."""

from __future__ import annotations

import argparse

from splitserve.gateway.admission.controller import AdmissionSettings
from splitserve.gateway.admission.slo import Slo, slo_milliseconds

_DEFAULTS = AdmissionSettings()


def add_admission_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("admission (overload control: docs/overload.md)")
    group.add_argument(
        "--admission",
        action="store_true",
        help="queue requests per tenant and priority past the pods' capacity, and refuse at "
        "once (429/503 with Retry-After) those no pod could serve within their SLO",
    )
    group.add_argument(
        "--slo-ttft-ms",
        type=float,
        default=None,
        metavar="MS",
        help="default time-to-first-token objective (requests: x-slo-ttft-ms; tenants: "
        "slo_ttft_ms in the key file); none = TTFT binds no request by default",
    )
    group.add_argument(
        "--slo-tpot-ms",
        type=float,
        default=None,
        metavar="MS",
        help="default time-per-output-token objective; it also caps each decode pod's rows "
        "so its steps stay within it",
    )
    group.add_argument(
        "--batch-priority",
        type=int,
        default=_DEFAULTS.batch_priority,
        metavar="P",
        help="requests with priority >= P are batch work: queued, never refused on an SLO "
        f"(default {_DEFAULTS.batch_priority})",
    )
    group.add_argument(
        "--queue-timeout",
        type=float,
        default=_DEFAULTS.queue_timeout_s,
        metavar="S",
        help=f"seconds a request may wait in the queue before a 408 "
        f"(default {_DEFAULTS.queue_timeout_s:g})",
    )
    group.add_argument(
        "--max-queued-per-tenant",
        type=int,
        default=_DEFAULTS.max_queued_per_tenant,
        metavar="N",
        help="queued requests per tenant and priority; past it a 429 "
        f"(default {_DEFAULTS.max_queued_per_tenant})",
    )


def admission_settings(args: argparse.Namespace) -> AdmissionSettings | None:
    """None without --admission; raises ValueError naming the flag at fault."""
    slo = Slo(
        None if args.slo_ttft_ms is None else slo_milliseconds("--slo-ttft-ms", args.slo_ttft_ms),
        None if args.slo_tpot_ms is None else slo_milliseconds("--slo-tpot-ms", args.slo_tpot_ms),
    )
    if not args.admission:
        if slo.binds:
            raise ValueError("--slo-ttft-ms and --slo-tpot-ms need --admission")
        return None
    if not args.queue_timeout > 0:
        raise ValueError(f"--queue-timeout must be positive, got {args.queue_timeout}")
    if args.max_queued_per_tenant < 1:
        raise ValueError(
            f"--max-queued-per-tenant must be positive, got {args.max_queued_per_tenant}"
        )
    return AdmissionSettings(
        slo=slo,
        batch_priority=args.batch_priority,
        queue_timeout_s=args.queue_timeout,
        max_queued_per_tenant=args.max_queued_per_tenant,
    )


def admission_argv(args: argparse.Namespace) -> list[str]:
    """The admission flags as given, for a gateway started by `splitserve up`."""
    if not args.admission:
        return []
    argv = ["--admission", "--batch-priority", str(args.batch_priority)]
    argv += ["--queue-timeout", str(args.queue_timeout)]
    argv += ["--max-queued-per-tenant", str(args.max_queued_per_tenant)]
    for flag, value in (("--slo-ttft-ms", args.slo_ttft_ms), ("--slo-tpot-ms", args.slo_tpot_ms)):
        if value is not None:
            argv += [flag, str(value)]
    return argv
