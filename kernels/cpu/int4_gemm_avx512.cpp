// int4_gemm's AVX-512 VNNI variant: 16 outputs per register, one dpbusd per 4 columns and
// activation row. Chosen at run time (int4_gemm.cpp), so this file alone is compiled for
// these instructions; it includes nothing but intrinsics and int4_gemm.h, so no inline
// function shared with other files can pick them up (the module's baseline is x86-64-v3).

#if defined(__x86_64__)

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "int4_gemm.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")

namespace int4 {
namespace {

inline __m512i broadcast_four(const int8_t* codes) {
  int32_t four;
  std::memcpy(&four, codes, sizeof(four));
  return _mm512_set1_epi32(four);
}

// dot[a] = per output, the int32 sum over the group's 32 columns of weight code x activation
// code, for activation row a (rows and passes, passes innermost).
template <int kActs>
inline void group_dots(const uint8_t* group, const int8_t* const* codes, int64_t k0,
                       __m512i* dot) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int a = 0; a < kActs; ++a) dot[a] = _mm512_setzero_si512();
  for (int c = 0; c < 4; ++c) {
    const __m512i bytes = _mm512_loadu_si512(group + c * kChunkBytes);
    const __m512i first = _mm512_and_si512(bytes, low);                         // 8c .. 8c+3
    const __m512i second = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);  // 8c+4 .. 8c+7
    const int64_t k = k0 + 8 * c;
    for (int a = 0; a < kActs; ++a) {
      dot[a] = _mm512_dpbusd_epi32(dot[a], first, broadcast_four(codes[a] + k));
      dot[a] = _mm512_dpbusd_epi32(dot[a], second, broadcast_four(codes[a] + k + 4));
    }
  }
}

template <int kRows, int kPasses>
void tile(const Weights& w, const Activations& x, const TileTask& task) {
  constexpr int kActs = kRows * kPasses;
  const uint8_t* group = w.packed + task.tile * w.groups * kGroupBytes;
  const uint16_t* pairs = w.scales_minimums + task.tile * w.groups * 2 * kTileOutputs;
  const int8_t* codes[kActs];
  for (int a = 0; a < kActs; ++a) codes[a] = x.codes + (task.row0 * kPasses + a) * x.in_padded;
  __m512 total[kRows];
  for (auto& t : total) t = _mm512_setzero_ps();
  for (int64_t g = 0; g < w.groups; ++g, group += kGroupBytes, pairs += 2 * kTileOutputs) {
    __m512i dot[kActs];
    group_dots<kActs>(group, codes, g * kGroup, dot);
    const auto* halves = reinterpret_cast<const __m256i*>(pairs);
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(halves));
    const __m512 minimum =
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs + kTileOutputs)));
    for (int r = 0; r < kRows; ++r) {
      const int64_t row = task.row0 + r;
      for (int p = 0; p < kPasses; ++p) {
        const float d = x.scales[(row * kPasses + p) * x.groups + g];
        const __m512 step = _mm512_mul_ps(scale, _mm512_set1_ps(d));
        total[r] = _mm512_fmadd_ps(step, _mm512_cvtepi32_ps(dot[r * kPasses + p]), total[r]);
      }
      const __m512 minimum_sum = _mm512_set1_ps(x.minimum_sums[row * x.groups + g]);
      total[r] = _mm512_fmadd_ps(minimum, minimum_sum, total[r]);
    }
  }
  const int64_t first_out = task.tile * kTileOutputs;
  const int64_t valid = task.out_features - first_out < kTileOutputs ? task.out_features - first_out
                                                                      : kTileOutputs;
  const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
  for (int r = 0; r < kRows; ++r) {
    _mm512_mask_storeu_ps(task.out + (task.row0 + r) * task.out_stride + first_out, mask, total[r]);
  }
}

}  // namespace

void tile_avx512_vnni(const Weights& w, const Activations& x, const TileTask& task) {
  with_row_count(x, task, [&](auto rows, auto passes) {
    tile<decltype(rows)::value, decltype(passes)::value>(w, x, task);
  });
}

}  // namespace int4

#pragma GCC pop_options

#endif  // __x86_64__
