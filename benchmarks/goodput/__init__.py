"""Goodput under overload, with and without admission control, beside vLLM (issue 35).

    python -m benchmarks.goodput [--quick] [--duration S] [--loads 0.5 1 2 3] [--force-avx2]

Each system's saturation is measured first (a closed loop of 16 streams, vLLM's client); then
Poisson arrivals at 0.5x, 1x, 2x and 3x splitserve's saturation (the same offered rates for
every system) for a fixed duration, for two workloads (256 in / 64 out, and mixed lengths of
the same means). Systems: vLLM's CPU server, `splitserve up`, and `splitserve up --admission`
with each SLO pair as its default (where the stack has those flags; without them the program
says so and measures splitserve without admission only). vLLM's own client
(`vllm bench serve --request-rate R --goodput ttft:3000 tpot:200`) measures every system; our
client (services/loadgen) measures the admission stacks too, for how fast a refusal comes.

Printed per system, client, workload and load: offered rate, requests sent, completed, refused
by HTTP status, failed, goodput and SLO attainment (among accepted requests) for both SLO
pairs, TTFT and TPOT p50/p99, refusal latency p50/p99, and our goodput over vLLM's. The JSON
record and the plot (goodput against offered load) go to docs/ (build/ with --quick).

Modules: `figures` (goodput maths, SLO pairs), `clients` (workloads, both clients),
`systems` (what is started, admission detection), `run` (the steps), `report`.
"""
