"""KV transport configuration: which backend, its timeouts, and the UCX tuning that makes
same-host transfers use shared memory instead of TCP loopback (docs/benchmarks.md has the
measurements behind each default)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

BACKENDS = ("ucx", "tcp")
UCX_PROGRESS_MODES = ("thread", "thread-polling", "polling", "blocking")

# Passed to UCX as if they were UCX_* environment variables; a UCX_* variable that is set wins.
DEFAULT_UCX_OPTIONS: Mapping[str, str] = MappingProxyType(
    {
        # Listener endpoints always ask for peer-failure error handling, and UCX only gives such
        # endpoints transports that claim it. By default posix/sysv shared memory do not, which
        # leaves tcp over loopback (~0.4 GB/s). This makes them claim it.
        "MM_ERROR_HANDLING": "y",
        # Zero-copy rendezvous over CMA (process_vm_readv, one copy, ~12 GB/s here) is likewise
        # withheld from error-handling endpoints unless the memory domain claims invalidation.
        # UCX marks this claim experimental: it cannot revoke a peer's access to registered
        # memory. Safe here because of RNDV_SCHEME below and because a sender keeps its buffer
        # referenced until the transfer finishes or its connection is aborted.
        "CMA_MEMORY_INVALIDATE": "y",
        # The receiver pulls (get): a remote process never writes into our KV blocks, so a
        # transfer the receiver gave up on cannot land in blocks already handed to another
        # request. On tcp this also picks eager fragments, which measured faster than rendezvous.
        "RNDV_SCHEME": "get_zcopy",
    }
)


@dataclass(frozen=True)
class KVTransferConfig:
    backend: str = "ucx"  # "ucx" | "tcp"
    # How long an arriving offer waits for the decode side to post its receive.
    offer_wait_s: float = 10.0
    # Opening a connection to a peer (part of, not added to, a send's timeout).
    connect_timeout_s: float = 5.0
    # "thread": a UCX progress thread that sleeps when idle, completions delivered as asyncio
    # futures. The default: the engine needs the cores, and the spinning modes ("thread-polling"
    # spins the progress thread, "polling" the event loop; ucxx 0.52's "blocking" also ends up
    # spinning after the first message) are faster on an idle machine but collapsed from ~5 to
    # ~1 GB/s when other processes loaded the cores (docs/benchmarks.md).
    ucx_progress_mode: str = "thread"
    ucx_options: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_UCX_OPTIONS))
    # Per-deployment secret both ends of a TCP connection prove on connect (peer_auth.py);
    # None = anyone who reaches the port may connect. Kept out of repr: config gets logged.
    auth_secret: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.offer_wait_s <= 0:
            raise ValueError(f"offer_wait_s must be > 0, got {self.offer_wait_s}")
        if self.connect_timeout_s <= 0:
            raise ValueError(f"connect_timeout_s must be > 0, got {self.connect_timeout_s}")
        if self.auth_secret is not None and self.backend != "tcp":
            raise ValueError(
                "auth_secret needs backend 'tcp': UCX connections are not authenticated, keep "
                "them on the pod network behind a NetworkPolicy (docs/security.md)"
            )
        if self.ucx_progress_mode not in UCX_PROGRESS_MODES:
            raise ValueError(
                f"ucx_progress_mode must be one of {UCX_PROGRESS_MODES}, "
                f"got {self.ucx_progress_mode!r}"
            )
