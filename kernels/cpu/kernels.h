// The kernels one C++ file calls from another, and module.cpp binds: each defined in its own
// file (named beside it).

#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <string>
#include <vector>

// paged_decode_attention.cpp
// window: keys of the last `window` positions only (0 = all); softcap: scores capped by
// softcap * tanh(score / softcap) (0 = none).
torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor key_cache,
                                     torch::Tensor value_cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale, int64_t window,
                                     double softcap);
// write_kv_int8.cpp
void write_kv_int8(torch::Tensor key, torch::Tensor value, torch::Tensor layer_cache,
                   torch::Tensor slot_mapping);
// layer_ops.cpp
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual,
                                        torch::Tensor weight, double eps);
void rms_norm_qk_heads(torch::Tensor qkv, torch::Tensor q_weight, torch::Tensor k_weight,
                       int64_t num_heads, int64_t num_kv_heads, double eps);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
std::vector<torch::Tensor> rotary_split_qkv(torch::Tensor qkv, torch::Tensor cos,
                                            torch::Tensor sin, int64_t num_heads,
                                            int64_t num_kv_heads);
torch::Tensor rotary_split_qkv_into_cache(torch::Tensor qkv, torch::Tensor cos,
                                          torch::Tensor sin, int64_t num_heads,
                                          int64_t num_kv_heads, torch::Tensor layer_cache,
                                          torch::Tensor slot_mapping);
// int4_gemm.cpp
// Products of fewer rows quantize their activations in two passes (int4_gemm.cpp says why);
// shared/model/quantized_linear.py's INT4_ONE_PASS_FROM_ROWS, which the tests hold equal.
constexpr int64_t kInt4OnePassFromRows = 16;
torch::Tensor int4_gemm(torch::Tensor x, torch::Tensor packed, torch::Tensor scales_minimums,
                        int64_t out_features);
std::vector<std::string> int4_isas();  // the variants this CPU runs, best first
std::string int4_isa();                // the one that runs
void select_int4_isa(const std::string& name);
// decode_layers.cpp
void bind_decode_layers(pybind11::module& m);
