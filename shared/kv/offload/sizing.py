"""How large the host tier is when asked for "auto": a share of the memory this process may
still use, after the engine's own pool when that pool lives in host memory too.

"The memory this process may still use" is the smaller of the machine's MemAvailable and the
room left under its cgroup's limit: inside a Kubernetes pod /proc/meminfo shows the node, while
the pod is killed at its own limit.
"""

from __future__ import annotations

from pathlib import Path

# Half of what is left: the rest stays for the process's own growth, page cache (the disk
# tier's files), and other processes on the machine.
AUTO_HOST_FRACTION = 0.5
_CGROUP = Path("/sys/fs/cgroup")


def auto_host_tier_bytes(pool_bytes_in_host_memory: int) -> int:
    available = linux_mem_available()
    room = cgroup_room_bytes()
    if room is not None:
        available = min(available, room)
    return max(0, int(AUTO_HOST_FRACTION * (available - pool_bytes_in_host_memory)))


def linux_mem_available() -> int:
    """MemAvailable of /proc/meminfo, in bytes (torch-free: the launcher sizes tiers too)."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable not found in /proc/meminfo")


def cgroup_room_bytes() -> int | None:
    """memory.max - memory.current of this process's cgroup (v2), or None without a limit."""
    try:
        limit = (_CGROUP / "memory.max").read_text().strip()
        current = int((_CGROUP / "memory.current").read_text())
    except (OSError, ValueError):
        return None
    if limit == "max":
        return None
    return max(0, int(limit) - current)
