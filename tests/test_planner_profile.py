"""`plan profile` with the real engine and the shipped model, on a small grid."""

from __future__ import annotations

import pytest

from services.planner.profile import load_profile
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
