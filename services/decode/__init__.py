"""The decode service: a gRPC `DecodeWorker` around the engine. Run: `python -m
splitserve.decode`."""

from splitserve.pod.openmp import bound_spin_waiting

# Before any module of this package loads torch (services/pod/openmp.py says why).
bound_spin_waiting()
