// The kernels one C++ file calls from another, and module.cpp binds: each defined in its own
// file (named beside it).

#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <vector>

// paged_decode_attention.cpp
torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor key_cache,
                                     torch::Tensor value_cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale);
// write_kv_int8.cpp
void write_kv_int8(torch::Tensor key, torch::Tensor value, torch::Tensor layer_cache,
                   torch::Tensor slot_mapping);
// layer_ops.cpp
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual,
                                        torch::Tensor weight, double eps);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
std::vector<torch::Tensor> rotary_split_qkv(torch::Tensor qkv, torch::Tensor cos,
                                            torch::Tensor sin, int64_t num_heads,
                                            int64_t num_kv_heads);
torch::Tensor rotary_split_qkv_into_cache(torch::Tensor qkv, torch::Tensor cos,
                                          torch::Tensor sin, int64_t num_heads,
                                          int64_t num_kv_heads, torch::Tensor layer_cache,
                                          torch::Tensor slot_mapping);
// int4_gemm.cpp
// Products of at least this many rows take int4_gemm where it is usable; fewer keep torch's
// bfloat16-activation kernel (shared/model/quantized_linear.py's INT4_VNNI_FROM_ROWS, which the
// tests hold equal to this).
constexpr int64_t kInt4VnniFromRows = 16;
bool int4_gemm_supported();
torch::Tensor int4_gemm(torch::Tensor x, torch::Tensor packed, torch::Tensor scales_zeros,
                        int64_t out_features);
// decode_layers.cpp
void bind_decode_layers(pybind11::module& m);
