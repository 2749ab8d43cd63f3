"""Serving costs taken against the engine's pace of the same minute (`measure/pace.py`)."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from splitserve.loadgen.stacks import usable_cores
from splitserve.planner.measure.engine_steps import load_engine
from splitserve.planner.measure.local_stacks import (
    COLOCATED_1,
    ONE_P_ONE_D,
    pace_cores,
    running_stack,
)
from splitserve.planner.measure.pace import EnginePace, PaceCores, PaceSample, pace_factors
from splitserve.planner.measure.settings import ProfileSettings
from splitserve.planner.profile import synthetic_profile
from splitserve.planner.profile.parts import MixedGrid


def _profile():
    profile = synthetic_profile(0.05, prefill_per_token_s=0.002, decode_step_s=0.03)
    # A mixed grid, so that its scaling shows: 10 ms beyond its parts at every point.
    mixed = MixedGrid(
        [1, 4],
        [32, 128],
        64,
        [
            [profile.prefill_s(n) + profile.decode.step_s(b, 64) + 0.01 for n in (32, 128)]
            for b in (1, 4)
        ],
    )
    return replace(profile, mixed=mixed)


def test_a_profile_at_another_pace_scales_prefill_and_decode_apart() -> None:
    profile = _profile()
    paced = profile.at_pace(1.25, 0.8)
    for num_tokens in (16, 98, 467):
        assert paced.prefill_s(num_tokens) == pytest.approx(1.25 * profile.prefill_s(num_tokens))
    for batch, context in ((1, 64), (4, 600)):
        assert paced.decode.step_s(batch, context) == pytest.approx(
            0.8 * profile.decode.step_s(batch, context)
        )
    # A mixed step is mostly its prompt's compute: it moves with prefill.
    assert paced.mixed.seconds[1][1] == pytest.approx(1.25 * profile.mixed.seconds[1][1])
    assert paced.kv_transfer == profile.kv_transfer
    with pytest.raises(ValueError):
        profile.at_pace(0.0, 1.0)


def test_pace_factors_are_the_median_ratios_to_the_profile() -> None:
    profile = _profile()
    samples = [
        PaceSample(n, 1.2 * profile.prefill_s(n), 0.9 * profile.decode.step_s(1, n + 2))
        for n in (64, 98, 128, 400, 467)
    ]
    # One request whose engine timing was disturbed does not move the medians.
    samples.append(PaceSample(100, 5 * profile.prefill_s(100), 3 * profile.decode.step_s(1, 102)))
    prefill, decode = pace_factors(profile, samples)
    assert prefill == pytest.approx(1.2) and decode == pytest.approx(0.9)
    with pytest.raises(ValueError):
        pace_factors(profile, [])


def test_the_pace_times_a_real_engine_on_the_pods_cores_and_leaves_no_pin(
    tiny_hf_checkpoint: str,
) -> None:
    """The prefill step on the prefilling pod's core, the decode steps on the decode pod's."""
    engine = load_engine(ProfileSettings(model=tiny_hf_checkpoint), lambda line: None)
    before = os.sched_getaffinity(0)
    prefill_core, decode_core = sorted(before)[0], sorted(before)[-1]
    pins_seen: list[set[int]] = []
    step = engine.step

    def step_and_note_the_pin():
        pins_seen.append(os.sched_getaffinity(0))
        return step()

    engine.step = step_and_note_the_pin
    sample = EnginePace(engine).sample(40, PaceCores(prefill_core, decode_core))
    assert sample.num_tokens == 40
    assert sample.prefill_s > 0 and sample.decode_s > 0
    assert pins_seen[0] == {prefill_core}
    assert all(pin == {decode_core} for pin in pins_seen[1:5])
    assert not engine.has_unfinished_requests()  # its request ran to the end: no KV left held
    assert os.sched_getaffinity(0) == before


@pytest.mark.parametrize("config", [COLOCATED_1, ONE_P_ONE_D], ids=lambda c: c.name)
def test_a_local_stack_keeps_its_serving_path_off_the_decode_pods_core(config) -> None:
    # Left to the scheduler, the gateway and the client sat on the pod's core in some stacks
    # and not in others, and the serving costs read 0 or 12 ms a step from one to the next.
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs, as the local stacks do")
    before = os.sched_getaffinity(0)
    cores = usable_cores()
    serving = {cores[config.serving_core]}
    with running_stack(config) as stack:
        assert os.sched_getaffinity(0) == serving  # the client
        assert os.sched_getaffinity(stack.process("gateway").pid) == serving
        for name, core in zip(config.pins, cores):
            assert os.sched_getaffinity(stack.process(name).pid) == {core}
        # Paced where the pods run: the prompt on the prefilling pod's core, the tokens on
        # the decode pod's, which the serving path keeps off.
        paced = pace_cores(config, stack)
        assert (paced.prefill, paced.decode) == (cores[0], cores[config.num_prefill])
        assert serving != {paced.decode}
    assert os.sched_getaffinity(0) == before
