"""The discrete-event simulation of a gateway, P prefill pods and D decode pods serving a
workload (`cluster.py`): one pod's scheduler replayed on token counts (`pod.py`) with its
tiered prefix cache (`prefix_cache.py`) and speculation (`speculation.py`), the gateway's real
scoring over what it would know (`gateway.py`), pods that die (`failures.py`), and what a run
adds up to (`results.py`). Reads a `profile`; imports nothing else of the planner.
"""
