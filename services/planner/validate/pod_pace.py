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

Only decode steps that ran while no other pod of the stack was stepping count: beside a
neighbour's step a decode step is slower by the profile's neighbour slowdowns (16-28% on that
Zen 5), which the simulator applies on top of the pace, so a pace read off steps that already
carry them counted them twice (the first run, docs/benchmarks.md). Prefill steps count
whatever ran beside them: a neighbour slows them by 2-3% there, and a prompt's step of half a
second or more nearly always has a neighbour's decode step beside it under load.
"""

from __future__ import annotations

import bisect
import json
import math
import statistics
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
        pods = [read_steps(path, *window) for path in paths]
        every_step = [step for steps in pods for step in steps]
        alone = [step for steps in steps_alone(pods) for step in steps]
        return pod_pace(profile, every_step, alone)


def read_steps(path: Path, start_wall_s: float, end_wall_s: float) -> list[dict]:
    """One pod's step records (none when its file is missing) that started in the window."""
    records: list[dict] = []
    if not path.exists():
        return records
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a pod stopped mid-line leaves at most a partial last one
        if start_wall_s <= record["start"] <= end_wall_s:
            records.append(record)
    return records


def steps_alone(pods: list[list[dict]]) -> list[list[dict]]:
    """Each pod's steps that overlapped no step of another pod."""
    spans = [sorted((r["start"], r["start"] + r["seconds"]) for r in steps) for steps in pods]
    return [
        [r for r in steps if not any(_overlaps(r, spans[j]) for j in range(len(pods)) if j != i)]
        for i, steps in enumerate(pods)
    ]


def _overlaps(record: dict, spans: list[tuple[float, float]]) -> bool:
    """Whether `record`'s step overlaps any of `spans` (sorted by start)."""
    start, end = record["start"], record["start"] + record["seconds"]
    # Of the spans that start before this step ends, the last one also ends last (a pod's
    # steps never overlap each other), so it alone decides.
    index = bisect.bisect_left(spans, (end, -math.inf))
    return index > 0 and spans[index - 1][1] > start


def pod_pace(
    profile: Profile, prefill_steps: list[dict], decode_steps: list[dict]
) -> tuple[float, ...]:
    """(prefill, decode): the median ratio of the pods' steps to the profile's for the same
    work, prefill off `prefill_steps`, decode off `decode_steps` (steps of other kinds are
    skipped); () when either holds no step of its kind to judge by."""
    prefill = [
        r["seconds"] / profile.prefill_s(r["prompt_tokens"])
        for r in prefill_steps
        if r["decodes"] == 0 and r["prompt_chunks"] == 1
    ]
    decode = [
        r["seconds"]
        / profile.decode.step_s(r["decodes"], r["decode_context_tokens"] / r["decodes"])
        for r in decode_steps
        if r["decode_only"] and r["decodes"] > 0 and "decode_context_tokens" in r
    ]
    if not prefill or not decode:
        return ()
    factors = (statistics.median(prefill), statistics.median(decode))
    return factors if all(math.isfinite(f) and f > 0 for f in factors) else ()
