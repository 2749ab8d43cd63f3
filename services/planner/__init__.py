"""The capacity planner: profile a pod, simulate prefill and decode pools under a workload,
recommend pod counts, check the simulation against real runs, and autoscale a cluster.

- `profile`: a pod's measured cost model (JSON); `profiler`: measuring it with the engine;
- `simulator` (with `sim_pod`, `sim_results`): the discrete-event simulation of the gateway,
  P prefill and D decode pods serving a workload (Poisson or a JSONL trace, from
  services/loadgen/workload.py), and its TTFT / ITL / goodput summary;
- `recommend` / `plot`: the search over (P, D), its table, plot and Helm values;
- `validate`: simulated against measured latencies of the real services on this machine
  (measured with services/loadgen);
- `load` / `controller` / `autoscaler`: live load from the pods, the scaling policy, and the
  loop that patches the Deployments' scale through the Kubernetes API.
"""
