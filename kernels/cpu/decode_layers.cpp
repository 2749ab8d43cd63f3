// Every decoder layer of a decode-only step in one call from Python: the same operations the
// model's Python forward runs (shared/model/llama.py: norms, q/k/v projection, rotary and the KV
// write, paged attention, output projection, the MLP), in the same order with the same
// kernels, without the interpreter between them. At batch 1 with gguf weights on SmolLM2-135M
// the Python around each layer's dozen operations was a large part of a step: this loop took
// the step from 7.7 to 5.9 ms in one process (docs/benchmarks.md).
//
// The products run on the kernels the Python layers use: oneDNN's inner product on weights it
// reordered (float32 models, shared/model/linear.py), int8_gemv.cpp's product of int8 codes and
// int16-rounded activations, or int4_gemm.cpp's product of our int4 layout
// (shared/model/quantized_linear.py; torch's own int4 layout never comes here). Only the shapes
// those layers handle at decode come here: dense Llama-family layers with the parts of the
// families built on them (Qwen2's q/k/v bias, the only bias those families have; Qwen3's and Gemma
// 3's q/k norms; Gemma's norms around each branch, GeGLU and Gemma 3's own rotary base on window
// layers), one process (no tensor parallel), every row a decode token with its slot;
// LlamaForCausalLM checks that.

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/gelu.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/Parallel.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kernels.h"

namespace {

// kInt4: our int4 layout, through int4_gemm.cpp at every row count.
enum class WeightFormat : int64_t { kOneDnn = 0, kInt8 = 1, kInt4 = 2 };

// One product's weight as the Python layer holds it:
//   oneDNN  first = the reordered weight
//   int8    first = codes [out, in_padded], second = scales [out] bfloat16
//   int4    first = packed [tiles, groups, 256] uint8, second = scales_minimums
//           [tiles, groups, 2, 16] float16 (int4_gemm.h)
// decode_passes: int4's activation passes below kInt4OnePassFromRows rows, the Python layer's
// activation_passes (int4_gemm.cpp).
struct Weight {
  at::Tensor first, second;
  int64_t in_padded = 0, out_features = 0;
  int64_t decode_passes = 2;
};

// One projection's LoRA slots, the Python hook's own tensors (shared/lora/layers.py): the
// engine writes an adapter into a slot in place, so holding them here keeps the two in step.
//   a [max_loras, slices, rank, in]; b per slice [max_loras, rank, out_s], at column offset_s
struct LoraSlots {
  at::Tensor a;
  std::vector<at::Tensor> b;
  std::vector<int64_t> offsets;
};

// The projections of a layer, in decode order; LoRA slots are set per projection.
enum Projection : int64_t { kQkv = 0, kO = 1, kGateUp = 2, kDown = 3, kNumProjections = 4 };

struct Layer {
  // post_norm: Llama's norm before the MLP (of the residual sum); with Gemma's sandwich norms,
  // the attention branch's own norm, and pre_ff_norm takes the former's place.
  at::Tensor input_norm, post_norm;
  Weight qkv, o, gate_up, down;
  at::Tensor qkv_bias;  // Qwen2's q/k/v bias [q + 2 kv] float32; undefined: none
  at::Tensor q_norm, k_norm;  // [head_dim] each; undefined: no q/k norms
  at::Tensor pre_ff_norm, post_ff_norm;  // Gemma's [hidden] each; undefined: Llama's layout
  int64_t window = 0;  // a sliding window's positions (0 = the whole context)
  bool local_rotary = false;  // Gemma 3's window layers: the step's local angles
  std::optional<LoraSlots> lora[kNumProjections];
};

// The step's row -> slot map (shared/lora/batched.py's LoRABatch.slot_ids); undefined: no
// adapter rows.
struct LoraStep {
  at::Tensor slot_ids;  // [rows] int64, -1 for a row of the base model
};

// out[row, slice s] += (x[row] @ A[slot, s]^T) @ B_s[slot] for each row's slot, row by row
// (gather matrix-vector, as punica's BGMV): each row reads only its own adapter's A and B,
// rank r multiply-adds per input and per output feature. A masked product over every slot in
// use (the Python hooks' form) did k times the work through sgemm calls whose shapes suit it
// badly: it cost more than the base products at 16 rows and 8 adapters (py-spy --native).
// x [rows, in] and out [rows, out_total] float32, rows contiguous; the slots float32 contiguous.
void add_lora_delta(at::Tensor& out, const at::Tensor& x,
                    const std::optional<LoraSlots>& slots, const LoraStep& step) {
  if (!slots.has_value() || !step.slot_ids.defined()) return;
  const auto xc = x.contiguous();
  TORCH_CHECK(out.stride(1) == 1, "a LoRA output's rows must be contiguous");
  const auto& a = slots->a;
  const int64_t rows = xc.size(0), in = xc.size(1), max_loras = a.size(0);
  const int64_t num_slices = a.size(1), rank = a.size(2), per_slot = num_slices * rank;
  const int64_t* slot_of = step.slot_ids.data_ptr<int64_t>();
  for (int64_t row = 0; row < rows; ++row) {
    TORCH_CHECK(slot_of[row] < max_loras, "row ", row, " has slot ", slot_of[row], " of ",
                max_loras);
  }
  // shrink: xa[row, s, j] = x[row] . A[slot, s, j]
  std::vector<float> xa(rows * per_slot, 0.0f);
  const float* x_data = xc.data_ptr<float>();
  const float* a_data = a.data_ptr<float>();
  at::parallel_for(0, rows * per_slot, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t row = i / per_slot, slot = slot_of[row];
      if (slot < 0) continue;
      const float* x_row = x_data + row * in;
      const float* a_row = a_data + (slot * per_slot + i % per_slot) * in;
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t k = 0; k < in; ++k) sum += x_row[k] * a_row[k];
      xa[i] = sum;
    }
  });
  // expand: out[row, offset_s + n] += sum_j xa[row, s, j] * B_s[slot, j, n]
  float* out_data = out.data_ptr<float>();
  const int64_t out_stride = out.stride(0);
  for (int64_t s = 0; s < num_slices; ++s) {
    const float* b_data = slots->b[s].data_ptr<float>();
    const int64_t width = slots->b[s].size(2), offset = slots->offsets[s];
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        const int64_t slot = slot_of[row];
        if (slot < 0) continue;
        float* dst = out_data + row * out_stride + offset;
        for (int64_t j = 0; j < rank; ++j) {
          const float weight = xa[row * per_slot + s * rank + j];
          const float* b_row = b_data + (slot * rank + j) * width;
#pragma omp simd
          for (int64_t n = 0; n < width; ++n) dst[n] += weight * b_row[n];
        }
      }
    });
  }
}

at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& weight) {
  // Called boxed: the schema's C++ argument types have changed between torch releases, its
  // boxed form (what torch.ops calls) has not.
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack;
  stack.reserve(6);
  stack.emplace_back(x);
  stack.emplace_back(weight);
  stack.emplace_back(c10::IValue());  // no bias
  stack.emplace_back(std::string("none"));  // no fused activation
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(std::string(""));
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// x [rows, in] float32 -> [rows, out] float32, as the Python layer computes it.
at::Tensor linear(const at::Tensor& x, const Weight& w, WeightFormat format) {
  if (format == WeightFormat::kOneDnn) return onednn_linear(x, w.first);
  if (format == WeightFormat::kInt4) {
    return int4_gemm(x.contiguous(), w.first, w.second, w.out_features, w.decode_passes);
  }
  return int8_gemv(x.contiguous(), w.first, w.second);  // codes have out_features rows
}

}  // namespace

// The layers of one model, built once after its weights are loaded.
class DecodeLayers {
 public:
  // softcap: attention soft-capping for every layer (0 = none); gelu_tanh: the MLP's gate
  // through tanh-approximated GELU (Gemma's GeGLU) instead of SiLU.
  DecodeLayers(int64_t format, int64_t num_heads, int64_t num_kv_heads, double eps,
               double scale, double softcap, bool gelu_tanh)
      : format_(static_cast<WeightFormat>(format)),
        num_heads_(num_heads),
        num_kv_heads_(num_kv_heads),
        eps_(eps),
        scale_(scale),
        softcap_(softcap),
        gelu_tanh_(gelu_tanh) {
    TORCH_CHECK(format >= 0 && format <= 2, "weight format ", format, " is not 0 to 2");
    TORCH_CHECK(softcap >= 0.0, "softcap must be >= 0, got ", softcap);
  }

  // tensors: input_norm, post_norm, then (first, second) of qkv, o, gate_up, down (second
  // may be an empty tensor); sizes: (in_padded, out_features) of qkv, o, gate_up, down;
  // window: the layer's sliding window (0 = none); passes: each product's activation passes
  // at decode rows, int4 only (empty: two each); qkv_bias: the q/k/v bias, added to the
  // product as the Python Linear adds it (none: no bias); qk_norms: {q_norm, k_norm} weights
  // [head_dim] (empty: none); sandwich_norms: Gemma's {pre_feedforward, post_feedforward}
  // weights [hidden] (empty: Llama's layout); local_rotary: the layer rotates with the step's
  // local angles (run's local_cos and local_sin).
  void add_layer(std::vector<at::Tensor> tensors, std::vector<int64_t> sizes,
                 int64_t window, std::vector<int64_t> passes, std::optional<at::Tensor> qkv_bias,
                 std::vector<at::Tensor> qk_norms, std::vector<at::Tensor> sandwich_norms,
                 bool local_rotary) {
    TORCH_CHECK(window >= 0, "window must be >= 0, got ", window);
    TORCH_CHECK(tensors.size() == 10 && sizes.size() == 8,
                "a layer takes 10 tensors and 8 sizes, got ", tensors.size(), " and ",
                sizes.size());
    TORCH_CHECK(passes.empty() || passes.size() == 4, "passes: none or one per product");
    for (const int64_t count : passes) {
      TORCH_CHECK(count == 1 || count == 2, "activation passes must be 1 or 2, got ", count);
    }
    Layer layer;
    layer.input_norm = tensors[0];
    layer.post_norm = tensors[1];
    Weight* weights[] = {&layer.qkv, &layer.o, &layer.gate_up, &layer.down};
    for (int i = 0; i < 4; ++i) {
      *weights[i] = Weight{tensors[2 + 2 * i], tensors[3 + 2 * i], sizes[2 * i], sizes[2 * i + 1],
                           passes.empty() ? 2 : passes[i]};
    }
    layer.window = window;
    if (qkv_bias.has_value()) {
      TORCH_CHECK(qkv_bias->dim() == 1 && qkv_bias->size(0) == layer.qkv.out_features &&
                      qkv_bias->scalar_type() == at::kFloat && qkv_bias->is_contiguous(),
                  "qkv_bias must be [", layer.qkv.out_features, "] float32, contiguous");
      layer.qkv_bias = *qkv_bias;
    }
    TORCH_CHECK(qk_norms.empty() || qk_norms.size() == 2, "qk_norms: none or {q_norm, k_norm}");
    TORCH_CHECK(sandwich_norms.empty() || sandwich_norms.size() == 2,
                "sandwich_norms: none or {pre_feedforward, post_feedforward}");
    const int64_t head_dim = layer.qkv.out_features / (num_heads_ + 2 * num_kv_heads_);
    for (const auto& weight : qk_norms) check_norm_weight(weight, head_dim, "a q/k norm");
    for (const auto& weight : sandwich_norms) {
      check_norm_weight(weight, layer.input_norm.numel(), "a feed-forward norm");
    }
    if (!qk_norms.empty()) {
      layer.q_norm = qk_norms[0];
      layer.k_norm = qk_norms[1];
    }
    if (!sandwich_norms.empty()) {
      layer.pre_ff_norm = sandwich_norms[0];
      layer.post_ff_norm = sandwich_norms[1];
    }
    layer.local_rotary = local_rotary;
    layers_.push_back(std::move(layer));
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // The LoRA slots of one projection (Projection order) of one layer: a [max_loras, slices,
  // rank, in] float32 and per slice b [max_loras, rank, out_s] at column offsets[s].
  void set_lora(int64_t layer, int64_t projection, at::Tensor a, std::vector<at::Tensor> b,
                std::vector<int64_t> offsets) {
    TORCH_CHECK(layer >= 0 && layer < num_layers(), "layer ", layer, " not added");
    TORCH_CHECK(projection >= 0 && projection < kNumProjections, "projection ", projection,
                " is not 0 to 3");
    TORCH_CHECK(a.dim() == 4 && static_cast<int64_t>(b.size()) == a.size(1) &&
                    offsets.size() == b.size(),
                "LoRA slots: a [max_loras, slices, rank, in] with one b and offset per slice");
    TORCH_CHECK(a.scalar_type() == at::kFloat && a.is_contiguous(),
                "LoRA slots must be float32, contiguous");
    for (const auto& b_s : b) {
      TORCH_CHECK(b_s.scalar_type() == at::kFloat && b_s.is_contiguous() &&
                      b_s.size(0) == a.size(0) && b_s.size(1) == a.size(2),
                  "LoRA b must be [max_loras, rank, out_s] float32, contiguous");
    }
    layers_[layer].lora[projection] = LoraSlots{a, std::move(b), std::move(offsets)};
  }

  // run() with each row's adapter delta added to every projection that has LoRA slots:
  // lora_slot_ids [rows] int64, each row's slot (-1: the base model).
  at::Tensor run_lora(at::Tensor hidden, at::Tensor kv_cache, at::Tensor slot_mapping,
                      at::Tensor block_tables, at::Tensor seq_lens, at::Tensor cos,
                      at::Tensor sin, int64_t num_layers, at::Tensor lora_slot_ids,
                      std::optional<at::Tensor> local_cos,
                      std::optional<at::Tensor> local_sin,
                      std::vector<at::Tensor> group_slot_mappings,
                      std::vector<at::Tensor> group_block_tables,
                      std::vector<int64_t> layer_places) const {
    TORCH_CHECK(lora_slot_ids.dim() == 1 && lora_slot_ids.size(0) == hidden.size(0) &&
                    lora_slot_ids.scalar_type() == at::kLong && lora_slot_ids.is_contiguous(),
                "lora_slot_ids must be [rows] int64, contiguous");
    return run_layers(hidden, kv_cache, slot_mapping, block_tables, seq_lens,
                      Angles{cos, sin, local_cos, local_sin}, num_layers,
                      LoraStep{lora_slot_ids},
                      Groups{group_slot_mappings, group_block_tables, layer_places});
  }

  // hidden [rows, hidden] float32 -> the hidden states after the first num_layers layers.
  // kv_cache [layers, 2, blocks, block_size, kv_heads, row] (float32, or int8 rows with their
  // scales); slot_mapping [rows] int64; block_tables [rows, max_blocks] and seq_lens [rows]
  // int32, the tokens' own slots included; cos, sin [rows, head_dim] float32; local_cos,
  // local_sin: the same for layers added with local_rotary (none: no such layer).
  // A cache in layer groups (shared/kv/groups.py): kv_cache's first dimension is a group's
  // slots, layer_places lists each layer's (group, slot) flat, and group_slot_mappings /
  // group_block_tables are groups 1.. own (the arguments above are group 0's); all empty
  // for a cache of one group.
  at::Tensor run(at::Tensor hidden, at::Tensor kv_cache, at::Tensor slot_mapping,
                 at::Tensor block_tables, at::Tensor seq_lens, at::Tensor cos,
                 at::Tensor sin, int64_t num_layers, std::optional<at::Tensor> local_cos,
                 std::optional<at::Tensor> local_sin,
                 std::vector<at::Tensor> group_slot_mappings,
                 std::vector<at::Tensor> group_block_tables,
                 std::vector<int64_t> layer_places) const {
    return run_layers(hidden, kv_cache, slot_mapping, block_tables, seq_lens,
                      Angles{cos, sin, local_cos, local_sin}, num_layers, LoraStep{},
                      Groups{group_slot_mappings, group_block_tables, layer_places});
  }

 private:
  // The step's rotary angles: the model's, and a window layer's own where it has them.
  struct Angles {
    at::Tensor cos, sin;
    std::optional<at::Tensor> local_cos, local_sin;
  };

  // Where each layer's pages are in a cache of layer groups (run's comment); empty: layer l
  // at slot l, with run's own slot mapping and block tables.
  struct Groups {
    std::vector<at::Tensor> slot_mappings, block_tables;  // groups 1..
    std::vector<int64_t> places;  // (group, slot) per layer, flat
  };

  // Checks every layer's place before any layer writes the cache (see run_layers).
  static void check_groups(const Groups& groups, int64_t num_layers, int64_t num_slots) {
    if (groups.places.empty()) {
      TORCH_CHECK(groups.slot_mappings.empty() && groups.block_tables.empty(),
                  "group tables need layer_places");
      TORCH_CHECK(num_slots >= num_layers, "the cache has ", num_slots, " layers, fewer than ",
                  num_layers);
      return;
    }
    const auto num_groups = static_cast<int64_t>(groups.slot_mappings.size()) + 1;
    TORCH_CHECK(groups.block_tables.size() == groups.slot_mappings.size(),
                "one block table per group slot mapping");
    TORCH_CHECK(static_cast<int64_t>(groups.places.size()) >= 2 * num_layers,
                "layer_places lists ", groups.places.size() / 2, " layers, fewer than ",
                num_layers);
    for (int64_t l = 0; l < num_layers; ++l) {
      const auto group = groups.places[2 * l], slot = groups.places[2 * l + 1];
      TORCH_CHECK(group >= 0 && group < num_groups && slot >= 0 && slot < num_slots, "layer ", l,
                  " placed at group ", group, " slot ", slot, " of ", num_groups, " groups and ",
                  num_slots, " slots");
    }
  }

  at::Tensor run_layers(const at::Tensor& hidden, const at::Tensor& kv_cache,
                        const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                        const at::Tensor& seq_lens, const Angles& angles,
                        int64_t num_layers, const LoraStep& lora,
                        const Groups& groups) const {
    TORCH_CHECK(num_layers >= 0 && num_layers <= this->num_layers(), "num_layers ", num_layers,
                " outside [0, ", this->num_layers(), "]");
    TORCH_CHECK(angles.local_cos.has_value() == angles.local_sin.has_value(),
                "local_cos and local_sin come together");
    // Before any layer writes the cache: a step refused midway would leave some layers' KV
    // written for tokens the engine then never counts.
    for (int64_t l = 0; l < num_layers; ++l) {
      TORCH_CHECK(!layers_[l].local_rotary || angles.local_cos.has_value(), "layer ", l,
                  " rotates with local angles, and run was given none");
    }
    check_groups(groups, num_layers, kv_cache.size(0));
    const bool int8_cache = kv_cache.scalar_type() == at::kChar;
    const int64_t rows = hidden.size(0);
    auto x = hidden;
    for (int64_t l = 0; l < num_layers; ++l) {
      const Layer& layer = layers_[l];
      const int64_t group = groups.places.empty() ? 0 : groups.places[2 * l];
      const int64_t slot = groups.places.empty() ? l : groups.places[2 * l + 1];
      const auto layer_cache = kv_cache.select(0, slot);
      const auto& slots = group ? groups.slot_mappings[group - 1] : slot_mapping;
      const auto& tables = group ? groups.block_tables[group - 1] : block_tables;
      const auto attention_in = rms_norm(x, layer.input_norm, eps_);
      auto qkv = linear(attention_in, layer.qkv, format_);
      if (layer.qkv_bias.defined()) qkv.add_(layer.qkv_bias);
      add_lora_delta(qkv, attention_in, layer.lora[kQkv], lora);
      if (layer.q_norm.defined()) {
        rms_norm_qk_heads(qkv, layer.q_norm, layer.k_norm, num_heads_, num_kv_heads_, eps_);
      }
      const auto& cos = layer.local_rotary ? *angles.local_cos : angles.cos;
      const auto& sin = layer.local_rotary ? *angles.local_sin : angles.sin;
      at::Tensor q;
      if (int8_cache) {
        auto split = rotary_split_qkv(qkv, cos, sin, num_heads_, num_kv_heads_);
        write_kv_int8(split[1], split[2], layer_cache, slots);
        q = split[0];
      } else {
        q = rotary_split_qkv_into_cache(qkv, cos, sin, num_heads_, num_kv_heads_, layer_cache,
                                        slots);
      }
      auto attention = paged_decode_attention(q, layer_cache.select(0, 0),
                                              layer_cache.select(0, 1), tables, seq_lens,
                                              scale_, layer.window, softcap_);
      const auto attention_out = attention.view({rows, -1});
      auto o = linear(attention_out, layer.o, format_);
      add_lora_delta(o, attention_out, layer.lora[kO], lora);
      const bool sandwich = layer.pre_ff_norm.defined();
      if (sandwich) o = rms_norm(o, layer.post_norm, eps_);  // Gemma: the branch's own norm
      // {normed, o + x}
      auto normed = add_rms_norm(o, x, sandwich ? layer.pre_ff_norm : layer.post_norm, eps_);
      auto gate_up = linear(normed[0], layer.gate_up, format_);
      add_lora_delta(gate_up, normed[0], layer.lora[kGateUp], lora);
      const auto activated = activate(gate_up);
      auto down = linear(activated, layer.down, format_);
      add_lora_delta(down, activated, layer.lora[kDown], lora);
      if (sandwich) down = rms_norm(down, layer.post_ff_norm, eps_);
      x = normed[1] + down;
    }
    return x;
  }

  // The gated MLP's activation of [rows, 2 * inner] (gate columns first) -> [rows, inner], as
  // shared/model/llama.py's LlamaMLP computes it.
  at::Tensor activate(const at::Tensor& gate_up) const {
    if (!gelu_tanh_) return silu_and_mul(gate_up);
    const auto halves = gate_up.chunk(2, 1);
    return at::gelu(halves[0], "tanh") * halves[1];
  }

  static void check_norm_weight(const at::Tensor& weight, int64_t size, const char* what) {
    TORCH_CHECK(weight.dim() == 1 && weight.size(0) == size &&
                    weight.scalar_type() == at::kFloat && weight.is_contiguous(),
                what, " weight must be a contiguous float32 [", size, "]");
  }

  WeightFormat format_;
  int64_t num_heads_, num_kv_heads_;
  double eps_, scale_, softcap_;
  bool gelu_tanh_;
  std::vector<Layer> layers_;
};

void bind_decode_layers(pybind11::module_& m) {
  pybind11::class_<DecodeLayers>(m, "DecodeLayers",
                                 "every decoder layer of a decode-only step in one call (CPU)")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, double, double, bool>(),
           pybind11::arg("format"), pybind11::arg("num_heads"), pybind11::arg("num_kv_heads"),
           pybind11::arg("eps"), pybind11::arg("scale"), pybind11::arg("softcap") = 0.0,
           pybind11::arg("gelu_tanh") = false)
      .def("add_layer", &DecodeLayers::add_layer, pybind11::arg("tensors"),
           pybind11::arg("sizes"), pybind11::arg("window") = 0,
           pybind11::arg("passes") = std::vector<int64_t>{},
           pybind11::arg("qkv_bias") = std::nullopt,
           pybind11::arg("qk_norms") = std::vector<at::Tensor>{},
           pybind11::arg("sandwich_norms") = std::vector<at::Tensor>{},
           pybind11::arg("local_rotary") = false)
      .def_property_readonly("num_layers", &DecodeLayers::num_layers)
      // Without the GIL, as torch's own ops run: a step takes milliseconds, and the pod's
      // event loop (streaming the last step's tokens, taking new requests) runs meanwhile.
      .def("set_lora", &DecodeLayers::set_lora)
      .def("run", &DecodeLayers::run, pybind11::arg("hidden"), pybind11::arg("kv_cache"),
           pybind11::arg("slot_mapping"), pybind11::arg("block_tables"), pybind11::arg("seq_lens"),
           pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("num_layers"),
           pybind11::arg("local_cos") = std::nullopt, pybind11::arg("local_sin") = std::nullopt,
           pybind11::arg("group_slot_mappings") = std::vector<at::Tensor>{},
           pybind11::arg("group_block_tables") = std::vector<at::Tensor>{},
           pybind11::arg("layer_places") = std::vector<int64_t>{},
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("run_lora", &DecodeLayers::run_lora, pybind11::arg("hidden"),
           pybind11::arg("kv_cache"), pybind11::arg("slot_mapping"),
           pybind11::arg("block_tables"), pybind11::arg("seq_lens"), pybind11::arg("cos"),
           pybind11::arg("sin"), pybind11::arg("num_layers"), pybind11::arg("lora_slot_ids"),
           pybind11::arg("local_cos") = std::nullopt, pybind11::arg("local_sin") = std::nullopt,
           pybind11::arg("group_slot_mappings") = std::vector<at::Tensor>{},
           pybind11::arg("group_block_tables") = std::vector<at::Tensor>{},
           pybind11::arg("layer_places") = std::vector<int64_t>{},
           pybind11::call_guard<pybind11::gil_scoped_release>());
}
