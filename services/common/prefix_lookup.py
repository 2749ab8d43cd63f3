"""The prefix-index lookup with less Redis work per pod than registry_schema's
`LOOKUP_SCRIPT`, answering the same question with the same `cached_prefixes` signature.

What `LOOKUP_SCRIPT` spends per request, measured with simulated pods (benchmarks/scale):
one SISMEMBER per cached block of every pod, plus one per tier at each pod's first miss, and
the prompt's hashes sent once per pod (1,000 pods x a 4k-token prompt: 4 MB of arguments).
Here:
- each distinct prompt blob is sent once, and each pod names its blob by a one-byte index;
- a pod whose lower tiers hold nothing (no host or disk SET: EXISTS) has its cached run found
  by galloping then binary search, O(log run) SISMEMBERs instead of O(run). This relies on
  what registry_schema's module docstring states: a pod evicts tails before their parents and
  writes them down in that order, so the hashes it holds of any chain are a prefix of it;
- a pod with offload tiers is scanned as before (each block's tier must be known to credit it).
It still visits every pod: the work per request is O(pods x log run), not O(pods x run). An
index that does not touch every pod (the gateway's own, fed by events) is the next step.
"""

from __future__ import annotations

from collections.abc import Sequence

from splitserve.common.registry_schema import CachedPrefix
from splitserve.engine.kv.block_hash import BLOCK_HASH_NUM_BYTES
from splitserve.engine.kv.tiers import Tier

MAX_DISTINCT_BLOBS = 255  # one byte per pod names its blob

# KEYS: per pod, its tier SETs (ARGV[1] of them, fastest first). ARGV[1]: tiers per pod;
# ARGV[2]: per pod, one byte, the 1-based index of its prompt blob among ARGV[3..]; ARGV[3..]:
# the distinct prompt blobs, 16 bytes per hash. Returns, per pod and tier, how many of the
# leading hashes held anywhere on the pod are held in that tier, as LOOKUP_SCRIPT does.
FAST_LOOKUP_SCRIPT = """
local tiers = tonumber(ARGV[1])
local which = ARGV[2]
local counts = {}
local function hash_at(blob, i) return string.sub(blob, (i - 1) * 16 + 1, i * 16) end
local function run_on_device(key, blob)
  local n = #blob / 16
  local lo, probe = 0, 1
  while probe <= n and redis.call('SISMEMBER', key, hash_at(blob, probe)) == 1 do
    lo = probe
    probe = probe * 2
  end
  local hi = math.min(probe, n + 1)
  while hi - lo > 1 do
    local mid = math.floor((lo + hi) / 2)
    if redis.call('SISMEMBER', key, hash_at(blob, mid)) == 1 then lo = mid else hi = mid end
  end
  return lo
end
local function scan_tiers(base, present, blob, found)
  for start = 1, #blob, 16 do
    local hash = string.sub(blob, start, start + 15)
    local where = 0
    for _, t in ipairs(present) do
      if redis.call('SISMEMBER', KEYS[base + t], hash) == 1 then
        where = t
        break
      end
    end
    if where == 0 then return end
    found[where] = found[where] + 1
  end
end
for p = 1, #which do
  local base = (p - 1) * tiers
  local blob = ARGV[2 + string.byte(which, p)]
  local present = {1}
  for t = 2, tiers do
    if redis.call('EXISTS', KEYS[base + t]) == 1 then present[#present + 1] = t end
  end
  local found = {}
  for t = 1, tiers do found[t] = 0 end
  if #present == 1 then
    found[1] = run_on_device(KEYS[base + 1], blob)
  else
    scan_tiers(base, present, blob, found)
  end
  for t = 1, tiers do counts[base + t] = found[t] end
end
return counts
"""


async def cached_prefixes(
    client, queries: Sequence[tuple[tuple[str, ...], Sequence[bytes]]]
) -> list[CachedPrefix]:
    """registry_schema.cached_prefixes' contract (one round trip), with the work above."""
    if not queries:
        return []
    assert all(len(h) == BLOCK_HASH_NUM_BYTES for _, hashes in queries for h in hashes), (
        "block hashes are 16 bytes"
    )
    assert all(len(tier_keys) == len(Tier) for tier_keys, _ in queries), "one key per tier"
    blob_indexes: dict[bytes, int] = {}  # blob -> its 1-based place among the arguments
    which = bytearray()
    for _, hashes in queries:
        which.append(blob_indexes.setdefault(b"".join(hashes), len(blob_indexes) + 1))
    if len(blob_indexes) > MAX_DISTINCT_BLOBS:
        raise ValueError(f"more than {MAX_DISTINCT_BLOBS} distinct block sizes and namespaces")
    keys = [key for tier_keys, _ in queries for key in tier_keys]
    args = [len(Tier), bytes(which), *blob_indexes]
    counts = [int(count) for count in await _script(client)(keys=keys, args=args)]
    return [
        CachedPrefix({tier: counts[i * len(Tier) + t] for t, tier in enumerate(Tier)})
        for i in range(len(queries))
    ]


def _script(client):
    # register_script runs EVALSHA and re-sends the script after NOSCRIPT (a restarted Redis).
    script = getattr(client, "_splitserve_fast_lookup", None)
    if script is None:
        script = client.register_script(FAST_LOOKUP_SCRIPT)
        client._splitserve_fast_lookup = script
    return script
