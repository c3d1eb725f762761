// What the attention kernels check of their tensors before reading through slot lists: their reads
// go wherever the indices point, so shapes and every slot are checked once per call (microseconds).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>

namespace kvmesh {

// q and out `[rows, heads, head_dim]`, the caches `[slots, kv_heads, head_dim]`, one dtype, the head
// dimension contiguous, heads a multiple of kv_heads.
inline void check_attention_tensors(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                    const at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3 && out.dim() == 3,
              "q, k_cache, v_cache and out must be [rows or slots, heads, head_dim]");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(2) == 1 && v_cache.stride(2) == 1 && out.stride(2) == 1,
              "the head dimension must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type() &&
                  q.scalar_type() == out.scalar_type(),
              "q, k_cache, v_cache and out must have one dtype");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0 && v_cache.size(1) == k_cache.size(1),
              "heads must be a multiple of kv_heads");
  TORCH_CHECK(q.size(2) == k_cache.size(2) && q.size(2) == v_cache.size(2) && q.size(2) == out.size(2),
              "q, k_cache, v_cache and out must have one head size");
  TORCH_CHECK(out.size(0) == q.size(0) && out.size(1) == q.size(1), "out must have q's shape");
}

// Every slot inside both caches.
inline void check_slots(const at::Tensor& slot_ids, const at::Tensor& k_cache, const at::Tensor& v_cache) {
  const int64_t* slots = slot_ids.data_ptr<int64_t>();
  const int64_t num_slots = std::min(k_cache.size(0), v_cache.size(0));
  for (int64_t i = 0; i < slot_ids.size(0); ++i)
    TORCH_CHECK(slots[i] >= 0 && slots[i] < num_slots, "slot ", slots[i], " is outside the cache of ", num_slots);
}

}  // namespace kvmesh
