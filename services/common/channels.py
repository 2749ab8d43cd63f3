"""gRPC channels between our own processes, and the keepalive their servers accept.

grpc backs off exponentially (up to minutes) after failed connection attempts. Pods start in
any order and restart, so a gateway that tried a pod while it was still loading would otherwise
keep seeing it down long after it came up; a short cap keeps the view within about a second.

Keepalive: while a call is open, the client pings every KEEPALIVE_TIME_MS and should fail the
call (UNAVAILABLE) when a ping goes unanswered for KEEPALIVE_TIMEOUT_MS, for a peer whose
machine or network went away. Servers must accept pings that often, even on a quiet stream (a
request queued, a long prefill), or they answer with GOAWAY "too_many_pings". On loopback a
SIGSTOPped pod was not detected this way within 60 s (the kernel keeps its socket alive), so the
gateway also breaks off the calls of a pod whose stats polls keep failing (gateway/routing/pods.py).
"""

from __future__ import annotations

import grpc

from splitserve.common.tls import TlsFiles, channel_credentials, channel_options

KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000

RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
CLIENT_KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 0),  # only while a call is open
    ("grpc.http2.max_pings_without_data", 0),  # a quiet stream keeps being pinged
]
SERVER_KEEPALIVE_OPTIONS = [
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
    ("grpc.http2.max_ping_strikes", 0),  # never GOAWAY a client for pinging
]
CHANNEL_OPTIONS = RECONNECT_OPTIONS + CLIENT_KEEPALIVE_OPTIONS


# The TLS files this process dials our other processes with (None: plaintext). One setting per
# process, like its log format: set once by `main` from --tls-*, before any channel opens.
_client_tls: TlsFiles | None = None


def use_client_tls(tls: TlsFiles | None) -> None:
    """Every channel this process opens from now on uses `tls` (None: plaintext)."""
    global _client_tls
    _client_tls = tls


def aio_channel(address: str, tls: TlsFiles | None = None) -> grpc.aio.Channel:
    """A channel to `address`, over TLS with `tls` or else the process's `use_client_tls`."""
    tls = tls or _client_tls
    if tls is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    options = CHANNEL_OPTIONS + channel_options(tls)
    return grpc.aio.secure_channel(address, channel_credentials(tls), options=options)


def sync_channel(address: str, tls: TlsFiles | None = None) -> grpc.Channel:
    tls = tls or _client_tls
    if tls is None:
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    options = CHANNEL_OPTIONS + channel_options(tls)
    return grpc.secure_channel(address, channel_credentials(tls), options=options)
