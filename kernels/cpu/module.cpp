// The Python module of the CPU kernels: one binding per kernel, each defined in its own file.

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  bind_decode_layers(m);
  m.def("write_kv_int8", &write_kv_int8,
        "new keys and values quantized into their slots of an int8 KV cache (CPU)");
  // Without the GIL, as torch's ops: long contexts take milliseconds.
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over a paged KV cache, read in place (float32 or int8 rows, CPU)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.attr("INT4_VNNI_FROM_ROWS") = kInt4VnniFromRows;
  m.def("int4_gemm_supported", &int4_gemm_supported,
        "whether this CPU has the AVX512-VNNI and VBMI instructions int4_gemm needs");
  m.def("int4_gemm", &int4_gemm,
        "float32 rows @ torch's packed int4 weight, as int8 x int4 VNNI dot products (CPU)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "RMSNorm of float32 rows (CPU)");
  m.def("add_rms_norm", &add_rms_norm,
        "a residual add and the RMSNorm after it, in one pass: {normed, summed} (CPU)");
  m.def("silu_and_mul", &silu_and_mul, "SwiGLU's silu(gate) * up from the fused projection (CPU)");
  m.def("rotary_split_qkv", &rotary_split_qkv,
        "q, k, v split from the fused projection, q and k rotated (rotate-half RoPE, CPU)");
  m.def("rotary_split_qkv_into_cache", &rotary_split_qkv_into_cache,
        "rotary_split_qkv with k and v written into their slots of a float32 cache -> q (CPU)");
}
