"""What every service's command line shares: byte sizes as flag values and the log format."""

from __future__ import annotations

import argparse
import logging
import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_UNITS = {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text: str) -> int:
    """Bytes from "134217728", "128MiB", "128Mi", "1.5GB" (binary with i, decimal without)."""
    match = _SIZE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 134217728 or 128MiB)")
    number, unit = match.groups()
    unit = (unit or "").lower().removesuffix("b")
    scale = _BINARY_UNITS.get(unit) or _UNITS[unit]
    size = int(float(number) * scale)
    if size <= 0:
        raise argparse.ArgumentTypeError(f"size must be > 0, got {text!r}")
    return size


def setup_logging(level: str, name: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
    )
