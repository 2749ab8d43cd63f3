"""Steps beside another pod on the same machine (`plan profile --neighbor-core N`, and
`plan validate --fresh-profile`): the profile's `neighbor` slowdowns.

Pods that share a machine share its memory bandwidth and last-level cache, so a step takes
longer while another pod's runs. A second engine process, pinned to `neighbor_core` with the
same settings, loops over decode steps (a batch of DECODE_BATCH) or prefill steps
(PREFILL_TOKENS-token prompts) on command, while this process times its own steps of both
kinds: alone, beside decodes, beside prefills, in ROUNDS rounds. Each slowdown is the ratio of
the medians less one (0 where noise makes it negative), averaged over the rounds.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import time

from splitserve.planner.measure.engine_steps import (
    Log,
    add_request,
    drain,
    fresh_tokens,
    load_engine,
    timed_step,
    warm_up,
)
from splitserve.planner.measure.settings import ProfileSettings
from splitserve.planner.profile.parts import NeighborSlowdown

DECODE_BATCH = 2
DECODE_PROMPT_TOKENS = 64
DECODE_STEPS = 20
PREFILL_TOKENS = 256
PREFILL_STEPS = 4
# Rounds of (alone, beside decodes, beside prefills), the mean slowdown of each pair kept. The
# slowdown comes and goes: with the neighbor running 64 decode steps in 2 s beside it, one
# window found a decode step 39% longer and the next 1% (the neighbor's steps slowed
# instead); the simulator wants the average over a run, so the mean of several windows.
ROUNDS = 5
START_TIMEOUT_S = 300.0
NEIGHBOR_DECODE_TOKENS = 16  # its decodes end (and restart) often, so it turns quickly
SETTLE_S = 1.0  # for the neighbor's loop to be running its new kind of step
IDLE, DECODE, PREFILL, STOP = range(4)
_MODES = {None: IDLE, "decode": DECODE, "prefill": PREFILL}


def measure_neighbor(engine, settings: ProfileSettings, log: Log) -> NeighborSlowdown:
    """`engine` (this process, pinned by the caller) timed alone and beside a neighbor engine
    on `settings.neighbor_core`."""
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked torch state
    mode = context.Value("i", IDLE)
    steps = context.Value("i", 0)  # the neighbor's steps so far: did it really run beside?
    ready = context.Event()
    neighbor = context.Process(
        target=_neighbor_loop,
        args=(settings, mode, steps, ready),
        name="profile-neighbor",
        daemon=True,
    )
    log(f"neighbor: starting a second engine on CPU {settings.neighbor_core}")
    neighbor.start()
    try:
        if not ready.wait(START_TIMEOUT_S):
            raise RuntimeError("the neighbor engine did not start")
        rounds = [_one_round(engine, mode, steps, neighbor, log) for _ in range(ROUNDS)]
    finally:
        mode.value = STOP
        neighbor.join(timeout=30)
        if neighbor.is_alive():
            neighbor.terminate()
    return NeighborSlowdown(
        **{name: statistics.fmean(getattr(r, name) for r in rounds) for name in _PAIRS}
    )


_PAIRS = (
    "decode_beside_decode",
    "decode_beside_prefill",
    "prefill_beside_decode",
    "prefill_beside_prefill",
)


def _one_round(engine, mode, steps, neighbor, log: Log) -> NeighborSlowdown:
    medians = {}
    for kind in (None, "decode", "prefill"):
        mode.value = _MODES[kind]
        time.sleep(SETTLE_S)
        steps_before, started = steps.value, time.monotonic()
        medians[kind] = (_decode_step_s(engine), _prefill_step_s(engine))
        neighbor_steps, seconds = steps.value - steps_before, time.monotonic() - started
        if not neighbor.is_alive():
            raise RuntimeError("the neighbor engine exited while measuring")
        log(
            f"neighbor: beside {kind or 'nothing'}: decode {medians[kind][0] * 1e3:.1f} "
            f"ms/step, prefill {medians[kind][1] * 1e3:.1f} ms/step (the neighbor ran "
            f"{neighbor_steps} steps in {seconds:.1f} s)"
        )
    mode.value = IDLE
    return _slowdowns(medians)


def _slowdowns(medians: dict) -> NeighborSlowdown:
    (decode_alone, prefill_alone) = medians[None]

    def beyond(seconds: float, alone: float) -> float:
        return max(seconds / alone - 1.0, 0.0)

    return NeighborSlowdown(
        decode_beside_decode=beyond(medians["decode"][0], decode_alone),
        decode_beside_prefill=beyond(medians["prefill"][0], decode_alone),
        prefill_beside_decode=beyond(medians["decode"][1], prefill_alone),
        prefill_beside_prefill=beyond(medians["prefill"][1], prefill_alone),
    )


def _decode_step_s(engine) -> float:
    for _ in range(DECODE_BATCH):
        add_request(engine, fresh_tokens(DECODE_PROMPT_TOKENS), DECODE_STEPS + 2)
    engine.step()  # the prompts
    times = [timed_step(engine) for _ in range(DECODE_STEPS)]
    drain(engine)
    return statistics.median(times)


def _prefill_step_s(engine) -> float:
    times = []
    for _ in range(PREFILL_STEPS):
        add_request(engine, fresh_tokens(PREFILL_TOKENS), 1)
        times.append(timed_step(engine))
        drain(engine)
    return statistics.median(times)


def _neighbor_loop(settings, mode, steps, ready) -> None:
    """The second engine: the kind of step `mode` names, over and over, until STOP."""
    os.sched_setaffinity(0, {settings.neighbor_core})
    engine = load_engine(settings, lambda message: None)
    warm_up(engine)
    ready.set()
    while mode.value != STOP:
        if mode.value == DECODE:
            for _ in range(DECODE_BATCH):
                add_request(engine, fresh_tokens(DECODE_PROMPT_TOKENS), NEIGHBOR_DECODE_TOKENS)
            while mode.value == DECODE and engine.has_unfinished_requests():
                engine.step()
                steps.value += 1
            drain(engine)
        elif mode.value == PREFILL:
            add_request(engine, fresh_tokens(PREFILL_TOKENS), 1)
            drain(engine)
            steps.value += 1
        else:
            time.sleep(0.01)
