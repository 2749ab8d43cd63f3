"""When a decode stream breaks after output, the sequence moves to another decode pod with the
tokens it has so far (`DecodeRequest.resumed_output_token_ids`); the new pod re-prefills them
(its prefix cache and the router's index make that cheap) and continues, so the client sees one
uninterrupted stream: no token repeated, lost or changed (tests/test_migration.py).

What counts as broken: the call failed with a status a healthy pod does not answer a good
request with (the pod died, was reset, or its connection timed out under gRPC keepalive), the
stream ended without its finish, or no response came for `stall_timeout_s` once output had
started (a pod stopped or wedged). A request the pod refused (INVALID_ARGUMENT and the like) is
never moved: another pod would refuse it too.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import grpc

# Statuses of a call whose pod went away or broke mid-stream.
_BROKEN_STATUSES = {
    grpc.StatusCode.UNAVAILABLE: "unavailable",  # connection refused / reset, keepalive timeout
    grpc.StatusCode.INTERNAL: "reset",  # RST_STREAM, a torn HTTP/2 stream
    grpc.StatusCode.UNKNOWN: "reset",  # a stream cut without a status
    grpc.StatusCode.ABORTED: "aborted",
    grpc.StatusCode.CANCELLED: "reset",  # cancelled by the pod's side (its server stopping)
}


@dataclass(frozen=True)
class MigrationPolicy:
    # Moves of one sequence after output (0 turns migration off).
    max_migrations: int = 2
    # A sequence with more tokens than this is not replayed (its re-prefill would cost more
    # than the client's wait is worth); it ends with an error as before.
    max_replay_tokens: int = 8192
    # No response for this long after output began: the pod counts as stalled.
    stall_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_migrations < 0:
            raise ValueError(f"--max-migrations must be >= 0, got {self.max_migrations}")
        if self.max_replay_tokens < 1:
            raise ValueError(
                f"--max-migration-replay-tokens must be >= 1, got {self.max_replay_tokens}"
            )
        if self.stall_timeout_s <= 0:
            raise ValueError(f"--stream-stall-timeout must be > 0, got {self.stall_timeout_s}")


class Stalled(Exception):
    """No response from the decode pod within the stall timeout."""


class PodDown(Exception):
    """The pod stopped answering its stats polls and the gateway broke the call off."""


def broken_cause(outcome: object, finished: bool) -> str | None:
    """Why a stream that ended with `outcome` (the call's error, a Stalled, or the end of the
    stream) broke: the cause label for metrics, or None if it did not break (or broke in a
    way another pod cannot mend)."""
    if isinstance(outcome, Stalled):
        return "stalled"
    if isinstance(outcome, PodDown):
        return "pod_down"
    if isinstance(outcome, grpc.aio.AioRpcError):
        return _BROKEN_STATUSES.get(outcome.code())
    if isinstance(outcome, Exception):
        return None
    return None if finished else "ended"


def add_migration_flags(parser: argparse.ArgumentParser) -> None:
    defaults = MigrationPolicy()
    group = parser.add_argument_group("fault tolerance")
    group.add_argument(
        "--max-migrations",
        type=int,
        default=defaults.max_migrations,
        help="moves of one sequence to another decode pod after its stream broke mid-way (0: off)",
    )
    group.add_argument(
        "--max-migration-replay-tokens",
        type=int,
        default=defaults.max_replay_tokens,
        help="longest output a migration replays",
    )
    group.add_argument(
        "--stream-stall-timeout",
        type=float,
        default=defaults.stall_timeout_s,
        metavar="SECONDS",
        help="a decode stream silent this long after its first token is moved elsewhere",
    )


def migration_policy(args: argparse.Namespace) -> MigrationPolicy:
    return MigrationPolicy(
        max_migrations=args.max_migrations,
        max_replay_tokens=args.max_migration_replay_tokens,
        stall_timeout_s=args.stream_stall_timeout,
    )
