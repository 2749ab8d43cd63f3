"""The prefill service: a gRPC `PrefillWorker` around the engine (`python -m services.prefill`)."""
