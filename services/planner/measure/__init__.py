"""`splitserve plan profile`: measuring a pod's costs on this machine with the real engine.

`profiler.py` times engine steps (prefill, decode, mixed) and KV transfers, `tiers.py` the
offload tiers' loads, `neighbor.py` steps beside a second engine on another CPU (all on the
engine and its steps of `engine_steps.py`, set up by `settings.py`); `serving.py` measures what
a running stack adds, on the local stacks of `local_stacks.py` (also `plan validate`'s), and
simulates the same requests to take the difference. Imports `profile` and `simulate`; nothing
of the planner imports this package but the CLI and `validate`.
"""
