// The two lookups at either end of a decode step that PyTorch spent several small ops on: a
// quantized vocabulary matrix's embedding rows (shared/model/quantization.py's
// QuantizedEmbedding.forward) and each logits row's argmax (shared/sampler.py's argmax_rows).
// At batch 1 on a 2-core AVX2 EPYC (2026-12-02) they took 0.27 and 0.13 ms of a 13-14 ms int4
// step: dispatch and allocation for the first, torch's scalar argmax loop over 49,152 logits
// for the second (its plain max over the same row takes 16 us).

// Separate multiply and add, as torch computes the embedding.
#pragma GCC optimize("fp-contract=off")

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>

#include "kernels.h"

namespace {

constexpr int64_t kArgmaxRowsPerTask = 4;

inline bool is_nan(float value) {  // by its bits: -ffast-math folds std::isnan to false
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return (bits & 0x7fffffffu) > 0x7f800000u;
}

// The first index of the largest value, or of the first NaN (torch's max(dim) semantics).
int64_t row_argmax(const float* row, int64_t n) {
  float largest = row[0];
  bool has_nan = false;
  int64_t k = 0;
#if defined(__AVX2__)
  if (n >= 8) {
    __m256 best = _mm256_loadu_ps(row);
    __m256 unordered = _mm256_cmp_ps(best, best, _CMP_UNORD_Q);
    for (k = 8; k + 8 <= n; k += 8) {
      const __m256 values = _mm256_loadu_ps(row + k);
      best = _mm256_max_ps(best, values);
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(values, values, _CMP_UNORD_Q));
    }
    has_nan = _mm256_movemask_ps(unordered) != 0;
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, best);
    largest = lanes[0];
    for (float lane : lanes) largest = lane > largest ? lane : largest;
  }
#endif
  for (; k < n; ++k) {
    has_nan = has_nan || is_nan(row[k]);
    largest = row[k] > largest ? row[k] : largest;
  }
  for (int64_t i = 0; i < n; ++i) {
    if (has_nan ? is_nan(row[i]) : row[i] == largest) return i;
  }
  return 0;
}

}  // namespace

at::Tensor argmax_rows(at::Tensor logits) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 &&
                  logits.is_contiguous() && logits.device().is_cpu(),
              "logits must be a contiguous float32 [rows, vocab] CPU tensor");
  TORCH_CHECK(logits.size(1) > 0, "logits rows must not be empty");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  auto out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* data = logits.data_ptr<float>();
  int64_t* index = out.data_ptr<int64_t>();
  // A decode batch's rows over the threads; a few rows stay on the calling thread.
  at::parallel_for(0, rows, kArgmaxRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) index[r] = row_argmax(data + r * vocab, vocab);
  });
  return out;
}

at::Tensor int8_embedding(at::Tensor token_ids, at::Tensor codes, at::Tensor residual,
                          at::Tensor refinements, at::Tensor scales, int64_t hidden) {
  TORCH_CHECK(token_ids.scalar_type() == at::kLong && token_ids.dim() == 1 &&
                  token_ids.is_contiguous(),
              "token_ids must be a contiguous int64 [tokens]");
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.dim() == 2 && codes.is_contiguous(),
              "codes must be a contiguous int8 [vocab, in_padded]");
  const int64_t vocab = codes.size(0), in_padded = codes.size(1);
  TORCH_CHECK(hidden > 0 && hidden <= in_padded && in_padded % 2 == 0,
              "hidden must be within the codes' ", in_padded, " columns");
  TORCH_CHECK(residual.scalar_type() == at::kByte && residual.is_contiguous() &&
                  residual.dim() == 2 && residual.size(0) == vocab &&
                  residual.size(1) == in_padded / 2,
              "residual must be a contiguous uint8 [", vocab, ", ", in_padded / 2, "]");
  TORCH_CHECK(refinements.scalar_type() == at::kFloat && refinements.is_contiguous() &&
                  refinements.numel() == 512,
              "refinements must be a contiguous float32 [256, 2]");
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.is_contiguous() &&
                  scales.dim() == 1 && scales.size(0) == vocab,
              "scales must be a contiguous bfloat16 [", vocab, "]");
  const int64_t tokens = token_ids.size(0);
  const int64_t* ids = token_ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(ids[t] >= 0 && ids[t] < vocab, "token id ", ids[t],
                " is outside the vocabulary of ", vocab);
  }
  auto out = at::empty({tokens, hidden}, codes.options().dtype(at::kFloat));
  const float* table = refinements.data_ptr<float>();
  const auto* scale_bits = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  for (int64_t t = 0; t < tokens; ++t) {
    const int8_t* code = codes.data_ptr<int8_t>() + ids[t] * in_padded;
    const uint8_t* nibbles = residual.data_ptr<uint8_t>() + ids[t] * (in_padded / 2);
    const float scale = bfloat16_to_float(scale_bits[ids[t]]);
    float* row = out.data_ptr<float>() + t * hidden;
    // Column k's refinement is entry (byte k / 2, half k % 2) of the table, low nibble first.
    for (int64_t k = 0; k < hidden; ++k) {
      const float refined = static_cast<float>(code[k]) + table[2 * nibbles[k / 2] + k % 2];
      row[k] = refined * scale;
    }
  }
  return out;
}
