"""Short steps for less important prompts, from the flags to the engine: `splitserve up` gives
every pod the background cap, a pod's flag reaches the engine's scheduler, and the engine,
with the shipped model, computes an important prompt arriving beside a long background one in
steps of its own (the scheduler's exact rules are in test_scheduler.py)."""

from __future__ import annotations

import argparse

import pytest

from splitserve.cli import build_parser
from splitserve.engine.config import EngineConfig
from splitserve.engine.llm import LLM
from splitserve.engine.sampling_params import SamplingParams
from splitserve.launcher import UP_MAX_BACKGROUND_PREFILL_TOKENS, plan
from splitserve.pod.flags import add_engine_flags, engine_options

FLAG = "--max-background-prefill-tokens"


def _pod_argv(*up_flags: str) -> dict[str, list[str]]:
    args = build_parser().parse_args(["up", *up_flags])
    return {spec.name: spec.argv for spec in plan(args, prefill_available=True).specs}


def test_up_gives_every_pod_the_background_cap_and_zero_turns_it_off():
    pods = {name: argv for name, argv in _pod_argv().items() if name != "gateway"}
    assert {"prefill-0", "decode-0"} <= set(pods)
    for argv in pods.values():
        assert argv[argv.index(FLAG) + 1] == str(UP_MAX_BACKGROUND_PREFILL_TOKENS)
    assert all(FLAG not in argv for argv in _pod_argv(FLAG, "0").values())
    with pytest.raises(ValueError, match=f"{FLAG} must be >= 0"):
        _pod_argv(FLAG, "-1")


def test_a_pods_flag_reaches_the_scheduler_config():
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    options = engine_options(parser.parse_args([FLAG, "64"]))
    config = EngineConfig.from_options(None, **options)
    assert config.scheduler.max_background_prefill_tokens == 64
    with pytest.raises(SystemExit):
        parser.parse_args([FLAG, "0"])


def _greedy_run(llm: LLM, prompts: dict[str, tuple[list[int], int]]) -> tuple[dict, list]:
    """Each prompt's greedy tokens, and each step's plan [(request id, tokens)]: the
    important prompt ("vip") is added after the background one's first step."""
    engine = llm.engine
    schedule = engine.scheduler.schedule
    steps: list[list[tuple[str, int]]] = []

    def recorded():
        out = schedule()
        steps.append([(c.request.request_id, c.num_tokens) for c in out.chunks])
        return out

    engine.scheduler.schedule = recorded
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    tokens: dict[str, list[int]] = {name: [] for name in prompts}
    for name, (prompt, priority) in prompts.items():
        engine.add_request(name, prompt, greedy, priority=priority)
        if name == "bulk":
            for delta in engine.step():
                tokens[delta.request_id] += delta.token_ids
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[delta.request_id] += delta.token_ids
    return tokens, steps


def test_the_engine_steps_an_important_prompt_apart_and_the_tokens_do_not_change():
    bulk = [1000 + (i * 37) % 20000 for i in range(200)]
    vip = [500 + (i * 53) % 20000 for i in range(40)]
    prompts = {"bulk": (bulk, 1), "vip": (vip, 0)}
    capped, steps = _greedy_run(
        LLM(max_num_batched_tokens=64, max_background_prefill_tokens=16), prompts
    )
    alike, _ = _greedy_run(LLM(max_num_batched_tokens=64), prompts)
    assert capped == alike and all(len(t) == 4 for t in capped.values())
    assert steps[1] == [("vip", 40)]  # the running bulk prompt waits out vip's step
    prompt_steps = [s for s in steps[2:] if any(n > 1 for _, n in s)]
    # Until vip has finished (4 tokens), bulk's prompt runs 16 tokens a step beside its decode.
    assert prompt_steps[0] == [("vip", 1), ("bulk", 16)]
