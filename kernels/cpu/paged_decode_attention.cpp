// Decode attention on the CPU that reads the paged KV cache in place: one query token per
// sequence, over every key of that sequence, found through its block table. No gather into a
// padded buffer (what the PyTorch path pays for on every layer), no padding at all.
//
// One task per sequence, spread over OpenMP threads; each reads every key and value row of
// its sequence from memory once, for all its heads:
//
//   scores[g][t] = scale * q[g] . k[t]            (first pass over the keys)
//   p[g][t] = exp(scores[g][t] - max_t) / sum      (softmax in float32)
//   out[g] = sum_t p[g][t] * v[t]                  (second pass, over the values)
//
// With a sliding window (Mistral, Phi-3, Gemma's local layers) t runs over the last `window`
// positions only, the blocks before them never read; with soft-capping (Gemma 2) each score
// becomes softcap * tanh(score / softcap) before the softmax.
//
// Layouts (what the engine's cache holds):
//   query        [num_seqs, num_heads, head_dim] float32
//   key_cache    [num_blocks, block_size, num_kv_heads, head_dim] float32  (value_cache the same)
//                or int8 [..., head_dim + 2]: each row's codes, then its bfloat16 scale in the
//                last two bytes (kernels/kv_int8.py); a row's dot product and weighted add run
//                on the codes and apply the scale once, so nothing is dequantized to memory
//   block_tables [num_seqs, max_blocks] int32;  seq_lens [num_seqs] int32

#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros_like.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

inline void add_scaled(float* out, const float* v, float weight, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] += weight * v[i];
}

// An int8 row's scale: the bfloat16 after its head_dim codes (the upper half of a float32).
inline float row_scale(const int8_t* row, int64_t head_dim) {
  uint16_t half;
  std::memcpy(&half, row + head_dim, sizeof(half));
  const uint32_t bits = static_cast<uint32_t>(half) << 16;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return scale;
}

inline float dot(const float* q, const int8_t* codes, int64_t n) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += q[i] * static_cast<float>(codes[i]);
  return sum * row_scale(codes, n);
}

inline void add_scaled(float* out, const int8_t* codes, float weight, int64_t n) {
  const float w = weight * row_scale(codes, n);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] += w * static_cast<float>(codes[i]);
}

struct Geometry {
  int64_t num_heads, num_kv_heads, head_dim, block_size, max_blocks, group;
  int64_t row;           // elements of one (slot, kv head) row: head_dim (+ 2 for int8)
  int64_t token_stride;  // elements from one slot of a block to the next: num_kv_heads * row
  int64_t block_stride;  // elements from one block to the next: block_size * token_stride
};

// One sequence, every head: `seq_len` keys, read block by block. A slot's keys for all kv
// heads are one contiguous run (num_kv_heads * head_dim floats), so each cache line fetched
// is used whole; query head h reads kv head h / group (GQA).
// What a query sees besides its causal prefix: the window (0 = every position) and the cap
// (0 = none).
struct Visibility {
  int64_t window;
  float softcap;
};

template <typename T>  // float (float32 cache) or int8_t (int8 rows with scales)
void attend_sequence(const Geometry& g, const float* q, const T* k_cache, const T* v_cache,
                     const int32_t* table, int64_t seq_len, float scale, Visibility visibility,
                     float* out, std::vector<float>& scores) {
  // Positions [start, seq_len): the query (at seq_len - 1) sees the last `window` of them.
  const int64_t start =
      visibility.window > 0 ? std::max<int64_t>(0, seq_len - visibility.window) : 0;
  const int64_t num_keys = seq_len - start;
  scores.resize(g.num_heads * num_keys);
  const int64_t first_block = start / g.block_size;
  const int64_t num_blocks = (seq_len + g.block_size - 1) / g.block_size;
  for (int64_t b = first_block; b < num_blocks; ++b) {
    const T* block = k_cache + table[b] * g.block_stride;
    const int64_t begin = std::max(b * g.block_size, start);
    const int64_t end = std::min((b + 1) * g.block_size, seq_len);
    for (int64_t position = begin; position < end; ++position) {
      const T* keys = block + (position - b * g.block_size) * g.token_stride;
      for (int64_t h = 0; h < g.num_heads; ++h) {
        const T* key = keys + (h / g.group) * g.row;
        scores[h * num_keys + position - start] =
            scale * dot(q + h * g.head_dim, key, g.head_dim);
      }
    }
  }
  for (int64_t h = 0; h < g.num_heads; ++h) {
    float* row = scores.data() + h * num_keys;
    if (visibility.softcap > 0.0f) {
      const float cap = visibility.softcap, inverse_cap = 1.0f / visibility.softcap;
      for (int64_t t = 0; t < num_keys; ++t) row[t] = cap * std::tanh(row[t] * inverse_cap);
    }
    float top = row[0];
    for (int64_t t = 1; t < num_keys; ++t) top = std::max(top, row[t]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < num_keys; ++t) {
      row[t] = std::exp(row[t] - top);  // vectorized through glibc's libmvec (-ffast-math)
      sum += row[t];
    }
    const float inverse = 1.0f / sum;
#pragma omp simd
    for (int64_t t = 0; t < num_keys; ++t) row[t] *= inverse;
  }
  std::fill(out, out + g.num_heads * g.head_dim, 0.0f);
  for (int64_t b = first_block; b < num_blocks; ++b) {
    const T* block = v_cache + table[b] * g.block_stride;
    const int64_t begin = std::max(b * g.block_size, start);
    const int64_t end = std::min((b + 1) * g.block_size, seq_len);
    for (int64_t position = begin; position < end; ++position) {
      const T* values = block + (position - b * g.block_size) * g.token_stride;
      for (int64_t h = 0; h < g.num_heads; ++h) {
        const T* value = values + (h / g.group) * g.row;
        add_scaled(out + h * g.head_dim, value, scores[h * num_keys + position - start],
                   g.head_dim);
      }
    }
  }
}

template <typename T>
void attend_all(const Geometry& g, int64_t num_seqs, const float* q, const T* k, const T* v,
                const int32_t* tables, const int32_t* lens, float scale, Visibility visibility,
                float* o) {
  // One sequence (batch-1 decode) runs on the calling thread: a team would only wait for it.
#pragma omp parallel if (num_seqs > 1)
  {
    std::vector<float> scores;  // one per thread, reused across its sequences
#pragma omp for schedule(dynamic, 1)
    for (int64_t seq = 0; seq < num_seqs; ++seq) {
      const int64_t seq_len = lens[seq];
      if (seq_len == 0) continue;  // a padding row: zeros, as the reference gives
      const int64_t row = seq * g.num_heads * g.head_dim;
      attend_sequence(g, q + row, k, v, tables + seq * g.max_blocks, seq_len, scale, visibility,
                      o + row, scores);
    }
  }
}

}  // namespace

at::Tensor paged_decode_attention(at::Tensor query, at::Tensor key_cache,
                                  at::Tensor value_cache, at::Tensor block_tables,
                                  at::Tensor seq_lens, double scale, int64_t window,
                                  double softcap) {
  TORCH_CHECK(window >= 0, "window must be >= 0, got ", window);
  TORCH_CHECK(softcap >= 0.0, "softcap must be >= 0, got ", softcap);
  const Visibility visibility{window, static_cast<float>(softcap)};
  Geometry g;
  const int64_t num_seqs = query.size(0);
  g.num_heads = query.size(1);
  g.head_dim = query.size(2);
  g.block_size = key_cache.size(1);
  g.num_kv_heads = key_cache.size(2);
  g.max_blocks = block_tables.size(1);
  g.group = g.num_heads / g.num_kv_heads;
  const bool is_int8 = key_cache.scalar_type() == at::kChar;
  g.row = is_int8 ? g.head_dim + 2 : g.head_dim;
  TORCH_CHECK(key_cache.size(3) == g.row, "cache rows of ", key_cache.size(3),
              " elements for head_dim ", g.head_dim);
  g.token_stride = g.num_kv_heads * g.row;
  g.block_stride = g.block_size * g.token_stride;
  const int64_t num_blocks = key_cache.size(0);
  const int32_t* lens_in = seq_lens.data_ptr<int32_t>();
  const int32_t* tables_in = block_tables.data_ptr<int32_t>();
  // Values the caller could get wrong and that would read outside the cache: checked here,
  // where a pass over the used table entries costs nanoseconds.
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t seq_len = lens_in[seq];
    TORCH_CHECK(seq_len >= 0 && seq_len <= g.max_blocks * g.block_size,
                "seq_lens[", seq, "] = ", seq_len, " does not fit its block table");
    for (int64_t b = 0; b < (seq_len + g.block_size - 1) / g.block_size; ++b) {
      const int64_t block = tables_in[seq * g.max_blocks + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block id ", block, " outside [0, ",
                  num_blocks, ")");
    }
  }
  auto out = at::zeros_like(query);
  const float* q = query.data_ptr<float>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  float* o = out.data_ptr<float>();
  const float s = static_cast<float>(scale);
  if (is_int8) {
    attend_all(g, num_seqs, q, key_cache.data_ptr<int8_t>(), value_cache.data_ptr<int8_t>(),
               tables, lens, s, visibility, o);
  } else {
    attend_all(g, num_seqs, q, key_cache.data_ptr<float>(), value_cache.data_ptr<float>(),
               tables, lens, s, visibility, o);
  }
  return out;
}
