// The Python module of the CPU kernels: one binding per kernel, each defined in its own file.

#include <torch/csrc/utils/pybind.h>

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  bind_decode_layers(m);
  m.def("write_kv_int8", &write_kv_int8,
        "new keys and values quantized into their slots of an int8 KV cache (CPU)");
  // Without the GIL, as torch's ops: long contexts take milliseconds.
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over a paged KV cache, read in place (float32 or int8 rows, CPU)",
        pybind11::arg("query"), pybind11::arg("key_cache"), pybind11::arg("value_cache"),
        pybind11::arg("block_tables"), pybind11::arg("seq_lens"), pybind11::arg("scale"),
        pybind11::arg("window") = 0, pybind11::arg("softcap") = 0.0,
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.attr("INT4_ONE_PASS_FROM_ROWS") = kInt4OnePassFromRows;
  m.def("int4_isas", &int4_isas, "int4_gemm's variants this CPU runs, best first");
  m.def("int4_isa", &int4_isa, "the int4_gemm variant that runs");
  m.def("select_int4_isa", &select_int4_isa,
        "runs int4_gemm's named variant from now on (refused where the CPU lacks it)");
  m.def("int4_gemm", &int4_gemm,
        "float32 rows @ an int4 weight in our tiled layout, as int8 x int4 dot products (CPU)",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("scales_minimums"),
        pybind11::arg("out_features"), pybind11::arg("decode_passes") = 2,
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("int8_gemv", &int8_gemv,
        "a few float32 rows, in int16 steps per group of 32, @ a weight-only int8 weight (CPU)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("argmax_rows", &argmax_rows,
        "each row's argmax of float32 logits, first of ties, NaN first (CPU)");
  m.def("int8_embedding", &int8_embedding,
        "a quantized vocabulary matrix's embedding rows, refined, float32 (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm of float32 rows (CPU)");
  m.def("add_rms_norm", &add_rms_norm,
        "a residual add and the RMSNorm after it, in one pass: {normed, summed} (CPU)");
  m.def("rms_norm_qk_heads", &rms_norm_qk_heads,
        "each q and k head of the fused projection RMS-normalised in place (CPU)");
  m.def("silu_and_mul", &silu_and_mul, "SwiGLU's silu(gate) * up from the fused projection (CPU)");
  m.def("rotary_split_qkv", &rotary_split_qkv,
        "q, k, v split from the fused projection, q and k rotated (rotate-half RoPE, CPU)");
  m.def("rotary_split_qkv_into_cache", &rotary_split_qkv_into_cache,
        "rotary_split_qkv with k and v written into their slots of a float32 cache -> q (CPU)");
}
