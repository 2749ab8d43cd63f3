"""What a request would see on the pods as they stand: its time to first token and time per
output token, predicted from each pod's reported load and fitted step costs
(services/common/step_costs.py), and how many rows a decode pod can run before its steps
outgrow a TPOT objective.

The model, per pod (steps of `base + row * rows + prefill_token * prompt tokens` ms):
- prefill: the prompt tokens queued ahead on the pod plus this prompt's, computed at most
  `max_num_batched_tokens - rows` per step beside the pod's decode rows (for a favoured
  request, which the pods compute before other tenants' work, only the favoured ones);
- time to first token: that prefill on the pod that prefills (a prefill pod, or the decode pod
  itself when there is none; with a prefill pod, no sooner than the decode pod's own queue of
  prompts), then one decode step;
- time per output token: a decode step with one row more (no more than the pod's row limit:
  past it the request waits for a row instead), plus, when the decode pod prefills it too, its
  own prompt spread over its output. The prompts of others that the pod interleaves are not
  modelled: the controller calibrates the step against the token gaps the pod's streams show,
  which carry them (`modelled_gap_ms`).
The gateway does not know yet how much of the prompt a pod has cached (routing asks the index
after admission), so every prompt token is counted: a TTFT prediction errs long, never short
(the TPOT one leans on its calibration for the prompts of others).
Pods that have not fitted their costs yet (a fresh pod) give no prediction: nothing is refused
on a guess. What the model misses (serving overheads, the machine's noise) the controller
corrects by how far recent predictions were off (feedback.py's `Calibration`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from splitserve.common.step_costs import StepCosts
from splitserve.gateway.routing.pods import Pod

# The share of a TPOT objective a decode step may take at a pod's row cap: the rest is room for
# the prompts it interleaves and for the noise of a shared machine.
ROW_CAP_HEADROOM = 0.8


@dataclass(frozen=True)
class PodSnapshot:
    """What prediction reads of one pod at one moment."""

    costs: StepCosts
    num_rows: int  # requests it runs or has queued, with those sent since its last stats
    # The prompt tokens it has yet to compute before the request predicted for (all it has
    # queued, likewise, unless the request is favoured: then this gateway's favoured ones).
    num_ahead_prompt_tokens: int


@dataclass(frozen=True)
class Prediction:
    ttft_ms: float
    tpot_ms: float


def snapshot(pod: Pod, favoured: bool = False) -> PodSnapshot | None:
    """None for a pod without stats or without fitted costs. `favoured`: for a request the
    pods compute ahead of others (admission/controller.py's pod_priority), whose prefill
    waits only behind this gateway's favoured prompts on the pod."""
    if pod.stats is None:
        return None
    costs = StepCosts.from_proto(pod.stats)
    if not costs.is_known:
        return None
    if favoured:
        return PodSnapshot(costs, pod.num_queued, pod.awaiting_favoured_prompt_tokens)
    reported = pod.load.num_waiting_prompt_tokens + pod.dispatched_prompt_tokens
    # The stats lag by up to an engine step (a second when prompts are long): this gateway's
    # own calls still awaiting their first token are the fresher floor.
    return PodSnapshot(costs, pod.num_queued, max(reported, pod.awaiting_prompt_tokens))


def prefill_ms(pod: PodSnapshot, num_prompt_tokens: int, num_rows: int) -> float:
    """Until `num_prompt_tokens` more are computed behind what the pod computes first, with
    `num_rows` decode rows in every step."""
    tokens = pod.num_ahead_prompt_tokens + num_prompt_tokens
    budget = pod.costs.max_num_batched_tokens - num_rows
    steps = math.ceil(tokens / budget) if budget > 0 else 1
    return steps * pod.costs.step_ms(num_rows) + tokens * pod.costs.step_prefill_token_ms


def ttft_ms(prefill: PodSnapshot | None, decode: PodSnapshot, num_prompt_tokens: int) -> float:
    """Prefill on `prefill` (None: the decode pod prefills), then the first decode step. With
    a prefill pod, the prompts the decode pod has queued to prefill itself (conditional
    disaggregation: it does while its prefill pods are busy) hold up its first step too."""
    if prefill is None:
        prefilled = prefill_ms(decode, num_prompt_tokens, decode.num_rows)
    else:
        remote = prefill_ms(prefill, num_prompt_tokens, 0)
        prefilled = max(remote, prefill_ms(decode, 0, decode.num_rows))
    return prefilled + decode.costs.step_ms(decode.num_rows + 1)


def tpot_ms(
    decode: PodSnapshot,
    num_prompt_tokens: int,
    max_tokens: int,
    prefills: bool,
    row_limit: int | None = None,
) -> float:
    """A decode step with this request's row added, at most `row_limit` rows; `prefills`: the
    decode pod computes this prompt too (no prefill pod)."""
    rows = decode.num_rows + 1
    if row_limit is not None:
        rows = min(rows, max(row_limit, 1))
    per_step = (num_prompt_tokens if prefills else 0) / max(max_tokens, 1)
    return decode.costs.step_ms(rows, round(per_step))


def modelled_gap_ms(pod: Pod, num_rows: int) -> float | None:
    """The model's decode step at `num_rows` rows: what a window of the pod's measured token
    gaps is set against to calibrate the TPOT prediction (None without fitted costs)."""
    if pod.stats is None:
        return None
    costs = StepCosts.from_proto(pod.stats)
    return costs.step_ms(max(num_rows, 1)) if costs.is_known else None


def best_prediction(
    decode_pods: list[Pod],
    prefill_pods: list[Pod],
    num_prompt_tokens: int,
    max_tokens: int,
    favoured: bool = False,
    row_limits: Mapping[str, int] | None = None,
) -> Prediction | None:
    """The best time to first token and the best time per output token any pod offers (each
    taken on its own best pod: admission refuses only what no placement could serve); None
    when no decode pod has fitted costs. `favoured`: as `snapshot` says; `row_limits`: decode
    pod address -> the rows admission lets it run."""
    limits = row_limits or {}
    decoded = [(pod, s) for pod in decode_pods if (s := snapshot(pod, favoured)) is not None]
    if not decoded:
        return None
    decodes = [s for _, s in decoded]
    prefills: list[PodSnapshot | None] = [
        s for pod in prefill_pods if (s := snapshot(pod, favoured)) is not None
    ]
    if not prefill_pods:
        prefills = [None]  # colocated: the decode pod prefills
    elif not prefills:
        return None  # prefill pods without fitted costs: no basis for a TTFT
    first = min(ttft_ms(p, d, num_prompt_tokens) for p in prefills for d in decodes)
    gap = min(
        tpot_ms(d, num_prompt_tokens, max_tokens, not prefill_pods, limits.get(pod.address))
        for pod, d in decoded
    )
    return Prediction(first, gap)


def row_cap(pod: Pod, tpot_slo_ms: float | None, fallback: int) -> int:
    """How many rows the decode pod may run: its own maximum, and no more than keep a step
    within ROW_CAP_HEADROOM of the TPOT objective by its fitted costs. `fallback` for a pod
    that reports neither."""
    if pod.stats is None:
        return 0
    costs = StepCosts.from_proto(pod.stats)
    cap = costs.max_num_seqs or fallback
    if tpot_slo_ms is None or not costs.is_known or costs.step_row_ms <= 0:
        return cap
    room = tpot_slo_ms * ROW_CAP_HEADROOM - costs.step_base_ms
    return max(1, min(cap, int(room / costs.step_row_ms)))
