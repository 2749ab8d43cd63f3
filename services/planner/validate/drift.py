"""The machine's drift around each validated run, told apart from the model's error.

On a shared VM the same engine runs a step a tenth to a third slower or faster from one minute
to the next (2026-12-02, an EPYC: batch-1 decode 49 ms in the profile, ~43 ms in the runs a few
minutes later). The planner cannot know the minute it will run in, so its figures stand as they
are; but a validation that only prints them cannot say whether a miss is the simulator's or the
machine's. So with a fresh profile (its engine still loaded), the bare engine is timed just
before and just after each measured run, on the cores of the stack's pods (idle then), and
the run is simulated a third time with the profile at that pace: a diagnostic printed beside the
planner's figures, never in their place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from splitserve.planner.measure.pace import EnginePace, PaceCores, PaceSample, pace_factors
from splitserve.planner.profile import Profile

SAMPLES_PER_SIDE = 2  # lone prompts timed before and after a run (a few seconds each side)


@dataclass
class RunPace:
    """Paces the bare engine on prompts of a run's mean length, around the run."""

    pace: EnginePace
    cores: PaceCores
    num_tokens: int
    samples: list[PaceSample]

    @classmethod
    def start(cls, pace: EnginePace, cores: PaceCores, num_tokens: int) -> RunPace:
        run_pace = cls(pace, cores, num_tokens, [])
        run_pace._sample()
        return run_pace

    def finish(self, profile: Profile) -> tuple[float, float]:
        """(prefill, decode) factors of the engine around the run to the profile's steps."""
        self._sample()
        return pace_factors(profile, self.samples)

    def _sample(self) -> None:
        for _ in range(SAMPLES_PER_SIDE):
            self.samples.append(self.pace.sample(self.num_tokens, self.cores))


def format_drift(comparisons: list, tolerance: float) -> str:
    """The paces around the runs (`Comparison.engine_pace`), the pods' own during them
    (`Comparison.pod_pace`), and how the planner's model fares at each; empty without."""
    engine = _pace_block(
        [(c, c.engine_pace, c.errors_at_pace()) for c in comparisons if len(c.engine_pace) == 2],
        "the machine's drift: the bare engine around each run ran the profile's prefill steps "
        "at {prefill} and its decode steps at {decode};",
        "the planner's model at each run's pace",
        "(a diagnostic: the planner cannot know the pace of a later minute)",
        tolerance,
    )
    pods = _pace_block(
        [(c, c.pod_pace, c.errors_at_pod_pace()) for c in comparisons if len(c.pod_pace) == 2],
        "the pods' own steps during the runs (their step logs) ran the profile's prefill at "
        "{prefill} and its decode at {decode};",
        "the planner's model at the pods' own pace",
        "(a diagnostic, as above)",
        tolerance,
    )
    return "\n".join(block for block in (engine, pods) if block)


def _pace_block(
    paced: list[tuple], headline: str, label: str, caveat: str, tolerance: float
) -> str:
    """One kind of pace: its range over the runs (`headline` with {prefill} and {decode}),
    the model's errors at it in all, then run by run; empty without paced runs. `paced`
    holds (comparison, (prefill, decode), errors at that pace)."""
    if not paced:
        return ""
    errors = [error for *_, by_key in paced for error in by_key.values() if not math.isnan(error)]
    within = sum(abs(error) <= tolerance for error in errors)
    mean = sum(errors) / len(errors) if errors else math.nan
    prefill = [pace[0] for _, pace, _ in paced]
    decode = [pace[1] for _, pace, _ in paced]
    lines = [
        headline.format(
            prefill=f"x{min(prefill):.2f}-{max(prefill):.2f}",
            decode=f"x{min(decode):.2f}-{max(decode):.2f}",
        ),
        f"  {label}: {within}/{len(errors)} within {tolerance:.0%}, mean error {mean:+.1%} "
        + caveat,
    ]
    for c, pace, by_key in paced:
        listed = ", ".join(f"{key} {error:+.0%}" for key, error in by_key.items())
        lines.append(
            f"  {c.config:<12} {c.workload:<12} prefill x{pace[0]:.2f} decode "
            f"x{pace[1]:.2f}: {listed}"
        )
    return "\n".join(lines)
