"""`SPLITSERVE_STEP_LOG`: one JSON line per engine step, written by a real engine."""

from __future__ import annotations

import json

from splitserve import LLM, SamplingParams
from splitserve.engine.step_log import ENV_VAR, StepLog


def test_every_step_is_one_line_with_its_shape(
    single_thread, tiny_hf_checkpoint, tmp_path, monkeypatch
):
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "steps"))
    llm = LLM(tiny_hf_checkpoint, kv_cache_bytes=16 * 2**20, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    llm.generate([[17] * 40, [18] * 3], params)
    (path,) = tmp_path.glob("steps.*.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    # 43 prompt tokens in 32-token steps, then decodes: every step is there, in order.
    assert sum(row["prompt_tokens"] for row in rows) == 43
    assert rows[0]["prompt_tokens"] == 32 and not rows[0]["decode_only"]
    assert rows[-1] == rows[-1] | {"decode_only": True, "prompt_tokens": 0, "prompt_chunks": 0}
    assert sum(row["decodes"] for row in rows) == 2 * 5 - 2  # each first token ends a prompt
    # The last step computes both requests' fourth output token: the rows attend over 40 + 4
    # and 3 + 4 positions (the prompt, the three tokens before and the new one).
    assert rows[-1]["decodes"] == 2 and rows[-1]["decode_context_tokens"] == 44 + 7
    assert all(row["seconds"] > 0 and row["threads"] >= 1 for row in rows)
    assert [row["start"] for row in rows] == sorted(row["start"] for row in rows)


def test_no_variable_no_log(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert StepLog.from_environment() is None
