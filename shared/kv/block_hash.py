"""Chained prefix hashes of full KV blocks, identical in every process that computes them.

The gateway hashes a prompt to ask Redis which workers hold its prefix; prefill and decode pods
hash the same tokens to find and publish their cached blocks. All three must agree bit for bit,
so the hash is sha256 over a canonical byte encoding: no Python `hash()` (salted per process),
no pickle (version dependent). This module imports no torch: the gateway loads no model.

Block i's hash covers its own tokens and, through its parent's hash, every token before it:

    root(namespace) <- h0 = H(root, block 0 tokens, extra keys) <- h1 = H(h0, block 1 tokens) ...

Canonical encoding of one block (all integers little-endian uint32):

    b"ssblk1" | parent (16 bytes) | num_tokens | token ids... | num_keys | (len, utf-8 bytes)...
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NewType

# 16 bytes = 128 bits: collisions stay out of reach for any cache size, and keys stay short in
# Redis and on the wire.
BLOCK_HASH_NUM_BYTES = 16

BlockHash = NewType("BlockHash", bytes)

# Domain tags keep a root and a block hash from ever sharing an encoding; bump the digit when
# the encoding changes so old and new pods never match each other's entries.
_BLOCK_TAG = b"ssblk1"
_ROOT_TAG = b"ssroot1"
_UINT32 = struct.Struct("<I")


def root_hash(namespace: str) -> BlockHash:
    """The parent of a sequence's first block; a namespace per model keeps caches apart."""
    if not isinstance(namespace, str):
        raise ValueError(f"namespace must be a str, got {type(namespace).__name__}")
    encoded = namespace.encode("utf-8")
    digest = hashlib.sha256(_ROOT_TAG + _UINT32.pack(len(encoded)) + encoded).digest()
    return BlockHash(digest[:BLOCK_HASH_NUM_BYTES])


def hash_block_tokens(
    parent: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple[str, ...] = (),
) -> BlockHash:
    """Hash of one block given its parent's hash; `parent=None` means `root_hash("")`."""
    if parent is None:
        parent = _EMPTY_NAMESPACE_ROOT
    elif len(parent) != BLOCK_HASH_NUM_BYTES:
        raise ValueError(f"parent must be {BLOCK_HASH_NUM_BYTES} bytes, got {len(parent)}")
    hasher = hashlib.sha256(_BLOCK_TAG)
    hasher.update(parent)
    hasher.update(_pack_token_ids(token_ids))
    hasher.update(_pack_extra_keys(extra_keys))
    return BlockHash(hasher.digest()[:BLOCK_HASH_NUM_BYTES])


def hash_full_blocks(
    token_ids: Sequence[int],
    block_size: int,
    namespace: str,
    extra_keys: tuple[str, ...] = (),
    start_hashes: Sequence[BlockHash] = (),
) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids` that come after `start_hashes`.

    `start_hashes` is a chain already computed for a prefix of the same tokens (with the same
    namespace and extra keys); it is extended, never recomputed, so `[*start_hashes, *result]`
    is the chain of every full block. A trailing partial block gets no hash. `extra_keys`
    identify the whole sequence (a LoRA, an image) and mix into the first block only: every
    later block inherits them through its parent.
    """
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    num_full_blocks = len(token_ids) // block_size
    first = len(start_hashes)
    if first > num_full_blocks:
        raise ValueError(
            f"start_hashes has {first} hashes but token_ids holds only "
            f"{num_full_blocks} full blocks"
        )
    parent = start_hashes[-1] if first else root_hash(namespace)
    hashes: list[BlockHash] = []
    for index in range(first, num_full_blocks):
        start = index * block_size
        keys = extra_keys if index == 0 else ()
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], keys)
        hashes.append(parent)
    return hashes


def _pack_token_ids(token_ids: Sequence[int]) -> bytes:
    try:
        return _UINT32.pack(len(token_ids)) + struct.pack(f"<{len(token_ids)}I", *token_ids)
    except struct.error as exc:
        raise ValueError(f"token_ids must be ints in [0, 2**32): {exc}") from exc


def _pack_extra_keys(extra_keys: tuple[str, ...]) -> bytes:
    # Length prefixes make ("ab", "c") and ("a", "bc") encode differently.
    parts = [_UINT32.pack(len(extra_keys))]
    for key in extra_keys:
        if not isinstance(key, str):
            raise ValueError(f"extra_keys must be strs, got {type(key).__name__}")
        encoded = key.encode("utf-8")
        parts.append(_UINT32.pack(len(encoded)))
        parts.append(encoded)
    return b"".join(parts)


_EMPTY_NAMESPACE_ROOT = root_hash("")


def cache_salt_keys(cache_salt: str | None) -> tuple[str, ...]:
    """The extra hash keys of a tenant's salt: requests share cached blocks only with requests
    of the same salt (the engine and the router hash alike)."""
    return () if cache_salt is None else (f"cache_salt:{cache_salt}",)


# A salt the gateway set from a key's tenant: "tenant:<name>" or "tenant:<name>/<client salt>".
# Tenant names hold no "/" (services/gateway/auth/keys.py), so the first "/" ends the name and
# no client salt can spell another tenant's salt.
TENANT_SALT_PREFIX = "tenant:"


def tenant_cache_salt(tenant: str, client_salt: str | None) -> str:
    """The salt the server sets for a tenant's request: the client's salt only narrows it."""
    salt = f"{TENANT_SALT_PREFIX}{tenant}"
    return salt if client_salt is None else f"{salt}/{client_salt}"


def quota_tenant(cache_salt: str | None) -> str:
    """Whom a salted block's cache quota counts against: the tenant of a server-set salt (all
    its client salts together), else the salt itself ("" for unsalted prompts)."""
    if cache_salt is None:
        return ""
    if cache_salt.startswith(TENANT_SALT_PREFIX):
        return cache_salt.split("/", 1)[0]
    return cache_salt


def salted_hash(block_hash: BlockHash, salt: bytes) -> BlockHash:
    """`block_hash` keyed by `salt`: the hash a second layer group of one pool caches the same
    tokens under (shared/kv/groups.py), so its blocks never answer another group's lookup."""
    digest = hashlib.blake2b(block_hash, key=salt, digest_size=BLOCK_HASH_NUM_BYTES).digest()
    return BlockHash(digest)
