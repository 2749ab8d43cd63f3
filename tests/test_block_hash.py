"""Block hashes: the canonical encoding, chaining, and agreement across processes."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from splitserve.engine.kv.block_hash import (
    BLOCK_HASH_NUM_BYTES,
    hash_block_tokens,
    hash_full_blocks,
    root_hash,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = "splitserve-v1"
TOKENS = list(range(100, 140))  # 40 tokens: 5 full blocks of 8


def _run_python(code: str, hash_seed: str) -> str:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return result.stdout


def test_encoding_is_the_documented_canonical_one() -> None:
    # Rebuilt here from the module docstring, so a change of encoding cannot go unnoticed:
    # pods and gateways of different versions would stop agreeing.
    def u32(value: int) -> bytes:
        return struct.pack("<I", value)

    ns = NAMESPACE.encode()
    root = hashlib.sha256(b"ssroot1" + u32(len(ns)) + ns).digest()[:16]
    tokens = [7, 70000, 2**32 - 1]
    keys = ("lora:a", "é")
    body = b"ssblk1" + root + u32(3) + b"".join(u32(t) for t in tokens) + u32(2)
    body += u32(6) + b"lora:a" + u32(2) + "é".encode()
    expected = hashlib.sha256(body).digest()[:16]

    assert root_hash(NAMESPACE) == root
    assert hash_block_tokens(root_hash(NAMESPACE), tokens, keys) == expected
    assert len(expected) == BLOCK_HASH_NUM_BYTES
    assert hash_block_tokens(None, tokens) == hash_block_tokens(root_hash(""), tokens)


def test_hashes_agree_with_a_process_with_another_hash_seed() -> None:
    code = (
        "import json\n"
        "from splitserve.engine.kv.block_hash import hash_full_blocks, root_hash\n"
        f"hashes = hash_full_blocks({TOKENS!r}, 8, {NAMESPACE!r}, ('lora:x',))\n"
        f"print(json.dumps([root_hash({NAMESPACE!r}).hex()] + [h.hex() for h in hashes]))\n"
    )
    local = [root_hash(NAMESPACE).hex()]
    local += [h.hex() for h in hash_full_blocks(TOKENS, 8, NAMESPACE, ("lora:x",))]
    for seed in ("0", "12345"):
        assert json.loads(_run_python(code, seed)) == local


def test_block_hash_modules_do_not_import_torch() -> None:
    # The gateway imports the hash function and must not pay for (or need) torch.
    code = (
        "import sys\n"
        "import splitserve.engine.kv.block_hash, splitserve.engine.kv.block\n"
        "import splitserve.engine.kv.events\n"
        "import splitserve.engine.kv.block_pool, splitserve.engine.kv.manager\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    assert _run_python(code, "0").strip() == "[]"


def test_chain_has_one_hash_per_full_block_and_links_parents() -> None:
    hashes = hash_full_blocks(TOKENS + [1, 2, 3], 8, NAMESPACE)  # 43 tokens: partial tail
    assert len(hashes) == 5
    assert len(set(hashes)) == 5
    parent = root_hash(NAMESPACE)
    for index, block_hash in enumerate(hashes):
        assert block_hash == hash_block_tokens(parent, TOKENS[index * 8 : index * 8 + 8])
        parent = block_hash


def test_changing_one_token_changes_that_block_and_all_later_ones_only() -> None:
    base = hash_full_blocks(TOKENS, 8, NAMESPACE)
    changed_tokens = list(TOKENS)
    changed_tokens[19] += 1  # inside block 2
    changed = hash_full_blocks(changed_tokens, 8, NAMESPACE)
    assert changed[:2] == base[:2]
    assert all(a != b for a, b in zip(changed[2:], base[2:]))


def test_extra_keys_and_namespace_change_every_hash() -> None:
    base = hash_full_blocks(TOKENS, 8, NAMESPACE)
    with_keys = hash_full_blocks(TOKENS, 8, NAMESPACE, ("lora:a",))
    other_keys = hash_full_blocks(TOKENS, 8, NAMESPACE, ("lora:b",))
    other_namespace = hash_full_blocks(TOKENS, 8, "another-model")
    for variant in (with_keys, other_keys, other_namespace):
        assert all(a != b for a, b in zip(variant, base))
    assert set(with_keys).isdisjoint(other_keys)
    # Keys mix into the first block only; later blocks inherit them through the parent.
    assert with_keys[1] == hash_block_tokens(with_keys[0], TOKENS[8:16])
    # Length prefixes: splitting the same characters differently is a different key set.
    assert hash_block_tokens(None, [1], ("ab", "c")) != hash_block_tokens(None, [1], ("a", "bc"))


def test_start_hashes_extend_the_chain_without_recomputing() -> None:
    full = hash_full_blocks(TOKENS, 8, NAMESPACE, ("k",))
    assert hash_full_blocks(TOKENS, 8, NAMESPACE, ("k",), start_hashes=full[:2]) == full[2:]
    assert hash_full_blocks(TOKENS, 8, NAMESPACE, ("k",), start_hashes=full) == []
    # The start chain is trusted, not recomputed: a fake parent changes every new hash.
    fake = [bytes(16), bytes(16)]
    extended = hash_full_blocks(TOKENS, 8, NAMESPACE, ("k",), start_hashes=fake)
    assert extended[0] == hash_block_tokens(bytes(16), TOKENS[16:24])


def test_bad_input_raises_value_error_naming_the_parameter() -> None:
    with pytest.raises(ValueError, match="block_size"):
        hash_full_blocks(TOKENS, 0, NAMESPACE)
    with pytest.raises(ValueError, match="start_hashes"):
        hash_full_blocks(TOKENS[:8], 8, NAMESPACE, start_hashes=[bytes(16), bytes(16)])
    with pytest.raises(ValueError, match="token_ids"):
        hash_block_tokens(None, [1, -1])
    with pytest.raises(ValueError, match="token_ids"):
        hash_block_tokens(None, [2**32])
    with pytest.raises(ValueError, match="parent"):
        hash_block_tokens(b"short", [1])
    with pytest.raises(ValueError, match="extra_keys"):
        hash_block_tokens(None, [1], (b"bytes",))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="namespace"):
        root_hash(None)  # type: ignore[arg-type]
