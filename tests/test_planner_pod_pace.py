"""The pods' own pace during a validated run, read off their step logs (`pod_pace.py`), and
the run simulated again at it."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from splitserve.planner.profile import synthetic_profile
from splitserve.planner.profile.parts import DecodeGrid
from splitserve.planner.validate.pod_pace import StepLogs, pod_pace, read_steps, steps_alone

# Decode steps that grow with their rows' context, so a ratio taken at the wrong context
# (their sum instead of their mean) is visibly off.
PROFILE = replace(
    synthetic_profile(0.05, prefill_per_token_s=1e-3),
    decode=DecodeGrid([1, 64], [16, 4096], [[0.010, 0.050], [0.020, 0.100]]),
)


def _prefill(tokens: int, factor: float, chunks: int = 1, start: float = 0.0) -> dict:
    seconds = factor * PROFILE.prefill_s(tokens)
    return dict(start=start, seconds=seconds, decodes=0, decode_context_tokens=0,
                prompt_tokens=tokens, prompt_chunks=chunks, decode_only=False)  # fmt: skip


def _decode(rows: int, mean_context: int, factor: float, start: float = 0.0) -> dict:
    seconds = factor * PROFILE.decode.step_s(rows, mean_context)
    return dict(start=start, seconds=seconds, decodes=rows,
                decode_context_tokens=rows * mean_context, prompt_tokens=0, prompt_chunks=0,
                decode_only=True)  # fmt: skip


def test_pace_is_the_median_ratio_of_each_kind_of_step() -> None:
    records = [
        _prefill(300, 1.2),
        _prefill(500, 1.2),
        _prefill(100, 3.0),  # one slow step does not move the median
        _decode(1, 400, 1.3),
        _decode(8, 2000, 1.3),
        _decode(4, 1000, 1.3),
    ]
    prefill, decode = pod_pace(PROFILE, records, records)
    assert prefill == pytest.approx(1.2)
    assert decode == pytest.approx(1.3)


def test_steps_that_mix_work_are_not_judged() -> None:
    # Two prompts in one step, and a step with prompt and decode rows together: the profile
    # times neither shape, so they must not move the pace.
    mixed = dict(_decode(2, 500, 5.0), prompt_tokens=200, prompt_chunks=1, decode_only=False)
    records = [_prefill(400, 1.1), _prefill(512, 4.0, chunks=2), mixed, _decode(2, 500, 0.9)]
    assert pod_pace(PROFILE, records, records) == pytest.approx((1.1, 0.9))


def test_no_pace_without_both_kinds_of_step() -> None:
    prefill, decode = [_prefill(300, 1.2)], [_decode(1, 300, 1.2)]
    assert pod_pace(PROFILE, prefill, prefill) == ()
    assert pod_pace(PROFILE, decode, decode) == ()
    assert pod_pace(PROFILE, decode, prefill) == ()  # each kind from its own list
    old_log = {k: v for k, v in decode[0].items() if k != "decode_context_tokens"}
    assert pod_pace(PROFILE, prefill, [old_log]) == ()


def test_steps_are_read_within_the_runs_window(tmp_path) -> None:
    path = tmp_path / "steps.11.jsonl"
    lines = [json.dumps(_prefill(300, 1.0, start=t)) for t in (5.0, 10.0, 12.0, 20.0)]
    # A pod stopped mid-write leaves a partial last line.
    path.write_text("\n".join(lines) + '\n{"start": 1')
    assert [r["start"] for r in read_steps(path, 10.0, 15.0)] == [10.0, 12.0]
    assert read_steps(tmp_path / "steps.12.jsonl", 0.0, 99.0) == []


def test_only_steps_no_other_pod_ran_beside_count() -> None:
    # Pod A steps over [0, 1), [1, 2), [5, 6); pod B over [1.5, 1.7) and [3, 4): A's second
    # step ran beside B's first, the rest alone.
    a = [_decode(1, 300, 1.0, start=t) | {"seconds": 1.0} for t in (0.0, 1.0, 5.0)]
    b = [_decode(1, 300, 1.0, start=t) | {"seconds": s} for t, s in ((1.5, 0.2), (3.0, 1.0))]
    alone_a, alone_b = steps_alone([a, b])
    assert [r["start"] for r in alone_a] == [0.0, 5.0]
    assert [r["start"] for r in alone_b] == [3.0]
    assert steps_alone([a]) == [a]  # one pod: every step is alone


def test_a_stacks_pace_leaves_out_steps_slowed_by_a_neighbour(tmp_path) -> None:
    # The decode pod's steps ran at x1.1 alone and x1.5 beside the prefill pod's prompts:
    # the decode pace is the alone one (the simulator adds the neighbour's slowdown itself);
    # the prompts' steps count though a decode step ran beside each.
    prefill = [_prefill(400, 1.2, start=t) for t in (0.0, 10.0)]
    width = prefill[0]["seconds"]
    beside = [_decode(2, 500, 1.5, start=t) for t in (0.01, 0.1, 10.05)]
    alone = [_decode(2, 500, 1.1, start=width + 1.0 + 0.2 * i) for i in range(2)]
    logs = StepLogs(tmp_path / "steps")
    for pid, records in ((1, prefill), (2, beside + alone)):
        lines = [json.dumps(r) for r in sorted(records, key=lambda r: r["start"])]
        (tmp_path / f"steps.{pid}.jsonl").write_text("\n".join(lines) + "\n")
    assert logs.pods_pace(PROFILE, [1, 2], (0.0, 60.0)) == pytest.approx((1.2, 1.1))
