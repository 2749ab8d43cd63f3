"""The capacity planner: profile a pod, simulate prefill and decode pools under a workload,
recommend pod counts, check the simulation against real runs, and autoscale a cluster.

- `profile/`: a pod's measured cost model (JSON) and its parts;
- `measure/`: measuring a profile with the engine and, for the serving path, local stacks;
- `simulate/`: the discrete-event simulation of the gateway, P prefill and D decode pods
  serving a workload (Poisson or a JSONL trace, from services/loadgen/workload.py), and its
  TTFT / ITL / goodput summary;
- `sizing.py`: the one test of a configuration against a target (recommend and autoscale);
- `recommend.py` / `plot.py`: the search over (P, D), its table, plot and Helm values;
- `validate/`: simulated against measured latencies of the real services on this machine
  (measured with services/loadgen);
- `autoscale/`: live load from the pods, the scaling policy, and the loop that patches the
  Deployments' scale through the Kubernetes API;
- `__main__.py`: `python -m splitserve.planner` and `splitserve plan`.

Imports point down this list's dependency order: `profile` <- `simulate` <- `sizing` <-
`recommend`, `autoscale`; `measure` uses `profile` and `simulate`; `validate` uses all three.
"""
