"""Which LoRA adapter a request runs with. Imports no torch: the gateway hashes with it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's shape: a name (what clients put in `"model"`), an integer id unique per adapter
    within an engine (> 0), and the directory of its PEFT checkpoint."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int):
            raise ValueError(f"lora_int_id must be an integer, got {self.lora_int_id!r}")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1, got {self.lora_int_id}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty string, got {self.lora_path!r}")


def lora_hash_keys(lora_name: str | None) -> tuple[str, ...]:
    """The extra block-hash keys of an adapter: cached blocks are shared among requests of the
    same adapter and never across adapters or with the base model. By name, not int id: the
    gateway, the prefill and the decode pods all know the name, the ids are per engine."""
    return () if lora_name is None else (f"lora:{lora_name}",)
