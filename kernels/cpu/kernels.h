// The kernels one C++ file calls from another, and module.cpp binds: each defined in its own
// file (named beside it).

#pragma once

// Headers: the kernels include ATen's tensor and the per-operator headers they call, and only
// the two binding files (module.cpp, decode_layers.cpp) torch's pybind header. torch/extension.h
// costs about 50 s of compile per file on a 2-core AVX2 EPYC (ATen/core/Tensor.h about 4 s):
// with it in every file the build took 195 s, without it 65 s (2026-12-02).

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace pybind11 {
class module_;
}  // namespace pybind11

// A bfloat16's bits as the float32 it is (the int8 weights' scales).
inline float bfloat16_to_float(uint16_t bits) {
  const uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &widened, sizeof(value));
  return value;
}

// paged_decode_attention.cpp
// window: keys of the last `window` positions only (0 = all); softcap: scores capped by
// softcap * tanh(score / softcap) (0 = none).
at::Tensor paged_decode_attention(at::Tensor query, at::Tensor key_cache,
                                  at::Tensor value_cache, at::Tensor block_tables,
                                  at::Tensor seq_lens, double scale, int64_t window,
                                  double softcap);
// write_kv_int8.cpp
void write_kv_int8(at::Tensor key, at::Tensor value, at::Tensor layer_cache,
                   at::Tensor slot_mapping);
// layer_ops.cpp
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
std::vector<at::Tensor> add_rms_norm(at::Tensor x, at::Tensor residual,
                                     at::Tensor weight, double eps);
void rms_norm_qk_heads(at::Tensor qkv, at::Tensor q_weight, at::Tensor k_weight,
                       int64_t num_heads, int64_t num_kv_heads, double eps);
at::Tensor silu_and_mul(at::Tensor gate_up);
std::vector<at::Tensor> rotary_split_qkv(at::Tensor qkv, at::Tensor cos,
                                         at::Tensor sin, int64_t num_heads,
                                         int64_t num_kv_heads);
at::Tensor rotary_split_qkv_into_cache(at::Tensor qkv, at::Tensor cos,
                                       at::Tensor sin, int64_t num_heads,
                                       int64_t num_kv_heads, at::Tensor layer_cache,
                                       at::Tensor slot_mapping);
// int4_gemm.cpp
// Products of fewer rows quantize their activations in decode_passes (1 or 2) passes, from
// here in one (int4_gemm.cpp says why); shared/model/quantized_linear.py's
// INT4_ONE_PASS_FROM_ROWS, which the tests hold equal.
constexpr int64_t kInt4OnePassFromRows = 16;
at::Tensor int4_gemm(at::Tensor x, at::Tensor packed, at::Tensor scales_minimums,
                     int64_t out_features, int64_t decode_passes);
std::vector<std::string> int4_isas();  // the variants this CPU runs, best first
std::string int4_isa();                // the one that runs
void select_int4_isa(const std::string& name);
// int8_gemv.cpp
// Few float32 rows @ int8 codes [out, in_padded] with bfloat16 scales [out] -> float32.
at::Tensor int8_gemv(at::Tensor x, at::Tensor codes, at::Tensor scales);
// step_lookups.cpp
// Each row's argmax of float32 logits [rows, vocab] -> int64 [rows] (torch's max(dim) indices).
at::Tensor argmax_rows(at::Tensor logits);
// QuantizedEmbedding's lookup: int8 codes plus their 4-bit refinements, times each row's scale.
at::Tensor int8_embedding(at::Tensor token_ids, at::Tensor codes, at::Tensor residual,
                          at::Tensor refinements, at::Tensor scales, int64_t hidden);
// decode_layers.cpp
void bind_decode_layers(pybind11::module_& m);
