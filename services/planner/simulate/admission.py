"""SLO-aware admission in the simulated gateway, as `--admission --slo-ttft-ms` runs it
(services/gateway/admission/): a request whose predicted time to first token misses the
objective is refused on arrival, before any prefill is spent on it, instead of queueing
behind work it cannot overtake.

The prediction follows the gateway's (admission/predict.py): every prompt token still to be
computed on the pod that prefills it, this prompt's included, in steps of the pod's token
budget, then one decode step on the decode pod with one row more. It reads the pods' exact
state where the gateway reads polled stats and corrects its errors by feedback; and the
gateway's TPOT row cap is not modelled, so admission here binds on TTFT alone.
"""

from __future__ import annotations

from splitserve.planner.simulate.pod import SimPod


def predicted_ttft_s(prefilling: SimPod, decode_pod: SimPod, prompt_tokens: int) -> float:
    """Seconds until a request of `prompt_tokens` sees its first token, by the profiles."""
    queued = prefilling.num_queued_prompt_tokens + prompt_tokens
    budget = prefilling.limits.max_num_batched_tokens
    num_full_steps, rest = divmod(queued, budget)
    profile = prefilling.profile
    prefill_s = num_full_steps * profile.prefill_s(budget)
    if rest:
        prefill_s += profile.prefill_s(rest)
    rows = len(decode_pod.running) + 1
    return prefill_s + decode_pod.profile.decode.step_s(rows, prompt_tokens)
