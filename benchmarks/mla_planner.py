"""What MLA's smaller KV does to the prefill:decode trade-off, by the planner (issue 36).

    python -m benchmarks.mla_planner [--plot docs/mla_planner.png]

Three profiles of one pod, each with the same KV cache bytes (`--kv-cache-bytes`):
- `gqa`: a tiny Llama GQA model (benchmarks/mla_bytes.py's: hidden 512, 4 layers, 4 KV heads of
  32), profiled on this machine by `splitserve plan profile --quick`;
- `gqa compute, MLA KV`: that profile with the KV bytes per token and the pod's KV capacity of
  the MLA profile below, so only the KV differs (what a planner asks: what does the smaller
  cache buy, the compute being equal?);
- `mla`: the DeepSeek-V2-shaped tiny model of the same hidden size (latent 128 + rope 16, MoE),
  profiled the same way: its compute differs too (MLA prefill on the CPU decompresses the
  latents per sequence), so its row shows the whole model, not the KV alone.

For each, the planner's layout sweep (`recommend`'s second part: for every P:D up to
`--max-pods` pods, the highest Poisson rate at which 90% of requests meet both SLOs in 80% of
the seeded workloads) on long prompts, where the KV capacity of a pod binds. Printed: each
profile's KV bytes per token, tokens a pod holds, the transfer of one prompt; per layout the
goodput per pod and what binds; the best layout per profile.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import replace

from benchmarks.mla_bytes import DEEPSEEK, LLAMA, _checkpoint
from splitserve.loadgen.stats import Slo
from splitserve.loadgen.workload import LengthDistribution, WorkloadSpec
from splitserve.planner.profile import Profile, load_profile
from splitserve.planner.recommend import ratio_sweep
from splitserve.planner.search import Profiles, RatioPoint, SearchSpec


def _profile(directory: str, output: str, kv_cache_bytes: int) -> Profile:
    """`plan profile --quick` of the model in `directory`, in its own process (as users run it)."""
    command = [sys.executable, "-m", "splitserve.planner", "profile", "--quick", "--model",
               directory, "--kv-cache-bytes", str(kv_cache_bytes), "--output", output]  # fmt: skip
    print(f"[mla_planner] profiling {os.path.basename(directory)} ...", flush=True)
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return load_profile(output)


def _with_kv_of(profile: Profile, other: Profile) -> Profile:
    """`profile`'s compute with `other`'s KV: bytes per token and the blocks the same cache
    bytes hold."""
    return replace(
        profile, kv_bytes_per_token=other.kv_bytes_per_token, num_kv_blocks=other.num_kv_blocks
    )


def _describe(name: str, profile: Profile, prompt_tokens: int) -> str:
    tokens = profile.num_kv_blocks * profile.block_size
    transfer_ms = profile.transfer_s(prompt_tokens) * 1e3
    return (
        f"  {name:22s} {profile.kv_bytes_per_token:6d} B/token, {tokens:6d} tokens per pod, "
        f"{prompt_tokens}-token prompt's pages {transfer_ms:5.2f} ms to send"
    )


def _sweep(profile: Profile, spec: SearchSpec, name: str) -> list[RatioPoint]:
    def progress(message: str) -> None:
        print(f"[mla_planner] {name}: {message}", file=sys.stderr, flush=True)

    return ratio_sweep((Profiles(profile),), spec, progress)


def _plot(results: dict[str, list[RatioPoint]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display here
    import matplotlib.pyplot as plt

    labels = [p.cluster.label for p in next(iter(results.values()))]
    width = 0.8 / len(results)
    figure, axis = plt.subplots(figsize=(max(7.0, 0.8 * len(labels)), 4.2))
    for i, (name, points) in enumerate(results.items()):
        xs = [x + (i - (len(results) - 1) / 2) * width for x in range(len(points))]
        axis.bar(xs, [p.goodput_per_pod for p in points], width, label=name)
    axis.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
    axis.set_ylabel("goodput per pod (req/s)")
    axis.set_title("The layout sweep with GQA and MLA KV (same cache bytes per pod)", fontsize=9)
    axis.grid(axis="y", alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kv-cache-bytes", type=int, default=32 * 2**20)
    parser.add_argument("--input-lens", type=int, default=1024)
    parser.add_argument("--output-lens", type=int, default=256)
    parser.add_argument("--rate", type=float, default=0.5, help="the sweep's first rate")
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--ttft-slo", type=float, default=3.0, help="seconds")
    parser.add_argument("--itl-slo", type=float, default=0.2, help="seconds (a request's mean)")
    parser.add_argument("--max-pods", type=int, default=4)
    parser.add_argument("--plot", default="docs/mla_planner.png", help="'' for none")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        gqa_dir = _checkpoint(root, "llama", "LlamaConfig", LLAMA)
        mla_dir = _checkpoint(root, "deepseek", "DeepseekV2Config", DEEPSEEK)
        gqa = _profile(gqa_dir, os.path.join(root, "gqa.json"), args.kv_cache_bytes)
        mla = _profile(mla_dir, os.path.join(root, "mla.json"), args.kv_cache_bytes)
    profiles = {"gqa": gqa, "gqa compute, MLA KV": _with_kv_of(gqa, mla), "mla": mla}
    workload = WorkloadSpec(
        rate=args.rate,
        num_requests=args.num_requests,
        input_lens=LengthDistribution(args.input_lens, args.input_lens),
        output_lens=LengthDistribution(args.output_lens, args.output_lens),
    )
    spec = SearchSpec(workload, Slo(args.ttft_slo, args.itl_slo), ratio_max_pods=args.max_pods)
    print(f"pods: {gqa.description}")
    print(f"workload: {args.input_lens}-token prompts, {args.output_lens} tokens out, {spec.slo}")
    for name, profile in profiles.items():
        print(_describe(name, profile, args.input_lens))
    results = {name: _sweep(profile, spec, name) for name, profile in profiles.items()}
    print(f"{'layout':12s}" + "".join(f"{name:>34s}" for name in results))
    for row in zip(*results.values()):
        cells = "".join(f"{p.goodput_per_pod:9.3f} req/s/pod {p.binding:>16s}" for p in row)
        print(f"{row[0].cluster.label:12s}{cells}")
    for name, points in results.items():
        best = max(points, key=lambda p: p.goodput_per_pod)
        print(f"best for {name}: {best.cluster.label}, {best.goodput_per_pod:.3f} req/s per "
              f"pod, bound by {best.binding}")  # fmt: skip
    if args.plot:
        _plot(results, args.plot)
        print(f"wrote {args.plot}")
    summary = {n: [(p.cluster.label, p.goodput_per_pod) for p in v] for n, v in results.items()}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
