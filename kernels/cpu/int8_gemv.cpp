// int8_gemv: a few float32 rows @ a weight-only int8 weight (codes [out, in_padded] int8, one
// bfloat16 scale per output) -> [rows, out] float32. What decode steps' int8 products (and every
// quantized model's int8 vocabulary head) run below shared/model/quantized_linear.py's
// INT8_ACTIVATION_QUANT_FROM_ROWS rows.
//
// The activations are first rounded to int16 per row and group of 32 columns (step = the
// group's largest magnitude / 32767; kernels/reference.py's int16_group_activations), so each
// product is the dequantized weight times activations within 2^-16 of their group's largest
// value, with float32 sums per group: its relative error against float activations is about
// 2e-5, against 4e-3 for the bfloat16 activations of torch's packed kernel
// (aten._weight_int8pack_mm) and 1e-2 for the int8 weight's own rounding.
//
// Why int16: a decode product reads one byte per weight, and the float loop this replaced
// (widen 8 codes to float32, one FMA into a chain per output) read SmolLM2's int8 head at 4.3
// GB/s a thread on a 2-core AVX2 EPYC against 7.4-8 for a plain read, a quarter or more of an
// int4 decode step there (2026-12-02). Mostly its prefetching held it (kPrefetchBytes), but its
// arithmetic too: on codes already in L2 it ran at 11.4 GB/s a thread, this loop at 16.1 (16
// codes widened to int16 take one madd against 16 activation codes, a group's 32 columns one
// float step per output).
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
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels.h"

namespace {

constexpr int64_t kGroup = 32;         // activation columns per int16 step
constexpr float kInt16Max = 32767.f;
constexpr int kMaxRows = 4;  // rows one pass over a block of outputs multiplies
constexpr int64_t kOutputsPerTask = 16;
// How far ahead of its reads a thread's code stream is prefetched. A thread's outputs are one
// contiguous stream of codes, which the hardware prefetcher alone kept at a third of the read
// speed on a 2-core AVX2 EPYC; a block of outputs prefetches the same number of bytes, as one
// linear run, this far past its own (one line per output row, as before, took 1.5-1.9x a
// plain read's time for SmolLM2's head, this 0.8-1.2x; 1-16 KiB tried, 2026-12-02).
constexpr int64_t kPrefetchBytes = 2048;

// The activations as int16 codes per group of 32: x[r, k] ~ steps[r, k / 32] * codes[r, k].
struct Activations {
  std::vector<int16_t> codes;  // [rows, groups * 32], zero past in_features
  std::vector<float> steps;    // [rows, groups]
  int64_t groups;
};

struct Product {
  const Activations* x;
  const int8_t* codes;     // [out, in_padded]
  const uint16_t* scales;  // [out] bfloat16 bits
  float* out;              // [rows, out]
  int64_t in_padded, out_features;
  int64_t prefetch_share;  // bytes of one output's codes prefetched per group (prefetch_ahead)

  int64_t num_codes() const { return out_features * in_padded; }  // nothing past is prefetched
  const int16_t* row_codes(int64_t row) const { return x->codes.data() + row * x->groups * kGroup; }
  const float* row_steps(int64_t row) const { return x->steps.data() + row * x->groups; }
};

#if defined(__AVX2__) && defined(__FMA__)
// Group g's share of the lines kPrefetchBytes past the codes of outputs o0 .. o0 + outs - 1:
// their bytes spread evenly over the groups (no division here: it cost more than the loads).
// Always inlined: GCC 12 counts a prefetch as no side effect, so it took a separate function
// holding only prefetches for a pure one and deleted every call (none reached the binary).
__attribute__((always_inline)) inline void prefetch_ahead(const Product& p, int64_t o0,
                                                          int64_t outs, int64_t g) {
  const int64_t share = outs * p.prefetch_share;
  const int64_t from = o0 * p.in_padded + kPrefetchBytes + share * g;
  const int64_t end = std::min(from + share, p.num_codes());
  for (int64_t at = from & ~int64_t{63}; at < end; at += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(p.codes + at), _MM_HINT_T0);
  }
}
#endif

inline bool is_finite(float value) {  // by its bits: -ffast-math folds std::isfinite to true
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return (bits & 0x7fffffffu) < 0x7f800000u;
}

// Round-to-nearest-even of x * (32767 / group max), as the reference does in float32. A group
// holding an infinity or a NaN gets a NaN step, so its outputs come out NaN as a float product's
// would (its codes could not be rounded); one whose largest value is below kSmallestGroupMax
// counts as zeros (32767 / it would overflow).
constexpr float kSmallestGroupMax = 1e-30f;
Activations int16_groups(const float* x, int64_t rows, int64_t in_features) {
  Activations a;
  a.groups = (in_features + kGroup - 1) / kGroup;
  a.codes.assign(rows * a.groups * kGroup, 0);
  a.steps.assign(rows * a.groups, 0.f);
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * in_features;
    for (int64_t g = 0; g < a.groups; ++g) {
      const int64_t begin = g * kGroup, end = std::min(begin + kGroup, in_features);
      float largest = 0.f;
      bool finite = true;
      for (int64_t k = begin; k < end; ++k) {
        finite = finite && is_finite(row[k]);
        largest = std::max(largest, std::fabs(row[k]));
      }
      if (!finite) {
        a.steps[r * a.groups + g] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      if (largest < kSmallestGroupMax) continue;
      const float inverse = kInt16Max / largest;
      a.steps[r * a.groups + g] = largest / kInt16Max;
      int16_t* codes = a.codes.data() + r * a.groups * kGroup;
      for (int64_t k = begin; k < end; ++k) {
        codes[k] = static_cast<int16_t>(std::nearbyint(row[k] * inverse));
      }
    }
  }
  return a;
}

// Rows row0 .. row0 + kRows - 1 times outputs o0 .. o0 + kOuts - 1: per group, each output's
// 32 codes widened to int16 once, madd into every row's codes, the int32 sums (at most
// 32 x 127 x 32767 < 2^24: exact in float32) scaled by the row's step.
template <int kRows, int kOuts>
void block(const Product& p, int64_t row0, int64_t o0) {
  float sums[kRows][kOuts] = {};
  const int64_t groups = p.x->groups;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc[kRows][kOuts];
  for (auto& row : acc) {
    for (auto& lanes : row) lanes = _mm256_setzero_ps();
  }
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t k = g * kGroup;
    prefetch_ahead(p, o0, kOuts, g);
    __m256i w[kOuts][2];
    for (int o = 0; o < kOuts; ++o) {
      const auto* sixteen = reinterpret_cast<const __m128i*>(p.codes + (o0 + o) * p.in_padded + k);
      w[o][0] = _mm256_cvtepi8_epi16(_mm_loadu_si128(sixteen));
      w[o][1] = _mm256_cvtepi8_epi16(_mm_loadu_si128(sixteen + 1));
    }
    for (int r = 0; r < kRows; ++r) {
      const auto* x = reinterpret_cast<const __m256i*>(p.row_codes(row0 + r) + k);
      const __m256i x0 = _mm256_loadu_si256(x), x1 = _mm256_loadu_si256(x + 1);
      const __m256 step = _mm256_set1_ps(p.row_steps(row0 + r)[g]);
      for (int o = 0; o < kOuts; ++o) {
        const __m256i dot =
            _mm256_add_epi32(_mm256_madd_epi16(w[o][0], x0), _mm256_madd_epi16(w[o][1], x1));
        acc[r][o] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), step, acc[r][o]);
      }
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
#else
  for (int64_t g = 0; g < groups; ++g) {
    for (int r = 0; r < kRows; ++r) {
      const int16_t* x = p.row_codes(row0 + r) + g * kGroup;
      const float step = p.row_steps(row0 + r)[g];
      for (int o = 0; o < kOuts; ++o) {
        const int8_t* w = p.codes + (o0 + o) * p.in_padded + g * kGroup;
        int32_t dot = 0;
        for (int64_t k = 0; k < kGroup; ++k) dot += static_cast<int32_t>(w[k]) * x[k];
        sums[r][o] += static_cast<float>(dot) * step;
      }
    }
  }
#endif
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
  TORCH_CHECK(codes.size(1) % kGroup == 0, "codes must have a multiple of ", kGroup,
              " columns (in_padded), not ", codes.size(1));
  TORCH_CHECK(scales.dtype() == at::kBFloat16 && scales.dim() == 1 && scales.is_contiguous() &&
                  scales.size(0) == codes.size(0),
              "scales must be a contiguous bfloat16 [", codes.size(0), "]");
  TORCH_CHECK(x.size(1) <= codes.size(1), "x has ", x.size(1), " columns, the weight ",
              codes.size(1));
  const int64_t rows = x.size(0), out_features = codes.size(0);
  auto out = at::empty({rows, out_features}, x.options());
  if (rows == 0 || out_features == 0) return out;
  // Groups past x's columns are the weight's zero padding: never read.
  const Activations activations = int16_groups(x.data_ptr<float>(), rows, x.size(1));
  const Product p{&activations,
                  codes.data_ptr<int8_t>(),
                  reinterpret_cast<const uint16_t*>(scales.data_ptr()),
                  out.data_ptr<float>(),
                  codes.size(1),
                  out_features,
                  (codes.size(1) + activations.groups - 1) / activations.groups};
  const int64_t tasks = (out_features + kOutputsPerTask - 1) / kOutputsPerTask;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    outputs(p, rows, begin * kOutputsPerTask, std::min(end * kOutputsPerTask, out_features));
  });
  return out;
}
