// The KV cache write: each new token's K and V rows copied to their cache slots.
//
// A token's row (all its KV heads) is contiguous in the cache `[slots, kv_heads, head_dim]` and in
// the projection it comes from, so a write is one memcpy per token and tensor. torch's
// `index_copy_` moves it element by element: about 95 us for 1,024 tokens of 4 heads of 64
// (5 GB/s) into written memory, where this copy takes about 19. (Into a fresh pool both pay the
// OS's first write of each page, far more: docs/benchmarks.md.)
//
// Registered as torch.ops.kvmesh.write_kv_ (writes into the caches).

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstring>

namespace {

void check_rows(const at::Tensor& cache, const at::Tensor& src, const char* name) {
  TORCH_CHECK(cache.dim() == 3 && src.dim() == 3, name, ": cache and rows must be [slots or tokens, kv_heads, head_dim]");
  TORCH_CHECK(cache.scalar_type() == src.scalar_type(), name, ": cache and rows must have one dtype");
  TORCH_CHECK(cache.size(1) == src.size(1) && cache.size(2) == src.size(2), name,
              ": rows must have the cache's kv_heads and head_dim");
  TORCH_CHECK(cache.stride(2) == 1 && cache.stride(1) == cache.size(2) && src.stride(2) == 1 &&
                  src.stride(1) == src.size(2),
              name, ": each token's row (kv_heads x head_dim) must be contiguous");
}

void copy_rows(at::Tensor& cache, const at::Tensor& src, const int64_t* slots) {
  const int64_t elem = src.element_size();
  const int64_t row_bytes = src.size(1) * src.size(2) * elem;
  char* dst = static_cast<char*>(cache.data_ptr());
  const char* from = static_cast<const char*>(src.data_ptr());
  const int64_t dst_s0 = cache.stride(0) * elem, src_s0 = src.stride(0) * elem;
  for (int64_t t = 0; t < src.size(0); ++t) std::memcpy(dst + slots[t] * dst_s0, from + t * src_s0, row_bytes);
}

void write_kv_(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots, const at::Tensor& k,
               const at::Tensor& v) {
  check_rows(k_cache, k, "k");
  check_rows(v_cache, v, "v");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(),
              "slots must be contiguous int64");
  TORCH_CHECK(slots.size(0) == k.size(0) && slots.size(0) == v.size(0), "one slot per token: ", slots.size(0),
              " slots for ", k.size(0), " K and ", v.size(0), " V rows");
  const int64_t* s = slots.data_ptr<int64_t>();
  const int64_t num_slots = std::min(k_cache.size(0), v_cache.size(0));
  for (int64_t i = 0; i < slots.size(0); ++i)  // writes go wherever the slots point: check them all
    TORCH_CHECK(s[i] >= 0 && s[i] < num_slots, "slot ", s[i], " is outside the cache of ", num_slots);
  copy_rows(k_cache, k, s);
  copy_rows(v_cache, v, s);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("write_kv_(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, Tensor k, Tensor v) -> ()");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("write_kv_", write_kv_); }
