"""`splitserve plan autoscale`: live load from the pods (`load.py`), the policy that turns it
into prefill and decode replica counts (`controller.py`, sized by `planner.sizing`), and the
loop that applies them to the Deployments through the Kubernetes API (`loop.py`)."""
