"""`recommend` on a crafted profile, the planner's command line, and profile files."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from splitserve.cli import main as splitserve_main
from splitserve.loadgen.stats import Slo
from splitserve.loadgen.workload import LengthDistribution, WorkloadSpec
from splitserve.planner.__main__ import main as plan_main
from splitserve.planner.profile import Profile, load_profile, synthetic_profile
from splitserve.planner.recommend import recommend
from splitserve.planner.search import SearchSpec


def _prefill_bound_profile() -> Profile:
    # Each prompt takes 1 s of prefill on its own step (64-token budget, 64-token prompts); a
    # decode step takes 20 ms whatever the batch. At 2.5 req/s prefill needs 3 pods (2 would
    # be 125% busy); one decode pod is plenty; colocating puts 1 s prefill steps between the
    # decode steps, which breaks a 100 ms mean-ITL SLO.
    return synthetic_profile(1.0, decode_step_s=0.02, max_num_batched_tokens=64)


def _spec(max_pods: int = 4) -> SearchSpec:
    workload = WorkloadSpec(2.5, 300, LengthDistribution(64, 64), LengthDistribution(32, 32))
    return SearchSpec(
        workload, Slo(ttft_s=8.0, itl_s=0.1), max_pods=max_pods, ratio_max_pods=3, num_seeds=2
    )


@pytest.mark.slow  # ~7 s of simulations; the fast suite measured 14:32 on a quiet evening
def test_recommend_finds_the_prefill_heavy_ratio() -> None:
    recommendation = recommend(_prefill_bound_profile(), _spec())
    best = recommendation.best
    assert best is not None
    assert (best.cluster.num_prefill, best.cluster.num_decode) == (3, 1)
    failing = {
        (c.cluster.num_prefill, c.cluster.num_decode)
        for c in recommendation.candidates
        if not c.meets
    }
    assert {(2, 1), (2, 2), (1, 3), (0, 4)} <= failing
    # The ratio sweep (up to 3 pods) puts its best goodput per pod on 2 prefill : 1 decode.
    ratio = recommendation.best_ratio
    assert (ratio.cluster.num_prefill, ratio.cluster.num_decode) == (2, 1)


@pytest.mark.slow  # the whole recommend sweep and its plot (~15 s)
def test_recommend_command_prints_table_plot_and_helm_values(tmp_path, capsys) -> None:
    profile_path = tmp_path / "profile.json"
    _prefill_bound_profile().save(str(profile_path))
    plot_path = tmp_path / "ratio.png"
    status = splitserve_main(
        [
            "plan", "recommend", "--profile", str(profile_path), "--rate", "2.5",
            "--num-requests", "300", "--input-lens", "64", "--output-lens", "32",
            "--ttft-slo", "8", "--itl-slo", "0.1", "--max-pods", "4", "--ratio-max-pods", "3",
            "--plot", str(plot_path), "--seeds", "3", "--margin", "0",
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert status == 0
    assert "3P+1D" in out and "<== fewest devices" in out
    assert "binds on prefill compute" in out
    assert "prefill:\n  replicas: 3\ndecode:\n  replicas: 1" in out
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_command(tmp_path, capsys) -> None:
    profile_path = tmp_path / "profile.json"
    synthetic_profile(0.05, prefill_per_token_s=0.001).save(str(profile_path))
    result_path = tmp_path / "result.json"
    status = plan_main(
        ["simulate", "--profile", str(profile_path), "--prefill", "1", "--decode", "2",
         "--rate", "2", "--num-requests", "50", "--json", str(result_path)]
    )  # fmt: skip
    assert status == 0
    assert "1P+2D, 50 requests" in capsys.readouterr().out
    assert json.loads(result_path.read_text())["num_finished"] == 50


def test_pods_sharing_a_host_simulate_slower_and_a_bad_count_is_refused(tmp_path, capsys) -> None:
    from dataclasses import replace

    from splitserve.planner.profile import NeighborSlowdown

    profile = replace(
        synthetic_profile(0.05, prefill_per_token_s=0.001),
        neighbor=NeighborSlowdown(decode_beside_decode=0.5, decode_beside_prefill=0.2),
    )
    profile_path = tmp_path / "profile.json"
    profile.save(str(profile_path))

    def mean_itl_p50(pods_per_host: str) -> float:
        result_path = tmp_path / f"result-{pods_per_host}.json"
        status = plan_main(
            ["simulate", "--profile", str(profile_path), "--prefill", "0", "--decode", "2",
             "--rate", "4", "--num-requests", "60", "--pods-per-host", pods_per_host,
             "--json", str(result_path)]
        )  # fmt: skip
        assert status == 0
        return json.loads(result_path.read_text())["mean_itl"]["p50"]

    assert mean_itl_p50("2") > 1.1 * mean_itl_p50("1")
    capsys.readouterr()
    assert plan_main(["simulate", "--profile", str(profile_path), "--pods-per-host", "0"]) == 2
    assert "pods_per_host must be >= 1" in capsys.readouterr().err


def test_bad_input_is_a_clear_error(tmp_path, capsys) -> None:
    missing = tmp_path / "nope.json"
    assert plan_main(["simulate", "--profile", str(missing)]) == 2
    assert "cannot read" in capsys.readouterr().err
    not_a_profile = tmp_path / "bad.json"
    not_a_profile.write_text(json.dumps({"prefill": []}))
    assert plan_main(["simulate", "--profile", str(not_a_profile)]) == 2
    assert "not a planner profile" in capsys.readouterr().err
    profile_path = tmp_path / "profile.json"
    synthetic_profile(0.05).save(str(profile_path))
    assert plan_main(["simulate", "--profile", str(profile_path), "--input-lens", "9-2"]) == 2
    assert "--input-lens" in capsys.readouterr().err
    assert plan_main(["simulate", "--profile", str(profile_path), "--decode", "0"]) == 2
    assert "decode pods >= 1" in capsys.readouterr().err


def test_profile_json_round_trip(tmp_path) -> None:
    profile = synthetic_profile(0.1, prefill_per_token_s=0.002, decode_per_seq_s=0.001)
    path = tmp_path / "p.json"
    profile.save(str(path))
    loaded = load_profile(str(path))
    assert loaded == profile
    assert loaded.prefill_s(100) == pytest.approx(0.1 + 0.2)
    assert loaded.decode.step_s(10, 500) == pytest.approx(0.02 + 0.01)


@pytest.mark.slow  # ~15 s of simulations; the fast suite is near its 15 minutes
def test_the_margin_makes_the_planner_ask_for_more() -> None:
    # 1 s per prompt at 2.5 req/s needs 3 prefill pods; taken 25% slower (1.25 s) it needs 4.
    spec = _spec(max_pods=5)
    plain = recommend(_prefill_bound_profile(), spec).best
    pessimistic = recommend(_prefill_bound_profile().with_margin(0.25), spec).best
    assert (plain.cluster.num_prefill, pessimistic.cluster.num_prefill) == (3, 4)


def _sweep_spec(workload: WorkloadSpec, slo: Slo, **options) -> SearchSpec:
    """A small search for the layout sweep's tests: one pod for the fewest-devices part, up to
    two in the sweep, two seeds."""
    return SearchSpec(
        workload, slo, **{"max_pods": 1, "ratio_max_pods": 2, "num_seeds": 2, **options}
    )


def test_the_layout_sweep_tries_each_setup_and_limit_and_names_what_binds() -> None:
    from splitserve.planner.profile.parts import EngineSetup
    from splitserve.planner.recommend import format_table
    from splitserve.planner.search import Profiles

    # The same prefill-bound model, and a variant whose prefill takes half as long (as int8
    # weights might): the variant's best layout serves more per device, and prefill binds it.
    plain = _prefill_bound_profile()
    faster = replace(
        synthetic_profile(0.5, decode_step_s=0.02, max_num_batched_tokens=64),
        engine=EngineSetup(quantization="int8"),
    )
    workload = WorkloadSpec(1.0, 100, LengthDistribution(64, 64), LengthDistribution(32, 32))
    spec = _sweep_spec(workload, Slo(ttft_s=8.0, itl_s=0.1), remote_prefill_limits=(256,))
    recommendation = recommend(plain, spec, variants=(Profiles(faster),))
    layouts = {
        (p.setup, p.cluster.label, p.cluster.max_remote_prefill_tokens)
        for p in recommendation.ratios
    }
    # Per setup: 1 and 2 colocated, 1P+1D sending every prompt and 1P+1D past 256 tokens.
    assert len(layouts) == len(recommendation.ratios) == 8
    assert ("weights int8, KV auto, TP=1 PP=1", "1P+1D", 256) in layouts
    best = recommendation.best_ratio
    assert best is not None and best.setup.startswith("weights int8")
    plain_best = max(
        (p for p in recommendation.ratios if p.setup.startswith("weights none")),
        key=lambda p: p.goodput_per_pod,
    )
    assert best.goodput_per_pod > 1.5 * plain_best.goodput_per_pod
    assert (best.cluster.label, best.binding) == ("1P+1D", "prefill compute")
    # With the slow prefill, letting the decode pod take prompts while 256 tokens wait at the
    # prefill pod serves more than sending it every prompt.
    plain_best_label = (plain_best.cluster.label, plain_best.cluster.max_remote_prefill_tokens)
    assert plain_best_label == ("1P+1D", 256)
    # Colocated, a 0.5-1 s prefill step between decode steps breaks the 100 ms mean ITL.
    colocated = [p for p in recommendation.ratios if p.cluster.num_prefill == 0]
    assert {p.binding for p in colocated} == {"decode step"}
    table = format_table(recommendation, spec)
    assert "<== best layout" in table and "1P+1D (prefill locally past 256 tokens)" in table
    assert f"bound by {best.binding}" in table


def test_the_layout_sweep_tries_admission_and_it_raises_an_overloaded_layouts_goodput() -> None:
    # Prompts of 64-512 tokens at 1 ms a token, a 1 s TTFT: without admission a burst queues
    # everyone behind it; with it the gateway refuses what would be late, and a layout holds
    # its 80% at a higher rate only if few are refused, so the sweep reports both.
    profile = synthetic_profile(0.05, prefill_per_token_s=1e-3, decode_step_s=0.02)
    workload = WorkloadSpec(0.5, 200, LengthDistribution(64, 512), LengthDistribution(16, 16))
    slo = Slo(ttft_s=1.0, itl_s=0.2)
    spec = _sweep_spec(workload, slo, attainment=0.8, ratio_max_pods=1, try_admission=True)
    points = recommend(profile, spec).ratios
    assert [p.label for p in points] == ["1 colocated", "1 colocated, admission"]
    without, with_admission = points
    assert with_admission.max_rate > without.max_rate > 0
