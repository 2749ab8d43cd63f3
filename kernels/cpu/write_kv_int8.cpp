// The KV write of an int8 cache (kv_cache_dtype int8) on the CPU: each new token's key and value
// rows quantized straight into their slots, what kernels/kv_int8.py's quantize_rows and an
// index_copy_ do in about fourteen whole-tensor ops per layer. At decode those tensors are a few
// rows, so the ops' fixed costs were the write's whole cost.
//
// Row format (kernels/kv_int8.py): head_dim int8 codes, then the scale as a bfloat16 in two
// bytes; scale = bfloat16(absmax / 127) rounded to nearest even, code = x / scale rounded half
// away from zero, clamped to [-127, 127]. Bit for bit what the PyTorch reference writes.

// Separate multiply and add, as torch computes them: a fused multiply-add would round once
// where torch rounds twice and move a code that sits on a half.
#pragma GCC optimize("fp-contract=off")

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

// float32 -> the nearest bfloat16 (ties to even), as its 16 upper bits; x finite and >= 0.
inline uint16_t to_bfloat16_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

inline float from_bfloat16_bits(uint16_t half) {
  const uint32_t bits = static_cast<uint32_t>(half) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

void quantize_row(const float* x, int64_t head_dim, int8_t* row) {
  float absmax = 0.0f;
  for (int64_t i = 0; i < head_dim; ++i) absmax = std::max(absmax, std::fabs(x[i]));
  const uint16_t scale_bits = to_bfloat16_bits(absmax / 127.0f);
  const float scale = from_bfloat16_bits(scale_bits);
  const float inverse = scale > 0.0f ? 1.0f / scale : 0.0f;  // a zero row stays zero
  for (int64_t i = 0; i < head_dim; ++i) {
    const float y = x[i] * inverse;
    const float code = std::min(std::max(y + std::copysign(0.5f, y), -127.0f), 127.0f);
    row[i] = static_cast<int8_t>(code);  // the cast truncates toward zero
  }
  std::memcpy(row + head_dim, &scale_bits, sizeof(scale_bits));
}

}  // namespace

// key, value [num_tokens, num_kv_heads, head_dim] float32 (rows contiguous); layer_cache
// [2, num_blocks, block_size, num_kv_heads, head_dim + 2] int8, contiguous; slot_mapping
// [num_tokens] int64 (-1: a padding token, skipped). Mutates layer_cache.
void write_kv_int8(at::Tensor key, at::Tensor value, at::Tensor layer_cache,
                   at::Tensor slot_mapping) {
  const int64_t num_tokens = key.size(0);
  const int64_t num_kv_heads = key.size(1);
  const int64_t head_dim = key.size(2);
  const int64_t row = head_dim + 2;
  const int64_t num_slots = layer_cache.size(1) * layer_cache.size(2);
  const int64_t slot_stride = num_kv_heads * row;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(slots[t] < num_slots, "slot ", slots[t], " outside [0, ", num_slots, ")");
  }
  int8_t* keys = layer_cache.data_ptr<int8_t>();
  int8_t* values = keys + num_slots * slot_stride;
  const float* k = key.data_ptr<float>();
  const float* v = value.data_ptr<float>();
  const int64_t k_tok = key.stride(0), k_head = key.stride(1);
  const int64_t v_tok = value.stride(0), v_head = value.stride(1);
#pragma omp parallel for if (num_tokens > 64)
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      const int64_t dst = slot * slot_stride + h * row;
      quantize_row(k + t * k_tok + h * k_head, head_dim, keys + dst);
      quantize_row(v + t * v_tok + h * v_head, head_dim, values + dst);
    }
  }
}
