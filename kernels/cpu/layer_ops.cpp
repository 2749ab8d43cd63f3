// The small per-layer operations of a decoder layer on the CPU, each one call instead of the
// several whole-tensor ops PyTorch spends on it: RMSNorm (with the residual add before it),
// SwiGLU's activation, and rotary embedding applied while q, k and v are split out of the fused
// projection. At decode those tensors are a few rows of 576 values, so each op's fixed cost
// (dispatch, allocation, a pass over memory) was its whole cost: about 100 ops per layer and
// 5 ms of a 17 ms batch-1 step on SmolLM2-135M (`python -m benchmarks.step_breakdown`).
//
// Arithmetic follows the PyTorch references (kernels/reference.py, shared/model/llama.py) in
// float32, operation for operation; sums may be ordered differently (vectorized), so results
// agree to float32 rounding, not bit for bit. Rows run in parallel over OpenMP threads only
// when there are enough of them (a prefill chunk): at decode a thread team costs more than the
// work.

// Separate multiply and add, as torch computes them.
#pragma GCC optimize("fp-contract=off")

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kParallelRows = 32;  // fewer rows than this run on the calling thread

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, name, " must be float32, got ",
              x.scalar_type());
  TORCH_CHECK(x.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name,
              " must be [rows, columns] with contiguous rows");
}

// out = (x * rsqrt(mean(x^2) + eps)) * weight, as shared/model/llama.py's RMSNorm in float32.
inline void norm_row(const float* x, const float* weight, float eps, int64_t n, float* out) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const float inverse_rms = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = weight[i] * (x[i] * inverse_rms);
}

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

// Hugging Face's rotate-half rotary: out = x * cos + cat(-x2, x1) * sin, with cos and sin
// already repeated over both halves (shared/model/rotary.py's table).
inline void rotate_row(const float* x, const float* cos, const float* sin, int64_t dim,
                       float* out) {
  const int64_t half = dim / 2;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) out[i] = x[i] * cos[i] + (-x[i + half]) * sin[i];
#pragma omp simd
  for (int64_t i = half; i < dim; ++i) out[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

}  // namespace

// x [rows, hidden] float32; weight [hidden] float32 -> [rows, hidden].
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(weight.numel() == n && weight.is_contiguous() &&
                  weight.scalar_type() == at::kFloat,
              "weight must be a contiguous float32 [", n, "]");
  auto out = at::empty({rows, n}, x.options());
  const float* in = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t stride = x.stride(0);
#pragma omp parallel for if (rows >= kParallelRows)
  for (int64_t r = 0; r < rows; ++r) {
    norm_row(in + r * stride, w, static_cast<float>(eps), n, o + r * n);
  }
  return out;
}

// summed = x + residual; normed = rms_norm(summed) -> {normed, summed}, both [rows, hidden]:
// a layer's residual add and the norm after it in one pass.
std::vector<at::Tensor> add_rms_norm(at::Tensor x, at::Tensor residual,
                                     at::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes(), "x ", x.sizes(), " and residual ",
              residual.sizes(), " differ");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(weight.numel() == n && weight.is_contiguous() &&
                  weight.scalar_type() == at::kFloat,
              "weight must be a contiguous float32 [", n, "]");
  auto normed = at::empty({rows, n}, x.options());
  auto summed = at::empty({rows, n}, x.options());
  const float* a = x.data_ptr<float>();
  const float* b = residual.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* s = summed.data_ptr<float>();
  float* o = normed.data_ptr<float>();
  const int64_t a_stride = x.stride(0), b_stride = residual.stride(0);
#pragma omp parallel for if (rows >= kParallelRows)
  for (int64_t r = 0; r < rows; ++r) {
    float* row = s + r * n;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) row[i] = a[r * a_stride + i] + b[r * b_stride + i];
    norm_row(row, w, static_cast<float>(eps), n, o + r * n);
  }
  return {normed, summed};
}

// qkv [rows, (num_heads + 2 * num_kv_heads) * head_dim]: each q head normalised over head_dim
// with q_weight [head_dim] and each k head with k_weight, in place; v is left as it is. Qwen3's
// and Gemma 3's q/k norms, the same arithmetic as rms_norm over the heads as rows, without the
// split, the copies and the concatenation the Python form takes.
void rms_norm_qk_heads(at::Tensor qkv, at::Tensor q_weight, at::Tensor k_weight,
                       int64_t num_heads, int64_t num_kv_heads, double eps) {
  check_rows(qkv, "qkv");
  const int64_t head_dim = q_weight.numel();
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim, "qkv has ",
              qkv.size(1), " columns, not (", num_heads, " + 2 * ", num_kv_heads, ") * ",
              head_dim);
  for (const auto* weight : {&q_weight, &k_weight}) {
    TORCH_CHECK(weight->numel() == head_dim && weight->is_contiguous() &&
                    weight->scalar_type() == at::kFloat,
                "q/k norm weights must be contiguous float32 [", head_dim, "]");
  }
  const int64_t rows = qkv.size(0), stride = qkv.stride(0);
  const int64_t normed_heads = num_heads + num_kv_heads;  // q's heads, then k's
  float* data = qkv.data_ptr<float>();
  const float* q_w = q_weight.data_ptr<float>();
  const float* k_w = k_weight.data_ptr<float>();
  const float epsilon = static_cast<float>(eps);
#pragma omp parallel for if (rows >= kParallelRows)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = 0; h < normed_heads; ++h) {
      float* head = data + r * stride + h * head_dim;
      // norm_row reads each value before it writes it: in place is safe.
      norm_row(head, h < num_heads ? q_w : k_w, epsilon, head_dim, head);
    }
  }
}

// gate_up [rows, 2 * inner] (gate columns first) -> silu(gate) * up [rows, inner].
at::Tensor silu_and_mul(at::Tensor gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t rows = gate_up.size(0), inner = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up has an odd number of columns");
  auto out = at::empty({rows, inner}, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t stride = gate_up.stride(0);
#pragma omp parallel for if (rows >= kParallelRows)
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = in + r * stride;
    const float* up = gate + inner;
    float* dst = o + r * inner;
    for (int64_t i = 0; i < inner; ++i) dst[i] = silu(gate[i]) * up[i];
  }
  return out;
}

namespace {

struct QkvGeometry {
  int64_t rows, num_heads, num_kv_heads, dim, stride;
};

QkvGeometry check_qkv(const at::Tensor& qkv, const at::Tensor& cos,
                      const at::Tensor& sin, int64_t num_heads, int64_t num_kv_heads) {
  check_rows(qkv, "qkv");
  const int64_t rows = qkv.size(0);
  const int64_t heads = num_heads + 2 * num_kv_heads;
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && qkv.size(1) % heads == 0, "qkv's ",
              qkv.size(1), " columns do not split into ", heads, " heads");
  const int64_t dim = qkv.size(1) / heads;
  TORCH_CHECK(dim % 2 == 0, "head_dim ", dim, " is odd");
  for (const auto* angle : {&cos, &sin}) {
    TORCH_CHECK(angle->scalar_type() == at::kFloat && angle->numel() == rows * dim &&
                    angle->is_contiguous(),
                "cos and sin must be contiguous float32 [", rows, ", ", dim, "]");
  }
  return {rows, num_heads, num_kv_heads, dim, qkv.stride(0)};
}

// Row r's q heads rotated into q_out, and its k heads rotated and v heads copied to k_out and
// v_out (each num_kv_heads * dim floats).
inline void split_row(const QkvGeometry& g, const float* row, const float* cos, const float* sin,
                      float* q_out, float* k_out, float* v_out) {
  for (int64_t h = 0; h < g.num_heads; ++h) {
    rotate_row(row + h * g.dim, cos, sin, g.dim, q_out + h * g.dim);
  }
  const float* keys = row + g.num_heads * g.dim;
  for (int64_t h = 0; h < g.num_kv_heads; ++h) {
    rotate_row(keys + h * g.dim, cos, sin, g.dim, k_out + h * g.dim);
  }
  const float* values = keys + g.num_kv_heads * g.dim;
  std::copy(values, values + g.num_kv_heads * g.dim, v_out);
}

}  // namespace

// qkv [rows, (num_heads + 2 * num_kv_heads) * head_dim], the fused projection's output;
// cos, sin [rows, head_dim] (rows contiguous) -> {q [rows, num_heads, head_dim] rotated,
// k [rows, num_kv_heads, head_dim] rotated, v [rows, num_kv_heads, head_dim]}, each contiguous.
std::vector<at::Tensor> rotary_split_qkv(at::Tensor qkv, at::Tensor cos,
                                         at::Tensor sin, int64_t num_heads,
                                         int64_t num_kv_heads) {
  const QkvGeometry g = check_qkv(qkv, cos, sin, num_heads, num_kv_heads);
  auto q = at::empty({g.rows, num_heads, g.dim}, qkv.options());
  auto k = at::empty({g.rows, num_kv_heads, g.dim}, qkv.options());
  auto v = at::empty({g.rows, num_kv_heads, g.dim}, qkv.options());
  const float* in = qkv.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  float* qo = q.data_ptr<float>();
  float* ko = k.data_ptr<float>();
  float* vo = v.data_ptr<float>();
  const int64_t q_row = num_heads * g.dim, kv_row = num_kv_heads * g.dim;
#pragma omp parallel for if (g.rows >= kParallelRows)
  for (int64_t r = 0; r < g.rows; ++r) {
    split_row(g, in + r * g.stride, c + r * g.dim, s + r * g.dim, qo + r * q_row,
              ko + r * kv_row, vo + r * kv_row);
  }
  return {q, k, v};
}

// The same split, with k and v written straight into their slots of a float32 layer cache
// [2, num_blocks, block_size, num_kv_heads, head_dim] (contiguous; slot_mapping [rows] int64,
// -1 skipped): the write_kv that would follow, without the intermediate tensors -> q.
at::Tensor rotary_split_qkv_into_cache(at::Tensor qkv, at::Tensor cos,
                                       at::Tensor sin, int64_t num_heads,
                                       int64_t num_kv_heads, at::Tensor layer_cache,
                                       at::Tensor slot_mapping) {
  const QkvGeometry g = check_qkv(qkv, cos, sin, num_heads, num_kv_heads);
  TORCH_CHECK(layer_cache.scalar_type() == at::kFloat && layer_cache.is_contiguous() &&
                  layer_cache.dim() == 5 && layer_cache.size(0) == 2 &&
                  layer_cache.size(3) == num_kv_heads && layer_cache.size(4) == g.dim,
              "layer_cache must be a contiguous float32 [2, blocks, block_size, ", num_kv_heads,
              ", ", g.dim, "], got ", layer_cache.sizes());
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == g.rows,
              "slot_mapping must be a contiguous int64 [", g.rows, "]");
  const int64_t num_slots = layer_cache.size(1) * layer_cache.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t r = 0; r < g.rows; ++r) {
    TORCH_CHECK(slots[r] < num_slots, "slot ", slots[r], " outside [0, ", num_slots, ")");
  }
  auto q = at::empty({g.rows, num_heads, g.dim}, qkv.options());
  const float* in = qkv.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  float* qo = q.data_ptr<float>();
  const int64_t kv_row = num_kv_heads * g.dim;
  float* keys = layer_cache.data_ptr<float>();
  float* values = keys + num_slots * kv_row;
  std::vector<float> padding(2 * kv_row);  // where a padding row's k and v go
#pragma omp parallel for if (g.rows >= kParallelRows) firstprivate(padding)
  for (int64_t r = 0; r < g.rows; ++r) {
    const int64_t slot = slots[r];
    float* k_out = slot < 0 ? padding.data() : keys + slot * kv_row;
    float* v_out = slot < 0 ? padding.data() + kv_row : values + slot * kv_row;
    split_row(g, in + r * g.stride, c + r * g.dim, s + r * g.dim, qo + r * num_heads * g.dim,
              k_out, v_out);
  }
  return q;
}
