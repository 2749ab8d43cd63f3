"""The prefix-index lookup as it was before issue 39 (a SISMEMBER per cached block of every
pod, the prompt's hashes sent once per pod), kept only so benchmarks.scale can show the
Redis lookup's work beside it (registry_schema.LOOKUP_SCRIPT replaces it)."""

from __future__ import annotations

from collections.abc import Sequence

from splitserve.common.registry_schema import CachedPrefix
from splitserve.engine.kv.block_hash import BLOCK_HASH_NUM_BYTES
from splitserve.engine.kv.tiers import Tier

# KEYS: each pod's block SETs, one per tier, fastest first (len(Tier) keys per pod); ARGV[i]:
# the prompt's block hashes for pod i, concatenated (16 bytes each). Returns, per pod and tier,
# how many of the leading hashes held anywhere on the pod are held in that tier (the fastest
# one holding it): the run ends at the first hash no tier holds. Server side, so a 4k-token
# prompt costs one command with a few arguments instead of thousands.
SCAN_LOOKUP_SCRIPT = """
local tiers = #KEYS / #ARGV
local counts = {}
for i, blob in ipairs(ARGV) do
  local found = {}
  for t = 1, tiers do found[t] = 0 end
  for start = 1, #blob, 16 do
    local hash = string.sub(blob, start, start + 15)
    local where = 0
    for t = 1, tiers do
      if redis.call('SISMEMBER', KEYS[(i - 1) * tiers + t], hash) == 1 then
        where = t
        break
      end
    end
    if where == 0 then break end
    found[where] = found[where] + 1
  end
  for t = 1, tiers do counts[(i - 1) * tiers + t] = found[t] end
end
return counts
"""


async def cached_prefixes(
    client, queries: Sequence[tuple[tuple[str, ...], Sequence[bytes]]]
) -> list[CachedPrefix]:
    """For each (the pod's tier block SETs from `tier_blocks`, the prompt's chained block
    hashes): the leading hashes the pod holds in any tier, counted by tier. One round trip.

    A pod evicts tail blocks before their parents, and writes them down in that order, so its
    hits form a prefix; the first hash no tier holds ends the count."""
    if not queries:
        return []
    assert all(len(h) == BLOCK_HASH_NUM_BYTES for _, hashes in queries for h in hashes), (
        "block hashes are 16 bytes"
    )
    assert all(len(tier_keys) == len(Tier) for tier_keys, _ in queries), "one key per tier"
    keys = [key for tier_keys, _ in queries for key in tier_keys]
    blobs = [b"".join(hashes) for _, hashes in queries]
    counts = [int(count) for count in await _lookup_script(client)(keys=keys, args=blobs)]
    return [
        CachedPrefix({tier: counts[i * len(Tier) + t] for t, tier in enumerate(Tier)})
        for i in range(len(queries))
    ]


def _lookup_script(client):
    # register_script runs EVALSHA and re-sends the script after NOSCRIPT (a restarted Redis).
    script = getattr(client, "_splitserve_scan_lookup", None)
    if script is None:
        script = client.register_script(SCAN_LOOKUP_SCRIPT)
        client._splitserve_scan_lookup = script
    return script
