"""Client-side load for a running system: what `splitserve plan validate` measures the planner's
simulation against, and what `make bench-serve` (benchmarks/serve.py) compares systems with.

- `workload`: which requests arrive when (token ids for the client, lengths for the simulator);
- `client`: the open-loop streaming HTTP client, timing TTFT and every inter-token gap;
- `stats`: latency percentiles, throughput and goodput under an `Slo`;
- `stacks` (with `pin`): a `splitserve up` stack on this machine, engine processes pinned to
  cores; `cpu`: how much CPU other processes took meanwhile.
"""
