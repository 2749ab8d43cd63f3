"""The scheduler's side of the offload tiers: requests whose cached prefix is loading.

Two kinds of load, one owner:

- admissions (`start_admission`): the request took blocks for its cached prefix and waits
  aside in WAITING_FOR_KV_LOAD; `take_due` hands it back, with its loaded blocks counted as
  computed, once the load is done or past its deadline (what it did not load is computed);
- reservations of a P/D decode pod (`start_reserved`): the prefix its own tiers hold loads
  while a prefill pod sends the rest; `finish_reserved` waits for it when the pages land.

Every load that runs its course, or is given up on as late, is counted with the loader
(`record_finished`) once; a load stopped because its request ended is not.
"""

from __future__ import annotations

import time
from typing import Protocol

from splitserve.engine.kv.manager import ComputedBlocks, KVCacheManager
from splitserve.engine.kv.offload.loading import LoadItem, LoadJob
from splitserve.engine.request import Request, RequestStatus

# The longest one step waits for a load when nothing else can run (no busy loop, and the engine
# thread still takes new requests between steps).
IDLE_LOAD_WAIT_S = 0.05


class KVLoader(Protocol):
    """Loads cached blocks from the lower tiers (shared/kv/offload/offloader.py)."""

    def start_load(self, request_id: str, items: list[LoadItem]) -> LoadJob: ...

    def record_finished(self, job: LoadJob, num_loaded: int) -> None: ...


class KVLoads:
    def __init__(self, kv: KVCacheManager, loader: KVLoader) -> None:
        self.kv = kv
        self.loader = loader
        self._admissions: dict[str, tuple[Request, LoadJob]] = {}
        self._reserved: dict[str, LoadJob] = {}

    def __len__(self) -> int:
        """Admissions waiting for their loads (they hold a running slot)."""
        return len(self._admissions)

    # ---- admissions ---------------------------------------------------------------------------

    def start_admission(self, request: Request, computed: ComputedBlocks) -> bool:
        """Takes blocks for the request's cached prefix (the pool's hits, then one new block per
        block to load) and starts the load; False when the blocks are not free now."""
        if not self.kv.allocate_slots(request, 0, computed):
            return False
        request.num_computed_tokens = computed.num_tokens
        request.status = RequestStatus.WAITING_FOR_KV_LOAD
        self._admissions[request.request_id] = (request, self._start(request, computed))
        return True

    def take_due(self, nothing_else_to_run: bool) -> list[Request]:
        """Requests whose loads are done (or overdue), their loaded blocks now computed and
        cached, status RUNNING. Waits a little for the oldest when `nothing_else_to_run`."""
        if nothing_else_to_run and self._admissions:
            _, first = next(iter(self._admissions.values()))
            first.wait(min(IDLE_LOAD_WAIT_S, max(0.0, first.deadline - time.monotonic())))
        now = time.monotonic()
        due = [rid for rid, (_, job) in self._admissions.items() if job.is_due(now)]
        return [self._resume(*self._admissions.pop(rid)) for rid in due]

    def _resume(self, request: Request, job: LoadJob) -> Request:
        num_loaded = self._end(job)
        request.num_computed_tokens += num_loaded * self.kv.block_size
        request.num_cached_tokens = request.num_computed_tokens
        request.loaded_tokens_by_tier = self._tokens_by_tier(job)
        self.kv.cache_blocks(request, request.num_computed_tokens)
        request.status = RequestStatus.RUNNING
        return request

    # ---- reservations (disaggregation) --------------------------------------------------------

    def start_reserved(self, request: Request, computed: ComputedBlocks) -> None:
        """The reservation allocated `computed`'s blocks: load its lower-tier part."""
        self._reserved[request.request_id] = self._start(request, computed)

    def finish_reserved(self, request: Request) -> bool:
        """Waits (until its deadline) for the load of a reserved request whose pages have
        landed; False when it ended short: those blocks hold neither loaded nor sent KV."""
        job = self._reserved.pop(request.request_id, None)
        if job is None:
            return True
        job.wait(max(0.0, job.deadline - time.monotonic()))
        num_loaded = self._end(job)
        request.loaded_tokens_by_tier = self._tokens_by_tier(job)
        return num_loaded == len(job.items)

    # ---- either ---------------------------------------------------------------------------------

    def stop(self, request_id: str) -> None:
        """The request ends (abort, fallback): its load stops before its blocks are freed."""
        entry = self._admissions.pop(request_id, None)
        job = entry[1] if entry is not None else self._reserved.pop(request_id, None)
        if job is not None:
            job.finish()

    def _start(self, request: Request, computed: ComputedBlocks) -> LoadJob:
        """Starts loading `computed.load_hashes` into the blocks allocated after its hits."""
        first = len(computed.blocks)
        num_loads = len(computed.load_hashes)
        block_ids = self.kv.get_block_ids(request.request_id)[first : first + num_loads]
        items = [
            LoadItem(block_hash, block_id, tier)
            for block_hash, block_id, tier in zip(
                computed.load_hashes, block_ids, computed.load_tiers, strict=True
            )
        ]
        return self.loader.start_load(request.request_id, items)

    def _end(self, job: LoadJob) -> int:
        """Stops the job where it stands (nothing writes its blocks afterwards) and counts it."""
        num_loaded = job.finish()
        self.loader.record_finished(job, num_loaded)
        return num_loaded

    def _tokens_by_tier(self, job: LoadJob) -> dict[str, int]:
        return {tier.label: n * self.kv.block_size for tier, n in job.loaded_by_tier.items()}
