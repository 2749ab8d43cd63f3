"""The addresses a pod gives its peers: what they dial for its gRPC (the registry's record) and
for its KV pages (a decode pod's --kv-host)."""

from __future__ import annotations

import socket


def reachable_host(host: str) -> str:
    """An address peers can dial for a pod bound to `host`: a wildcard bind ("0.0.0.0") is
    not one, so the machine's own address stands in for it."""
    if host not in ("", "0.0.0.0", "::"):
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
