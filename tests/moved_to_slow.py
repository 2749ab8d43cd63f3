"""Tests that `make test` leaves to `make test-slow` for its time alone: each is the heavier
variant of a behaviour a test that stays in `make test` also checks (a second dtype, a second
policy, preemption on top of the same parity, a second kernel shape).

Measured 2026-11-27 on a 2-vCPU Xeon (avx512_vnni): `make test`'s pytest took 25:00 for 1,850
tests, against the aim of well under 15 minutes; these are the largest items of its
`--durations` list (about 4 minutes together) whose behaviour stays covered. Tests in the files
`test_forced_avx2.py` reruns under AVX2 are not moved: that run skips slow tests.

An entry is a node id or the start of one (a parametrized family); conftest.py marks what
matches slow and fails the run when an entry matches nothing, so a rename cannot quietly put
a test back.
"""

from __future__ import annotations

import pytest

MOVED_TO_SLOW = (
    # parity with transformers stays in test_greedy_matches_transformers_in_one_batch
    "tests/test_engine_parity.py::test_chunked_prefill_of_32_tokens_matches",
    "tests/test_engine_parity.py::test_small_kv_pool_preempts_and_still_matches",
    # speculation: the stop-token cut and the homogeneity test stay
    "tests/test_spec_decode_engine.py::test_self_speculative_greedy_identical",
    "tests/test_spec_decode_engine.py::test_abort_mid_speculation_frees_every_block",
    # the largest shape and the launch variants in bfloat16 (float32 stays)
    "tests/test_kernels_dequant.py::test_int4_group_matmul_matches_reference[96-1536-dtype1-",
    "tests/test_kernels_dequant.py::test_launch_variants_match_reference[dtype1-",
    # the other policy and quota stay
    "tests/test_kv_eviction.py::test_a_premium_session_survives_a_flood_only_under_the_priority_policy[lru]",
    "tests/test_kv_eviction.py::test_a_tenant_quota_keeps_one_tenants_flood_from_pushing_out_another[1.0]",
    # the int8 (and int4) model's RSS stays
    "tests/test_memory.py::test_float32_llm_grows_rss_by_at_most_1_5x_the_checkpoint",
    # draining's deregistration and refusals stay
    "tests/test_pod_drain.py::test_sigterm_mid_stream_deregisters_refuses_new_calls_and_finishes_the_stream",
    # the host tier's own tests stay
    "tests/test_kv_offload.py::test_a_session_pushed_out_of_the_pool_comes_back_from_host_memory",
    # the 3-64 (SmolLM2) launches stay
    "tests/test_kernels_attention.py::test_the_launches_gpu_graph_timings_compares_match_reference[8-128]",
    # TLS between the services stays in the transport and Redis tests
    "tests/test_transport_security.py::test_real_pod_serves_tls_only",
    # encode/decode parity with transformers stays
    "tests/test_tokenizer.py::test_llama3_pre_tokenizer_matches_transformers",
    # int4 on the Triton path stays
    "tests/test_quantized_triton.py::test_model_on_the_triton_path_is_its_weights_dequantized[int8]",
    # the float cache on the Triton path stays
    "tests/test_triton_backend.py::test_int8_kv_engine_greedy_tokens_match_torch_backend",
    # TP and PP parity with chunked prefill and prefix hits stay
    "tests/test_tensor_parallel.py::test_tp2_greedy_equals_tp1_under_preemption",
    "tests/test_tensor_parallel.py::test_tp2_greedy_equals_tp1_with_ngram_speculation",
    "tests/test_pipeline_parallel.py::test_pp2_greedy_equals_pp1_under_preemption",
    # the profile's fitting and its record stay
    "tests/test_planner_profile.py::test_profile_measures_the_engine",
    # tool calls and their streaming stay
    "tests/test_gateway_tools.py::test_a_tool_result_round_trip",
    # the colocated M/D/1 check stays
    "tests/test_planner_simulator.py::test_one_prefill_server_at_fixed_service_time_is_md1[prefill-pod]",
    # resumption's other tests (grammar, held-back text) stay
    "tests/test_resume_engine.py::test_greedy_with_penalties_and_logprobs_resumes_identically",
)


def cases_by_variants(cases, variants, ids=str):
    """pytest params of every case (a tuple of arguments) with every launch variant, for a
    kernel test parametrized by both. `make test` keeps each case with the first variant (the
    default launch) and each other variant with one case, in turn; `make test-slow` runs the
    rest of the cross product. Every case and every variant still runs in `make test`, which
    is what a wrong mask or index in one of them would fail."""
    params = []
    for case_index, case in enumerate(cases):
        for variant_index, variant in enumerate(variants):
            # Variant j (j >= 1) with case j - 1: the first variants meet the first cases.
            kept = variant_index == 0 or (variant_index - 1) % len(cases) == case_index
            marks = () if kept else (pytest.mark.slow,)
            params.append(
                pytest.param(*case, variant, marks=marks, id=f"{_case_id(case)}-{ids(variant)}")
            )
    return params


def _case_id(case) -> str:
    """`(torch.float32, 16, [1, 17])` -> "float32-16-1x17"."""
    return "-".join(
        "x".join(map(str, value)) if isinstance(value, list) else str(value).removeprefix("torch.")
        for value in case
    )
