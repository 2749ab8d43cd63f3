"""The pods' own pace during a validated run, read off their step logs (`pod_pace.py`), and
the run simulated again at it."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from splitserve.planner.profile import synthetic_profile
from splitserve.planner.profile.parts import DecodeGrid
from splitserve.planner.validate.pod_pace import pod_pace, read_steps

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
    prefill, decode = pod_pace(PROFILE, records)
    assert prefill == pytest.approx(1.2)
    assert decode == pytest.approx(1.3)


def test_steps_that_mix_work_are_not_judged() -> None:
    # Two prompts in one step, and a step with prompt and decode rows together: the profile
    # times neither shape, so they must not move the pace.
    mixed = dict(_decode(2, 500, 5.0), prompt_tokens=200, prompt_chunks=1, decode_only=False)
    records = [_prefill(400, 1.1), _prefill(512, 4.0, chunks=2), mixed, _decode(2, 500, 0.9)]
    assert pod_pace(PROFILE, records) == pytest.approx((1.1, 0.9))


def test_no_pace_without_both_kinds_of_step() -> None:
    assert pod_pace(PROFILE, [_prefill(300, 1.2)]) == ()
    assert pod_pace(PROFILE, [_decode(1, 300, 1.2)]) == ()
    old_log = {k: v for k, v in _decode(1, 300, 1.2).items() if k != "decode_context_tokens"}
    assert pod_pace(PROFILE, [_prefill(300, 1.2), old_log]) == ()


def test_steps_are_read_within_the_runs_window(tmp_path) -> None:
    first, second = tmp_path / "steps.11.jsonl", tmp_path / "steps.12.jsonl"
    first.write_text(
        "\n".join(json.dumps(_prefill(300, 1.0, start=t)) for t in (5.0, 10.0, 20.0)) + "\n"
    )
    # A pod stopped mid-write leaves a partial last line.
    second.write_text(json.dumps(_decode(1, 300, 1.0, start=12.0)) + '\n{"start": 1')
    records = read_steps([first, second, tmp_path / "steps.13.jsonl"], 10.0, 15.0)
    assert sorted(r["start"] for r in records) == [10.0, 12.0]
