"""The pace the pods themselves ran at during a validated run, read off their step logs.

`drift.py` times the bare engine just before and just after each run, on the pods' cores.
On a VM whose speed walks by a tenth within a minute that brackets the run loosely: on a Zen 5
EPYC (2026-12-03) the engine ran a profile's prefill at x1.13 before a one-minute run and x1.24
after it, while the prefill pod's own steps in between ran at x1.17 (docs/benchmarks.md). So
`plan validate` starts its stacks with `SPLITSERVE_STEP_LOG` (engine/step_log.py) and reads
each pod's steps of the run back: every prefill-only step of one prompt against the profile's
prefill of that length, every decode-only step against the profile's decode step at its rows
and their mean context. The medians are the run's (prefill, decode) pace, a diagnostic like
the bare engine's: the planner cannot know it before the run.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from splitserve.planner.profile import Profile


@dataclass(frozen=True)
class StepLogs:
    """Where a stack's engines log their steps: `<prefix>.<pid>.jsonl`."""

    prefix: Path

    def pods_pace(
        self, profile: Profile, pids: list[int], window: tuple[float, float]
    ) -> tuple[float, ...]:
        """The pace of the pods `pids` over `window` (wall-clock seconds), `pod_pace`'s."""
        paths = [Path(f"{self.prefix}.{pid}.jsonl") for pid in pids]
        return pod_pace(profile, read_steps(paths, *window))


def read_steps(paths: Iterable[Path], start_wall_s: float, end_wall_s: float) -> list[dict]:
    """The step records of `paths` (missing files hold none) that started in the window."""
    records = []
    for path in paths:
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            if not line.strip():
                continue  # a pod stopped mid-line leaves at most a partial last one
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if start_wall_s <= record["start"] <= end_wall_s:
                records.append(record)
    return records


def pod_pace(profile: Profile, records: list[dict]) -> tuple[float, ...]:
    """(prefill, decode): the median ratio of the pods' steps to the profile's for the same
    work; () when the records hold no step of either kind to judge by."""
    prefill = [
        r["seconds"] / profile.prefill_s(r["prompt_tokens"])
        for r in records
        if r["decodes"] == 0 and r["prompt_chunks"] == 1
    ]
    decode = [
        r["seconds"]
        / profile.decode.step_s(r["decodes"], r["decode_context_tokens"] / r["decodes"])
        for r in records
        if r["decode_only"] and r["decodes"] > 0 and "decode_context_tokens" in r
    ]
    if not prefill or not decode:
        return ()
    factors = (statistics.median(prefill), statistics.median(decode))
    return factors if all(math.isfinite(f) and f > 0 for f in factors) else ()
