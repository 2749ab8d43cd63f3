"""`python services/loadgen/pin.py CPUS -- PROGRAM ARGS...`: runs PROGRAM on the CPUs given
("0", "1", "0,1"). Run by path, not `-m`: it needs nothing on the path and imports nothing
of ours.

The affinity is set before exec, so every thread PROGRAM starts later (torch's OpenMP pool
included) inherits it; setting it on a running pid would pin only the main thread. exec keeps
the pid, so the supervisor's process-group signals and its parent-death signal still apply.
"""

from __future__ import annotations

import os
import sys


def parse_cpus(text: str) -> set[int]:
    try:
        cpus = {int(part) for part in text.split(",") if part.strip()}
    except ValueError:
        raise ValueError(f"cpus must be comma-separated CPU numbers, got {text!r}") from None
    if not cpus or min(cpus) < 0:
        raise ValueError(f"cpus must name at least one CPU number >= 0, got {text!r}")
    return cpus


def wrap(cpus: set[int], argv: list[str]) -> list[str]:
    """`argv` run through this wrapper on `cpus`."""
    cpu_list = ",".join(str(cpu) for cpu in sorted(cpus))
    return [sys.executable, os.path.abspath(__file__), cpu_list, "--", *argv]


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "--":
        raise SystemExit("usage: pin.py CPUS -- PROGRAM [ARGS...]")
    os.sched_setaffinity(0, parse_cpus(argv[0]))
    os.execvp(argv[2], argv[2:])


if __name__ == "__main__":
    main(sys.argv[1:])
