"""The Redis registry's schema, shared by the pods (writers) and the gateway and autoscaler
(readers): key layout, the `PodRecord` a pod heartbeats, the Lua scripts, the reads. Torch-free.

Key layout (every key under one prefix, so a Redis can be shared):

    {prefix}:pods                    ZSET  pod_id -> expiry (Redis clock, ms)
    {prefix}:pod:{pod_id}            HASH  the pod's `PodRecord`, PEXPIRE ttl
    {prefix}:gen:{pod_id}            STRING the newest generation that heartbeated
    {prefix}:blocks:{pod_id}:{gen}   SET   block hashes (16 raw bytes) + the sentinel b""
    {prefix}:blocks:{pod_id}:{gen}:host, ...:disk
                                     SET   hashes the pod's offload tiers hold (no sentinel:
                                           the device SET's stands for all three)
    {prefix}:block_events            STREAM every pod's SET changes, in order (`BlockEvent`),
                                           capped: gateways follow it into their in-memory
                                           index (services/gateway/routing/prefix_index.py)

Why one block SET per pod and generation, not one SET of pods per block hash:
- a pod's entries expire with it (one PEXPIRE per heartbeat), never one by one;
- a stale writer (an older process with the same pod id, or a publisher that lost a race)
  writes into its own generation's SET, which the gateway never reads, because the record
  names the live generation; `HEARTBEAT_SCRIPT` refuses a generation older than the newest;
- the gateway's lookup is one script call over every pod's SET: one round trip per prompt.
The sentinel member b"" tells a SET rebuilt from snapshot apart from one that Redis lost (a
restart) and that later events partly re-created: without it the pod republishes everything.

The hash's field names are a contract with pods and readers of other versions (a rolling
upgrade runs both): the pod id is stored as "worker_id", the word the proto also keeps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio

from splitserve.common.pod_load import PodLoad
from splitserve.common.redis_auth import redis_password
from splitserve.engine.kv.block_hash import BLOCK_HASH_NUM_BYTES
from splitserve.engine.kv.tiers import Tier

DEFAULT_KEY_PREFIX = "splitserve"
SENTINEL = b""  # always in a pod's block SET once it is complete (see the module docstring)
MAX_DISTINCT_BLOBS = 255  # a lookup's prompt blobs (block sizes x namespaces): a byte per pod

# KEYS: gen, pod, pods, blocks, then the lower tiers' block SETs. ARGV: generation, ttl_ms,
# pod_id, field, value, ... Returns 0 when a newer generation owns the pod id (this writer is
# stale), 2 when the block SET is missing or incomplete (the publisher must resync it), 1
# otherwise.
HEARTBEAT_SCRIPT = """
local newest = tonumber(redis.call('GET', KEYS[1]) or '0')
local mine = tonumber(ARGV[1])
if newest > mine then return 0 end
local ttl = tonumber(ARGV[2])
redis.call('SET', KEYS[1], ARGV[1], 'PX', 86400000)
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], unpack(ARGV, 4))
redis.call('PEXPIRE', KEYS[2], ttl)
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now_ms)
redis.call('ZADD', KEYS[3], now_ms + ttl, ARGV[3])
if redis.call('SISMEMBER', KEYS[4], '') == 0 then return 2 end
for i = 4, #KEYS do redis.call('PEXPIRE', KEYS[i], ttl) end
return 1
"""
HEARTBEAT_FENCED, HEARTBEAT_OK, HEARTBEAT_RESYNC = 0, 1, 2

# KEYS: gen, pod, pods, blocks, the lower tiers' SETs. ARGV: generation, pod_id. Takes the
# pod out of the registry only while this generation is still the newest: a stale process
# shutting down must not remove the record of the live one that replaced it. Its own block
# SETs go either way.
DEREGISTER_SCRIPT = """
for i = 4, #KEYS do redis.call('DEL', KEYS[i]) end
local newest = tonumber(redis.call('GET', KEYS[1]) or '0')
if newest > tonumber(ARGV[1]) then return 0 end
redis.call('ZREM', KEYS[3], ARGV[2])
redis.call('DEL', KEYS[2])
return 1
"""


@dataclass(frozen=True)
class RegistryKeys:
    prefix: str = DEFAULT_KEY_PREFIX

    @property
    def pods(self) -> str:
        return f"{self.prefix}:pods"

    def pod(self, pod_id: str) -> str:
        return f"{self.prefix}:pod:{pod_id}"

    def generation(self, pod_id: str) -> str:
        return f"{self.prefix}:gen:{pod_id}"

    def blocks(self, pod_id: str, generation: int, tier: Tier = Tier.DEVICE) -> str:
        device = f"{self.prefix}:blocks:{pod_id}:{generation}"
        return device if tier == Tier.DEVICE else f"{device}:{tier.label}"

    @property
    def block_events(self) -> str:
        return f"{self.prefix}:block_events"

    def tier_blocks(self, pod_id: str, generation: int) -> tuple[str, ...]:
        """The block SETs of every tier, fastest first (Tier order)."""
        return tuple(self.blocks(pod_id, generation, tier) for tier in Tier)


# The block-event stream keeps about this many entries (XADD MAXLEN ~): a gateway that falls
# further behind finds a gap in a pod's sequence numbers and re-reads that pod's SETs.
BLOCK_EVENTS_MAXLEN = 100_000
EVENT_STORE, EVENT_REMOVE, EVENT_RESYNC = "sadd", "srem", "resync"


@dataclass(frozen=True)
class BlockEvent:
    """One entry of the block-event stream: what a pod's publisher just did to one tier's SET.
    `seq` counts a publisher's entries from 1 per generation, so a reader that sees a gap knows
    it missed some (trimmed, or written while it was away). RESYNC: the pod replaced all its
    SETs from a snapshot; readers re-read them (`hashes` empty)."""

    pod_id: str
    generation: int
    seq: int
    op: str  # EVENT_STORE, EVENT_REMOVE or EVENT_RESYNC
    tier: Tier
    hashes: tuple[bytes, ...]  # 16 bytes each

    def to_fields(self) -> dict[str, bytes | str | int]:
        return {
            "pod": self.pod_id,
            "gen": self.generation,
            "seq": self.seq,
            "op": self.op,
            "tier": int(self.tier),
            "hashes": b"".join(self.hashes),
        }

    @classmethod
    def from_fields(cls, fields: dict[bytes, bytes]) -> BlockEvent:
        blob, size = fields[b"hashes"], BLOCK_HASH_NUM_BYTES
        return cls(
            pod_id=fields[b"pod"].decode(),
            generation=int(fields[b"gen"]),
            seq=int(fields[b"seq"]),
            op=fields[b"op"].decode(),
            tier=Tier(int(fields[b"tier"])),
            hashes=tuple(blob[i : i + size] for i in range(0, len(blob), size)),
        )


@dataclass(frozen=True)
class PodRecord:
    """What a pod publishes about itself at every heartbeat (strings and numbers only)."""

    pod_id: str
    role: str  # "prefill" or "decode"
    address: str  # host:port others dial for the pod's gRPC
    generation: int  # this process's fencing token: later processes have larger ones
    model: str = ""
    kv_address: str = ""  # decode pods: where prefill pods send KV pages
    kv_transport: str = ""
    region: str = ""
    zone: str = ""
    node: str = ""  # the machine (Kubernetes node): pods on one node exchange pages fastest
    block_size: int = 16
    hash_namespace: str = ""  # with block_size, what the gateway must hash prompts with
    # The engine's parallel layout (processes per pod: docs/parallelism.md). Pods of any
    # layouts exchange KV pages; the planner may weigh a pod's capacity by it.
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # For the autoscaler (services/planner/autoscale/load.py), which reads pods only from
    # here; the gateway takes load from its GetStats polls instead
    # (services/gateway/routing/pods.py).
    load: PodLoad = field(default_factory=PodLoad)
    # Exponentially weighted averages over the latest requests (services/pod/metrics.py),
    # in seconds; 0.0 until the pod has served one. A prefill pod's ITL stays 0.0.
    recent_ttft_s: float = 0.0
    recent_itl_s: float = 0.0
    # Measured costs of the offload tiers (shared/kv/offload/costs.py), in seconds; 0.0 until
    # measured. The gateway credits blocks in the lower tiers by them.
    prefill_s_per_token: float = 0.0
    host_load_s_per_block: float = 0.0
    disk_load_s_per_block: float = 0.0
    # LoRA adapters the pod holds and those in its active slots now, comma-separated (the
    # gateway routes an adapter's requests to pods where it is resident: routing/scoring.py).
    lora_adapters: str = ""
    resident_lora_adapters: str = ""

    def to_fields(self) -> dict[str, str]:
        """The HASH fields: this record's scalars and its load's, flat."""
        scalars = {
            _WIRE_NAMES.get(name, name): value
            for name, value in vars(self).items()
            if name != "load"
        }
        return {name: str(value) for name, value in {**scalars, **self.load.as_fields()}.items()}

    @classmethod
    def from_fields(cls, fields: dict[bytes | str, bytes | str]) -> PodRecord | None:
        """The record from HGETALL's answer; None for an empty (expired) or foreign hash."""
        text = {_text(key): _text(value) for key, value in fields.items()}
        try:
            return cls(**_parsed(cls, text), load=PodLoad(**_parsed(PodLoad, text)))
        except (TypeError, ValueError):
            return None

    def blocks_key(self, keys: RegistryKeys) -> str:
        return keys.blocks(self.pod_id, self.generation)

    def tier_blocks_keys(self, keys: RegistryKeys) -> tuple[str, ...]:
        return keys.tier_blocks(self.pod_id, self.generation)


# Field -> its name in the HASH, where that differs (see the module docstring).
_WIRE_NAMES = {"pod_id": "worker_id"}
# By annotation (a string: annotations are postponed); other types (the load) are not scalars.
_PARSERS = {"str": str, "int": int, "float": float}


def _parsed(cls, text: dict[str, str]) -> dict[str, Any]:
    """`cls`'s scalar fields that the HASH holds, parsed; absent ones keep their defaults.
    Any: each value has its field's type, which only the field's annotation says."""
    values: dict[str, Any] = {}
    for item in dataclasses.fields(cls):
        name = _WIRE_NAMES.get(item.name, item.name)
        if name in text and item.type in _PARSERS:
            values[item.name] = _PARSERS[item.type](text[name])
    return values


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def read_pods(client, keys: RegistryKeys) -> list[PodRecord]:
    """Every live pod's record, in two round trips. Raises redis errors."""
    pod_ids = await client.zrange(keys.pods, 0, -1)
    if not pod_ids:
        return []
    pipe = client.pipeline(transaction=False)
    for pod_id in pod_ids:
        pipe.hgetall(keys.pod(_text(pod_id)))
    records = [PodRecord.from_fields(fields) for fields in await pipe.execute()]
    return [record for record in records if record is not None]


# KEYS: per pod, its tier SETs (ARGV[1] of them, fastest first). ARGV[1]: tiers per pod;
# ARGV[2]: per pod, one byte, the 1-based index of its prompt blob among ARGV[3..]; ARGV[3..]:
# the distinct prompt blobs, 16 bytes per hash. Returns, per pod and tier, how many of the
# leading hashes held anywhere on the pod are held in that tier (the fastest one holding it):
# the run ends at the first hash no tier holds. Server side, one command per prompt. The work
# per pod: each distinct prompt blob is sent once (a byte per pod names it); a pod with no
# lower-tier SET (one EXISTS) has its run found by galloping then binary search, O(log run)
# SISMEMBERs, which relies on the run being a prefix (see `cached_prefixes`); a pod with
# offload tiers is scanned hash by hash, since each block's tier is credited. Still every pod
# is visited (benchmarks/scale measures it: docs/benchmarks.md, "Cluster scale").
LOOKUP_SCRIPT = """
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
local function scan_tiers(base, blob, found)
  for start = 1, #blob, 16 do
    local hash = string.sub(blob, start, start + 15)
    local where = 0
    for t = 1, tiers do
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
  local found = {}
  for t = 1, tiers do found[t] = 0 end
  if tiers == 1 or redis.call('EXISTS', unpack(KEYS, base + 2, base + tiers)) == 0 then
    found[1] = run_on_device(KEYS[base + 1], blob)
  else
    scan_tiers(base, blob, found)
  end
  for t = 1, tiers do counts[base + t] = found[t] end
end
return counts
"""


@dataclass(frozen=True)
class CachedPrefix:
    """A prompt's longest prefix cached on one pod, in blocks, by the tier holding each."""

    num_blocks_by_tier: dict[Tier, int] = field(default_factory=dict)

    @property
    def num_blocks(self) -> int:
        return sum(self.num_blocks_by_tier.values())


async def cached_prefixes(
    client, queries: Sequence[tuple[tuple[str, ...], Sequence[bytes]]]
) -> list[CachedPrefix]:
    """For each (the pod's tier block SETs from `tier_blocks`, the prompt's chained block
    hashes): the leading hashes the pod holds in any tier, counted by tier. One round trip.

    A pod evicts tail blocks before their parents, and writes them down in that order, so its
    hits form a prefix; the first hash no tier holds ends the count."""
    if not queries:
        return []
    assert all(len(tier_keys) == len(Tier) for tier_keys, _ in queries), "one key per tier"
    blob_indexes: dict[bytes, int] = {}  # blob -> its 1-based place among the arguments
    # Pods of one block size and namespace share one hash list: joined and checked once, not
    # once per pod (at 1,000 pods that was most of a lookup's Python).
    by_list: dict[int, int] = {}  # id(hash list) -> its blob's place; queries keeps them alive
    which = bytearray()
    for _, hashes in queries:
        index = by_list.get(id(hashes))
        if index is None:
            assert all(len(h) == BLOCK_HASH_NUM_BYTES for h in hashes), "hashes are 16 bytes"
            index = blob_indexes.setdefault(b"".join(hashes), len(blob_indexes) + 1)
            by_list[id(hashes)] = index
        which.append(index)
    if len(blob_indexes) > MAX_DISTINCT_BLOBS:
        raise ValueError(f"more than {MAX_DISTINCT_BLOBS} distinct block sizes and namespaces")
    keys = [key for tier_keys, _ in queries for key in tier_keys]
    args = [len(Tier), bytes(which), *blob_indexes]
    counts = [int(count) for count in await _lookup_script(client)(keys=keys, args=args)]
    return [
        CachedPrefix({tier: counts[i * len(Tier) + t] for t, tier in enumerate(Tier)})
        for i in range(len(queries))
    ]


def _lookup_script(client):
    # register_script runs EVALSHA and re-sends the script after NOSCRIPT (a restarted Redis).
    script = getattr(client, "_splitserve_lookup", None)
    if script is None:
        script = client.register_script(LOOKUP_SCRIPT)
        client._splitserve_lookup = script
    return script


def connect(url: str, timeout_s: float = 0.5):
    """An asyncio Redis client for `url`; its password as redis_auth.py says.
    Short timeouts: a Redis that is down must cost a request milliseconds, not seconds."""
    return redis.asyncio.Redis.from_url(
        url,
        password=redis_password(),
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry_on_timeout=False,
    )
