"""The PNG that `recommend` writes: goodput per pod against the prefill:decode ratio."""

from __future__ import annotations

from splitserve.planner.search import RatioPoint, Recommendation, SearchSpec


def plot_goodput_vs_ratio(recommendation: Recommendation, spec: SearchSpec, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display here
    import matplotlib.pyplot as plt

    points = sorted(
        recommendation.ratios,
        key=lambda p: (p.cluster.num_prefill / p.cluster.num_decode, p.cluster.num_decode),
    )
    setups = sorted({p.setup for p in points})
    labels = [_layout_label(p, setups) for p in points]
    values = [p.goodput_per_pod for p in points]
    best = recommendation.best_ratio
    colors = ["tab:orange" if p is best else "tab:blue" for p in points]
    figure, axis = plt.subplots(figsize=(max(6.0, 0.6 * len(points)), 4.0))
    bars = axis.bar(range(len(points)), values, color=colors)
    for bar, point in zip(bars, points):
        if not point.settled:  # a slice's screened rate only (slices.py): hatched, paler
            bar.set_hatch("//")
            bar.set_alpha(0.45)
    axis.set_xticks(range(len(points)), labels, rotation=45, ha="right")
    axis.set_xlabel(
        "prefill pods : decode pods (0:D = colocated; <=N: decode pods prefill past N tokens "
        "in flight; adm: SLO-aware admission)"
        + "".join(f"\n#{i}: {setup}" for i, setup in enumerate(setups, 1) if len(setups) > 1),
        fontsize=8,
    )
    axis.set_ylabel("goodput per device (req/s)")
    axis.set_title(
        f"Highest rate with >= {spec.attainment:.0%} of requests meeting\n{spec.slo} "
        f"in >= {spec.confidence:.0%} of {spec.num_seeds} seeds, per device"
        + _slice_title(recommendation.slice_pods),
        fontsize=9,
    )
    axis.grid(axis="y", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _slice_title(slice_pods: int) -> str:
    if not slice_pods:
        return ""
    return f"\nslices of {slice_pods} pods; hatched: screened on one seed, not settled"


def _layout_label(point: RatioPoint, setups: list[str]) -> str:
    """P:D, the remote-prefill limit where one is set, and the setup's number when several
    setups were swept (the title lists them)."""
    label = f"{point.cluster.num_prefill}:{point.cluster.num_decode}"
    if point.cluster.num_prefill and point.cluster.max_remote_prefill_tokens:
        label += f" <={point.cluster.max_remote_prefill_tokens}"
    if point.cluster.admission_ttft_s is not None:
        label += " adm"
    if len(setups) > 1:
        label += f" #{setups.index(point.setup) + 1}"
    return label


def plot_validation(comparisons: list, path: str) -> None:
    """Measured against simulated TTFT and ITL p50/p90, one panel per figure, one pair of bars
    per (configuration, workload). `comparisons` are `validate.Comparison`s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures: tuple[tuple[str, str], ...] = (("ttft_p50", "TTFT p50"), ("ttft_p90", "TTFT p90"))
    figures += (("itl_p50", "ITL p50"), ("itl_p90", "ITL p90"))
    labels = [f"{c.config}\n{c.workload}" for c in comparisons]
    positions = range(len(comparisons))
    figure, axes = plt.subplots(2, 2, figsize=(max(8.0, 1.6 * len(comparisons)), 7.0))
    for axis, (key, title) in zip(axes.flat, figures):
        measured = [getattr(c.measured, key) * 1e3 for c in comparisons]
        simulated = [getattr(c.simulated_with_overheads, key) * 1e3 for c in comparisons]
        axis.bar([p - 0.2 for p in positions], measured, 0.4, label="measured")
        axis.bar([p + 0.2 for p in positions], simulated, 0.4, label="simulated")
        axis.set_xticks(list(positions), labels, fontsize=7)
        axis.set_title(f"{title} (ms)", fontsize=9)
        axis.grid(axis="y", alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
