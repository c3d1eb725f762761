// Decode attention over a paged KV cache: one query token per sequence, every sequence in one call.
//
// torch's fused attention is called once per sequence and pays a fixed cost per call that is
// several times what one decode query's memory traffic needs; a step with 32 decoding sequences
// made 32 calls per layer. This kernel takes all decoding sequences of a step at once, reads each
// sequence's K and V in place through its slot list (no gather), and splits the work over
// (sequence, KV head) pairs with ATen's thread pool. Softmax is in float32, as in SDPA.
// With AVX-512 and a head size that is a multiple of 16 (float32, bfloat16 and float16 alike),
// each K and V row is read once for all query heads of its GQA group, in one pass with an online
// softmax: decode attention is memory-bound, so the bytes read are what it costs.
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
// 16 values as float32 lanes: float32 loaded as is, bfloat16 widened (its bits are the top half of
// a float32), float16 converted.
template <typename scalar_t>
inline __m512 load16(const scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return _mm512_loadu_ps(p);
  } else if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
}

// exp of 16 float32 lanes (Cephes' expf: x = n ln2 + r, a degree-5 polynomial for e^r, times 2^n),
// relative error about 1e-7; inputs below -88 give 0's neighbourhood (softmax inputs are <= 0).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-88.3762626647949f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(y, n);
}

// Tokens per block of the online softmax: a block of K and V rows (32 x 128 float32 values is
// 16 KiB each) stays in L1/L2 while every query head of the group goes over it, so each row comes
// from memory once per group; the running max and the accumulators are rescaled once per block.
constexpr int64_t kBlock = 32;

// One (sequence, KV head): every query head of its GQA group, block by block over the context,
// with an online softmax in float32. `qf` holds the group's queries in float32 ([group][D]);
// `acc` ([group][D]), `scores` ([group][kBlock]), `m` and `sums` ([group]) are scratch; on return
// acc[g] / sums[g] is head g's output.
template <typename scalar_t, int64_t kVec>
void group_avx512(const float* qf, const scalar_t* k, const scalar_t* v, const int64_t* slots, int64_t n,
                  int64_t k_s0, int64_t v_s0, int64_t group, float scale, float* acc, float* scores, float* m,
                  float* sums, float* kbuf, float* vbuf) {
  constexpr int64_t D = kVec * 16;
  constexpr bool kWide = std::is_same_v<scalar_t, float>;
  for (int64_t g = 0; g < group; ++g) {
    m[g] = -std::numeric_limits<float>::infinity();
    sums[g] = 0.f;
    for (int64_t d = 0; d < D; ++d) acc[g * D + d] = 0.f;
  }
  for (int64_t t0 = 0; t0 < n; t0 += kBlock) {
    const int64_t b = std::min(kBlock, n - t0);
    const int64_t* block = slots + t0;
    if constexpr (!kWide) {  // half precision: widen the block's rows once, not once per head
      for (int64_t t = 0; t < b; ++t) {
        const scalar_t* key = k + block[t] * k_s0;
        const scalar_t* value = v + block[t] * v_s0;
        for (int64_t j = 0; j < kVec; ++j) {
          _mm512_storeu_ps(kbuf + t * D + 16 * j, load16(key + 16 * j));
          _mm512_storeu_ps(vbuf + t * D + 16 * j, load16(value + 16 * j));
        }
      }
    }
    auto key_row = [&](int64_t t) -> const float* {
      if constexpr (kWide) return k + block[t] * k_s0; else return kbuf + t * D;
    };
    auto value_row = [&](int64_t t) -> const float* {
      if constexpr (kWide) return v + block[t] * v_s0; else return vbuf + t * D;
    };
    for (int64_t g = 0; g < group; ++g) {
      __m512 qv[kVec], av[kVec];
      for (int64_t j = 0; j < kVec; ++j) qv[j] = _mm512_loadu_ps(qf + g * D + 16 * j);
      float* sg = scores + g * kBlock;
      float block_max = -std::numeric_limits<float>::infinity();
      for (int64_t t = 0; t < b; ++t) {
        const float* key = key_row(t);
        __m512 dot = _mm512_mul_ps(qv[0], _mm512_loadu_ps(key));
        for (int64_t j = 1; j < kVec; ++j) dot = _mm512_fmadd_ps(qv[j], _mm512_loadu_ps(key + 16 * j), dot);
        sg[t] = _mm512_reduce_add_ps(dot) * scale;
        block_max = std::max(block_max, sg[t]);
      }
      const float m_new = std::max(m[g], block_max);
      const float alpha = std::exp(m[g] - m_new);  // 0 on the first block (m = -inf)
      const __m512 mv = _mm512_set1_ps(m_new);
      __m512 sumv = _mm512_setzero_ps();
      for (int64_t t = 0; t < b; t += 16) {
        const __mmask16 lanes = b - t >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (b - t)) - 1);
        const __m512 e = _mm512_maskz_mov_ps(lanes, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, sg + t), mv)));
        _mm512_mask_storeu_ps(sg + t, lanes, e);
        sumv = _mm512_add_ps(sumv, e);
      }
      sums[g] = sums[g] * alpha + _mm512_reduce_add_ps(sumv);
      m[g] = m_new;
      const __m512 a = _mm512_set1_ps(alpha);
      for (int64_t j = 0; j < kVec; ++j) av[j] = _mm512_mul_ps(a, _mm512_loadu_ps(acc + g * D + 16 * j));
      for (int64_t t = 0; t < b; ++t) {
        const float* value = value_row(t);
        const __m512 p = _mm512_set1_ps(sg[t]);
        for (int64_t j = 0; j < kVec; ++j) av[j] = _mm512_fmadd_ps(p, _mm512_loadu_ps(value + 16 * j), av[j]);
      }
      for (int64_t j = 0; j < kVec; ++j) _mm512_storeu_ps(acc + g * D + 16 * j, av[j]);
    }
  }
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
    std::vector<float> qf(group * head_dim), acc(group * head_dim), sums(group), maxes(group), scores;
    std::vector<float> kbuf, vbuf;  // a block of K and V rows widened to float32 (half precision only)
#if defined(__AVX512F__)
    if constexpr (!std::is_same_v<scalar_t, float>) kbuf.resize(kBlock * head_dim), vbuf.resize(kBlock * head_dim);
#endif
    for (int64_t work = begin; work < end; ++work) {
      const int64_t s = work / kv_heads, kvh = work % kv_heads;
      const int64_t row = rows[s], first = ptr[s], n = ptr[s + 1] - first;
      for (int64_t g = 0; g < group; ++g) {
        const scalar_t* src = qp + row * q_s0 + (kvh * group + g) * q_s1;
        for (int64_t d = 0; d < head_dim; ++d) qf[g * head_dim + d] = static_cast<float>(src[d]);
      }
#if defined(__AVX512F__)
      if constexpr (kHeadDim > 0 && kHeadDim % 16 == 0) {
        scores.resize(group * kBlock);
        group_avx512<scalar_t, kHeadDim / 16>(qf.data(), kp + kvh * k_s1, vp + kvh * v_s1, slots + first, n, k_s0,
                                              v_s0, group, fscale, acc.data(), scores.data(), maxes.data(),
                                              sums.data(), kbuf.data(), vbuf.data());
        for (int64_t g = 0; g < group; ++g) {
          scalar_t* dst = op + row * o_s0 + (kvh * group + g) * o_s1;
          const float inv = 1.f / sums[g];
          for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(acc[g * head_dim + d] * inv);
        }
        continue;
      }
#endif
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
      case 32: run<scalar_t, 32>(q, k_cache, v_cache, q_rows, indptr, slot_ids, scale, out); break;
      case 64: run<scalar_t, 64>(q, k_cache, v_cache, q_rows, indptr, slot_ids, scale, out); break;
      case 80: run<scalar_t, 80>(q, k_cache, v_cache, q_rows, indptr, slot_ids, scale, out); break;
      case 96: run<scalar_t, 96>(q, k_cache, v_cache, q_rows, indptr, slot_ids, scale, out); break;
      case 128: run<scalar_t, 128>(q, k_cache, v_cache, q_rows, indptr, slot_ids, scale, out); break;
      case 256: run<scalar_t, 256>(q, k_cache, v_cache, q_rows, indptr, slot_ids, scale, out); break;
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
