"""The prefill service: a gRPC `PrefillWorker` around the engine (`python -m
splitserve.prefill`)."""

from splitserve.common.openmp import bound_spin_waiting

# Before any module of this package loads torch (services/common/openmp.py says why).
bound_spin_waiting()
