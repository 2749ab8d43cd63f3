// int4_gemm's AVX2 variant: 8 outputs per register, each half of a 16-output tile in turn.
// AVX2 has no 4-byte dot product: maddubs multiplies weight codes (0..15) by activation codes
// (-127..127) and adds neighbouring pairs into int16 lanes (at most 2 x 15 x 127 = 3810), the
// group's 8 such results add up in int16 (at most 30480: no overflow, no saturation), and one
// madd with ones turns each output's two int16 lanes into its int32 dot product. Same
// integers, same float steps in the same order as the other variants: the same result.
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

inline __m256i broadcast_four(const int8_t* codes) {
  int32_t four;
  std::memcpy(&four, codes, sizeof(four));
  return _mm256_set1_epi32(four);
}

// dot[a] = per output of this half, the int32 sum over the group's 32 columns.
template <int kActs>
inline void group_dots(const uint8_t* half, const int8_t* const* codes, int64_t k0,
                       __m256i* dot) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256i pairs[kActs];
  for (int a = 0; a < kActs; ++a) pairs[a] = _mm256_setzero_si256();
  for (int c = 0; c < 4; ++c) {
    const auto* chunk = reinterpret_cast<const __m256i*>(half + c * kChunkBytes);
    const __m256i bytes = _mm256_loadu_si256(chunk);
    const __m256i first = _mm256_and_si256(bytes, low);
    const __m256i second = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
    const int64_t k = k0 + 8 * c;
    for (int a = 0; a < kActs; ++a) {
      const __m256i low_part = _mm256_maddubs_epi16(first, broadcast_four(codes[a] + k));
      const __m256i high_part = _mm256_maddubs_epi16(second, broadcast_four(codes[a] + k + 4));
      const __m256i both = _mm256_add_epi16(low_part, high_part);
      pairs[a] = _mm256_add_epi16(pairs[a], both);
    }
  }
  const __m256i ones = _mm256_set1_epi16(1);
  for (int a = 0; a < kActs; ++a) dot[a] = _mm256_madd_epi16(pairs[a], ones);
}

template <int kRows, int kPasses>
void tile(const Weights& w, const Activations& x, const TileTask& task) {
  constexpr int kActs = kRows * kPasses;
  const int8_t* codes[kActs];
  for (int a = 0; a < kActs; ++a) codes[a] = x.codes + (task.row0 * kPasses + a) * x.in_padded;
  for (int h = 0; h < 2; ++h) {  // outputs 8h .. 8h + 7 of the tile
    const int64_t first_out = task.tile * kTileOutputs + 8 * h;
    if (first_out >= task.out_features) break;
    const uint8_t* group = w.packed + task.tile * w.groups * kGroupBytes + 32 * h;
    const uint16_t* pairs = w.scales_minimums + task.tile * w.groups * 2 * kTileOutputs + 8 * h;
    __m256 total[kRows];
    for (auto& t : total) t = _mm256_setzero_ps();
    for (int64_t g = 0; g < w.groups; ++g, group += kGroupBytes, pairs += 2 * kTileOutputs) {
      __m256i dot[kActs];
      group_dots<kActs>(group, codes, g * kGroup, dot);
      const auto* halves = reinterpret_cast<const __m128i*>(pairs);
      const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(halves));
      const __m256 minimum =
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pairs + kTileOutputs)));
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
    const int64_t valid = task.out_features - first_out < 8 ? task.out_features - first_out : 8;
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
}

}  // namespace

void tile_avx2(const Weights& w, const Activations& x, const TileTask& task) {
  with_row_count(x, task, [&](auto rows, auto passes) {
    tile<decltype(rows)::value, decltype(passes)::value>(w, x, task);
  });
}

}  // namespace int4

#pragma GCC pop_options

#endif  // __x86_64__
