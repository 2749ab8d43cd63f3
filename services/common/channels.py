"""gRPC channels between our own processes.

grpc backs off exponentially (up to minutes) after failed connection attempts. Pods start in
any order and restart, so a gateway that tried a pod while it was still loading would otherwise
keep seeing it down long after it came up; a short cap keeps the view within about a second.
"""

from __future__ import annotations

import grpc

RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def aio_channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=RECONNECT_OPTIONS)


def sync_channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=RECONNECT_OPTIONS)
