// int8_gemv: a few float32 rows @ a weight-only int8 weight (codes [out, in_padded] int8, one
// bfloat16 scale per output) -> [rows, out] float32, exactly the product with the dequantized
// weight in float32 arithmetic. What decode steps' int8 products (and every quantized model's
// int8 vocabulary head) run below shared/model/quantized_linear.py's
// INT8_ACTIVATION_QUANT_FROM_ROWS rows.
//
// Why our own: at those rows a product waits on memory, one byte per weight, and torch's
// packed int8 kernel (aten._weight_int8pack_mm) wants bfloat16 activations and read SmolLM2's
// 27 MiB int8 head at 5.1 GB/s on a 2-core AVX2 EPYC whose reads stream at 15 GB/s (2026-12-02).
// Here each group of 8 codes is widened to float32 once and multiplied into every row, four
// outputs at a time so that independent FMA chains hide their latency, with the codes
// prefetched ahead; float32 activations also drop the bfloat16 rounding that kernel put on
// them (its products were off by 2e-3 of their norm, these by 2e-7).
//
// The module is compiled for x86-64-v3 (AVX2, FMA) on x86 (kernels/cpu/isa.py), so the AVX2
// body needs no run-time variant; elsewhere the portable loop below runs.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels.h"

namespace {

constexpr int kMaxRows = 4;  // rows one pass over a block of outputs multiplies
constexpr int64_t kOutputsPerTask = 16;
// How far ahead of its reads each output's code stream is prefetched. The outputs' codes are
// one contiguous stream per thread, which the hardware prefetcher alone kept at about half the
// read bandwidth; 2 KiB ahead (tried: 512 B to 4 KiB) read SmolLM2's int8 head at 12-13 GB/s
// against 7-8 without, on a 2-core AVX2 EPYC streaming 15 GB/s.
constexpr int64_t kPrefetchBytes = 2048;

struct Product {
  const float* x;          // [rows, in_features]
  const int8_t* codes;     // [out, in_padded]
  const uint16_t* scales;  // [out] bfloat16 bits
  float* out;              // [rows, out]
  int64_t in_features, in_padded, out_features;

  int64_t num_codes() const { return out_features * in_padded; }  // nothing past is prefetched
};

inline float bfloat16_to_float(uint16_t bits) {
  const uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &widened, sizeof(value));
  return value;
}

// Rows row0 .. row0 + kRows - 1 times outputs o0 .. o0 + kOuts - 1: x's columns 8 at a time
// with FMAs (AVX2), the rest one at a time.
template <int kRows, int kOuts>
void block(const Product& p, int64_t row0, int64_t o0) {
  float sums[kRows][kOuts] = {};
  int64_t k = 0;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc[kRows][kOuts];
  for (auto& row : acc) {
    for (auto& lanes : row) lanes = _mm256_setzero_ps();
  }
  for (; k + 8 <= p.in_features; k += 8) {
    __m256 x[kRows];
    for (int r = 0; r < kRows; ++r) x[r] = _mm256_loadu_ps(p.x + (row0 + r) * p.in_features + k);
    if (k % 64 == 0) {  // one cache line of each output's codes
      for (int o = 0; o < kOuts; ++o) {
        const int64_t at = (o0 + o) * p.in_padded + k + kPrefetchBytes;
        if (at < p.num_codes()) {
          _mm_prefetch(reinterpret_cast<const char*>(p.codes + at), _MM_HINT_T0);
        }
      }
    }
    for (int o = 0; o < kOuts; ++o) {
      const auto* eight = reinterpret_cast<const __m128i*>(p.codes + (o0 + o) * p.in_padded + k);
      const __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(eight)));
      for (int r = 0; r < kRows; ++r) acc[r][o] = _mm256_fmadd_ps(w, x[r], acc[r][o]);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int o = 0; o < kOuts; ++o) {
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, acc[r][o]);
      float total = 0.f;
      for (float lane : lanes) total += lane;
      sums[r][o] = total;
    }
  }
#endif
  for (; k < p.in_features; ++k) {
    for (int o = 0; o < kOuts; ++o) {
      const float w = static_cast<float>(p.codes[(o0 + o) * p.in_padded + k]);
      for (int r = 0; r < kRows; ++r) sums[r][o] += w * p.x[(row0 + r) * p.in_features + k];
    }
  }
  for (int o = 0; o < kOuts; ++o) {
    const float scale = bfloat16_to_float(p.scales[o0 + o]);
    for (int r = 0; r < kRows; ++r) {
      p.out[(row0 + r) * p.out_features + o0 + o] = sums[r][o] * scale;
    }
  }
}

// Four outputs at a time (the last block of a task takes what is left one by one); rows in
// blocks of up to kMaxRows, with fewer outputs per block as rows add accumulators.
template <int kRows>
void rows_times_outputs(const Product& p, int64_t row0, int64_t first, int64_t end) {
  constexpr int kOuts = kRows <= 2 ? 4 : 2;
  int64_t o = first;
  for (; o + kOuts <= end; o += kOuts) block<kRows, kOuts>(p, row0, o);
  for (; o < end; ++o) block<kRows, 1>(p, row0, o);
}

void outputs(const Product& p, int64_t rows, int64_t first, int64_t end) {
  for (int64_t row0 = 0; row0 < rows; row0 += kMaxRows) {
    switch (std::min<int64_t>(kMaxRows, rows - row0)) {
      case 1: rows_times_outputs<1>(p, row0, first, end); break;
      case 2: rows_times_outputs<2>(p, row0, first, end); break;
      case 3: rows_times_outputs<3>(p, row0, first, end); break;
      default: rows_times_outputs<4>(p, row0, first, end); break;
    }
  }
}

}  // namespace

at::Tensor int8_gemv(at::Tensor x, at::Tensor codes, at::Tensor scales) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous float32 [rows, in]");
  TORCH_CHECK(codes.dtype() == at::kChar && codes.dim() == 2 && codes.is_contiguous(),
              "codes must be a contiguous int8 [out, in_padded]");
  TORCH_CHECK(scales.dtype() == at::kBFloat16 && scales.dim() == 1 && scales.is_contiguous() &&
                  scales.size(0) == codes.size(0),
              "scales must be a contiguous bfloat16 [", codes.size(0), "]");
  TORCH_CHECK(x.size(1) <= codes.size(1), "x has ", x.size(1), " columns, the weight ",
              codes.size(1));
  const int64_t rows = x.size(0), out_features = codes.size(0);
  auto out = at::empty({rows, out_features}, x.options());
  if (rows == 0 || out_features == 0) return out;
  // Columns past x's are the weight's zero padding: never read.
  const Product p{x.data_ptr<float>(),
                  codes.data_ptr<int8_t>(),
                  reinterpret_cast<const uint16_t*>(scales.data_ptr()),
                  out.data_ptr<float>(),
                  x.size(1),
                  codes.size(1),
                  out_features};
  const int64_t tasks = (out_features + kOutputsPerTask - 1) / kOutputsPerTask;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    outputs(p, rows, begin * kOutputsPerTask, std::min(end * kOutputsPerTask, out_features));
  });
  return out;
}
