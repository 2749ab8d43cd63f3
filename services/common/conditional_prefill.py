"""Conditional disaggregation's one rule, shared by the decode pod (services/decode/
remote_prefill.py) and the planner's simulator (services/planner/simulate/cluster.py): when is
a prefill pod too backed up, so that the decode pod prefills a prompt itself ("local-busy")?

A local prefill stalls every stream the decode pod is running for the steps it takes; a remote
one makes only its own request wait. So the more streams run on the decode pod, the longer a
queue at the prefill pod is worth: the limit of our prompt tokens in flight there is
`max_remote_tokens` per stream a local prefill would stall, plus one (a pod running nothing
still sends one limit's worth before prefilling itself). An idle prefill pod takes any prompt.

Measured on 2 shared cores, 1P+1D at 4 streams (AVX2, docs/benchmarks.md): with a flat limit of
256 tokens the decode pod prefilled 256-token prompts beside 3 running streams, 390 ms steps,
and with a 128-token cap on such steps two 320-360 ms steps per prompt: those were the ITL p99.
"""

from __future__ import annotations


def prefill_pod_is_full(
    max_remote_tokens: int, tokens_in_flight: int, num_uncached: int, num_running: int
) -> bool:
    """Whether `num_uncached` more prompt tokens would pass the limit at a prefill pod that has
    `tokens_in_flight` of ours, while the decode pod runs `num_running` streams. 0: no limit."""
    if max_remote_tokens <= 0 or tokens_in_flight <= 0:
        return False
    return tokens_in_flight + num_uncached > max_remote_tokens * (1 + num_running)
