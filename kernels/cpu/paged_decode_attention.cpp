// Decode attention on the CPU that reads the paged KV cache in place: one query token per
// sequence, over every key of that sequence, found through its block table. No gather into a
// padded buffer (what the PyTorch path pays for on every layer), no padding at all.
//
// One task per sequence, spread over OpenMP threads (a long sequence split among threads
// when there are fewer sequences than threads: attend_all); each reads every key and value
// row of its positions from memory once, for all its heads:
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
#include <omp.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

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

// What a query sees besides its causal prefix: the window (0 = every position) and the cap
// (0 = none).
struct Visibility {
  int64_t window;
  float softcap;
};

// What one task computes for one sequence's positions [begin, end), every head: its scores'
// maximum, the sum of exp(score - maximum), and the values weighted by those exponentials,
// not yet divided by the sum (a whole sequence's task divides; split ones are merged first).
struct Partial {
  float* out;      // [num_heads, head_dim]
  float* maximum;  // [num_heads]
  float* sum;      // [num_heads]
};

// Where `position`'s slot starts in `cache`: kv head j's row of it at + j * g.row.
template <typename T>
inline const T* slot_of(const Geometry& g, const T* cache, const int32_t* table,
                        int64_t position) {
  const int64_t b = position / g.block_size;
  return cache + table[b] * g.block_stride + (position - b * g.block_size) * g.token_stride;
}

// scores[h * num_keys + t] = scale * q[h] . key(begin + t) for every query head, position by
// position: a slot's keys for all kv heads are one contiguous run (num_kv_heads * row
// elements), so each cache line fetched is used whole; query head h reads kv head h / group
// (GQA).
template <typename T>
void scores_by_position(const Geometry& g, const float* q, const T* k_cache,
                        const int32_t* table, int64_t begin, int64_t end, float scale,
                        float* scores) {
  const int64_t num_keys = end - begin;
  for (int64_t position = begin; position < end; ++position) {
    const T* keys = slot_of(g, k_cache, table, position);
    for (int64_t h = 0; h < g.num_heads; ++h) {
      scores[h * num_keys + position - begin] =
          scale * dot(q + h * g.head_dim, keys + (h / g.group) * g.row, g.head_dim);
    }
  }
}

// out[h] += sum_t weights[h * num_keys + t] * value(begin + t), position by position.
template <typename T>
void values_by_position(const Geometry& g, const T* v_cache, const int32_t* table,
                        int64_t begin, int64_t end, const float* weights, float* out) {
  const int64_t num_keys = end - begin;
  for (int64_t position = begin; position < end; ++position) {
    const T* values = slot_of(g, v_cache, table, position);
    for (int64_t h = 0; h < g.num_heads; ++h) {
      add_scaled(out + h * g.head_dim, values + (h / g.group) * g.row,
                 weights[h * num_keys + position - begin], g.head_dim);
    }
  }
}

// The int8 cache's rows (and float32 ones without AVX2 or with head_dim not a multiple of 8)
// go position by position; the float32 cache with AVX2 below.
template <typename T>
void fill_scores(const Geometry& g, const float* q, const T* k_cache, const int32_t* table,
                 int64_t begin, int64_t end, float scale, float* scores) {
  scores_by_position(g, q, k_cache, table, begin, end, scale, scores);
}

template <typename T>
void add_values(const Geometry& g, const T* v_cache, const int32_t* table, int64_t begin,
                int64_t end, const float* weights, float* out) {
  values_by_position(g, v_cache, table, begin, end, weights, out);
}

#if defined(__AVX2__) && defined(__FMA__)
// The float32 cache with AVX2, head_dim a multiple of 8: a run of positions at a time (the
// run's slots are read from memory once and stay in L1 while each kv head takes its part),
// eight positions' dot products with one query head accumulated in eight registers that one
// transposing reduction turns into eight scores (position by position, every dot product is
// reduced on its own), and a query head's weighted values kept in registers across the run,
// 64 dimensions at a time (position by position, its output is loaded and stored for every
// position). The same sums in another order. On the 2-vCPU AVX2 EPYC, SmolLM2's 9 heads over 3
// kv heads, 2026-12-02: one sequence 1.3x faster on one thread and 1.7-1.9x on two (150 and
// 2,000 positions), 16 sequences of 300 1.3-1.5x, 16 of 2,000 (memory-bound) the same within
// noise.
constexpr int64_t kPositionsPerRun = 32;  // SmolLM2's 3 kv heads: 24 KiB of keys a run

// visit(h, rows, offset) for every query head h, a run of positions at a time: rows[t] is kv
// head h / group's row of position begin + offset + t.
template <typename Visit>
void each_run(const Geometry& g, const float* cache, const int32_t* table, int64_t begin,
              int64_t end, Visit visit) {
  std::vector<const float*> rows;
  for (int64_t run = begin; run < end; run += kPositionsPerRun) {
    const int64_t run_end = std::min(end, run + kPositionsPerRun);
    rows.resize(run_end - run);
    for (int64_t j = 0; j < g.num_kv_heads; ++j) {
      for (int64_t position = run; position < run_end; ++position) {
        rows[position - run] = slot_of(g, cache, table, position) + j * g.row;
      }
      for (int64_t h = j * g.group; h < (j + 1) * g.group; ++h) visit(h, rows, run - begin);
    }
  }
}

inline __m256 eight_sums(const __m256* lanes) {
  // Lane i of the result: the sum of lanes[i]'s eight floats.
  const __m256 a = _mm256_hadd_ps(lanes[0], lanes[1]), b = _mm256_hadd_ps(lanes[2], lanes[3]);
  const __m256 c = _mm256_hadd_ps(lanes[4], lanes[5]), d = _mm256_hadd_ps(lanes[6], lanes[7]);
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
  // ab holds sums 0-3 split over its two 128-bit halves, cd sums 4-7.
  const __m256 low = _mm256_permute2f128_ps(ab, cd, 0x20);
  const __m256 high = _mm256_permute2f128_ps(ab, cd, 0x31);
  return _mm256_add_ps(low, high);
}

// row[t] = scale * query . keys[t].
void query_scores(const float* query, const std::vector<const float*>& keys, int64_t head_dim,
                  float scale, float* row) {
  const auto num_keys = static_cast<int64_t>(keys.size());
  int64_t t = 0;
  for (; t + 8 <= num_keys; t += 8) {
    __m256 sums[8];
    for (auto& sum : sums) sum = _mm256_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 8) {
      const __m256 x = _mm256_loadu_ps(query + d);
      for (int i = 0; i < 8; ++i) {
        sums[i] = _mm256_fmadd_ps(x, _mm256_loadu_ps(keys[t + i] + d), sums[i]);
      }
    }
    _mm256_storeu_ps(row + t, _mm256_mul_ps(_mm256_set1_ps(scale), eight_sums(sums)));
  }
  for (; t < num_keys; ++t) row[t] = scale * dot(query, keys[t], head_dim);
}

// out += sum_t weights[t] * values[t].
void query_values(const std::vector<const float*>& values, int64_t head_dim,
                  const float* weights, float* out) {
  constexpr int64_t kDims = 64;  // dimensions whose sums stay in registers: 8 of 16
  for (int64_t d0 = 0; d0 < head_dim; d0 += kDims) {
    const int64_t vectors = std::min(kDims, head_dim - d0) / 8;
    __m256 sums[kDims / 8];
    for (int64_t i = 0; i < vectors; ++i) sums[i] = _mm256_loadu_ps(out + d0 + 8 * i);
    for (size_t t = 0; t < values.size(); ++t) {
      const __m256 weight = _mm256_set1_ps(weights[t]);
      for (int64_t i = 0; i < vectors; ++i) {
        sums[i] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(values[t] + d0 + 8 * i), sums[i]);
      }
    }
    for (int64_t i = 0; i < vectors; ++i) _mm256_storeu_ps(out + d0 + 8 * i, sums[i]);
  }
}

template <>
void fill_scores<float>(const Geometry& g, const float* q, const float* k_cache,
                        const int32_t* table, int64_t begin, int64_t end, float scale,
                        float* scores) {
  if (g.head_dim % 8 != 0) {
    return scores_by_position(g, q, k_cache, table, begin, end, scale, scores);
  }
  const int64_t num_keys = end - begin;
  each_run(g, k_cache, table, begin, end,
           [&](int64_t h, const std::vector<const float*>& rows, int64_t offset) {
             query_scores(q + h * g.head_dim, rows, g.head_dim, scale,
                          scores + h * num_keys + offset);
           });
}

template <>
void add_values<float>(const Geometry& g, const float* v_cache, const int32_t* table,
                       int64_t begin, int64_t end, const float* weights, float* out) {
  if (g.head_dim % 8 != 0) {
    return values_by_position(g, v_cache, table, begin, end, weights, out);
  }
  const int64_t num_keys = end - begin;
  each_run(g, v_cache, table, begin, end,
           [&](int64_t h, const std::vector<const float*>& rows, int64_t offset) {
             query_values(rows, g.head_dim, weights + h * num_keys + offset, out + h * g.head_dim);
           });
}
#endif

// One sequence's positions [begin, end), every head.
template <typename T>  // float (float32 cache) or int8_t (int8 rows with scales)
void attend_positions(const Geometry& g, const float* q, const T* k_cache, const T* v_cache,
                      const int32_t* table, int64_t begin, int64_t end, float scale,
                      float softcap, Partial part, std::vector<float>& scores) {
  const int64_t num_keys = end - begin;
  scores.resize(g.num_heads * num_keys);
  fill_scores(g, q, k_cache, table, begin, end, scale, scores.data());
  for (int64_t h = 0; h < g.num_heads; ++h) {
    float* row = scores.data() + h * num_keys;
    if (softcap > 0.0f) {
      const float inverse_cap = 1.0f / softcap;
      for (int64_t t = 0; t < num_keys; ++t) row[t] = softcap * std::tanh(row[t] * inverse_cap);
    }
    float top = row[0];
    for (int64_t t = 1; t < num_keys; ++t) top = std::max(top, row[t]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < num_keys; ++t) {
      row[t] = std::exp(row[t] - top);  // vectorized through glibc's libmvec (-ffast-math)
      sum += row[t];
    }
    part.maximum[h] = top;
    part.sum[h] = sum;
  }
  std::fill(part.out, part.out + g.num_heads * g.head_dim, 0.0f);
  add_values(g, v_cache, table, begin, end, scores.data(), part.out);
}

// Fewer sequences than threads (batch-1 decode above all) would leave threads idle while one
// reads a long context: such a sequence's positions are split among them instead (split-K, as
// flash decoding does on GPUs), at least this many keys to a part, and the parts merged. On a
// 2-core AVX2 EPYC a batch-1 SmolLM2 step spent 1.2 of its ~10 ms in attention at 50-250
// positions on one thread (2026-12-02).
constexpr int64_t kMinKeysPerPart = 32;

struct Task {
  int64_t seq, begin, end;
  int64_t partial;  // index into the split sequences' partial buffers; -1: whole sequence
};

// out[h] = sum over parts of exp(max_p - max) * out_p[h] / sum over parts of exp(max_p - max) *
// sum_p[h], with max the parts' largest maximum.
void merge_parts(const Geometry& g, const std::vector<Partial>& parts, float* out) {
  for (int64_t h = 0; h < g.num_heads; ++h) {
    float top = parts[0].maximum[h];
    for (const Partial& part : parts) top = std::max(top, part.maximum[h]);
    float total = 0.0f;
    float* o = out + h * g.head_dim;
    std::fill(o, o + g.head_dim, 0.0f);
    for (const Partial& part : parts) {
      const float weight = std::exp(part.maximum[h] - top);
      total += weight * part.sum[h];
      add_scaled(o, part.out + h * g.head_dim, weight, g.head_dim);
    }
    const float inverse = 1.0f / total;
#pragma omp simd
    for (int64_t i = 0; i < g.head_dim; ++i) o[i] *= inverse;
  }
}

template <typename T>
void attend_all(const Geometry& g, int64_t num_seqs, const float* q, const T* k, const T* v,
                const int32_t* tables, const int32_t* lens, float scale, Visibility visibility,
                float* o) {
  const int64_t threads = omp_get_max_threads();
  const int64_t parts_cap = num_seqs >= threads ? 1 : (threads + num_seqs - 1) / num_seqs;
  std::vector<Task> tasks;
  std::vector<int64_t> split_seqs, split_first;  // each split sequence and its first partial
  int64_t partials = 0;
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t seq_len = lens[seq];
    if (seq_len == 0) continue;  // a padding row: zeros, as the reference gives
    // Positions [start, seq_len): the query (at seq_len - 1) sees the last `window` of them.
    const int64_t start =
        visibility.window > 0 ? std::max<int64_t>(0, seq_len - visibility.window) : 0;
    const int64_t num_keys = seq_len - start;
    const int64_t parts =
        std::max<int64_t>(1, std::min(parts_cap, num_keys / kMinKeysPerPart));
    if (parts == 1) {
      tasks.push_back({seq, start, seq_len, -1});
      continue;
    }
    split_seqs.push_back(seq);
    split_first.push_back(partials);
    for (int64_t p = 0; p < parts; ++p) {
      tasks.push_back({seq, start + num_keys * p / parts, start + num_keys * (p + 1) / parts,
                       partials++});
    }
  }
  const int64_t rows = g.num_heads * g.head_dim;
  std::vector<float> partial_out(partials * rows), partial_max(partials * g.num_heads),
      partial_sum(partials * g.num_heads);
  const auto partial = [&](int64_t index) {
    return Partial{partial_out.data() + index * rows, partial_max.data() + index * g.num_heads,
                   partial_sum.data() + index * g.num_heads};
  };
  const auto num_tasks = static_cast<int64_t>(tasks.size());
#pragma omp parallel if (num_tasks > 1)
  {
    std::vector<float> scores;  // one per thread, reused across its tasks
    std::vector<float> whole_max(g.num_heads), whole_sum(g.num_heads);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_tasks; ++i) {
      const Task& task = tasks[i];
      const float* query = q + task.seq * rows;
      const int32_t* table = tables + task.seq * g.max_blocks;
      if (task.partial >= 0) {
        attend_positions(g, query, k, v, table, task.begin, task.end, scale, visibility.softcap,
                         partial(task.partial), scores);
        continue;
      }
      float* out = o + task.seq * rows;
      attend_positions(g, query, k, v, table, task.begin, task.end, scale, visibility.softcap,
                       Partial{out, whole_max.data(), whole_sum.data()}, scores);
      for (int64_t h = 0; h < g.num_heads; ++h) {
        const float inverse = 1.0f / whole_sum[h];
        float* head = out + h * g.head_dim;
#pragma omp simd
        for (int64_t d = 0; d < g.head_dim; ++d) head[d] *= inverse;
      }
    }
  }
  for (size_t i = 0; i < split_seqs.size(); ++i) {
    const int64_t seq = split_seqs[i];
    const int64_t first = split_first[i];
    const int64_t last = i + 1 < split_seqs.size() ? split_first[i + 1] : partials;
    std::vector<Partial> parts;
    for (int64_t p = first; p < last; ++p) parts.push_back(partial(p));
    merge_parts(g, parts, o + seq * rows);
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
