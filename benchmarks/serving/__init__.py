"""Pieces of `make bench-serve` (benchmarks/serve.py): its flags and its report. The workload,
the client, the statistics and the pinned stacks are installed code, in services/loadgen."""
