"""What the two engine pods (prefill and decode) share: their flags, the serve loop with graceful
drain, the core and servicer base classes, `run_pod(role)`, their Prometheus metrics and their
side of the Redis registry. The gateway and the planner import nothing from here but the
metric names the autoscaler reads (`metrics.PREFIX`)."""
