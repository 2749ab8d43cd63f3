"""Helpers every service process shares: gRPC server bootstrap, proto <-> engine conversions,
model files, process supervision. Nothing here imports torch: the gateway uses all of it."""
