"""Keeps a gateway's `PrefixIndex` current: Redis stays the durable source, the index a copy.

    resync():  stream position X (XINFO STREAM, before reading anything else) ─▶ the registry
               ─▶ every pod's tier SETs (pipelined SMEMBERS) ─▶ index.replace_pod per pod
    follow():  XREAD BLOCK from X ─▶ entries trimmed unread (XINFO: the stream's oldest
               entry is past the one after X) ─▶ resync(); else index.apply(event) per
               entry; one it cannot apply (a gap in a pod's seq, a resync, an unknown pod)
               ─▶ re-read that pod's SETs

Replaying entries from X that the snapshot already reflects is harmless: each is a set add
or remove, and each hash ends as its last event says (or as the snapshot, with none after).
Any Redis error (an outage, a restart that lost the stream) marks the index unsynced; the
router then falls back to the per-request lookup script until `resync()` succeeds again.
`sync_pods(records)` follows the registry: gone pods are dropped, and new or restarted ones are
read by `follow()` between two reads of the stream (never beside it: a snapshot installed while
events are being applied could undo one).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

from redis.exceptions import RedisError, ResponseError

from splitserve.common.registry_schema import (
    SENTINEL,
    BlockEvent,
    PodRecord,
    RegistryKeys,
    read_pods,
)
from splitserve.engine.kv.tiers import Tier
from splitserve.gateway.routing.prefix_index import PrefixIndex

logger = logging.getLogger(__name__)

# XREAD BLOCK: below the client's socket timeout (router.py's FOLLOWER_TIMEOUT_S), or it
# times out.
BLOCK_MS = 200
READ_COUNT = 1024  # stream entries per XREAD
RETRY_SECONDS = 0.5  # after a Redis error, before resyncing
PODS_PER_READ = 8  # pods whose SETs one snapshot round trip reads (a few thousand hashes)


class IndexFollower:
    """Runs on the gateway's event loop: `run_forever()` as a task; `index` is read by the
    router only while `is_synced`."""

    def __init__(
        self,
        client,
        keys: RegistryKeys,
        index: PrefixIndex | None = None,
        after_first_sync: Callable[[], object] | None = None,
    ) -> None:
        """`after_first_sync`: called once, when the first snapshot is in (the gateway freezes
        its heap then: `RouterSettings.freeze_heap_after_index_sync`)."""
        self.client = client
        self.keys = keys
        self.index = index or PrefixIndex()
        self.is_synced = False
        self._last_id: bytes = b"0-0"  # the stream entry the index reflects up to
        # That entry's ordinal among every entry ever added (XINFO's entries-added counts).
        self._num_entries_seen = 0
        self._to_read: set[str] = set()  # pods `follow()` reads next (sync_pods asked)
        self._after_first_sync = after_first_sync

    async def run_forever(self) -> None:
        try:
            while True:
                try:
                    if not self.is_synced:
                        await self.resync()
                    await self.follow()
                except (RedisError, OSError) as error:
                    if _is_being_cancelled():
                        # A cancel that reached redis-py's read as its socket closed can come
                        # out as a connection or timeout error: retrying would outlive it.
                        raise asyncio.CancelledError from error
                    if self.is_synced:
                        logger.warning("prefix index lost Redis (%s): resyncing when back", error)
                    self.is_synced = False
                    await asyncio.sleep(RETRY_SECONDS)
        finally:
            # Ended (cancelled, or by a bug): nobody keeps the index current any more, so the
            # router must not read it.
            self.is_synced = False

    async def resync(self) -> None:
        """Rebuilds the index from the registry and every pod's SETs. Raises redis errors."""
        last_id, num_added, _ = await self._stream_position()
        records = await read_pods(self.client, self.keys)
        for pod_id in self.index.pod_ids() - {r.pod_id for r in records}:
            self.index.drop_pod(pod_id)
        await self._read_pods(records)
        self._last_id, self._num_entries_seen = last_id, num_added
        self.is_synced = True
        if self._after_first_sync is not None:
            hook, self._after_first_sync = self._after_first_sync, None
            hook()
        logger.info(
            "prefix index synced: %d pod(s), %d block(s)", len(records), self.index.num_blocks
        )

    async def follow(self, block_ms: int = BLOCK_MS) -> int:
        """Applies the stream's next entries (waits up to `block_ms` for some); how many."""
        answer = await self.client.xread(
            {self.keys.block_events: self._last_id}, count=READ_COUNT, block=block_ms
        )
        if self._to_read:
            to_read, self._to_read = self._to_read, set()
            await self._reread(to_read)
        if not answer:
            return 0
        if await self._missed_entries():
            logger.warning("prefix index fell behind the capped event stream: resyncing")
            await self.resync()
            return 0
        entries = answer[0][1]
        stale: set[str] = set()
        for entry_id, fields in entries:
            self._last_id = entry_id
            try:
                event = BlockEvent.from_fields(fields)
            except (KeyError, ValueError, UnicodeDecodeError):
                # Not ours to read (another version's writer?): whose blocks it changed is
                # unknown, so the index may be off until a pod's next gap or resync.
                logger.warning("skipping a malformed block-event entry %r", entry_id)
                continue
            if event.pod_id not in stale and not self.index.apply(event):
                stale.add(event.pod_id)
        self._num_entries_seen += len(entries)
        if stale:
            await self._reread(stale)
        return len(entries)

    async def _missed_entries(self) -> bool:
        """Whether the capped stream trimmed an entry the index has not read: its oldest entry
        is past the one after ours. Trimming takes the head only, and the head only moves on,
        so asking after the XREAD errs only toward a needless resync."""
        _, num_added, length = await self._stream_position()
        return num_added - length > self._num_entries_seen

    async def _stream_position(self) -> tuple[bytes, int, int]:
        """The stream's last id, how many entries were ever added to it, how many it holds
        (b"0-0", 0, 0 before the first). Redis 7's XINFO fields."""
        try:
            info = await self.client.xinfo_stream(self.keys.block_events)
        except ResponseError:  # no stream yet: no pod has published
            return b"0-0", 0, 0
        # Before Redis 7 XINFO has no entries-added: a trimmed range then goes unseen here
        # (a pod's sequence gap still shows it).
        num_added = int(info.get("entries-added", info["length"]))
        return info["last-generated-id"], num_added, int(info["length"])

    def sync_pods(self, records: list[PodRecord]) -> None:
        """Follows the registry: drops pods that left, and has `follow()` read the pods the
        index lacks (or holds of an older process). Only `follow()` reads SETs while synced:
        a snapshot installed beside it could undo an event it applied meanwhile."""
        if not self.is_synced:
            return
        for pod_id in self.index.pod_ids() - {record.pod_id for record in records}:
            self.index.drop_pod(pod_id)
        self._to_read.update(
            r.pod_id for r in records if self.index.generation(r.pod_id) != r.generation
        )

    async def _reread(self, pod_ids: Iterable[str]) -> None:
        """These pods' records (not the whole registry's) and SETs; a pod without a record
        left: dropped."""
        pod_ids = list(pod_ids)
        pipe = self.client.pipeline(transaction=False)
        for pod_id in pod_ids:
            pipe.hgetall(self.keys.pod(pod_id))
        found = [PodRecord.from_fields(fields) for fields in await pipe.execute()]
        records = [r for r in found if r is not None and r.pod_id in pod_ids]
        for pod_id in set(pod_ids) - {r.pod_id for r in records}:
            self.index.drop_pod(pod_id)
        await self._read_pods(records)

    async def _read_pods(self, records: list[PodRecord]) -> None:
        """Replaces these pods' blocks in the index by their SETs, a round trip per
        PODS_PER_READ pods, yielding the event loop between them: a thousand pods' million
        hashes read at once would stall routing for seconds. Each pod is replaced whole."""
        for start in range(0, len(records), PODS_PER_READ):
            chunk = records[start : start + PODS_PER_READ]
            pipe = self.client.pipeline(transaction=False)
            for record in chunk:
                for key in record.tier_blocks_keys(self.keys):
                    pipe.smembers(key)
            sets = await pipe.execute()
            for i, record in enumerate(chunk):
                by_tier = {
                    tier: [h for h in sets[i * len(Tier) + t] if h != SENTINEL]
                    for t, tier in enumerate(Tier)
                }
                self.index.replace_pod(record.pod_id, record.generation, by_tier)
            await asyncio.sleep(0)


def _is_being_cancelled() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
