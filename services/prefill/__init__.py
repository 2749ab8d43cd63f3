"""The prefill service: a gRPC `PrefillWorker` around the engine (`python -m services.prefill`)."""

from services.common.openmp import bound_spin_waiting

# Before any module of this package loads torch (services/common/openmp.py says why).
bound_spin_waiting()
