// int4_gemm: x [rows, in] float32 @ an int4 weight (groups of 32 along `in`, one scale and
// minimum per group and output) -> [rows, out] float32, as int8 x 4-bit integer dot products
// (llama.cpp's Q4 x Q8 idea, in our own layout: int4_gemm.h).
//
// Activations are quantized per row and group of 32 here (llama.cpp's Q8 blocks):
//   xq = round(x * 127 / amax|x over the group|) (int8, step d = amax / 127), so
//   sum_k w x ~= sum_g [ scale_g * d_g * sum_{k in g} q xq + minimum_g * d_g * sum_{k in g} xq ]
// Per group rather than per row: one row-wide step let one large activation coarsen all the
// others (an outlier channel is common in LLM hidden states). Below kInt4OnePassFromRows rows
// (decode steps) the caller says how many passes (decode_passes): with two, each row is
// quantized twice, the second pass quantizing what the first rounded away: twice the dot
// products, and an error ~250x smaller (as close to float activations as bfloat16 ones would
// be, and closer), which inputs with a few large features per row want (qkv's, down's:
// shared/model/quantized_linear.py). From there on (prefill chunks, big decode batches) one
// pass.
//
// The products run in one of three variants, chosen at run time (select_int4_isa, which
// splitserve.kernels.cpu.load calls with splitserve.kernels.cpu.isa's choice): AVX-512 VNNI,
// AVX2 (int4_gemm_avx512.cpp, int4_gemm_avx2.cpp), or the generic C++ below. Quantizing the
// activations is shared, compiled for the module's baseline: every variant multiplies the same
// integers and takes the same float steps in the same order, so all three give the same bits.

#include "int4_gemm.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "kernels.h"

namespace int4 {

// ---- activations ------------------------------------------------------------------------

namespace {

// One group's codes of `values` (kGroup of them, zero padded): returns its step d and adds the
// codes' sum to *sum.
float quantize_group(const float* values, int8_t* codes, int32_t* sum) {
  float amax = 0.f;
  for (int64_t k = 0; k < kGroup; ++k) amax = std::max(amax, std::fabs(values[k]));
  const float inverse = amax > 0.f ? 127.f / amax : 0.f;
  int32_t total = 0;
  for (int64_t k = 0; k < kGroup; ++k) {
    const int32_t code = static_cast<int32_t>(std::nearbyint(values[k] * inverse));
    codes[k] = static_cast<int8_t>(code);
    total += code;
  }
  *sum = total;
  return amax / 127.f;
}

struct QuantizedActivations {
  std::vector<int8_t> codes;
  std::vector<float> scales, minimum_sums;
  int64_t in_padded, groups;
  int passes;

  Activations view() const {
    return {codes.data(), scales.data(), minimum_sums.data(), in_padded, groups, passes};
  }
};

void quantize_row(const float* x, int64_t in_features, int64_t r, QuantizedActivations& q) {
  float values[kGroup];
  for (int64_t g = 0; g < q.groups; ++g) {
    const int64_t k = g * kGroup, size = std::max<int64_t>(0, std::min(kGroup, in_features - k));
    std::fill(values, values + kGroup, 0.f);
    std::memcpy(values, x + r * in_features + k, size * sizeof(float));
    float minimum_sum = 0.f;
    for (int p = 0; p < q.passes; ++p) {
      const int64_t at = r * q.passes + p;
      int8_t* codes = q.codes.data() + at * q.in_padded + k;
      int32_t sum = 0;
      const float step = quantize_group(values, codes, &sum);
      q.scales[at * q.groups + g] = step;
      minimum_sum = std::fma(step, static_cast<float>(sum), minimum_sum);
      // What this pass rounded away, for the next one.
      for (int64_t j = 0; j < kGroup; ++j) {
        values[j] = std::fma(-static_cast<float>(codes[j]), step, values[j]);
      }
    }
    q.minimum_sums[r * q.groups + g] = minimum_sum;
  }
}

QuantizedActivations quantize_rows(const float* x, int64_t rows, int64_t in_features,
                                   int64_t in_padded, int passes) {
  QuantizedActivations q;
  q.in_padded = in_padded;
  q.groups = in_padded / kGroup;
  q.passes = passes;
  q.codes.assign(rows * passes * in_padded, 0);
  q.scales.assign(rows * passes * q.groups, 0.f);
  q.minimum_sums.assign(rows * q.groups, 0.f);
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) quantize_row(x, in_features, r, q);
  });
  return q;
}

// ---- the generic variant (ARM, and the reference of the others) --------------------------

inline float half_to_float(uint16_t bits) { return c10::detail::fp16_ieee_to_fp32_value(bits); }

// Output n's int32 dot product with activation row `codes` over one group.
int32_t group_dot(const uint8_t* group, int n, const int8_t* codes) {
  int32_t dot = 0;
  for (int c = 0; c < 4; ++c) {
    const uint8_t* bytes = group + c * kChunkBytes + 4 * n;
    for (int i = 0; i < 4; ++i) {
      dot += static_cast<int32_t>(bytes[i] & 0x0F) * codes[8 * c + i];
      dot += static_cast<int32_t>(bytes[i] >> 4) * codes[8 * c + 4 + i];
    }
  }
  return dot;
}

}  // namespace

void tile_generic(const Weights& w, const Activations& x, const TileTask& task) {
  const int64_t first_out = task.tile * kTileOutputs;
  for (int n = 0; n < kTileOutputs && first_out + n < task.out_features; ++n) {
    for (int r = 0; r < task.num_rows; ++r) {
      const int64_t row = task.row0 + r;
      float total = 0.f;
      for (int64_t g = 0; g < w.groups; ++g) {
        const uint8_t* group = w.packed + (task.tile * w.groups + g) * kGroupBytes;
        const uint16_t* pairs = w.scales_minimums + (task.tile * w.groups + g) * 2 * kTileOutputs;
        const float scale = half_to_float(pairs[n]);
        const float minimum = half_to_float(pairs[kTileOutputs + n]);
        for (int p = 0; p < x.passes; ++p) {
          const int64_t at = row * x.passes + p;
          const int32_t dot = group_dot(group, n, x.codes + at * x.in_padded + g * kGroup);
          total = std::fma(scale * x.scales[at * x.groups + g], static_cast<float>(dot), total);
        }
        total = std::fma(minimum, x.minimum_sums[row * x.groups + g], total);
      }
      task.out[row * task.out_stride + first_out + n] = total;
    }
  }
}

}  // namespace int4

// ---- which variant runs -----------------------------------------------------------------

namespace {

struct Variant {
  const char* name;
  int4::TileFunction tile;
};

const Variant kVariants[] = {
#if defined(__x86_64__)
    {"avx512_vnni", int4::tile_avx512_vnni},
    {"avx2", int4::tile_avx2},
#endif
    {"generic", int4::tile_generic},
};

bool cpu_runs(const std::string& name) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (name == "avx512_vnni") {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  }
  if (name == "avx2") {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  }
#endif
  return name == "generic";
}

const Variant* best_variant() {
  for (const Variant& variant : kVariants) {
    if (cpu_runs(variant.name)) return &variant;
  }
  return &kVariants[0];  // unreachable: generic always runs
}

// Until select_int4_isa: the best the CPU has.
std::atomic<const Variant*> g_variant{best_variant()};

}  // namespace

std::vector<std::string> int4_isas() {
  std::vector<std::string> names;
  for (const Variant& variant : kVariants) {
    if (cpu_runs(variant.name)) names.push_back(variant.name);
  }
  return names;
}

std::string int4_isa() { return g_variant.load()->name; }

void select_int4_isa(const std::string& name) {
  for (const Variant& variant : kVariants) {
    if (name != variant.name) continue;
    TORCH_CHECK(cpu_runs(name), "int4_gemm's ", name, " variant needs instructions this CPU lacks");
    g_variant.store(&variant);
    return;
  }
  TORCH_CHECK(false, "int4_gemm has no variant ", name, " on this processor");
}

at::Tensor int4_gemm(at::Tensor x, at::Tensor packed, at::Tensor scales_minimums,
                     int64_t out_features, int64_t decode_passes) {
  using namespace int4;
  TORCH_CHECK(decode_passes == 1 || decode_passes == 2, "decode_passes must be 1 or 2, got ",
              decode_passes);
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous float32 [rows, in]");
  TORCH_CHECK(packed.dtype() == at::kByte && packed.dim() == 3 && packed.is_contiguous() &&
                  packed.size(2) == kGroupBytes,
              "packed must be a contiguous uint8 [tiles, groups, ", kGroupBytes, "]");
  const int64_t tiles = packed.size(0), groups = packed.size(1), in_padded = groups * kGroup;
  TORCH_CHECK(scales_minimums.dtype() == at::kHalf && scales_minimums.is_contiguous() &&
                  scales_minimums.dim() == 4 && scales_minimums.size(0) == tiles &&
                  scales_minimums.size(1) == groups && scales_minimums.size(2) == 2 &&
                  scales_minimums.size(3) == kTileOutputs,
              "scales_minimums must be a contiguous float16 [", tiles, ", ", groups, ", 2, ",
              kTileOutputs, "]");
  TORCH_CHECK(x.size(1) <= in_padded, "x has ", x.size(1), " columns, the weight ", in_padded);
  TORCH_CHECK(0 < out_features && out_features <= tiles * kTileOutputs, "out_features ",
              out_features, " does not fit ", tiles, " tiles");
  const int64_t rows = x.size(0);
  auto out = at::empty({rows, out_features}, x.options());
  if (rows == 0) return out;
  const int passes = rows < kInt4OnePassFromRows ? static_cast<int>(decode_passes) : 1;
  const QuantizedActivations q =
      quantize_rows(x.data_ptr<float>(), rows, x.size(1), in_padded, passes);
  const Activations activations = q.view();
  const Weights weights{packed.data_ptr<uint8_t>(),
                        reinterpret_cast<const uint16_t*>(scales_minimums.data_ptr()), groups};
  const int64_t row_tile = kMaxActivationRows / passes;
  const int64_t row_tiles = (rows + row_tile - 1) / row_tile;
  const int64_t live_tiles = (out_features + kTileOutputs - 1) / kTileOutputs;
  const TileFunction tile = g_variant.load()->tile;
  float* result = out.data_ptr<float>();
  // Output tiles outer, rows inner: a thread's consecutive tasks reuse one weight tile from L1.
  at::parallel_for(0, live_tiles * row_tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t row0 = (t % row_tiles) * row_tile;
      const int num_rows = static_cast<int>(std::min(row_tile, rows - row0));
      tile(weights, activations, TileTask{t / row_tiles, row0, num_rows, result, out_features,
                                          out_features});
    }
  });
  return out;
}
