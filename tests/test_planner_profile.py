"""`plan profile` with the real engine and the shipped model, on a small grid."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from services.planner.profile import PrefillSample, load_profile, synthetic_profile
from services.planner.profiler import ProfileSettings, measure_profile

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
