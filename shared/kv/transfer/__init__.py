"""KV page transport between the prefill and decode pods.

- `base`: the contract: `KVTransferDescriptor`, `KVTransferError`, `KVReceiver`, `KVSender`,
  `KVTransport`.
- `config`: `KVTransferConfig` (backend, timeouts, UCX tuning).
- `protocol`: offer / ready / payload / done over any `Channel`; shared by both backends.
- `ucx`: ucxx backend (`ucx://host:port`); `tcp`: asyncio sockets (`tcp://host:port`).

Packing pages out of a KV cache and into it is the engine's (`splitserve.engine.kv.disaggregation`).
`create_kv_transport` picks the backend; the ucx module (and ucxx) is imported only when asked
for, so the tcp backend works where ucxx is not installed.
"""

from __future__ import annotations

from splitserve.engine.kv.transfer.base import (
    KVReceiver,
    KVSender,
    KVTransferDescriptor,
    KVTransferError,
    KVTransport,
)
from splitserve.engine.kv.transfer.config import KVTransferConfig
from splitserve.engine.kv.transfer.tcp import TcpTransport

__all__ = [
    "KVReceiver",
    "KVSender",
    "KVTransferConfig",
    "KVTransferDescriptor",
    "KVTransferError",
    "KVTransport",
    "create_kv_transport",
]


def create_kv_transport(config: KVTransferConfig | str = "ucx") -> KVTransport:
    """The transport for `config.backend` ("ucx" | "tcp"); a bare string is a default config
    with that backend."""
    if isinstance(config, str):
        config = KVTransferConfig(backend=config)
    if config.backend == "tcp":
        return TcpTransport(config)
    # An optional dependency: ucxx is imported only when asked for (module docstring).
    from splitserve.engine.kv.transfer.ucx import UcxTransport

    return UcxTransport(config)
