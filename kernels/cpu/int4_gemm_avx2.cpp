// int4_gemm's AVX2 variant: 8 outputs per register.
// AVX2 has no 4-byte dot product: maddubs multiplies weight codes (0..15) by activation codes
// (-127..127) and adds neighbouring pairs into int16 lanes (at most 2 x 15 x 127 = 3810), the
// group's 8 such results add up in int16 (at most 30480: no overflow, no saturation), and one
// madd with ones turns each output's two int16 lanes into its int32 dot product. Same
// integers, same float steps in the same order as the other variants: the same result.
//
// Decode rows (one or two activation rows with their passes) take a tile's 16 outputs
// together, one register per half: each broadcast of four activation codes serves both
// halves, and the weight stream is prefetched ahead of its reads. At one row, two passes,
// SmolLM2's 120 products read at about 8 GB/s a thread against 15 for a plain read on a
// 2-core AVX2 EPYC (2026-12-02): the loads wait behind the arithmetic, and the hardware
// prefetcher alone did not keep enough lines in flight; this loop took 0.90x the time of the
// half-at-a-time one there (medians of 60 alternating rounds; end to end, int4 batch-1 decode
// +6% in alternating rounds, o and gate_up in one pass since). More activations (prefill chunks,
// decode batches) keep to one half at a time, whose accumulators already fill the registers.
// Includes only intrinsics and int4_gemm.h (see int4_gemm_avx512.cpp for why).

#if defined(__x86_64__)

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "int4_gemm.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace int4 {
namespace {

// How far ahead of a tile's reads its weight bytes are prefetched: 4 groups. Tried on the
// EPYC above, 120 products at one row: 256 B ahead 0.99x the time of none, 1 KiB 0.93x,
// 2 KiB 0.92x, 4 KiB 0.95x (medians of 60 alternating rounds, noisy).
constexpr int64_t kPrefetchBytes = 4 * kGroupBytes;
// The most activation rows (rows x passes) whose accumulators fit in registers for a whole
// tile: two per half, plus the weight and broadcast registers.
constexpr int kMaxWholeTileActs = 2;

inline __m256i broadcast_four(const int8_t* codes) {
  int32_t four;
  std::memcpy(&four, codes, sizeof(four));
  return _mm256_set1_epi32(four);
}

inline void prefetch_group(const uint8_t* group) {
  const char* ahead = reinterpret_cast<const char*>(group) + kPrefetchBytes;
  for (int line = 0; line < kGroupBytes / 64; ++line) {
    _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
  }
}

// The low and high nibbles of 32 bytes: codes of columns 8c .. 8c+3 and 8c+4 .. 8c+7.
struct Nibbles {
  __m256i first, second;
};

inline Nibbles nibbles(const uint8_t* bytes) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i all = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
  return {_mm256_and_si256(all, low), _mm256_and_si256(_mm256_srli_epi16(all, 4), low)};
}

// The int16 pair sums of one chunk's 8 columns for one half and activation (broadcasts
// `first` and `second` of its codes).
inline __m256i chunk_pairs(const Nibbles& half, __m256i first, __m256i second) {
  return _mm256_add_epi16(_mm256_maddubs_epi16(half.first, first),
                          _mm256_maddubs_epi16(half.second, second));
}

// dot[a] = per output of one half, the int32 sum over the group's 32 columns.
template <int kActs>
inline void half_group_dots(const uint8_t* half, const int8_t* const* codes, int64_t k0,
                            __m256i* dot) {
  __m256i pairs[kActs];
  for (int a = 0; a < kActs; ++a) pairs[a] = _mm256_setzero_si256();
  for (int c = 0; c < 4; ++c) {
    const Nibbles bytes = nibbles(half + c * kChunkBytes);
    const int64_t k = k0 + 8 * c;
    for (int a = 0; a < kActs; ++a) {
      pairs[a] = _mm256_add_epi16(
          pairs[a],
          chunk_pairs(bytes, broadcast_four(codes[a] + k), broadcast_four(codes[a] + k + 4)));
    }
  }
  const __m256i ones = _mm256_set1_epi16(1);
  for (int a = 0; a < kActs; ++a) dot[a] = _mm256_madd_epi16(pairs[a], ones);
}

// The same for both halves at once: dot[h][a].
template <int kActs>
inline void tile_group_dots(const uint8_t* group, const int8_t* const* codes, int64_t k0,
                            __m256i (*dot)[kActs]) {
  __m256i pairs[2][kActs];
  for (auto& half : pairs) {
    for (auto& sum : half) sum = _mm256_setzero_si256();
  }
  for (int c = 0; c < 4; ++c) {
    const Nibbles halves[2] = {nibbles(group + c * kChunkBytes),
                               nibbles(group + c * kChunkBytes + 32)};
    const int64_t k = k0 + 8 * c;
    for (int a = 0; a < kActs; ++a) {
      const __m256i first = broadcast_four(codes[a] + k), second = broadcast_four(codes[a] + k + 4);
      for (int h = 0; h < 2; ++h) {
        pairs[h][a] = _mm256_add_epi16(pairs[h][a], chunk_pairs(halves[h], first, second));
      }
    }
  }
  const __m256i ones = _mm256_set1_epi16(1);
  for (int h = 0; h < 2; ++h) {
    for (int a = 0; a < kActs; ++a) dot[h][a] = _mm256_madd_epi16(pairs[h][a], ones);
  }
}

// total[r] += the group's contribution to 8 outputs (whose float16 scales and minimums start
// at `scales` and `minimums`) from row r's dot products: the float steps every variant takes.
template <int kRows, int kPasses>
inline void add_group(const Activations& x, const TileTask& task, int64_t g,
                      const uint16_t* scales, const uint16_t* minimums, const __m256i* dot,
                      __m256* total) {
  const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales)));
  const __m256 minimum =
      _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(minimums)));
  for (int r = 0; r < kRows; ++r) {
    const int64_t row = task.row0 + r;
    for (int p = 0; p < kPasses; ++p) {
      const float d = x.scales[(row * kPasses + p) * x.groups + g];
      const __m256 step = _mm256_mul_ps(scale, _mm256_set1_ps(d));
      total[r] = _mm256_fmadd_ps(step, _mm256_cvtepi32_ps(dot[r * kPasses + p]), total[r]);
    }
    const __m256 minimum_sum = _mm256_set1_ps(x.minimum_sums[row * x.groups + g]);
    total[r] = _mm256_fmadd_ps(minimum, minimum_sum, total[r]);
  }
}

// Rows' results for outputs first_out .. first_out + 7 (those below out_features).
template <int kRows>
inline void store_half(const TileTask& task, int64_t first_out, const __m256* total) {
  const int64_t valid = task.out_features - first_out < 8 ? task.out_features - first_out : 8;
  if (valid <= 0) return;
  for (int r = 0; r < kRows; ++r) {
    float* dst = task.out + (task.row0 + r) * task.out_stride + first_out;
    if (valid == 8) {
      _mm256_storeu_ps(dst, total[r]);
    } else {
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, total[r]);
      for (int64_t o = 0; o < valid; ++o) dst[o] = lanes[o];
    }
  }
}

template <int kRows, int kPasses>
void activation_codes(const Activations& x, const TileTask& task, const int8_t** codes) {
  for (int a = 0; a < kRows * kPasses; ++a) {
    codes[a] = x.codes + (task.row0 * kPasses + a) * x.in_padded;
  }
}

// A tile's 16 outputs together (kRows x kPasses <= kMaxWholeTileActs).
template <int kRows, int kPasses>
void whole_tile(const Weights& w, const Activations& x, const TileTask& task) {
  constexpr int kActs = kRows * kPasses;
  const int8_t* codes[kActs];
  activation_codes<kRows, kPasses>(x, task, codes);
  const uint8_t* group = w.packed + task.tile * w.groups * kGroupBytes;
  const uint16_t* pairs = w.scales_minimums + task.tile * w.groups * 2 * kTileOutputs;
  __m256 total[2][kRows];
  for (auto& half : total) {
    for (auto& t : half) t = _mm256_setzero_ps();
  }
  for (int64_t g = 0; g < w.groups; ++g, group += kGroupBytes, pairs += 2 * kTileOutputs) {
    prefetch_group(group);
    __m256i dot[2][kActs];
    tile_group_dots<kActs>(group, codes, g * kGroup, dot);
    for (int h = 0; h < 2; ++h) {
      add_group<kRows, kPasses>(x, task, g, pairs + 8 * h, pairs + kTileOutputs + 8 * h, dot[h],
                                total[h]);
    }
  }
  for (int h = 0; h < 2; ++h) store_half<kRows>(task, task.tile * kTileOutputs + 8 * h, total[h]);
}

// One half of a tile at a time (more activation rows than whole_tile takes).
template <int kRows, int kPasses>
void tile_by_halves(const Weights& w, const Activations& x, const TileTask& task) {
  constexpr int kActs = kRows * kPasses;
  const int8_t* codes[kActs];
  activation_codes<kRows, kPasses>(x, task, codes);
  for (int h = 0; h < 2; ++h) {  // outputs 8h .. 8h + 7 of the tile
    const int64_t first_out = task.tile * kTileOutputs + 8 * h;
    if (first_out >= task.out_features) break;
    const uint8_t* group = w.packed + task.tile * w.groups * kGroupBytes + 32 * h;
    const uint16_t* pairs = w.scales_minimums + task.tile * w.groups * 2 * kTileOutputs + 8 * h;
    __m256 total[kRows];
    for (auto& t : total) t = _mm256_setzero_ps();
    for (int64_t g = 0; g < w.groups; ++g, group += kGroupBytes, pairs += 2 * kTileOutputs) {
      if (h == 0) prefetch_group(group);  // half 1 finds the tile's lines in cache
      __m256i dot[kActs];
      half_group_dots<kActs>(group, codes, g * kGroup, dot);
      add_group<kRows, kPasses>(x, task, g, pairs, pairs + kTileOutputs, dot, total);
    }
    store_half<kRows>(task, first_out, total);
  }
}

}  // namespace

void tile_avx2(const Weights& w, const Activations& x, const TileTask& task) {
  with_row_count(x, task, [&](auto rows, auto passes) {
    constexpr int kRows = decltype(rows)::value, kPasses = decltype(passes)::value;
    if constexpr (kRows * kPasses <= kMaxWholeTileActs) {
      whole_tile<kRows, kPasses>(w, x, task);
    } else {
      tile_by_halves<kRows, kPasses>(w, x, task);
    }
  });
}

}  // namespace int4

#pragma GCC pop_options

#endif  // __x86_64__
