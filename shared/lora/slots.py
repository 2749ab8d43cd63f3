"""Where adapters live: `max_loras` active slots in the model's LoRA weights and up to
`max_cpu_loras` host copies, both least recently used first out.

    registered (name -> LoRARequest: where to read it again)
      └─ host copies (LRU, max_cpu_loras)  ── copied into ──▶  active slots (LRU, max_loras)

A step's adapters are made active before its forward (`batch_for`); the scheduler admits no
more distinct adapters than there are slots, so a step never needs more. An adapter whose host
copy was evicted is read from its directory again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from splitserve.engine.lora.batched import LoRABatch, make_batch
from splitserve.engine.lora.layers import LoRAModel
from splitserve.engine.lora.peft_format import LoRAWeights, load_peft_adapter
from splitserve.engine.lora.request import LoRARequest
from splitserve.engine.step import ScheduledChunk


@dataclass
class LoRAStats:
    """Cumulative counts, for metrics."""

    num_slot_loads: int = 0  # adapters copied into an active slot
    num_slot_evictions: int = 0  # adapters pushed out of a slot for another
    num_host_loads: int = 0  # adapters read from their directory
    num_host_evictions: int = 0  # host copies dropped for another


class LoRASlots:
    """Not thread-safe: the engine's thread calls it (registration validates there too)."""

    def __init__(
        self,
        model: LoRAModel,
        max_loras: int,
        max_cpu_loras: int,
        max_rank: int,
        num_layers: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model = model
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.max_rank = max_rank
        self.num_layers = num_layers
        self.dtype = dtype
        self.device = device
        self.stats = LoRAStats()
        self._registered: dict[str, LoRARequest] = {}
        self._host: OrderedDict[str, LoRAWeights] = OrderedDict()  # least recent first
        self._active: OrderedDict[str, int] = OrderedDict()  # name -> slot, least recent first

    # ---- registration -------------------------------------------------------------------

    def register(self, request: LoRARequest) -> None:
        """Makes the adapter known and reads it to the host if it is not there: ValueError for
        one this engine cannot run, or a name or id already used by another adapter."""
        known = self._registered.get(request.lora_name)
        if known is not None and known != request:
            raise ValueError(
                f"LoRA adapter {request.lora_name!r} is already loaded as {known}; unload it first"
            )
        for other in self._registered.values():
            if other.lora_int_id == request.lora_int_id and other.lora_name != request.lora_name:
                raise ValueError(
                    f"lora_int_id {request.lora_int_id} is already used by {other.lora_name!r}"
                )
        self._host_weights(request)
        self._registered[request.lora_name] = request

    def unregister(self, lora_name: str) -> bool:
        """Forgets the adapter (its slot and host copy); False if it was not registered. The
        caller makes sure no request still runs with it."""
        if self._registered.pop(lora_name, None) is None:
            return False
        self._host.pop(lora_name, None)
        self._active.pop(lora_name, None)
        return True

    def registered(self) -> list[LoRARequest]:
        return list(self._registered.values())

    def resident(self) -> list[str]:
        """Names of the adapters in active slots, least recently used first."""
        return list(self._active)

    # ---- the step -----------------------------------------------------------------------

    def batch_for(self, chunks: Sequence[ScheduledChunk]) -> LoRABatch | None:
        """Activates the chunks' adapters and maps their rows (laid out in chunk order, as the
        runner flattens them) to slots; None when no chunk has an adapter."""
        names = {chunk.request.lora_name for chunk in chunks if chunk.request.lora_name}
        if not names:
            return None
        slots = self.activate(names)
        row_slots: list[int] = []
        for chunk in chunks:
            name = chunk.request.lora_name
            row_slots += [-1 if name is None else slots[name]] * chunk.num_tokens
        return make_batch(row_slots, self.dtype, self.device)

    def activate(self, names: set[str]) -> dict[str, int]:
        """Puts every adapter of `names` in a slot, evicting the least recently used others;
        name -> slot."""
        assert len(names) <= self.max_loras, (
            f"{len(names)} adapters in one step, max_loras is {self.max_loras}"
        )
        for name in sorted(names):
            if name in self._active:
                self._active.move_to_end(name)
            else:
                self._load_into_slot(name, protected=names)
        return {name: self._active[name] for name in names}

    def _load_into_slot(self, name: str, protected: set[str]) -> None:
        request = self._registered.get(name)
        assert request is not None, f"LoRA adapter {name!r} ran without being registered"
        used = set(self._active.values())
        free = [slot for slot in range(self.max_loras) if slot not in used]
        if free:
            slot = free[0]  # the lowest: batches then span fewer slots (batched.py's k)
        else:
            victim = next(n for n in self._active if n not in protected)
            slot = self._active.pop(victim)
            self.stats.num_slot_evictions += 1
        self.model.write_slot(slot, self._host_weights(request))
        self._active[name] = slot
        self.stats.num_slot_loads += 1

    def _host_weights(self, request: LoRARequest) -> LoRAWeights:
        name = request.lora_name
        weights = self._host.get(name)
        if weights is not None:
            self._host.move_to_end(name)
            return weights
        weights = load_peft_adapter(request.lora_path, self.max_rank, self.num_layers, self.dtype)
        self.model.check(weights, request.lora_path)
        self.stats.num_host_loads += 1
        while len(self._host) >= self.max_cpu_loras:
            self._host.popitem(last=False)
            self.stats.num_host_evictions += 1
        self._host[name] = weights
        return weights
