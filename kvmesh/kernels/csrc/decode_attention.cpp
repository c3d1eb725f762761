// Decode attention over a paged KV cache: one query token per sequence, every sequence in one call.
//
// torch's fused attention is called once per sequence and pays a fixed cost per call that is
// several times what one decode query's memory traffic needs; a step with 32 decoding sequences
// made 32 calls per layer. This kernel takes all decoding sequences of a step at once, reads each
// sequence's K and V in place through its slot list (no gather), and splits the work over
// (sequence, KV head) pairs with ATen's thread pool. Softmax is in float32, as in SDPA.
//
// Registered as torch.ops.kvmesh.decode_attention_ (writes into `out`).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// Below this many K values per call (1 MB of K and V in float32, some tens of microseconds on
// one core) the work stays on the calling thread.
constexpr int64_t kParallelMinElements = 1 << 17;

#if defined(__AVX512F__)
// float32 with AVX-512: one query head at a time, its dot products and its weighted sum of V
// kept in kVec registers of 16 lanes. K and V rows of one (sequence, KV head) are read once per
// query head of the group; after the first head they come from L2.
template <int64_t kVec>
void one_head_avx512(const float* q, const float* k, const float* v, const int64_t* slots, int64_t n, int64_t k_s0,
                     int64_t v_s0, float scale, float* scores, float* out) {
  __m512 qv[kVec], acc[kVec];
  for (int64_t j = 0; j < kVec; ++j) qv[j] = _mm512_loadu_ps(q + 16 * j);
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < n; ++t) {
    const float* key = k + slots[t] * k_s0;
    __m512 dot = _mm512_mul_ps(qv[0], _mm512_loadu_ps(key));
    for (int64_t j = 1; j < kVec; ++j) dot = _mm512_fmadd_ps(qv[j], _mm512_loadu_ps(key + 16 * j), dot);
    const float sc = _mm512_reduce_add_ps(dot) * scale;
    scores[t] = sc;
    m = std::max(m, sc);
  }
  float sum = 0.f;
  for (int64_t t = 0; t < n; ++t) {
    scores[t] = std::exp(scores[t] - m);
    sum += scores[t];
  }
  for (int64_t j = 0; j < kVec; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    const float* value = v + slots[t] * v_s0;
    const __m512 p = _mm512_set1_ps(scores[t]);
    for (int64_t j = 0; j < kVec; ++j) acc[j] = _mm512_fmadd_ps(p, _mm512_loadu_ps(value + 16 * j), acc[j]);
  }
  const __m512 inv = _mm512_set1_ps(1.f / sum);
  for (int64_t j = 0; j < kVec; ++j) _mm512_storeu_ps(out + 16 * j, _mm512_mul_ps(acc[j], inv));
}
#endif

template <typename scalar_t, int64_t kHeadDim>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& q_rows,
         const at::Tensor& indptr, const at::Tensor& slot_ids, double scale, at::Tensor& out) {
  const int64_t heads = q.size(1), head_dim = kHeadDim > 0 ? kHeadDim : q.size(2), kv_heads = k_cache.size(1);
  const int64_t group = heads / kv_heads;
  const int64_t num_seqs = q_rows.size(0);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kp = k_cache.data_ptr<scalar_t>();
  const scalar_t* vp = v_cache.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const int64_t* rows = q_rows.data_ptr<int64_t>();
  const int64_t* ptr = indptr.data_ptr<int64_t>();
  const int64_t* slots = slot_ids.data_ptr<int64_t>();
  const int64_t q_s0 = q.stride(0), q_s1 = q.stride(1), o_s0 = out.stride(0), o_s1 = out.stride(1);
  const int64_t k_s0 = k_cache.stride(0), k_s1 = k_cache.stride(1);
  const int64_t v_s0 = v_cache.stride(0), v_s1 = v_cache.stride(1);
  const float fscale = static_cast<float>(scale);

  // Like torch's own kernels, stay on the calling thread when the work is small: a parallel region
  // costs more than a few thousand dot products, and idle pool threads spin on shared cores.
  const int64_t work_items = num_seqs * kv_heads;
  const int64_t key_elements = slot_ids.size(0) * kv_heads * head_dim;  // K (and V) values read
  const int64_t grain = key_elements < kParallelMinElements ? std::max<int64_t>(work_items, 1) : 1;
  at::parallel_for(0, work_items, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), sums(group), scores;
    for (int64_t work = begin; work < end; ++work) {
      const int64_t s = work / kv_heads, kvh = work % kv_heads;
      const int64_t row = rows[s], first = ptr[s], n = ptr[s + 1] - first;
#if defined(__AVX512F__)
      if constexpr (std::is_same_v<scalar_t, float> && kHeadDim > 0 && kHeadDim % 16 == 0) {
        scores.resize(n);
        for (int64_t g = 0; g < group; ++g) {
          const int64_t h = kvh * group + g;
          one_head_avx512<kHeadDim / 16>(qp + row * q_s0 + h * q_s1, kp + kvh * k_s1, vp + kvh * v_s1, slots + first, n,
                                         k_s0, v_s0, fscale, scores.data(), op + row * o_s0 + h * o_s1);
        }
        continue;
      }
#endif
      for (int64_t g = 0; g < group; ++g) {
        const scalar_t* src = qp + row * q_s0 + (kvh * group + g) * q_s1;
        for (int64_t d = 0; d < head_dim; ++d) qf[g * head_dim + d] = static_cast<float>(src[d]);
      }
      scores.resize(group * n);
      for (int64_t t = 0; t < n; ++t) {
        const scalar_t* key = kp + slots[first + t] * k_s0 + kvh * k_s1;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * head_dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * static_cast<float>(key[d]);
          scores[g * n + t] = dot * fscale;
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * n;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < n; ++t) m = std::max(m, sg[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < n; ++t) {
          sg[t] = std::exp(sg[t] - m);
          sum += sg[t];
        }
        sums[g] = sum;
      }
      for (int64_t t = 0; t < n; ++t) {
        const scalar_t* value = vp + slots[first + t] * v_s0 + kvh * v_s1;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * n + t];
          float* ag = acc.data() + g * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * static_cast<float>(value[d]);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* dst = op + row * o_s0 + (kvh * group + g) * o_s1;
        const float inv = 1.f / sums[g];
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(acc[g * head_dim + d] * inv);
      }
    }
  });
}

void decode_attention_(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& q_rows, const at::Tensor& indptr, const at::Tensor& slot_ids, double scale,
                       at::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3 && out.dim() == 3,
              "q, k_cache, v_cache and out must be [rows or slots, heads, head_dim]");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(2) == 1 && v_cache.stride(2) == 1 && out.stride(2) == 1,
              "the head dimension must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type() &&
                  q.scalar_type() == out.scalar_type(),
              "q, k_cache, v_cache and out must have one dtype");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(q_rows.scalar_type() == at::kLong && indptr.scalar_type() == at::kLong &&
                  slot_ids.scalar_type() == at::kLong && q_rows.is_contiguous() && indptr.is_contiguous() &&
                  slot_ids.is_contiguous(),
              "q_rows, indptr and slot_ids must be contiguous int64");
  TORCH_CHECK(indptr.size(0) == q_rows.size(0) + 1, "indptr must have one more entry than q_rows");
  {  // Reads go wherever the indices point: check them once per call (microseconds).
    const int64_t* ptr = indptr.data_ptr<int64_t>();
    const int64_t* rows = q_rows.data_ptr<int64_t>();
    const int64_t* slots = slot_ids.data_ptr<int64_t>();
    TORCH_CHECK(ptr[0] == 0 && ptr[q_rows.size(0)] == slot_ids.size(0), "indptr must span slot_ids");
    for (int64_t s = 0; s < q_rows.size(0); ++s) {
      TORCH_CHECK(ptr[s + 1] > ptr[s], "every sequence must see at least one slot");
      TORCH_CHECK(rows[s] >= 0 && rows[s] < q.size(0) && rows[s] < out.size(0), "q_rows out of range");
    }
    const int64_t num_slots = std::min(k_cache.size(0), v_cache.size(0));
    for (int64_t i = 0; i < slot_ids.size(0); ++i)
      TORCH_CHECK(slots[i] >= 0 && slots[i] < num_slots, "slot ", slots[i], " is outside the cache of ", num_slots);
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention_", [&] {
    switch (q.size(2)) {
      case 64: run<scalar_t, 64>(q, k_cache, v_cache, q_rows, indptr, slot_ids, scale, out); break;
      case 128: run<scalar_t, 128>(q, k_cache, v_cache, q_rows, indptr, slot_ids, scale, out); break;
      default: run<scalar_t, 0>(q, k_cache, v_cache, q_rows, indptr, slot_ids, scale, out);
    }
  });
}

}  // namespace

TORCH_LIBRARY(kvmesh, m) {
  m.def("decode_attention_(Tensor q, Tensor k_cache, Tensor v_cache, Tensor q_rows, Tensor indptr, Tensor slot_ids, "
        "float scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("decode_attention_", decode_attention_); }
