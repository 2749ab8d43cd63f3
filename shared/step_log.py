"""One JSON line per engine step, for finding what stalls a stream (`SPLITSERVE_STEP_LOG`).

    SPLITSERVE_STEP_LOG=/tmp/steps splitserve up ...   # each engine writes /tmp/steps.<pid>.jsonl

Each line: the step's start on the wall clock (`time.time()`, to line up with a client's token
times) and its seconds, its decode rows and the positions they attend over together (what a
profile's decode step is timed by), its prompt tokens and chunks, the torch threads it ran
with and whether it was decode-only. A step observer: it sees every forward pass the engine
runs, in order, on the engine thread; the file is line-buffered, so a killed pod leaves every
step before its end.
"""

from __future__ import annotations

import json
import os
import time
from typing import TextIO

import torch

from splitserve.engine.step import StepResult

ENV_VAR = "SPLITSERVE_STEP_LOG"


class StepLog:
    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        # StepResult's times are time.monotonic(); the log gives wall-clock starts.
        self._wall_offset = time.time() - time.monotonic()

    @classmethod
    def from_environment(cls) -> StepLog | None:
        """A log at `$SPLITSERVE_STEP_LOG.<pid>.jsonl`, or None when the variable is unset."""
        prefix = os.environ.get(ENV_VAR)
        if not prefix:
            return None
        return cls(open(f"{prefix}.{os.getpid()}.jsonl", "a", buffering=1))  # noqa: SIM115

    def observe(self, step: StepResult) -> None:
        chunks = step.sched.chunks
        prompt = [chunk for chunk in chunks if not chunk.is_decode]
        decodes = [chunk for chunk in chunks if chunk.is_decode]
        record = {
            "start": round(step.start_time + self._wall_offset, 6),
            "seconds": round(step.seconds, 6),
            "decodes": len(decodes),
            "decode_context_tokens": sum(c.start_position + c.num_tokens for c in decodes),
            "prompt_tokens": sum(chunk.num_tokens for chunk in prompt),
            "prompt_chunks": len(prompt),
            "threads": torch.get_num_threads(),
            "decode_only": not prompt,
        }
        self._stream.write(json.dumps(record) + "\n")
