"""The one Lua script that settles a gateway replica's lease on one tenant's limits with Redis.

A replica admits a tenant's requests from quota it leased (lease.py) and comes here only when
its lease falls short, and in the background to give back what it does not use. One call, one
atomic script, in this order:
1. gives back the per-minute quota the replica returns (unused lease), to the window it was
   charged to;
2. admits the requests waiting on this replica, each on its own (as if alone: requests, then
   concurrent requests, then tokens; the first over refuses it and nothing of it is charged);
3. if none was refused, leases spare quota for the replica's next requests: at most what it
   asked (about half a second of its recent use) and at most LEASE_FRACTION of what is left
   under each limit, so leases shrink to nothing as the tenant nears a limit;
4. charges all of it: the per-minute windows, and this replica's count of concurrent slots
   (slots in use here + admitted + spare), which expires unless renewed within SLOT_LEASE_S.

Concurrent slots are kept per replica (a hash replica -> slots held, and each replica's expiry
in a sorted set), so a replica gives a slot back by changing its own count, and a replica that
died is forgotten once its lease expires.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from splitserve.gateway.auth.windows import WINDOW_S, previous_weight, window_index

LEASE_FRACTION = 0.125  # of what is left under a limit, the most one lease may take
SLOT_LEASE_S = 30.0  # a replica's slots are forgotten this long after its last call
_PREFIX = "splitserve:limits"
_WINDOW_TTL_S = int(2 * WINDOW_S) + 1  # a window is read as "previous" for one more minute

# KEYS: 1 requests now, 2 requests before, 3 tokens now, 4 tokens before (windows), 5 slots held
# (hash: replica -> count), 6 slot leases' expiry (sorted set: replica -> Redis's time).
# ARGV: 1 previous window's weight, 2 window ttl, 3 requests limit, 4 tokens limit, 5 slots
# limit (a limit of 0: unchecked), 6 a slot lease's length in seconds, 7 replica, 8 lease
# fraction, 9 requests returned, 10 tokens returned, 11 returned to the window before (1) or
# now (0), 12 slots in use on this replica, 13-15 spare requests, tokens and slots wanted, then
# three per waiting request: requests asked (0/1), tokens asked (-1: unchecked), slot (0: none,
# 1: take one, 2: check there is one free).
# Slot leases expire by Redis's clock (TIME), not the caller's: replicas whose clocks differ by
# more than a lease would otherwise drop each other's live slots.
# -> {requests now, before, tokens now, before (after the returns, before the waiters), slots
# held by other replicas, spare requests, tokens leased, slots held here after, then a verdict
# per waiter: '' (admitted) or the limit that refused it}.
LEASE_SCRIPT = """
-- Before Redis 5 a script replicates verbatim and may not write after TIME; later ones
-- replicate its effects (and in 7 this call is a no-op kept for compatibility).
if redis.replicate_commands then redis.replicate_commands() end
local weight = tonumber(ARGV[1])
local rl, tl, sl = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local fraction = tonumber(ARGV[8])
local function give_back(key, amount)
  if amount <= 0 then return end
  local charged = tonumber(redis.call('GET', key) or '0')
  if charged > 0 then redis.call('DECRBY', key, math.min(charged, amount)) end
end
local back = tonumber(ARGV[11])
give_back(KEYS[1 + back], tonumber(ARGV[9]))
give_back(KEYS[3 + back], tonumber(ARGV[10]))
local function count(key) return tonumber(redis.call('GET', key) or '0') end
local rc, rp, tc, tp = 0, 0, 0, 0
if rl > 0 then rc, rp = count(KEYS[1]), count(KEYS[2]) end
if tl > 0 then tc, tp = count(KEYS[3]), count(KEYS[4]) end
local others, mine = 0, tonumber(ARGV[12])
local server_now = 0
if sl > 0 then
  local clock = redis.call('TIME')
  server_now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
  local expired = redis.call('ZRANGEBYSCORE', KEYS[6], '-inf', server_now)
  for _, replica in ipairs(expired) do redis.call('HDEL', KEYS[5], replica) end
  if #expired > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[6], '-inf', server_now) end
  local held = redis.call('HGETALL', KEYS[5])
  for i = 1, #held, 2 do
    if held[i] ~= ARGV[7] then others = others + tonumber(held[i + 1]) end
  end
end
local r0, t0 = rc, tc
local verdicts, any_refused = {}, false
for i = 16, #ARGV, 3 do
  local asks_request, tokens = tonumber(ARGV[i]), tonumber(ARGV[i + 1])
  local slot = tonumber(ARGV[i + 2])
  local refused = ''
  if rl > 0 and asks_request > 0 and rc + rp * weight + 1 > rl then
    refused = 'requests'
  elseif sl > 0 and slot > 0 and others + mine + 1 > sl then
    refused = 'concurrent_requests'
  elseif tl > 0 and tokens >= 0 and tc + tp * weight + tokens > tl then
    refused = 'tokens'
  end
  if refused == '' then
    rc = rc + asks_request
    if tokens > 0 then tc = tc + tokens end
    if slot == 1 then mine = mine + 1 end
  else
    any_refused = true
  end
  verdicts[#verdicts + 1] = refused
end
local function spare(want, room)
  if any_refused or want <= 0 or room <= 0 then return 0 end
  return math.min(want, math.floor(fraction * room))
end
-- One per-minute window: its spare leased, and what this call added charged to its key.
local function lease_window(limit, key, want, now_count, before_count, found)
  if limit <= 0 then return now_count, 0 end
  local leased = spare(want, limit - now_count - before_count * weight)
  now_count = now_count + leased
  if now_count ~= found then
    redis.call('INCRBY', key, now_count - found)
    redis.call('EXPIRE', key, ARGV[2])
  end
  return now_count, leased
end
local r_spare, t_spare
rc, r_spare = lease_window(rl, KEYS[1], tonumber(ARGV[13]), rc, rp, r0)
tc, t_spare = lease_window(tl, KEYS[3], tonumber(ARGV[14]), tc, tp, t0)
if sl > 0 then
  mine = mine + spare(tonumber(ARGV[15]), sl - others - mine)
  if mine > 0 then
    local lease_s = tonumber(ARGV[6])
    local slot_ttl = math.ceil(2 * lease_s)
    redis.call('HSET', KEYS[5], ARGV[7], mine)
    redis.call('ZADD', KEYS[6], string.format('%.6f', server_now + lease_s), ARGV[7])
    redis.call('EXPIRE', KEYS[5], slot_ttl)
    redis.call('EXPIRE', KEYS[6], slot_ttl)
  else
    redis.call('HDEL', KEYS[5], ARGV[7])
    redis.call('ZREM', KEYS[6], ARGV[7])
  end
end
local reply = {r0, rp, t0, tp, others, r_spare, t_spare, mine}
for _, verdict in ipairs(verdicts) do reply[#reply + 1] = verdict end
return reply
"""


class SlotAsk(enum.IntEnum):
    NONE = 0
    TAKE = 1  # a concurrent slot, held until the request ends
    CHECK = 2  # that one is free, none taken (a request already over)


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """A tenant's limits as its lease knows them; 0: unlimited."""

    requests_per_minute: int = 0
    tokens_per_minute: int = 0
    concurrent_requests: int = 0


@dataclass(frozen=True, slots=True)
class WaiterAsk:
    """What one request waiting for the call asks: only what its own check names."""

    asks_request: bool
    num_tokens: int | None  # None: tokens per minute not checked
    slot: SlotAsk


@dataclass(frozen=True, slots=True)
class LeaseCall:
    """What one call sends: what the replica returns, holds and wants for one tenant."""

    tenant: str
    replica_id: str
    now: float  # time.time(), the window the call charges
    limits: TenantLimits
    returned_requests: int  # unused quota given back ...
    returned_tokens: int
    returns_to_previous: bool  # ... to the window before `now`'s (the lease's minute turned)
    num_slots_in_use: int  # on this replica; its slots held become these + admitted + spare
    spare_requests: int  # wanted on top of the waiters' needs
    spare_tokens: int
    spare_slots: int
    waiters: tuple[WaiterAsk, ...] = ()

    def keys(self) -> list[str]:
        """One hash tag per tenant, so one cluster slot."""
        index = window_index(self.now)
        base = f"{_PREFIX}:{{{self.tenant}}}"
        return [
            f"{base}:requests:{index}",
            f"{base}:requests:{index - 1}",
            f"{base}:tokens:{index}",
            f"{base}:tokens:{index - 1}",
            f"{base}:slots",
            f"{base}:slot_leases",
        ]

    def args(self) -> list[str | int]:
        limits = self.limits
        args: list[str | int] = [
            repr(previous_weight(self.now)),
            _WINDOW_TTL_S,
            limits.requests_per_minute,
            limits.tokens_per_minute,
            limits.concurrent_requests,
            repr(SLOT_LEASE_S),
            self.replica_id,
            repr(LEASE_FRACTION),
            self.returned_requests,
            self.returned_tokens,
            1 if self.returns_to_previous else 0,
            self.num_slots_in_use,
            self.spare_requests,
            self.spare_tokens,
            self.spare_slots,
        ]
        for waiter in self.waiters:
            tokens = -1 if waiter.num_tokens is None else waiter.num_tokens
            args += [1 if waiter.asks_request else 0, tokens, int(waiter.slot)]
        return args


@dataclass(frozen=True, slots=True)
class LeaseReply:
    """What the script found and did (counts before the waiters, after the returns)."""

    requests_now: int
    requests_before: int
    tokens_now: int
    tokens_before: int
    num_slots_elsewhere: int  # held by the other replicas
    spare_requests: int  # leased to this replica
    spare_tokens: int
    num_slots_held: int  # by this replica, from now
    verdicts: tuple[str | None, ...]  # per waiter: None admitted, else the limit that refused

    @classmethod
    def parse(cls, reply: Any) -> LeaseReply:
        numbers = [int(value) for value in reply[:8]]
        verdicts = tuple(verdict.decode() or None for verdict in reply[8:])
        requests_now, requests_before, tokens_now, tokens_before = numbers[:4]
        elsewhere, spare_requests, spare_tokens, held = numbers[4:]
        return cls(
            requests_now,
            requests_before,
            tokens_now,
            tokens_before,
            elsewhere,
            spare_requests,
            spare_tokens,
            held,
            verdicts,
        )
