"""Layer groups: how a model whose layers mix sliding windows and full attention (Gemma 2 and 3,
Qwen with `max_window_layers`) keeps its window layers' memory bounded by the window.

One block id names storage for every layer of the cache, so a window layer could only give back
the blocks of positions it no longer reads if every other layer did too, which a full-attention
layer never does. So the layers are split into groups of equal size, each group of one kind
(full attention, or one window size), and the cache tensor is `[slots_per_block, 2, num_blocks,
...]`: a block id holds `slots_per_block` layers' pages of ONE group, and each request holds one
block table per group. Every group draws its blocks from the one pool, so memory goes where the
sequences need it; a window group's table gives back blocks that fell out of its window, as an
all-window model's does (shared/kv/manager.py), while the full groups keep every position.

    Gemma 2, 26 layers alternating:  slots 13; group 0 = the 13 global layers, group 1 = the 13
                                     window layers
    Gemma 3, 26 layers, 5 local : 1 global: slots 4; group 0 = the 4 global layers, groups 1-6 =
                                     the 22 local layers (the last group has 2 slots unused)

Group 0 is always a full-attention group: its blocks are the ones the prefix index publishes and
the ones a request's plain `block_ids` name. vLLM's hybrid KV cache manager has the same shape.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.engine.model.architecture import ModelArchitecture


@dataclass(frozen=True)
class KVGroups:
    """Which group and slot each layer's pages live in (module docstring)."""

    slots_per_block: int
    group_windows: tuple[int, ...]  # per group: its layers' window (0 = full attention)
    layer_places: tuple[tuple[int, int], ...]  # per layer: (group, slot)

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    def place(self, layer: int) -> tuple[int, int]:
        return self.layer_places[layer]


# Each group costs a slot mapping and block tables per step (and a table per request): past
# this many, one group (no bounding) is the better trade.
MAX_GROUPS = 8


def plan_kv_groups(arch: ModelArchitecture) -> KVGroups | None:
    """The groups for `arch`, or None where one group holds every layer as before: no layer has
    a window, or every layer has one (the whole cache then releases what falls out of the
    widest window), a latent (MLA) cache, or more than MAX_GROUPS groups (one window layer
    among 28 would make 28 groups of one)."""
    windows = [arch.window_of(layer) for layer in range(arch.num_layers)]
    if arch.mla is not None or all(windows) or not any(windows):
        return None
    kinds: dict[int, list[int]] = {}  # window -> its layers, full attention (0) first
    for layer, window in sorted(enumerate(windows), key=lambda item: (item[1], item[0])):
        kinds.setdefault(window, []).append(layer)
    slots = min(len(layers) for layers in kinds.values())
    group_windows: list[int] = []
    places: dict[int, tuple[int, int]] = {}
    for window, layers in kinds.items():
        for start in range(0, len(layers), slots):
            group = len(group_windows)
            group_windows.append(window)
            for slot, layer in enumerate(layers[start : start + slots]):
                places[layer] = (group, slot)
    if len(group_windows) > MAX_GROUPS:
        return None
    return KVGroups(
        slots, tuple(group_windows), tuple(places[layer] for layer in range(arch.num_layers))
    )


def slots_in_cache(arch: ModelArchitecture, groups: KVGroups | None) -> int:
    """The cache tensor's first dimension: the model's layers, or a group's slots."""
    return arch.num_layers if groups is None else groups.slots_per_block
