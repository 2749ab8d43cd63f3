// What int4_gemm.cpp hands its instruction-set variants (int4_gemm_avx2.cpp,
// int4_gemm_avx512.cpp, and the generic one in int4_gemm.cpp): plain pointers, no torch, so the
// variant files include nothing that their target pragmas could recompile.
//
// The weight layout is ours (shared/model/quantized_linear.py's Int4Weight packs it):
//   packed            [tiles, groups, 4 chunks, 16 outputs, 4] uint8: tile t holds outputs
//                     16t .. 16t + 15, group g columns 32g .. 32g + 31, chunk c columns
//                     32g + 8c .. 32g + 8c + 7; byte (n, i) holds output n's code of column
//                     8c + i in its low nibble and of column 8c + 4 + i in its high one.
//   scales_minimums   [tiles, groups, 2, 16] float16: each output's scale, then its minimum,
//                     weight = scale * code + minimum (GGUF's Q4_1 d and m as they are).
// So one 64-byte chunk, masked to its low nibbles, is 16 lanes of 4 consecutive codes (what a
// VNNI dot product of 4 int8 activations wants), and shifted, the next 4: no shuffles. An AVX2
// register takes the chunk's first or second 8 outputs, the same way.

#pragma once

#include <cstdint>
#include <type_traits>

namespace int4 {

constexpr int64_t kGroup = 32;        // columns per scale
constexpr int64_t kTileOutputs = 16;  // outputs per tile
constexpr int64_t kChunkBytes = 64;   // 8 columns of a tile
constexpr int64_t kGroupBytes = 4 * kChunkBytes;
constexpr int kMaxActivationRows = 4;  // rows x passes one tile call computes

// Activations of one call, quantized per row and group of 32 (llama.cpp's Q8 blocks):
// codes[(row * passes + pass) * in_padded + k] int8, scales[(row * passes + pass) * groups + g]
// their steps d, and minimum_sums[row * groups + g] = sum over passes of d * (sum of the
// group's codes), which the minimum multiplies. With two passes the second holds what the
// first rounded away, so the product is as close to float activations as float32 gets.
struct Activations {
  const int8_t* codes;
  const float* scales;
  const float* minimum_sums;
  int64_t in_padded, groups;
  int passes;
};

struct Weights {
  const uint8_t* packed;
  const uint16_t* scales_minimums;  // float16 bits
  int64_t groups;
};

// out[row, o] for o in tile `tile`'s outputs below out_features, rows row0 .. row0 + num_rows - 1
// (num_rows * passes <= kMaxActivationRows); out has out_stride floats per row.
struct TileTask {
  int64_t tile, row0;
  int num_rows;
  float* out;
  int64_t out_stride, out_features;
};

using TileFunction = void (*)(const Weights&, const Activations&, const TileTask&);

template <int kValue>
using Count = std::integral_constant<int, kValue>;

// The row counts and passes a tile call is compiled for (rows x passes <= kMaxActivationRows),
// shared by the ISA variants: `tile(Count<rows>{}, Count<passes>{})` runs the task's case with
// constants the variant's loops unroll over.
template <class Tile>
inline void with_row_count(const Activations& x, const TileTask& task, Tile tile) {
  if (x.passes == 2) {
    if (task.num_rows == 1) return tile(Count<1>{}, Count<2>{});
    return tile(Count<2>{}, Count<2>{});
  }
  switch (task.num_rows) {
    case 1: return tile(Count<1>{}, Count<1>{});
    case 2: return tile(Count<2>{}, Count<1>{});
    case 3: return tile(Count<3>{}, Count<1>{});
    default: return tile(Count<4>{}, Count<1>{});
  }
}

void tile_generic(const Weights&, const Activations&, const TileTask&);
#if defined(__x86_64__)
void tile_avx2(const Weights&, const Activations&, const TileTask&);
void tile_avx512_vnni(const Weights&, const Activations&, const TileTask&);
#endif

}  // namespace int4
