"""The gateway: OpenAI HTTP + gRPC Generation in front of the decode (and prefill) pods. It loads
no model and imports no torch. Run: `python -m splitserve.gateway`."""
