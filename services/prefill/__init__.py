"""The prefill service: a gRPC `PrefillWorker` around the engine (`python -m
splitserve.prefill`)."""

from splitserve.pod.openmp import bound_spin_waiting

# Before any module of this package loads torch (services/pod/openmp.py says why).
bound_spin_waiting()
