"""`PodLoad`: a pod's requests and KV blocks at one moment, the one type its load travels as.

    EngineStats ─▶ PodLoad ─┬─▶ WorkerStats (GetStats) ─▶ PodLoad ─▶ gateway Pod ─▶ PodView
       (engine)   (the pod)  └─▶ PodRecord (Redis heartbeat) ─▶ the autoscaler's RoleLoad

The field names are the `WorkerStats` proto's and the registry hash's, so both conversions
walk the fields instead of listing them. Torch-free: the gateway and the planner import it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from splitserve.engine.core import EngineStats
    from splitserve.v1 import worker_pb2


@dataclass(frozen=True)
class PodLoad:
    """What a pod is doing now, as it reports it (routing scores it; the autoscaler sums it)."""

    num_running: int = 0  # requests in the running batch
    num_waiting: int = 0  # requests queued for admission
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0  # free or evictable: cached blocks no request holds count as free
    # Prompt tokens admitted and not computed yet (queued prompts, unfinished prefill chunks):
    # the prefill work ahead of a new request here.
    num_waiting_prompt_tokens: int = 0

    @property
    def num_queued(self) -> int:
        return self.num_running + self.num_waiting

    @property
    def kv_blocks_used(self) -> int:
        return self.kv_blocks_total - self.kv_blocks_free

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use, in [0, 1]; 1.0 for a pod that reported no blocks."""
        return 1.0 - self.kv_blocks_free / max(self.kv_blocks_total, 1)

    @classmethod
    def from_engine(cls, engine: EngineStats) -> PodLoad:
        return cls(
            num_running=engine.num_running,
            num_waiting=engine.num_waiting,
            kv_blocks_total=engine.num_kv_blocks_total,
            kv_blocks_free=engine.num_kv_blocks_free,
            num_waiting_prompt_tokens=engine.num_waiting_prompt_tokens,
        )

    @classmethod
    def from_proto(cls, stats: worker_pb2.WorkerStats) -> PodLoad:
        return cls(**{name: getattr(stats, name) for name in FIELD_NAMES})

    def as_fields(self) -> dict[str, int]:
        """Field name -> value: the `WorkerStats` keywords and the registry hash's fields."""
        return dataclasses.asdict(self)


FIELD_NAMES = tuple(field.name for field in dataclasses.fields(PodLoad))
