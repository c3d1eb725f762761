// A decode step's decoder layers in one call: for each layer, RMSNorm, the q|k|v product, the
// rotary embedding, the KV write, decode attention, the o product onto the residual, RMSNorm, the
// gate|up product, SiLU(gate) * up and the down product onto the residual: the operators
// CausalLM.forward calls one by one from Python (kvmesh/services/worker/model.py), called here
// in the same order with the same arguments, so the step's results are the same bit for bit.
//
// What it saves is the time between the operators. At one sequence the benchmark model's float32
// step on an AVX2 Zen 3 took 19-20 ms, of which 2.7-3.3 ms outside the matrix products, most of it
// the Python of twelve layers of about fifteen calls and views; and its 49 products took 15.6-17.4
// ms in the step against 13.6-15 ms back to back: while Python runs between two operators the
// weights stop streaming, and the other OpenMP thread waits. From C++ the next operator starts
// within microseconds (docs/benchmarks.md, 2026-12-07 late evening).
//
// Only the decode steps the Python loop would send entirely to kvmesh's CPU operators come here:
// every sequence one query (the decode kernel takes the step's attention), every product in the
// few-rows kernel (`kernels/linear.py`'s small_limit), no padding rows; the caller checks.
//
// Registered as torch.ops.kvmesh.decode_layers; the operators it calls are reached through
// torch's dispatcher, as from Python, so each stays in its own file.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>

namespace {

template <typename Signature>
c10::TypedOperatorHandle<Signature> kvmesh_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

using Optional = std::optional<at::Tensor>;

struct Ops {
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, double)> rms_norm =
      kvmesh_op<at::Tensor(const at::Tensor&, const at::Tensor&, double)>("kvmesh::rms_norm");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const Optional&, const Optional&)>
      small_linear = kvmesh_op<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const Optional&,
                                          const Optional&)>("kvmesh::small_linear");
  c10::TypedOperatorHandle<void(at::Tensor, const at::Tensor&, const at::Tensor&)> rotary =
      kvmesh_op<void(at::Tensor, const at::Tensor&, const at::Tensor&)>("kvmesh::rotary_");
  c10::TypedOperatorHandle<void(at::Tensor, at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&)>
      write_kv = kvmesh_op<void(at::Tensor, at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&)>(
          "kvmesh::write_kv_");
  c10::TypedOperatorHandle<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, double, at::Tensor)>
      attention = kvmesh_op<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor&, const at::Tensor&, double, at::Tensor)>("kvmesh::decode_attention_");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&)> silu_mul =
      kvmesh_op<at::Tensor(const at::Tensor&)>("kvmesh::silu_mul");

  // PackedLinear.__call__ for a product the few-rows kernel takes: with `compute` (a half-precision
  // model multiplying in float32) the input converted to it, the product rounded back to the
  // input's dtype, then the residual added: two roundings, as Python does.
  at::Tensor product(const at::Tensor& x, const at::Tensor& packed, int64_t n, const Optional& bias,
                     const Optional& residual, const std::optional<at::ScalarType>& compute) const {
    if (!compute) return small_linear.call(x.contiguous(), packed, n, bias, residual);
    at::Tensor y = small_linear.call(x.to(*compute).contiguous(), packed, n, bias, std::nullopt).to(x.scalar_type());
    if (residual) y.add_(*residual);
    return y;
  }
};

// x: the step's hidden states [rows, hidden]. Per layer, `weights` holds six tensors (the
// few-rows layouts of q|k|v, o, gate|up and down, then the input and post-attention norms' weights)
// and `biases` four (the products', each None or a tensor). cos and sin: the rows' rotary tables.
// The caches are [layers, slots, kv_heads, head_dim]; kv_slots the rows' slots, q_rows, indptr and
// slot_ids the decode kernel's (kernels/attention.py AttentionPlan). Returns the hidden states
// after the last layer.
at::Tensor decode_layers(const at::Tensor& x_in, at::TensorList weights, const c10::List<Optional>& biases,
                         const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache,
                         const at::Tensor& kv_slots, const at::Tensor& q_rows, const at::Tensor& indptr,
                         const at::Tensor& slot_ids, int64_t heads, int64_t kv_heads, int64_t head_dim,
                         int64_t intermediate, double eps, double scale, std::optional<at::ScalarType> compute) {
  static const Ops ops;
  const int64_t layers = k_cache.size(0);
  TORCH_CHECK(x_in.dim() == 2, "decode_layers: x must be [rows, hidden]");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 6 * layers && static_cast<int64_t>(biases.size()) == 4 * layers,
              "decode_layers: weights must hold 6 tensors and biases 4 per layer of the caches (", layers,
              " layers), got ", weights.size(), " and ", biases.size());
  TORCH_CHECK(v_cache.size(0) == layers, "decode_layers: k_cache and v_cache must have the same layers");
  const int64_t rows = x_in.size(0), hidden = x_in.size(1);
  const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim;
  at::Tensor x = x_in;
  for (int64_t i = 0; i < layers; ++i) {
    const at::Tensor* w = weights.data() + 6 * i;
    const Optional b_qkv = biases.get(4 * i), b_o = biases.get(4 * i + 1);
    const Optional b_gate_up = biases.get(4 * i + 2), b_down = biases.get(4 * i + 3);
    at::Tensor qkv = ops.product(ops.rms_norm.call(x, w[4], eps), w[0], q_size + 2 * kv_size, b_qkv, std::nullopt, compute);
    // q and k rotated together: they are adjacent in the fused projection
    at::Tensor qk = qkv.narrow(1, 0, q_size + kv_size).view({rows, heads + kv_heads, head_dim});
    ops.rotary.call(qk, cos, sin);
    const at::Tensor q = qk.narrow(1, 0, heads), k = qk.narrow(1, heads, kv_heads);
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({rows, kv_heads, head_dim});
    at::Tensor k_layer = k_cache.select(0, i), v_layer = v_cache.select(0, i);
    ops.write_kv.call(k_layer, v_layer, kv_slots, k, v);
    at::Tensor attn = at::empty({rows, heads, head_dim}, q.options());
    ops.attention.call(q, k_layer, v_layer, q_rows, indptr, slot_ids, scale, attn);
    x = ops.product(attn.view({rows, q_size}), w[1], hidden, b_o, x, compute);
    at::Tensor gate_up = ops.product(ops.rms_norm.call(x, w[5], eps), w[2], 2 * intermediate, b_gate_up, std::nullopt, compute);
    x = ops.product(ops.silu_mul.call(gate_up), w[3], hidden, b_down, x, compute);
  }
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("decode_layers(Tensor x, Tensor[] weights, Tensor?[] biases, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor kv_slots, Tensor q_rows, Tensor indptr, Tensor slot_ids, int heads, int kv_heads, "
        "int head_dim, int intermediate, float eps, float scale, ScalarType? compute) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("decode_layers", decode_layers); }
