"""How long a decode partition should be so that the grid fills the GPU in whole waves.

Decode attention at batch 64 with 3 kv heads makes 192 (sequence, kv head) rows; split into
1024-token partitions of a 4096-token context that is 768 programs. On 132 SMs running 4
programs each, the second wave would be less than half full and the device idle through a
third of it. `balanced_partition_size` picks, among the partition counts, the
fewest whose waves are nearly as full as the fullest (fewer partitions: less to merge), the
way FlashAttention-2 picks its split count for decoding. The launch key `WAVE_SLOTS` (programs
one SM runs at once, tuned per GPU: it depends on the kernel's registers and shared memory)
turns it on; 0 keeps the table's fixed PARTITION_SIZE.
"""

from __future__ import annotations

import functools
import math

import torch

# Of the best wave efficiency over all partition counts, what a smaller count must reach.
NEAR_BEST_EFFICIENCY = 0.85
# The interpreter has no SMs; any count exercises the same choice.
INTERPRETER_SMS = 4


def balanced_partition_size(max_context: int, row_programs: int, slots: int, tile: int) -> int:
    """A multiple of `tile` for `max_context` tokens when each partition index launches
    `row_programs` programs and the device runs `slots` programs at once."""
    if max_context <= tile or slots <= 0:
        return max(tile, max_context)
    choices: dict[int, tuple[float, int]] = {}  # partitions -> (mean fill of its waves, size)
    for wanted in range(1, math.ceil(max_context / tile) + 1):
        size = math.ceil(max_context / wanted / tile) * tile
        partitions = math.ceil(max_context / size)
        waves = row_programs * partitions / slots
        choices.setdefault(partitions, (waves / math.ceil(waves), size))
    best = max(fill for fill, _ in choices.values())
    fewest = min(p for p, (fill, _) in choices.items() if fill >= NEAR_BEST_EFFICIENCY * best)
    return choices[fewest][1]


def program_slots(device: torch.device, slots_per_sm: int) -> int:
    return _multiprocessors(device) * slots_per_sm


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count
