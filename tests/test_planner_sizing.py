"""The planner's one test of a configuration against a target (`sizing.py`): seeds and
confidence, the binding resource, devices per pod, and the autoscaler sizing by it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from splitserve.loadgen.stats import Slo
from splitserve.loadgen.workload import LengthDistribution, WorkloadSpec
from splitserve.planner.autoscale.controller import Autoscaler, Bounds, PolicySettings
from splitserve.planner.autoscale.load import LoadSnapshot, RoleLoad
from splitserve.planner.profile import EngineSetup, synthetic_profile
from splitserve.planner.recommend import recommend
from splitserve.planner.search import SearchSpec
from splitserve.planner.simulate.cluster import ClusterConfig
from splitserve.planner.sizing import Target, judge, pods_needed, steady_workload


def _workload(rate: float, inputs: int = 64, outputs: int = 32, n: int = 200) -> WorkloadSpec:
    return WorkloadSpec(
        rate, n, LengthDistribution(inputs, inputs), LengthDistribution(outputs, outputs)
    )


def test_confidence_is_the_share_of_seeds_meeting_the_attainment() -> None:
    # One prefill pod at 0.2 s per prompt (64-token budget: one prompt a step): at 4.5 req/s
    # it is 90% busy and the TTFT tail swings from seed to seed.
    profile = synthetic_profile(0.2, decode_step_s=0.01, max_num_batched_tokens=64)
    cluster = ClusterConfig(1, 1, local_prefill_threshold=0)
    slo = Slo(ttft_s=1.5, itl_s=1.0)
    verdict = judge(profile, cluster, _workload(4.5), Target(slo, 0.9, 0.8, num_seeds=6))
    per_seed = [r.attainment >= 0.9 for r in verdict.results]
    assert len(per_seed) == 6 and len({r.ttft.p90 for r in verdict.results}) == 6
    assert verdict.share_meeting == pytest.approx(sum(per_seed) / 6)
    assert verdict.meets == (verdict.share_meeting >= 0.8)
    band = verdict.band("ttft.p90")
    assert band.low < band.median < band.high
    # Asking for every seed can only make it harder.
    strict = judge(profile, cluster, _workload(4.5), Target(slo, 0.9, 1.0, num_seeds=6))
    assert strict.meets <= verdict.meets
    assert strict.meets == all(per_seed)


@pytest.mark.parametrize(
    "case, binding",
    [
        ("prefill", "prefill compute"),
        ("decode", "decode step"),
        ("kv", "KV capacity"),
        ("transfer", "KV transfer"),
    ],
)
def test_the_binding_resource_is_the_one_under_most_pressure(case: str, binding: str) -> None:
    base = dict(prefill_fixed_s=0.02, decode_step_s=0.01, kv_bytes_per_token=1000)
    slo = Slo(ttft_s=1.0, itl_s=0.05)
    if case == "prefill":
        base["prefill_fixed_s"] = 0.4  # 0.4 s of a 1 s TTFT
    elif case == "decode":
        base["decode_step_s"] = 0.04  # 40 of 50 ms per token
    elif case == "kv":
        base["num_kv_blocks"] = 40  # 640 tokens: a few 96-token requests fill it
    else:
        base["transfer_bandwidth"] = 200_000.0  # 64 KB of pages: 0.32 s
    profile = synthetic_profile(**base)
    cluster = ClusterConfig(1, 1, local_prefill_threshold=0)
    verdict = judge(profile, cluster, _workload(2.0), Target(slo, num_seeds=2))
    assert verdict.binding == binding, verdict.pressures


def test_devices_count_each_pods_parallel_layout() -> None:
    # Prefill-bound: 1 s per prompt at 2.5 req/s needs 3 plain prefill pods. A TP=2 prefill
    # profile twice as fast needs 2 pods, i.e. 4 devices: more than 3 + 1 plain ones, so the
    # plain pods win on devices although they are more pods.
    plain = synthetic_profile(1.0, decode_step_s=0.02, max_num_batched_tokens=64)
    fast = replace(
        synthetic_profile(0.5, decode_step_s=0.02, max_num_batched_tokens=64),
        engine=EngineSetup(tensor_parallel_size=2),
    )
    spec = SearchSpec(
        _workload(2.5, n=300),
        Slo(ttft_s=8.0, itl_s=0.1),
        max_pods=4,
        ratio_max_pods=1,
        include_colocated=False,
        num_seeds=2,
    )
    with_fast = recommend(plain, spec, prefill_profile=fast)
    best = with_fast.best
    assert (best.cluster.num_prefill, best.cluster.num_decode, best.num_devices) == (2, 1, 5)
    assert recommend(plain, spec).best.num_devices == 4
    other_kv = replace(fast, kv_bytes_per_token=1)
    with pytest.raises(ValueError, match="different formats"):
        recommend(plain, spec, prefill_profile=other_kv)


def test_the_autoscaler_sizes_with_recommends_test() -> None:
    # What the autoscaler's model asks for at a measured load is the fewest pods with which
    # `judge` (recommend's test) meets the same target, and one fewer does not.
    profile = synthetic_profile(0.5, decode_step_s=0.01)
    settings = PolicySettings(
        ttft_slo_s=2.0, itl_slo_s=0.1, prefill=Bounds(1, 6), decode=Bounds(1, 6)
    )
    load = LoadSnapshot(
        prefill=RoleLoad(num_pods=1),
        decode=RoleLoad(num_pods=1),
        request_rate=6.0,
        prompt_tokens_per_s=6.0 * 512,
        output_tokens_per_s=6.0 * 16,
    )
    needed = Autoscaler(settings, profile).model_replicas(
        "prefill", load, {"prefill": 1, "decode": 1}
    )
    workload = steady_workload(6.0, 512, 16)
    target = settings.target
    assert needed == pods_needed(profile, workload, target, "prefill", {"decode": 1}, 6)
    assert needed is not None and needed >= 2
    assert judge(profile, ClusterConfig(needed, 1), workload, target).meets
    assert not judge(profile, ClusterConfig(needed - 1, 1), workload, target).meets


def test_the_autoscaler_sizes_the_cluster_recommend_would_simulate() -> None:
    # Decode-bound: 20 ms a step plus 2 ms a row. Pods on separate machines, two suffice; all
    # pods on one machine, each decode step beside another takes twice as long, and the
    # autoscaler's model (given recommend's --pods-per-host) asks for more, or finds none.
    from splitserve.planner.profile import NeighborSlowdown

    profile = replace(
        synthetic_profile(0.01, decode_step_s=0.02, decode_per_seq_s=0.002),
        neighbor=NeighborSlowdown(decode_beside_decode=1.0),
    )
    load = LoadSnapshot(
        prefill=RoleLoad(num_pods=0),
        decode=RoleLoad(num_pods=1),
        request_rate=8.0,
        prompt_tokens_per_s=8.0 * 32,
        output_tokens_per_s=8.0 * 64,
    )

    def model_replicas(pods_per_host: int) -> int | None:
        settings = PolicySettings(
            ttft_slo_s=2.0,
            itl_slo_s=0.05,
            prefill=Bounds(0, 0),
            decode=Bounds(1, 4),
            pods_per_host=pods_per_host,
        )
        scaler = Autoscaler(settings, profile)
        return scaler.model_replicas("decode", load, {"prefill": 0, "decode": 1})

    alone = model_replicas(1)
    assert alone is not None and alone >= 2
    shared = model_replicas(4)
    assert shared is None or shared > alone
    with pytest.raises(ValueError, match="--pods-per-host"):
        PolicySettings(2.0, 0.05, Bounds(0, 0), Bounds(1, 4), pods_per_host=0)
