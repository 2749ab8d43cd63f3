"""Pieces of `make bench-serve` (benchmarks/serve.py): the seeded workload, the open-loop
streaming client, latency statistics, the pinned stacks under test, and the report."""
