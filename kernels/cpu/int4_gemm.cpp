// int4_gemm: x [rows, in] float32 @ an int4 weight (groups of 32 along `in`, one affine
// (scale, zero) per group and output) -> [rows, out] float32, as int8 x uint4 VNNI dot products
// (llama.cpp's Q4 x Q8 idea): torch's packed int4 kernel is no faster than float32 oneDNN from
// ~16 rows, and these products are compute-bound there.
//
// The weight is read in torch's `_convert_weight_to_int4pack_for_cpu` layout (Int4Weight in
// shared/model/quantized_linear.py), so one copy serves torch's kernel (decode rows) and this one:
// per block of 64 outputs, `in` runs of 32 bytes, byte j of run k holding the code of output j
// (low nibble) and j + 32 (high nibble) at column k. scales_zeros [in / 32, out_padded, 2]
// bfloat16 gives w = (q - 8) * scale + zero = q * scale + minimum, minimum = zero - 8 * scale.
//
// Activations are quantized per row and group of 32 inside the call (llama.cpp's Q8 blocks):
//   xq = round(x * 127 / amax|x over the group|) (int8, scale d = amax / 127), so
//   sum_k w x ~= sum_g d_g * [ scale_g * sum_{k in g} q xq + minimum_g * sum_{k in g} xq ]
// Per group rather than per row: one row-wide scale let one large activation coarsen all the
// others (an outlier channel is common in LLM hidden states), and it missed the product tests'
// 1% bound (1.05% at 16 rows); per group costs one multiply per group and 16 outputs.

#include "kernels.h"

#include <ATen/Parallel.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstring>

#if defined(__x86_64__)  // the rest of the file; other processors get the stubs at its end

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kBlock = 64;  // outputs per block of torch's layout
constexpr int64_t kHalf = 32;   // outputs one tile computes: one nibble of each byte
// Rows one tile computes: each weight load (and its shuffle) serves them all. Fewer than 4 rows
// (decode steps) take tiles of one row, so no padding row's products are computed.
constexpr int kRowTile = 4;

#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")))

// Activations of one call, quantized: [rows_padded, in_padded] int8 codes, per row and group
// the codes' scale d and d * (the sum of the group's codes) (the minimum's term); padding rows
// and columns are zero.
struct QuantizedRows {
  std::vector<int8_t> codes;
  std::vector<float> scales, scaled_sums;  // [rows_padded, groups]
  int64_t rows_padded, in_padded, groups;
};

void quantize_group(const float* x, int64_t size, int8_t* codes, float* scale, float* sum) {
  float amax = 0.f;
  for (int64_t k = 0; k < size; ++k) amax = std::max(amax, std::fabs(x[k]));
  const float inverse = amax > 0.f ? 127.f / amax : 0.f;
  int32_t total = 0;
  for (int64_t k = 0; k < size; ++k) {
    const int32_t code = static_cast<int32_t>(std::nearbyint(x[k] * inverse));
    codes[k] = static_cast<int8_t>(code);
    total += code;
  }
  *scale = amax / 127.f;
  *sum = *scale * static_cast<float>(total);
}

QuantizedRows quantize_rows(const float* x, int64_t rows, int64_t in_features, int64_t in_padded,
                            int64_t row_tile) {
  QuantizedRows q;
  q.rows_padded = (rows + row_tile - 1) / row_tile * row_tile;
  q.in_padded = in_padded;
  q.groups = in_padded / kGroup;
  q.codes.assign(q.rows_padded * in_padded, 0);
  q.scales.assign(q.rows_padded * q.groups, 0.f);
  q.scaled_sums.assign(q.rows_padded * q.groups, 0.f);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t g = 0; g * kGroup < in_features; ++g) {
        const int64_t k = g * kGroup, size = std::min(kGroup, in_features - k);
        const int64_t at = r * q.groups + g;
        quantize_group(x + r * in_features + k, size, q.codes.data() + r * in_padded + k,
                       &q.scales[at], &q.scaled_sums[at]);
      }
    }
  });
  return q;
}

// The byte shuffle that turns 4 runs of torch's layout (columns k..k+3, one nibble taken) into
// VNNI's: lane l of the result holds output `first + l`'s 4 codes, column order.
VNNI_TARGET __m512i vnni_index(int first) {
  alignas(64) uint8_t index[64];
  for (int l = 0; l < 16; ++l) {
    index[4 * l + 0] = static_cast<uint8_t>(first + l);       // column k (a's low half)
    index[4 * l + 1] = static_cast<uint8_t>(32 + first + l);  // k + 1 (a's high half)
    index[4 * l + 2] = static_cast<uint8_t>(64 + first + l);  // k + 2 (b's low half)
    index[4 * l + 3] = static_cast<uint8_t>(96 + first + l);  // k + 3 (b's high half)
  }
  return _mm512_load_si512(index);
}

VNNI_TARGET inline __m512 bf16_low(__m512i pairs) {  // the first bfloat16 of each pair
  return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
}

VNNI_TARGET inline __m512 bf16_high(__m512i pairs) {  // the second one
  return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(0xFFFF0000)));
}

struct Tile {
  int64_t block, half, row0;
};

// One tile: 32 outputs (one nibble of a 64-output block) x kRows rows, over all of `in`.
template <int kRows>
VNNI_TARGET void tile_product(const uint8_t* packed, const uint16_t* scales_zeros,
                              const QuantizedRows& q, int64_t out_padded, Tile tile, float* out,
                              int64_t rows, int64_t out_features) {
  const int64_t in_padded = q.in_padded;
  const uint8_t* weights = packed + tile.block * in_padded * 32;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i index0 = vnni_index(0), index1 = vnni_index(16);
  const int shift = static_cast<int>(tile.half) * 4;
  const int64_t first_out = tile.block * kBlock + tile.half * kHalf;
  __m512 total[kRows][2];
  for (auto& row : total) row[0] = row[1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < q.groups; ++g) {
    __m512i dot[kRows][2];
    for (auto& row : dot) row[0] = row[1] = _mm512_setzero_si512();
    for (int64_t k = g * kGroup; k < (g + 1) * kGroup; k += 4) {
      const uint8_t* run = weights + k * 32;
      __m512i a = _mm512_loadu_si512(run), b = _mm512_loadu_si512(run + 64);
      a = _mm512_and_si512(_mm512_srli_epi16(a, shift), nibble);
      b = _mm512_and_si512(_mm512_srli_epi16(b, shift), nibble);
      const __m512i w0 = _mm512_permutex2var_epi8(a, index0, b);
      const __m512i w1 = _mm512_permutex2var_epi8(a, index1, b);
      for (int r = 0; r < kRows; ++r) {
        int32_t four;
        std::memcpy(&four, q.codes.data() + (tile.row0 + r) * in_padded + k, 4);
        const __m512i x4 = _mm512_set1_epi32(four);
        dot[r][0] = _mm512_dpbusd_epi32(dot[r][0], w0, x4);
        dot[r][1] = _mm512_dpbusd_epi32(dot[r][1], w1, x4);
      }
    }
    // (scale, zero) pairs of this group's 32 outputs: 2 x 16 bfloat16 pairs.
    const uint16_t* pairs = scales_zeros + (g * out_padded + first_out) * 2;
    for (int h = 0; h < 2; ++h) {
      const __m512i raw = _mm512_loadu_si512(pairs + 32 * h);
      const __m512 scale = bf16_low(raw);
      const __m512 minimum = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), scale, bf16_high(raw));
      for (int r = 0; r < kRows; ++r) {
        const int64_t at = (tile.row0 + r) * q.groups + g;
        const __m512 dot_scale = _mm512_mul_ps(scale, _mm512_set1_ps(q.scales[at]));
        total[r][h] = _mm512_fmadd_ps(dot_scale, _mm512_cvtepi32_ps(dot[r][h]), total[r][h]);
        total[r][h] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(q.scaled_sums[at]), total[r][h]);
      }
    }
  }
  for (int r = 0; r < kRows && tile.row0 + r < rows; ++r) {
    for (int h = 0; h < 2; ++h) {
      const int64_t o = first_out + 16 * h;
      if (o >= out_features) break;
      const int64_t valid = std::min<int64_t>(16, out_features - o);
      const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
      float* dst = out + (tile.row0 + r) * out_features + o;
      _mm512_mask_storeu_ps(dst, mask, total[r][h]);
    }
  }
}

}  // namespace

bool int4_gemm_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
         __builtin_cpu_supports("avx512vbmi");
}

torch::Tensor int4_gemm(torch::Tensor x, torch::Tensor packed, torch::Tensor scales_zeros,
                        int64_t out_features) {
  TORCH_CHECK(int4_gemm_supported(), "int4_gemm needs AVX512-VNNI and AVX512-VBMI");
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous float32 [rows, in]");
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && packed.dim() == 2 && packed.is_contiguous(),
              "packed must be torch's contiguous uint8 [out_padded, in_padded / 2]");
  const int64_t out_padded = packed.size(0), in_padded = packed.size(1) * 2;
  TORCH_CHECK(out_padded % kBlock == 0 && in_padded % kGroup == 0,
              "packed ", packed.sizes(), " is not whole blocks of 64 outputs and 32 columns");
  TORCH_CHECK(scales_zeros.dtype() == torch::kBFloat16 && scales_zeros.is_contiguous() &&
                  scales_zeros.dim() == 3 && scales_zeros.size(0) == in_padded / kGroup &&
                  scales_zeros.size(1) == out_padded && scales_zeros.size(2) == 2,
              "scales_zeros must be a contiguous bfloat16 [", in_padded / kGroup, ", ",
              out_padded, ", 2]");
  TORCH_CHECK(x.size(1) <= in_padded, "x has ", x.size(1), " columns, the weight ", in_padded);
  TORCH_CHECK(0 < out_features && out_features <= out_padded, "out_features ", out_features);
  const int64_t rows = x.size(0);
  auto out = torch::empty({rows, out_features}, x.options());
  if (rows == 0) return out;
  const int64_t row_tile = rows < kRowTile ? 1 : kRowTile;
  const QuantizedRows q = quantize_rows(x.data_ptr<float>(), rows, x.size(1), in_padded, row_tile);
  const int64_t halves = (out_features + kHalf - 1) / kHalf;  // tiles of 32 outputs with work
  const int64_t row_tiles = q.rows_padded / row_tile;
  const auto* weights = packed.data_ptr<uint8_t>();
  const auto* pairs = reinterpret_cast<const uint16_t*>(scales_zeros.data_ptr());
  float* result = out.data_ptr<float>();
  // Output tiles outer, rows inner: a thread's consecutive tiles reuse one weight tile from L1.
  at::parallel_for(0, halves * row_tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t half_index = t / row_tiles;
      const Tile tile{half_index / 2, half_index % 2, (t % row_tiles) * row_tile};
      if (row_tile == 1) {
        tile_product<1>(weights, pairs, q, out_padded, tile, result, rows, out_features);
      } else {
        tile_product<kRowTile>(weights, pairs, q, out_padded, tile, result, rows, out_features);
      }
    }
  });
  return out;
}

#else  // not x86-64: no VNNI, so the Python side keeps torch's int4 kernels

bool int4_gemm_supported() { return false; }

torch::Tensor int4_gemm(torch::Tensor, torch::Tensor, torch::Tensor, int64_t) {
  TORCH_CHECK(false, "int4_gemm needs an x86-64 CPU with AVX512-VNNI and AVX512-VBMI");
}

#endif
