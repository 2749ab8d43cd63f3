"""The decode service: a gRPC `DecodeWorker` around the engine. Run: `python -m services.decode`."""
