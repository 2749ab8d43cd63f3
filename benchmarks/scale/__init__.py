"""Simulated pods at cluster scale (issue 39): `python -m benchmarks.scale --pods 10 100 1000`.

- `cache.py`: a pod's simulated prefix cache (LRU over block hashes, tails evicted first) that
  the real `RegistryPublisher` drains as it drains an engine;
- `sim_pod.py`: one process hosting many decode pods, each a real gRPC server on loopback and
  a real registry publisher;
- `workload.py`: shared system prompts and sessions, and the oracle that knows every pod's
  blocks;
- `__main__.py`: the benchmark (routing time, Redis memory and ops, hit rate vs the oracle).
"""
