"""`python -m splitserve.common.die_with_parent PARENT_PID PROGRAM ARGS...`: asks the kernel for
SIGTERM when the parent dies (PR_SET_PDEATHSIG), then execs PROGRAM in place.

Why a separate exec rather than `Popen(preexec_fn=...)`: a preexec_fn makes Python fork the
supervisor, and a fork of a process with live gRPC channels runs gRPC's fork handlers, which
can abort the child or the parent (`epoll_wait ... Bad file descriptor`, grpc/grpc#43055).
Without a preexec_fn, subprocess spawns with vfork and no Python code runs in between; the
death signal set here survives the exec.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: die_with_parent PARENT_PID PROGRAM [ARGS...]", file=sys.stderr)
        return 2
    parent_pid, program = int(argv[0]), argv[1:]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        print(f"prctl failed: errno {ctypes.get_errno()}", file=sys.stderr)
    if os.getppid() != parent_pid:
        return 1  # the parent died before the signal was armed: do not start an orphan
    os.execvp(program[0], program)
    return 127  # not reached: execvp raises on failure


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
