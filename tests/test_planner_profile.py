"""`plan profile` with the real engine and the shipped model, on a small grid."""

from __future__ import annotations

import re
from dataclasses import asdict, replace

import numpy as np
import pytest

from splitserve.planner.measure.profiler import measure_profile
from splitserve.planner.measure.settings import ProfileSettings
from splitserve.planner.profile import (
    EngineSetup,
    MixedGrid,
    NeighborSlowdown,
    PrefillSample,
    Profile,
    ServingCosts,
    load_profile,
    synthetic_profile,
)
from splitserve.planner.profile.parts import SPREAD_QUANTILES, spread_quantiles

KV_CACHE_BYTES = 64 * 2**20
SMOLLM2_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # layers, K and V, kv heads, head dim, float32


def test_profile_measures_the_engine(single_thread, tmp_path) -> None:
    settings = ProfileSettings(
        prefill_lens=(16, 64, 256),
        batch_sizes=(1, 4),
        context_lens=(32, 128),
        repeats=1,
        kv_cache_bytes=KV_CACHE_BYTES,
        transfer_blocks=(1, 8),
        mixed_batch_sizes=(1, 4),
        mixed_chunk_lens=(16, 128),
    )
    progress: list[str] = []
    profile = measure_profile(settings, log=progress.append)
    path = tmp_path / "profile.json"
    profile.save(str(path))
    loaded = load_profile(str(path))
    assert loaded == profile
    assert any(line.startswith("prefill 3/3: 256 tokens") for line in progress)
    assert any(line.startswith("decode 4/4: batch 4, context 128") for line in progress)
    assert profile.kv_bytes_per_token == SMOLLM2_BYTES_PER_TOKEN
    assert profile.num_kv_blocks == KV_CACHE_BYTES // (16 * SMOLLM2_BYTES_PER_TOKEN)
    assert [s.num_tokens for s in profile.prefill] == [16, 64, 256]
    # 16x the tokens costs clearly more (not a speed assertion: a ratio of the same engine).
    assert profile.prefill[-1].seconds > 2 * profile.prefill[0].seconds
    assert profile.decode.batch_sizes == [1, 4] and profile.decode.context_lens == [32, 128]
    assert all(seconds > 0 for row in profile.decode.seconds for seconds in row)
    assert profile.kv_transfer.bandwidth_bytes_per_s > 0
    assert profile.prefill_s(256) == pytest.approx(profile.prefill[-1].seconds, rel=0.5)
    assert any(line.startswith("mixed: 4 decodes + 128 prompt tokens") for line in progress)
    mixed = profile.mixed
    assert mixed.batch_sizes == [1, 4] and mixed.chunk_lens == [16, 128]
    assert mixed.context_len == 32
    # A step computing 128 prompt tokens beside its decodes costs more than one with 16.
    assert all(row[1] > row[0] for row in mixed.seconds)
    assert profile.engine == EngineSetup(num_threads=1)
    # Host-memory loads are copies within RAM: faster than going through files.
    loads = profile.tier_loads
    assert loads.host_bytes_per_s > 0 and loads.disk_bytes_per_s > 0
    assert profile.tier_load_s("host", 512) < profile.tier_load_s("host", 2048)


def test_bad_profile_settings_name_the_flag() -> None:
    with pytest.raises(ValueError, match="--batch-sizes"):
        ProfileSettings(batch_sizes=(4, 2))
    with pytest.raises(ValueError, match="--repeats"):
        ProfileSettings(repeats=0)


def _fitted(seconds_by_len: dict[int, float]) -> tuple[float, float, float]:
    samples = [PrefillSample(n, seconds) for n, seconds in seconds_by_len.items()]
    return replace(synthetic_profile(0.01), prefill=samples).prefill_coefficients


def test_prefill_fit_is_exact_on_its_own_model() -> None:
    a, b, c = 0.02, 3e-4, 5e-8
    fitted = _fitted({n: a + b * n + c * n * n for n in (16, 64, 256, 1024)})
    assert fitted == pytest.approx((a, b, c), rel=1e-6)


def test_prefill_fit_holds_negative_terms_at_zero() -> None:
    """Concave timings would want c < 0: the fit keeps c = 0 and is the best line a + b * n
    under the same relative weighting."""
    lens = np.array([16.0, 64.0, 256.0, 1024.0])
    seconds = 0.01 + 4e-4 * lens - 1e-7 * lens**2
    a, b, c = _fitted(dict(zip(lens.astype(int).tolist(), seconds.tolist())))
    weights = 1 / seconds
    line = np.stack([np.ones_like(lens), lens], axis=1) * weights[:, None]
    best_a, best_b = np.linalg.lstsq(line, seconds * weights, rcond=None)[0]
    assert best_a > 0 and best_b > 0, "the best line must itself be non-negative here"
    assert c == 0.0
    assert (a, b) == pytest.approx((best_a, best_b), rel=1e-9)


def _mixed_profile(interaction_s: float) -> Profile:
    """Synthetic prefill (10 ms + 1 ms/token) and decode (20 ms + 2 ms/row) costs, and mixed
    steps measured at exactly their sum plus `interaction_s`."""
    base = synthetic_profile(0.01, 0.001, decode_step_s=0.02, decode_per_seq_s=0.002)
    batches, chunks = [1, 8], [32, 256]
    seconds = [
        [base.prefill_s(c) + base.decode.step_s(b, 64) + interaction_s for c in chunks]
        for b in batches
    ]
    return replace(base, mixed=MixedGrid(batches, chunks, 64, seconds))


def test_mixed_steps_cost_the_measured_grid() -> None:
    profile = _mixed_profile(0.005)
    flat = [value for row in profile.mixed_interaction for value in row]
    assert flat == pytest.approx([0.005] * 4)
    # Inside the grid: prefill by the formula + decodes by their grid + the interaction.
    step = profile.step_s([(100, 0)], 4, 4 * 64)
    assert step == pytest.approx(0.01 + 0.1 + 0.02 + 4 * 0.002 + 0.005)
    # A version-1 profile (no mixed grid) keeps the old rule: the prefill formula over every
    # token, decodes adding only their attention beyond the shortest context.
    old = replace(profile, mixed=None)
    assert old.step_s([(100, 0)], 4, 4 * 16) == pytest.approx(0.01 + 0.104)


def test_mixed_step_never_costs_less_than_its_parts() -> None:
    # A measured mixed step cheaper than its parts (noise) must not make it cheaper than the
    # larger of the two alone.
    profile = _mixed_profile(-0.03)
    assert profile.step_s([(100, 0)], 4, 4 * 64) == pytest.approx(0.01 + 0.1)


def test_serving_costs_apply_by_topology() -> None:
    base = synthetic_profile(0.05, decode_step_s=0.02)
    serving = {
        "colocated": ServingCosts(step_s=0.001, row_s=0.0005, request_s=0.03),
        "disaggregated": ServingCosts(step_s=0.002, row_s=0.0, request_s=0.05, token_s=1e-4),
    }
    profile = replace(base, serving=serving)
    colocated, split = profile.for_topology(0), profile.for_topology(1)
    assert colocated.step_s([], 8, 8 * 64) == pytest.approx(0.02 + 0.001 + 8 * 0.0005)
    assert split.step_s([], 8, 8 * 64) == pytest.approx(0.022)
    assert (colocated.request_overhead_s, split.request_overhead_s) == (0.03, 0.05)
    assert (colocated.token_overhead_s, split.token_overhead_s) == (0.0, 1e-4)
    assert base.for_topology(0) is base


def test_profile_json_round_trips_and_reads_version_1(tmp_path) -> None:
    profile = replace(
        _mixed_profile(0.003),
        serving={"colocated": ServingCosts(0.001, 0.0002, 0.02, 0.0, (-0.001, 0.0, 0.004))},
        engine=EngineSetup(quantization="int8", tensor_parallel_size=2),
    )
    path = tmp_path / "profile.json"
    profile.save(str(path))
    assert load_profile(str(path)) == profile
    assert load_profile(str(path)).engine.devices_per_pod == 2
    body = profile.to_json()
    for key in ("mixed", "serving", "engine"):
        body.pop(key)
    body["version"] = 1
    old = Profile.from_json(body)
    assert old.mixed is None and old.serving == {} and old.engine == EngineSetup()
    body["serving"] = {"sideways": {"step_s": 0.0}}
    with pytest.raises(ValueError, match="sideways"):
        Profile.from_json(body)


def test_a_margin_slows_every_measured_time_alike() -> None:
    from splitserve.planner.profile import TierLoadModel

    base = replace(
        _mixed_profile(0.004),
        serving={"colocated": ServingCosts(0.001, 0.0002, 0.02)},
        tier_loads=TierLoadModel(1e9, 1e8),
        kv_bytes_per_token=1000,
    )
    slow = base.with_margin(0.25)
    for chunks, decodes in (([(100, 0)], 0), ([], 8), ([(100, 0)], 4)):
        assert slow.step_s(chunks, decodes, decodes * 64) == pytest.approx(
            1.25 * base.step_s(chunks, decodes, decodes * 64)
        )
    assert slow.transfer_s(512) == pytest.approx(1.25 * base.transfer_s(512))
    assert slow.tier_load_s("disk", 512) == pytest.approx(1.25 * base.tier_load_s("disk", 512))
    colocated, slow_colocated = base.for_topology(0), slow.for_topology(0)
    assert slow_colocated.request_overhead_s == pytest.approx(1.25 * colocated.request_overhead_s)
    assert slow_colocated.step_s([], 8, 512) == pytest.approx(1.25 * colocated.step_s([], 8, 512))
    assert base.with_margin(0) is base
    with pytest.raises(ValueError, match="margin"):
        base.with_margin(-0.1)


def test_a_pod_of_tensor_and_pipeline_parallel_counts_every_rank_as_a_device() -> None:
    setup = EngineSetup(tensor_parallel_size=2, pipeline_parallel_size=3)
    assert setup.devices_per_pod == 6
    assert "TP=2 PP=3" in setup.describe()


def test_gap_spread_is_kept_as_equally_likely_quantiles() -> None:
    # 0..999 ms: the middle of each twentieth is 25, 75, ..., 975 ms (within interpolation).
    deviations = [i / 1000 for i in range(1000)]
    spread = spread_quantiles(deviations)
    assert len(spread) == SPREAD_QUANTILES
    assert spread == tuple(sorted(spread))
    assert spread[0] == pytest.approx(0.025, abs=0.001)
    assert spread[-1] == pytest.approx(0.975, abs=0.001)
    assert spread_quantiles([]) == ()


def test_gap_spread_follows_the_topology_and_the_margin() -> None:
    serving = {
        "colocated": ServingCosts(step_s=0.001, itl_spread_s=[-0.002, 0.0, 0.006]),
        "disaggregated": ServingCosts(step_s=0.001),
    }
    profile = replace(synthetic_profile(0.05), serving=serving)
    assert profile.for_topology(0).itl_spread_s == (-0.002, 0.0, 0.006)  # a list in, a tuple
    assert profile.for_topology(1).itl_spread_s == ()
    slow = profile.with_margin(0.5)
    assert slow.for_topology(0).itl_spread_s == pytest.approx((-0.003, 0.0, 0.009))
    assert "-2.0 to +6.0 ms" in serving["colocated"].describe()


def test_neighbor_slowdowns_add_up_by_kind_and_round_trip(tmp_path) -> None:
    slowdown = NeighborSlowdown(0.4, 0.1, 0.05, 0.03)
    assert slowdown.factor("decode", []) == 1.0
    assert slowdown.factor("decode", ["decode"]) == pytest.approx(1.4)
    assert slowdown.factor("decode", ["decode", "prefill"]) == pytest.approx(1.5)
    assert slowdown.factor("prefill", ["decode", "prefill"]) == pytest.approx(1.08)
    with pytest.raises(ValueError, match="neighbor"):
        NeighborSlowdown(decode_beside_decode=-0.1)
    profile = replace(synthetic_profile(0.05), neighbor=slowdown)
    path = tmp_path / "profile.json"
    profile.save(str(path))
    assert load_profile(str(path)).neighbor == slowdown
    assert profile.with_margin(0.2).neighbor == slowdown  # a ratio: no margin on it


@pytest.mark.slow  # two engines, loaded and timed side by side: about 60 s
def test_a_second_engine_runs_beside_the_profiled_one_on_command(single_thread) -> None:
    import multiprocessing
    import os

    from splitserve.loadgen.stacks import usable_cores
    from splitserve.planner.measure.engine_steps import load_engine, warm_up
    from splitserve.planner.measure.neighbor import ROUNDS, measure_neighbor

    own_core, other_core = usable_cores()
    settings = ProfileSettings(neighbor_core=other_core)
    lines: list[str] = []
    affinity = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {own_core})
    try:
        engine = load_engine(settings, lambda message: None)
        warm_up(engine)
        slowdown = measure_neighbor(engine, settings, lines.append)
    finally:
        os.sched_setaffinity(0, affinity)
    # Each window logs how many steps the neighbor ran meanwhile: none when it should idle,
    # dozens of 20-30 ms decode steps, a few 300 ms prefills. (How much it slows this engine
    # comes and goes on a shared VM, 0-48% a window for two decodes, so no bound on it here.)
    neighbor_steps = {
        kind: [int(n) for n in re.findall(rf"beside {kind}: .* ran (\d+) steps", "\n".join(lines))]
        for kind in ("nothing", "decode", "prefill")
    }
    assert all(len(counts) == ROUNDS for counts in neighbor_steps.values())
    assert neighbor_steps["nothing"] == [0] * ROUNDS
    assert min(neighbor_steps["decode"]) >= 20
    assert min(neighbor_steps["prefill"]) >= 2
    assert all(value >= 0 for value in asdict(slowdown).values())
    assert not multiprocessing.active_children()  # the neighbor engine was stopped
    with pytest.raises(ValueError, match="--neighbor-core"):
        ProfileSettings(neighbor_core=4096)


def test_a_stack_faster_than_its_profile_scales_that_topologys_steps(tmp_path) -> None:
    # The colocated stack ran its lone requests' steps 10% faster than the profile measured:
    # colocated steps are taken 10% shorter; the disaggregated topology keeps its own (none).
    base = synthetic_profile(0.1, prefill_per_token_s=1e-3, decode_step_s=0.05)
    faster = replace(base, serving={"colocated": ServingCosts(engine_scale=0.9)})
    colocated, disaggregated = faster.for_topology(0), faster.for_topology(1)
    assert colocated.decode.step_s(1, 64) == pytest.approx(0.045)
    assert colocated.prefill_s(100) == pytest.approx(0.9 * base.prefill_s(100))
    assert disaggregated.decode.step_s(1, 64) == pytest.approx(0.05)
    # The margin takes times slower; the scale is a ratio of times and stays what it is.
    planned = faster.with_margin(0.1)
    assert planned.serving["colocated"].engine_scale == 0.9
    assert planned.for_topology(0).decode.step_s(1, 64) == pytest.approx(0.05 * 1.1 * 0.9)
    path = tmp_path / "profile.json"
    faster.save(str(path))
    assert load_profile(str(path)).serving["colocated"].engine_scale == 0.9
    # A stack far faster than its profile is a profile of another machine state: refused.
    with pytest.raises(ValueError, match="engine_scale must be in"):
        ServingCosts(engine_scale=0.5)
