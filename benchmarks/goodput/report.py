"""The table printed at the end, the JSON record and the plot of goodput against load."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

from benchmarks.goodput.figures import SLO_PAIRS, LoadFigures
from benchmarks.goodput.run import VLLM_CLIENT, Results, Row
from benchmarks.goodput.systems import VLLM

HEADER = (
    f"{'system':>20} {'client':>6} {'workload':>8} {'load':>4} {'req/s':>5} {'sent':>4} "
    f"{'done':>4} {'refused':>15} {'fail':>4} {'good L':>6} {'good T':>6} {'att L':>5} "
    f"{'att T':>5} {'TTFT p50/p99 ms':>15} {'TPOT p50/p99 ms':>15} {'refusal p50/p99':>15} "
    f"{'L/vllm':>6} {'T/vllm':>6}"
)


def _pair(p50: float, p99: float, scale: float = 1e3) -> str:
    if math.isnan(p50):
        return "-"
    return f"{p50 * scale:.0f}/{p99 * scale:.0f}"


def _refused(figures: LoadFigures) -> str:
    return " ".join(f"{status}:{n}" for status, n in figures.refused.items()) or "0"


def _ratio(ours: float, peer: float | None) -> str:
    return f"{ours / peer:6.2f}" if peer else f"{'-':>6}"


def peer_row(rows: list[Row], row: Row) -> Row | None:
    """vLLM's row (vLLM's client) at the same workload and load, to compare against."""
    for other in rows:
        if (other.system, other.client) == (VLLM, VLLM_CLIENT) and (
            other.workload,
            other.load_factor,
        ) == (row.workload, row.load_factor):
            return other
    return None


def format_row(row: Row, peer: Row | None) -> str:
    f = row.figures
    line = f"{row.system:>20} {row.client:>6} {row.workload:>8} {row.load_factor:>3g}x "
    line += f"{f.offered_rate:5.2f} {f.num_sent:4d} {f.num_completed:4d} {_refused(f):>15} "
    line += f"{f.num_failed:4d} {f.goodput['loose']:6.2f} {f.goodput['tight']:6.2f} "
    line += f"{f.attainment['loose']:5.2f} {f.attainment['tight']:5.2f} "
    line += f"{_pair(f.ttft.p50, f.ttft.p99):>15} {_pair(f.tpot.p50, f.tpot.p99):>15} "
    line += f"{_pair(f.refusal_s.p50, f.refusal_s.p99):>15}"
    if peer is not None and row.system != VLLM and row.client == VLLM_CLIENT:
        line += f" {_ratio(f.goodput['loose'], peer.figures.goodput['loose'])}"
        line += f" {_ratio(f.goodput['tight'], peer.figures.goodput['tight'])}"
    return line


def print_report(results: Results) -> None:
    print("\nsaturation (closed loop, vLLM's client), req/s:")
    for system, by_workload in results.saturation.items():
        rates = ", ".join(f"{name} {rate:.2f}" for name, rate in by_workload.items())
        print(f"  {system}: {rates}")
    print("loads are multiples of splitserve's saturation, the same offered rate for every system")
    for pair in SLO_PAIRS:
        print(f"SLO {pair.name[0].upper()} ({pair.name}): {pair}")
    print("good: goodput req/s; att: SLO attainment among accepted (200) requests; refused:")
    print("status:count; refusal: ms to a 429/503 (our client only); x/vllm: goodput ratio\n")
    print(HEADER)
    for row in results.rows:
        print(format_row(row, peer_row(results.rows, row)))


def _no_nan(value: object) -> object:
    """JSON has no NaN: an empty percentile becomes null."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {key: _no_nan(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_no_nan(item) for item in value]
    return value


def write_json(path: Path, header: dict, results: Results) -> None:
    record = {
        **header,
        "slo_pairs": [asdict(pair) for pair in SLO_PAIRS],
        "saturation_req_s": results.saturation,
        "rows": [asdict(row) for row in results.rows],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_no_nan(record), indent=1) + "\n")


def write_plot(path: Path, results: Results, title: str) -> None:
    """One panel per workload and SLO pair: goodput against offered load, a line per system
    (vLLM's client); an admission stack is drawn only in the panel of its own SLO pair."""
    import matplotlib  # optional: plotting only

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: plotting only

    workloads = list(dict.fromkeys(row.workload for row in results.rows))
    fig, axes = plt.subplots(
        len(workloads), len(SLO_PAIRS), figsize=(11, 4 * len(workloads)), squeeze=False
    )
    for i, workload in enumerate(workloads):
        for j, pair in enumerate(SLO_PAIRS):
            _panel(axes[i][j], results.rows, workload, pair.name)
            axes[i][j].set_title(f"{workload}, SLO {pair}", fontsize=9)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _panel(ax, rows: list[Row], workload: str, pair_name: str) -> None:
    mine = [r for r in rows if r.workload == workload and r.client == VLLM_CLIENT]
    for system in dict.fromkeys(r.system for r in mine):
        if "+adm" in system and not system.endswith(pair_name):
            continue
        points = sorted(
            (r.figures.offered_rate, r.figures.goodput[pair_name])
            for r in mine
            if r.system == system
        )
        ax.plot(*zip(*points), marker="o", label=system)
    offered = sorted({r.figures.offered_rate for r in mine})
    ax.plot(offered, offered, color="lightgrey", linestyle="--", label="offered")
    ax.set_xlabel("offered load (req/s): multiples of splitserve's saturation")
    ax.set_ylabel("goodput (req/s)")
    ax.legend(fontsize=8)
