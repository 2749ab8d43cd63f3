"""The decode service: a gRPC `DecodeWorker` around the engine. Run: `python -m
splitserve.decode`."""

from splitserve.common.openmp import bound_spin_waiting

# Before any module of this package loads torch (services/common/openmp.py says why).
bound_spin_waiting()
