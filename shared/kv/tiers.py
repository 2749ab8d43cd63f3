"""Where a cached KV block lives: the memory hierarchy a pod's prefix cache spans.

Tier 1 is the engine's KV pool (the tensors attention reads: GPU memory, or the pool in host
memory on a CPU machine). Blocks evicted from it can be written down to tier 2 (a larger store
in host memory) and from there to tier 3 (files on local disk), and loaded back when a prompt's
prefix hits them. Torch-free: the block pool, the events and the gateway's index share it.
"""

from __future__ import annotations

import enum


class Tier(enum.IntEnum):
    """Ordered fastest first, so `min` of a block's tiers is the one to load it from."""

    DEVICE = 1
    HOST = 2
    DISK = 3

    @property
    def label(self) -> str:
        """The name in metrics, the Redis index and the API ("device", "host", "disk")."""
        return self.name.lower()
