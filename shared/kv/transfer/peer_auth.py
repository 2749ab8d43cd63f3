"""Mutual proof of a per-deployment secret when a KV connection opens (TCP backend).

Both ends hold the same secret (the chart mounts it from a Secret; `--kv-secret-file`). Fixed
size raw bytes, so nothing from an unproven peer is parsed:

    sender (client)                              receiver (server)
                                ◀───────         nonce_s (32 random bytes)
    nonce_c, HMAC(secret, "client" | nonce_s | nonce_c)  ───────▶   checks it, or closes
                                ◀───────         HMAC(secret, "server" | nonce_s | nonce_c)
    checks it, or closes

A peer without the secret never gets a payload in or out: the receiver proves itself too, so a
sender does not push pages to an impostor. Fresh nonces on both sides make a recorded exchange
useless for another connection. Both ends then derive the connection's own key,
HMAC(secret, "session" | nonce_s | nonce_c), with which every transfer on it is MACed
(`transfer_mac`, protocol.py): pages rewritten on the pod network are refused, not stored.
The bytes are not encrypted (docs/security.md says what is open).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path

from cryptography.hazmat.primitives.poly1305 import Poly1305

NONCE_BYTES = 32
_DIGEST_BYTES = hashlib.sha256().digest_size
_CLIENT = b"splitserve-kv/1 client"
_SERVER = b"splitserve-kv/1 server"
_SESSION = b"splitserve-kv/1 session"
_TRANSFER = b"splitserve-kv/1 transfer"
MIN_SECRET_BYTES = 16

Send = Callable[[bytes], Awaitable[None]]
RecvExactly = Callable[[int], Awaitable[bytes]]


class PeerAuthError(Exception):
    """The peer did not prove the secret."""


def read_secret(path: str) -> bytes:
    """The secret in `path`, surrounding whitespace stripped; ValueError if it is too short."""
    secret = Path(path).read_bytes().strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"KV secret in {path} has {len(secret)} bytes; at least {MIN_SECRET_BYTES} needed "
            "(e.g. `head -c 32 /dev/urandom | base64`)"
        )
    return secret


def _proof(secret: bytes, role: bytes, nonce_s: bytes, nonce_c: bytes) -> bytes:
    return hmac.digest(secret, role + nonce_s + nonce_c, "sha256")


def transfer_mac(
    session_key: bytes, sequence: int, header: bytes, payload: memoryview | bytes
) -> str:
    """The MAC of one transfer on a connection (hex): Poly1305 over its descriptor and its
    payload, under a one-time key HMAC(session key, "transfer" | sequence) that only this
    transfer on this connection uses (Poly1305 is secure for one message per key, and the
    sequence also stops a transfer from being replayed or reordered on the connection).
    Poly1305 rather than HMAC-SHA256 over the pages: 4-6 GB/s against 1.0 on the development
    machine over a buffer in cache (64 MiB, `cryptography`'s OpenSSL; about 2 GB/s on a
    transfer's fresh pages), and it runs twice per transfer, once per end."""
    one_time_key = hmac.digest(session_key, _TRANSFER + sequence.to_bytes(8, "big"), "sha256")
    mac = Poly1305(one_time_key)
    mac.update(header)
    mac.update(payload)
    return mac.finalize().hex()


def macs_equal(expected: str, received: object) -> bool:
    return isinstance(received, str) and hmac.compare_digest(expected, received)


def _session_key(secret: bytes, nonce_s: bytes, nonce_c: bytes) -> bytes:
    return _proof(secret, _SESSION, nonce_s, nonce_c)


async def prove_to_server(secret: bytes, send: Send, recv_exactly: RecvExactly) -> bytes:
    """The connecting side; returns the connection's session key. Raises PeerAuthError when
    the server's proof is wrong."""
    nonce_s = await recv_exactly(NONCE_BYTES)
    nonce_c = secrets.token_bytes(NONCE_BYTES)
    await send(nonce_c + _proof(secret, _CLIENT, nonce_s, nonce_c))
    answer = await recv_exactly(_DIGEST_BYTES)
    if not hmac.compare_digest(answer, _proof(secret, _SERVER, nonce_s, nonce_c)):
        raise PeerAuthError("the receiver does not hold this deployment's KV secret")
    return _session_key(secret, nonce_s, nonce_c)


async def check_client(secret: bytes, send: Send, recv_exactly: RecvExactly) -> bytes:
    """The accepting side; returns the connection's session key. Raises PeerAuthError when
    the client's proof is wrong; the caller closes the connection then, having answered
    nothing."""
    nonce_s = secrets.token_bytes(NONCE_BYTES)
    await send(nonce_s)
    reply = await recv_exactly(NONCE_BYTES + _DIGEST_BYTES)
    nonce_c, proof = reply[:NONCE_BYTES], reply[NONCE_BYTES:]
    if not hmac.compare_digest(proof, _proof(secret, _CLIENT, nonce_s, nonce_c)):
        raise PeerAuthError("the sender does not hold this deployment's KV secret")
    await send(_proof(secret, _SERVER, nonce_s, nonce_c))
    return _session_key(secret, nonce_s, nonce_c)
