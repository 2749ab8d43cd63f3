"""Keeps glibc from handing large freed blocks back to the OS between layers.

An engine step allocates the same multi-megabyte temporaries in every layer (activations, the
gathered K/V). glibc serves blocks above its mmap threshold with fresh mappings and unmaps them
on free, so every layer pays the page faults of zero-filling them again. Raising the mmap and
trim thresholds lets freed memory be reused from the heap instead.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc caps the mmap threshold at 32 MiB on 64-bit systems; larger requests are mmap'ed anyway.
_MMAP_THRESHOLD_BYTES = 32 * 2**20
_TRIM_THRESHOLD_BYTES = 1 * 2**30


def keep_freed_memory_in_heap() -> bool:
    """Returns whether the thresholds were set (False off glibc, where nothing is done)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES) and mallopt(
        _M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES
    )
    if not ok:
        logger.warning("mallopt refused the allocator thresholds; continuing without them")
    return bool(ok)
