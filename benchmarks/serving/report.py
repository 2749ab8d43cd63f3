"""The comparison printed side by side, the rate where colocated's ITL p90 doubles, and the
plots written into docs/."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from splitserve.loadgen.client import RunResult
from splitserve.loadgen.stats import Slo, Summary

# The goal: at the rate where colocated's ITL p90 reaches this many times its
# unloaded value, disaggregated's ITL p90 should be clearly lower.
KNEE_FACTOR = 2.0


@dataclass(frozen=True)
class Point:
    """One system at one load."""

    rate: float | None  # requests/s; None for the unloaded (one-at-a-time) baseline
    num_requests: int
    run: RunResult
    summary: Summary
    remote_prefill_share: float | None = None  # prompt tokens the prefill pod computed / sent
    foreign_cores: float = 0.0  # CPU other processes (not this client, not the stack) took


@dataclass
class SystemResults:
    name: str  # "colocated" / "disaggregated"
    description: str
    unloaded: Point | None = None
    points: list[Point] | None = None  # one per swept rate, in order

    def at(self, rate: float) -> Point | None:
        return next((p for p in self.points or [] if p.rate == rate), None)


def knee_rate(colocated: SystemResults) -> float | None:
    """The lowest swept rate at which colocated's ITL p90 is at least KNEE_FACTOR times its
    unloaded ITL p90; None if no rate got there."""
    if colocated.unloaded is None:
        return None
    threshold = KNEE_FACTOR * colocated.unloaded.summary.itl.p90
    for point in colocated.points or []:
        if point.summary.itl.p90 >= threshold:
            return point.rate
    return None


# Above this many cores taken by strangers, a figure is marked as disturbed.
NOISY_FOREIGN_CORES = 0.2


def _foreign(cores: float) -> str:
    return f"{cores:.2f}" + (" (NOISY)" if cores > NOISY_FOREIGN_CORES else "")


def swept_rates(systems: list[SystemResults]) -> list[float]:
    """Every rate some system ran at, in order (a system may have been left out)."""
    rates = {p.rate for s in systems for p in s.points or [] if p.rate is not None}
    return sorted(rates)


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1e3:.0f}"


def _triple(values) -> str:
    return f"{_ms(values.p50)} / {_ms(values.p90)} / {_ms(values.p99)}"


_ROWS: list[tuple[str, Callable[[Point], str]]] = [
    ("finished / sent", lambda p: f"{p.summary.num_ok} / {p.summary.num_requests}"),
    ("TTFT p50 / p90 / p99 (ms)", lambda p: _triple(p.summary.ttft)),
    ("ITL p50 / p90 / p99 (ms)", lambda p: _triple(p.summary.itl)),
    ("requests/s", lambda p: f"{p.summary.request_throughput:.2f}"),
    ("output tokens/s", lambda p: f"{p.summary.output_throughput:.1f}"),
    ("goodput (req/s meeting SLO)", lambda p: f"{p.summary.goodput:.2f}"),
    ("requests meeting SLO", lambda p: f"{p.summary.num_good} / {p.summary.num_requests}"),
    ("other processes' load (cores)", lambda p: _foreign(p.foreign_cores)),
    (
        "prompt tokens prefilled remotely",
        lambda p: "-" if p.remote_prefill_share is None else f"{p.remote_prefill_share:.0%}",
    ),
]


def side_by_side(title: str, systems: list[SystemResults], points: list[Point | None]) -> str:
    width = 28
    lines = [title, f"  {'':<32}" + "".join(f"{s.name:>{width}}" for s in systems)]
    for label, cell in _ROWS:
        cells = ["n/a" if p is None else cell(p) for p in points]
        lines.append(f"  {label:<32}" + "".join(f"{c:>{width}}" for c in cells))
    errors = [
        f"{s.name}: {p.summary.first_error}"
        for s, p in zip(systems, points)
        if p and p.summary.first_error
    ]
    lines += [f"  first error  {e}" for e in errors]
    return "\n".join(lines)


def full_report(colocated: SystemResults, disaggregated: SystemResults, slo: Slo) -> str:
    systems = [colocated, disaggregated]
    knee = knee_rate(colocated)
    blocks = [f"SLO for goodput: {slo}"]
    for system in systems:
        blocks.append(f"{system.name}: {system.description}")
    blocks.append(
        side_by_side("unloaded (one request at a time)", systems, [s.unloaded for s in systems])
    )
    for rate in swept_rates(systems):
        point = next(p for p in (s.at(rate) for s in systems) if p is not None)
        mark = (
            f"   <== colocated ITL p90 >= {KNEE_FACTOR:g}x its unloaded value"
            if rate == knee
            else ""
        )
        title = f"rate {rate:g} req/s ({point.num_requests} requests, Poisson){mark}"
        blocks.append(side_by_side(title, systems, [s.at(rate) for s in systems]))
    blocks.append(summary_table(colocated, disaggregated, knee))
    blocks.append(verdict(colocated, disaggregated, knee))
    return "\n\n".join(blocks)


def summary_table(
    colocated: SystemResults, disaggregated: SystemResults, knee: float | None
) -> str:
    header = (
        f"  {'rate':>8}  {'ITL p90 (ms) coloc':>18}  {'disagg':>8}  "
        f"{'TTFT p90 (ms) coloc':>19}  {'disagg':>8}  {'goodput coloc':>13}  {'disagg':>7}"
    )
    lines = ["summary", header]
    rows = [(None, colocated.unloaded, disaggregated.unloaded)]
    rates = swept_rates([colocated, disaggregated])
    rows += [(rate, colocated.at(rate), disaggregated.at(rate)) for rate in rates]
    for rate, c, d in rows:
        if c is None or d is None:  # one system was left out: its own lines say it all
            continue
        name = "unloaded" if rate is None else f"{rate:g}"
        mark = "  <== knee" if rate is not None and rate == knee else ""
        if max(c.foreign_cores, d.foreign_cores) > NOISY_FOREIGN_CORES:
            mark += "  (NOISY: other processes were busy)"
        goodput = "" if rate is None else f"{c.summary.goodput:>13.2f}  {d.summary.goodput:>7.2f}"
        lines.append(
            f"  {name:>8}  {_ms(c.summary.itl.p90):>18}  {_ms(d.summary.itl.p90):>8}  "
            f"{_ms(c.summary.ttft.p90):>19}  {_ms(d.summary.ttft.p90):>8}  {goodput:>22}{mark}"
        )
    return "\n".join(lines)


def verdict(colocated: SystemResults, disaggregated: SystemResults, knee: float | None) -> str:
    if colocated.unloaded is None:
        return "no verdict: the colocated baseline did not run"
    unloaded = colocated.unloaded.summary.itl.p90
    if knee is None:
        return (
            f"colocated's ITL p90 stayed under {KNEE_FACTOR:g}x its unloaded {_ms(unloaded)} ms "
            "at every swept rate: raise the rates (--rates) to find the knee"
        )
    c, d = colocated.at(knee), disaggregated.at(knee)
    if c is None or d is None:
        return f"no verdict: disaggregated did not run at {knee:g} req/s"
    c90, d90 = c.summary.itl.p90, d.summary.itl.p90
    ratio = c90 / d90 if d90 > 0 else float("inf")
    outcome = "lower" if d90 < c90 else "NOT lower"
    noisy = max(c.foreign_cores, d.foreign_cores) > NOISY_FOREIGN_CORES
    caveat = " CAUTION: other processes were busy during this rate; run again." if noisy else ""
    return (
        f"at {knee:g} req/s colocated's ITL p90 is {_ms(c90)} ms ({c90 / unloaded:.1f}x its "
        f"unloaded {_ms(unloaded)} ms); disaggregated's is {_ms(d90)} ms: {outcome} "
        f"({ratio:.1f}x). TTFT p90 there: colocated {_ms(c.summary.ttft.p90)} ms, "
        f"disaggregated {_ms(d.summary.ttft.p90)} ms.{caveat}"
    )


# ---- plots ------------------------------------------------------------------------------------

_STYLE = {"colocated": ("tab:red", "o"), "disaggregated": ("tab:blue", "s")}


def plot_vs_rate(colocated: SystemResults, disaggregated: SystemResults, path: str) -> None:
    """ITL p90 and TTFT p90 against the request rate, both systems, the knee marked."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    knee = knee_rate(colocated)
    figure, (itl_axes, ttft_axes) = plt.subplots(1, 2, figsize=(11, 4.2))
    for system in (colocated, disaggregated):
        color, marker = _STYLE[system.name]
        points = system.points or []
        rates = [p.rate for p in points]
        for axes, figure_name in ((itl_axes, "itl"), (ttft_axes, "ttft")):
            axes.plot(
                rates,
                [getattr(p.summary, figure_name).p90 * 1e3 for p in points],
                marker=marker,
                color=color,
                label=f"{system.name} {figure_name.upper()} p90",
            )
        if system.unloaded is not None:
            itl_axes.axhline(
                system.unloaded.summary.itl.p90 * 1e3,
                color=color,
                linestyle=":",
                linewidth=1,
                label=f"{system.name} unloaded",
            )
    if colocated.unloaded is not None:
        itl_axes.axhline(
            KNEE_FACTOR * colocated.unloaded.summary.itl.p90 * 1e3,
            color="gray",
            linestyle="--",
            linewidth=1,
            label=f"{KNEE_FACTOR:g}x colocated unloaded",
        )
    for axes in (itl_axes, ttft_axes):
        if knee is not None:
            axes.axvline(knee, color="gray", linestyle="-.", linewidth=1)
        axes.set_xlabel("request rate (req/s, Poisson)")
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
    for system in (colocated, disaggregated):
        for point in system.points or []:
            if point.foreign_cores > NOISY_FOREIGN_CORES:  # say which figures a stranger bent
                itl_axes.annotate("noisy", (point.rate, point.summary.itl.p90 * 1e3), fontsize=7)
    itl_axes.set_ylabel("ITL p90 (ms)")
    ttft_axes.set_ylabel("TTFT p90 (ms)")
    ttft_axes.set_yscale("log")
    _plain_log_labels(ttft_axes.yaxis)
    itl_axes.set_title("inter-token latency, p90")
    ttft_axes.set_title("time to first token, p90")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_distributions(
    colocated: SystemResults, disaggregated: SystemResults, rate: float, path: str
) -> None:
    """Empirical CDFs of every ITL and every TTFT at one rate, both systems."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (itl_axes, ttft_axes) = plt.subplots(1, 2, figsize=(11, 4.2))
    for system in (colocated, disaggregated):
        point = system.at(rate)
        if point is None:
            continue
        color, _ = _STYLE[system.name]
        ok = [r for r in point.run.results if r.ok]
        _cdf(itl_axes, [g * 1e3 for r in ok for g in r.itls_s], color, system.name)
        _cdf(ttft_axes, [r.ttft_s * 1e3 for r in ok if r.ttft_s is not None], color, system.name)
    itl_axes.set_xlabel("inter-token latency (ms, log)")
    ttft_axes.set_xlabel("time to first token (ms, log)")
    for axes in (itl_axes, ttft_axes):
        axes.set_xscale("log")
        _plain_log_labels(axes.xaxis)
        axes.set_ylabel("fraction of samples <= x")
        axes.axhline(0.9, color="gray", linestyle=":", linewidth=1)
        axes.grid(alpha=0.3, which="both")
        axes.legend(fontsize=8)
    figure.suptitle(f"latency distributions at {rate:g} req/s")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _plain_log_labels(axis) -> None:
    """Milliseconds as plain numbers on a log axis: every decade, and 2x, 3x and 5x between
    (so a range narrower than a decade still has labels, and a wide one is not crowded)."""
    from matplotlib.ticker import FuncFormatter

    def minor(value: float, _) -> str:
        leading = f"{value:.0e}"[0]
        return f"{value:g}" if leading in "235" else ""

    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_minor_formatter(FuncFormatter(minor))


def _cdf(axes, samples: list[float], color: str, label: str) -> None:
    if not samples:
        return
    ordered = sorted(samples)
    fractions = [(i + 1) / len(ordered) for i in range(len(ordered))]
    axes.step(ordered, fractions, where="post", color=color, label=f"{label} ({len(ordered)})")
