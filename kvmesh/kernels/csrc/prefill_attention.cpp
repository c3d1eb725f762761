// Prefill attention over a paged KV cache: every prefill chunk of a step in one call.
//
// torch's fused attention took the chunks one sequence at a time, after a gather of the
// sequence's K and V into contiguous tensors; in bfloat16 on CPUs without AMX it multiplies through
// MKL's bfloat16 GEMM, which on AMD CPUs widens its inputs to float32 block by block (12% of a
// bfloat16 offline pass of the benchmark model, 50-90 GFLOP/s on an AMD EPYC Zen 4's two cores).
// This kernel reads K and V in place through each sequence's slot list and works as flash
// attention does: for a tile of query rows (16 or 32 query tokens times every query head of one
// GQA group, so each K and V row is read once per group) it walks the keys in blocks of 32, keeps
// each row's running max and sum (online softmax, in float32 as SDPA), and accumulates P.V.
//
// Layouts that make both products plain broadcast-and-multiply loops, with no horizontal sums:
// - Q.K: the tile's queries transposed once (`qt`, [head_dim][rows]), so a vector holds one
//   dimension of 16 (AVX-512) or 8 rows; a key's value is broadcast. The scores come out
//   transposed, [keys][rows], and the softmax's max and sum over keys are vector maxes and adds.
// - P.V: a row's weight is broadcast against V's rows as stored.
// With AVX512-BF16 (checked at run time), bfloat16 tiles multiply pairs of values in one
// `vdpbf16ps`: Q.K against pairs of dimensions, P.V against pairs of keys (V packed as pairs,
// the weights rounded to bfloat16 first, as transformers' bfloat16 attention rounds them).
// Other half-precision inputs are widened to float32 block by block. With AMX (checked at run
// time, and the op's `tiles` argument, true unless a caller turns it off), bfloat16 chunks
// multiply both products on the tile units instead ("bfloat16 on AMX's tile units" below): on an
// Intel Xeon with AMX, two threads, the benchmark model's heads (`bench/prefill_attention.py`), a
// 512-token prompt 2.6-2.9 ms a layer by `vdpbf16ps`, 1.3-1.4 by torch's SDPA (what bfloat16 took
// on these CPUs before), 0.7 on the tiles; 1,024 tokens 10-12, 3.6-3.9 and 3.0; 1,024 after a
// 15,360-token prefix 339, 109 and 72.
//
// Work items are (sequence, KV head, tile of query tokens; tiles four times as tall where a
// sequence's K and V outgrow the caches, so that each row read from memory serves more queries);
// the threads claim them one at a time, largest first (the causal mask makes a chunk's last tiles
// the costliest), and a step whose prefill is small stays on the calling thread.
//
// Registered as torch.ops.kvmesh.prefill_attention_ (writes the prefill rows of `out`).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "amx.h"
#include "paged_cache.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

namespace {

using at::vec::Vectorized;
using fVec = Vectorized<float>;
constexpr int64_t kW = fVec::size();  // float32 lanes: 16 with AVX-512, 8 otherwise
constexpr int64_t kKeys = 32;         // keys per block of the online softmax
constexpr int64_t kTileKeys = 64;     // the same on AMX's tile units (below)
constexpr int64_t kValuePairsBytes = 64 << 20;  // the tile path's V pairs for a call, at most
// Tiles: Q.K takes 4 keys against up to kRowVecs vectors of rows at once, P.V 4 rows against up
// to kDimVecs vectors of V's dimensions: accumulators for 16 (AVX-512, 32 registers) or 8 (AVX2).
constexpr int64_t kRowVecs = kW == 16 ? 4 : 2;
constexpr int64_t kDimVecs = kW == 16 ? 4 : 2;
// Below this many multiply-adds a call stays on the calling thread (some tens of microseconds).
constexpr double kParallelMinWork = 1 << 21;
// A sequence with this many bytes of K and V or more is computed in tall tiles (`run`). AMD EPYC
// Zen 4 (32 MiB of L3), one thread, a 1,024-token chunk after a prefix, the benchmark model's heads:
// float32 at 16,000 tokens of context 921-940 -> 742-795 ms, at 8,192 431 -> 360-372, level at
// 4,096 (8 MiB), 2-7% slower at 1,024 (so short contexts keep short tiles); bfloat16 at 16,000
// 656 -> 512. A row's output is the same in a tile of any height.
constexpr int64_t kTallTileBytes = 8 << 20;

struct Seq {
  int64_t row, nq, first, ctx;  // query rows [row, row + nq) at positions ctx - nq ..; slots [first, first + ctx)
};

struct Item {
  int64_t seq, kvh, t0, t1;  // the sequence's query tokens [t0, t1), every query head of KV head kvh
  double cost;
};

// One thread's scratch, sized per tile by run_item (its rows padded to a multiple of kW), kept
// across the thread's tiles so their buffers are allocated once.
struct Tile {
  std::vector<float> qt, s, o, m, l, alpha, pos, kbuf, vbuf;
  std::vector<uint32_t> qw, vw, pw;  // bfloat16 pairs (AVX512-BF16 path; qw and vw the tile path's too)
  std::vector<uint32_t> pa;          // the tile path's weights, [rows][keys / 2] pairs
  std::vector<at::BFloat16> kg;      // the tile path's keys where a block's slots do not run in order
};

template <typename T>
inline void widen(const T* src, float* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    int64_t i = 0;
    for (; i + 2 * kW <= n; i += 2 * kW) {
      auto [lo, hi] = at::vec::convert_to_float<T>(Vectorized<T>::loadu(src + i));
      lo.store(dst + i);
      hi.store(dst + i + kW);
    }
    for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  }
}

// s[t][rows of vectors v0 .. v0 + NV) for keys t0 .. t0 + KR: the tile's queries (qt, transposed)
// against each key's row, one broadcast value at a time.
template <int64_t KR, int64_t NV>
inline void qk_tile(const float* qt, int64_t rows_pad, const float* const* keys, int64_t D, int64_t v0, float* s,
                    int64_t t) {
  fVec acc[KR][NV];
  for (int64_t i = 0; i < KR; ++i)
    for (int64_t j = 0; j < NV; ++j) acc[i][j] = fVec(0.f);
  for (int64_t d = 0; d < D; ++d) {
    fVec qv[NV];
    for (int64_t j = 0; j < NV; ++j) qv[j] = fVec::loadu(qt + d * rows_pad + (v0 + j) * kW);
    for (int64_t i = 0; i < KR; ++i) {
      const fVec kb(keys[i][d]);
      for (int64_t j = 0; j < NV; ++j) acc[i][j] = at::vec::fmadd(qv[j], kb, acc[i][j]);
    }
  }
  for (int64_t i = 0; i < KR; ++i)
    for (int64_t j = 0; j < NV; ++j) acc[i][j].store(s + (t + i) * rows_pad + (v0 + j) * kW);
}

template <int64_t KR>
inline void qk_keys(const float* qt, int64_t rows_pad, const float* const* keys, int64_t D, float* s, int64_t t) {
  const int64_t vecs = rows_pad / kW;
  int64_t v = 0;
  for (; v + kRowVecs <= vecs; v += kRowVecs) qk_tile<KR, kRowVecs>(qt, rows_pad, keys, D, v, s, t);
  switch (vecs - v) {  // the rest in one tile: a tile of one vector would wait on each FMA's latency
    case 3: if constexpr (kRowVecs > 3) qk_tile<KR, 3>(qt, rows_pad, keys, D, v, s, t); break;
    case 2: if constexpr (kRowVecs > 2) qk_tile<KR, 2>(qt, rows_pad, keys, D, v, s, t); break;
    case 1: qk_tile<KR, 1>(qt, rows_pad, keys, D, v, s, t); break;
  }
}

// o[r .. r + MR][dims of vectors v0 .. v0 + NV] = alpha * o + sum over t < b of s[t][r] * V[t].
template <int64_t MR, int64_t NV>
inline void pv_tile(const float* s, int64_t rows_pad, const float* const* values, int64_t b, const float* alpha,
                    float* o, int64_t D, int64_t r, int64_t v0) {
  fVec acc[MR][NV];
  for (int64_t i = 0; i < MR; ++i) {
    const fVec a(alpha[r + i]);
    for (int64_t j = 0; j < NV; ++j) acc[i][j] = fVec::loadu(o + (r + i) * D + (v0 + j) * kW) * a;
  }
  for (int64_t t = 0; t < b; ++t) {
    fVec vv[NV];
    for (int64_t j = 0; j < NV; ++j) vv[j] = fVec::loadu(values[t] + (v0 + j) * kW);
    for (int64_t i = 0; i < MR; ++i) {
      const fVec p(s[t * rows_pad + r + i]);
      for (int64_t j = 0; j < NV; ++j) acc[i][j] = at::vec::fmadd(p, vv[j], acc[i][j]);
    }
  }
  for (int64_t i = 0; i < MR; ++i)
    for (int64_t j = 0; j < NV; ++j) acc[i][j].store(o + (r + i) * D + (v0 + j) * kW);
}

inline void pv_block(const float* s, int64_t rows_pad, const float* const* values, int64_t b, const float* alpha,
                     float* o, int64_t D) {
  const int64_t vecs = D / kW;
  for (int64_t r = 0; r < rows_pad; r += 4) {
    int64_t v = 0;
    for (; v + kDimVecs <= vecs; v += kDimVecs) pv_tile<4, kDimVecs>(s, rows_pad, values, b, alpha, o, D, r, v);
    switch (vecs - v) {
      case 3: if constexpr (kDimVecs > 3) pv_tile<4, 3>(s, rows_pad, values, b, alpha, o, D, r, v); break;
      case 2: if constexpr (kDimVecs > 2) pv_tile<4, 2>(s, rows_pad, values, b, alpha, o, D, r, v); break;
      case 1: pv_tile<4, 1>(s, rows_pad, values, b, alpha, o, D, r, v); break;
    }
  }
}

// The block's scores (s[t][row], t < b) scaled and masked, then the online softmax: each row's
// running max m and sum l updated, alpha = the factor its accumulated output is rescaled by, and
// s replaced by the weights exp(score - max). Rows that see no key yet keep max -inf and weight 0.
inline void softmax_block(float* s, int64_t rows_pad, int64_t b, int64_t key0, int64_t window, float scale,
                          const float* pos, float* m, float* l, float* alpha) {
  const fVec neg_inf(-std::numeric_limits<float>::infinity()), zero(0.f), sc(scale);
  for (int64_t v = 0; v < rows_pad; v += kW) {
    const fVec p = fVec::loadu(pos + v);
    const fVec low = window > 0 ? p - fVec(static_cast<float>(window)) : fVec(-1.f);  // keys at or below are out
    fVec mx = fVec::loadu(m + v);
    const fVec m_old = mx;
    for (int64_t t = 0; t < b; ++t) {
      const fVec kpos(static_cast<float>(key0 + t));
      const fVec x = fVec::blendv(fVec::loadu(s + t * rows_pad + v) * sc, neg_inf, (kpos > p) | (kpos <= low));
      x.store(s + t * rows_pad + v);
      mx = at::vec::maximum(mx, x);
    }
    const fVec safe = fVec::blendv(mx, zero, mx == neg_inf);  // exp(-inf - -inf) would be NaN
    const fVec a = (m_old - safe).exp();
    fVec sum = zero;
    for (int64_t t = 0; t < b; ++t) {
      const fVec e = (fVec::loadu(s + t * rows_pad + v) - safe).exp();
      e.store(s + t * rows_pad + v);
      sum = sum + e;
    }
    (fVec::loadu(l + v) * a + sum).store(l + v);
    mx.store(m + v);
    a.store(alpha + v);
  }
}

#if defined(__AVX512F__)
bool cpu_has_bf16_dot() {
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
}

// Q.K with AVX512-BF16: qw is the tile's queries as pairs of dimensions, transposed
// ([head_dim / 2][rows]); each key's pair is broadcast.
template <int64_t KR, int64_t NV>
__attribute__((target("avx512f,avx512bf16"))) inline void qk_tile_bf16(const uint32_t* qw, int64_t rows_pad,
                                                                       const uint32_t* const* keys, int64_t pairs,
                                                                       int64_t v0, float* s, int64_t t) {
  __m512 acc[KR][NV];
  for (int64_t i = 0; i < KR; ++i)
    for (int64_t j = 0; j < NV; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < pairs; ++d) {
    __m512bh qv[NV];
    for (int64_t j = 0; j < NV; ++j) qv[j] = (__m512bh)_mm512_loadu_si512(qw + d * rows_pad + (v0 + j) * 16);
    for (int64_t i = 0; i < KR; ++i) {
      const __m512bh kb = (__m512bh)_mm512_set1_epi32(static_cast<int>(keys[i][d]));
      for (int64_t j = 0; j < NV; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], qv[j], kb);
    }
  }
  for (int64_t i = 0; i < KR; ++i)
    for (int64_t j = 0; j < NV; ++j) _mm512_storeu_ps(s + (t + i) * rows_pad + (v0 + j) * 16, acc[i][j]);
}

template <int64_t KR>
__attribute__((target("avx512f,avx512bf16"))) void qk_keys_bf16(const uint32_t* qw, int64_t rows_pad,
                                                               const uint32_t* const* keys, int64_t pairs, float* s,
                                                               int64_t t) {
  const int64_t vecs = rows_pad / 16;
  int64_t v = 0;
  for (; v + 4 <= vecs; v += 4) qk_tile_bf16<KR, 4>(qw, rows_pad, keys, pairs, v, s, t);
  switch (vecs - v) {
    case 3: qk_tile_bf16<KR, 3>(qw, rows_pad, keys, pairs, v, s, t); break;
    case 2: qk_tile_bf16<KR, 2>(qw, rows_pad, keys, pairs, v, s, t); break;
    case 1: qk_tile_bf16<KR, 1>(qw, rows_pad, keys, pairs, v, s, t); break;
  }
}

// 16 float32 values rounded to bfloat16, each in the low half of a 32-bit word.
__attribute__((target("avx512f,avx512bw,avx512bf16"))) inline __m512i half_words(const float* x) {
  return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x)));
}

// A block's V rows (values[t], t < b, D values each, D a multiple of 16) as pairs of keys, the
// layout `vdpbf16ps` and the tile products take: vw[u][d] = value d of key 2u in the low half, of
// key 2u + 1 in the high, zero past b; `pairs` pairs.
__attribute__((target("avx512f,avx512bw"))) void pair_values(const at::BFloat16* const* values, int64_t b,
                                                              int64_t pairs, int64_t D, uint32_t* vw) {
  auto words = [&](int64_t t, int64_t d) {  // key t's values d .. d + 15 in the low halves of 32-bit words
    if (t >= b) return _mm512_setzero_si512();
    return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(values[t] + d)));
  };
  for (int64_t u = 0; u < pairs; ++u)
    for (int64_t d = 0; d < D; d += 16)
      _mm512_storeu_si512(vw + u * D + d, _mm512_or_si512(words(2 * u, d), _mm512_slli_epi32(words(2 * u + 1, d), 16)));
}

// The block's weights rounded to bfloat16, two keys to a 32-bit word ([keys / 2][rows]), and V's
// rows packed to match (pair_values); a block of odd length pairs its last key with zeros.
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void pack_pairs_bf16(
    const float* s, int64_t rows_pad, const at::BFloat16* const* values, int64_t b, int64_t D, uint32_t* pw,
    uint32_t* vw) {
  for (int64_t u = 0; 2 * u < b; ++u) {
    const bool odd = 2 * u + 1 == b;
    for (int64_t v = 0; v < rows_pad; v += 16) {
      const __m512i lo = half_words(s + 2 * u * rows_pad + v);
      const __m512i hi = odd ? _mm512_setzero_si512() : half_words(s + (2 * u + 1) * rows_pad + v);
      _mm512_storeu_si512(pw + u * rows_pad + v, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
  pair_values(values, b, (b + 1) / 2, D, vw);
}

template <int64_t MR, int64_t NV>
__attribute__((target("avx512f,avx512bf16"))) inline void pv_tile_bf16(const uint32_t* pw, int64_t rows_pad,
                                                                       const uint32_t* vw, int64_t pairs,
                                                                       const float* alpha, float* o, int64_t D,
                                                                       int64_t r, int64_t v0) {
  __m512 acc[MR][NV];
  for (int64_t i = 0; i < MR; ++i) {
    const __m512 a = _mm512_set1_ps(alpha[r + i]);
    for (int64_t j = 0; j < NV; ++j) acc[i][j] = _mm512_mul_ps(_mm512_loadu_ps(o + (r + i) * D + (v0 + j) * 16), a);
  }
  for (int64_t u = 0; u < pairs; ++u) {
    __m512bh vv[NV];
    for (int64_t j = 0; j < NV; ++j) vv[j] = (__m512bh)_mm512_loadu_si512(vw + u * D + (v0 + j) * 16);
    for (int64_t i = 0; i < MR; ++i) {
      const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pw[u * rows_pad + r + i]));
      for (int64_t j = 0; j < NV; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], p, vv[j]);
    }
  }
  for (int64_t i = 0; i < MR; ++i)
    for (int64_t j = 0; j < NV; ++j) _mm512_storeu_ps(o + (r + i) * D + (v0 + j) * 16, acc[i][j]);
}

__attribute__((target("avx512f,avx512bf16"))) void pv_block_bf16(const uint32_t* pw, int64_t rows_pad,
                                                                const uint32_t* vw, int64_t b, const float* alpha,
                                                                float* o, int64_t D) {
  const int64_t vecs = D / 16, pairs = (b + 1) / 2;
  for (int64_t r = 0; r < rows_pad; r += 4) {
    int64_t v = 0;
    for (; v + 4 <= vecs; v += 4) pv_tile_bf16<4, 4>(pw, rows_pad, vw, pairs, alpha, o, D, r, v);
    switch (vecs - v) {
      case 3: pv_tile_bf16<4, 3>(pw, rows_pad, vw, pairs, alpha, o, D, r, v); break;
      case 2: pv_tile_bf16<4, 2>(pw, rows_pad, vw, pairs, alpha, o, D, r, v); break;
      case 1: pv_tile_bf16<4, 1>(pw, rows_pad, vw, pairs, alpha, o, D, r, v); break;
    }
  }
}

// bfloat16 on AMX's tile units (Intel Xeon from Sapphire Rapids; checked at run time). The products
// go on the tiles, a block of 64 keys at a time (kTileKeys: half the trips through O's sums of
// 32-key blocks); the online softmax is AVX-512 code (amx_softmax), on scores transposed as the
// vector path's are:
// - S^T = K.Q^T: 16 keys' rows of 32 dimensions are a tile as the cache holds them (a page's 16
//   slots, consecutive, at the cache's row stride; copied into `kg` where a piece's slots are
//   not in order), and the tile's queries as pairs of dimensions (`qw`, [head_dim / 2][rows]) are
//   the other operand as they lie. The sums come out [keys][rows], as the softmax takes them.
// - O += P.V: the weights rounded to bfloat16 (as the AVX512-BF16 path and transformers round
//   them), two keys to a 32-bit word and transposed to [rows][keys / 2] (`pa`), against V packed
//   as pairs of keys (`vw`, [keys / 2][head_dim]; for a prompt of several tiles, packed once for
//   the call before the tiles start: `run`); O's float32 sums are loaded into a tile, added to and
//   stored back, after `alpha` rescaled them.
// Tiles: 0-3 sums of four 16-key pieces, 4 queries, 5-6 keys (scores); 0 sums, 1 and 3 weights,
// 2 and 4 values (P.V). A row's result depends only on its own queries and the keys (no sum
// crosses rows), whatever the tile's height or the rows beside it.

// Whether this call's bfloat16 chunks go on the tile units: the CPU has them, the caller allows
// them, and a head is whole 32-dimension pieces.
bool tiles_for(int64_t D, bool allow) { return allow && D % 32 == 0 && kvmesh::amx_ready(); }

// 16 vectors of 16 32-bit values, as a 16x16 matrix, transposed in registers.
__attribute__((target("avx512f"))) inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // each 128-bit lane of r[i] now holds row i % 4 of a 4x4 block; gather the lanes
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xDD);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xDD);
  }
}

// The tile's queries as pairs of dimensions, transposed: qw[pair][row] for row = token * group + g
// (q0's rows at strides s0 per token and s1 per head, in 32-bit words; pairs a multiple of 16),
// 16 rows by 16 pairs at a time; rows past `rows` stay zero.
__attribute__((target("avx512f"))) void pack_queries(const uint32_t* q0, int64_t s0, int64_t s1, int64_t group,
                                                      int64_t rows, int64_t rows_pad, int64_t pairs, uint32_t* qw) {
  for (int64_t c = 0; c < rows; c += 16) {
    const uint32_t* row[16];
    for (int64_t i = 0; i < 16; ++i) row[i] = c + i < rows ? q0 + (c + i) / group * s0 + (c + i) % group * s1 : nullptr;
    for (int64_t j = 0; j < pairs; j += 16) {
      __m512i r[16];
      for (int64_t i = 0; i < 16; ++i) r[i] = row[i] ? _mm512_loadu_si512(row[i] + j) : _mm512_setzero_si512();
      transpose16(r);
      for (int64_t k = 0; k < 16; ++k) _mm512_storeu_si512(qw + (j + k) * rows_pad + c, r[k]);
    }
  }
}

// S^T for one block: `pieces` pieces of 16 keys (1-4), piece i's rows at k[i] (stride ks[i]
// elements), against every 16 rows of qw.
__attribute__((target("amx-tile,amx-bf16"))) void amx_scores(const at::BFloat16* const* k, const int64_t* ks,
                                                              int pieces, const uint32_t* qw, int64_t rows_pad,
                                                              int64_t D, float* s) {
  const int64_t qs = rows_pad * 4, ss = rows_pad * 4;
  for (int64_t c = 0; c < rows_pad; c += 16) {
    _tile_zero(0);
    if (pieces > 1) _tile_zero(1);
    if (pieces > 2) _tile_zero(2);
    if (pieces > 3) _tile_zero(3);
    for (int64_t j = 0; j < D; j += 32) {
      _tile_loadd(4, qw + j / 2 * rows_pad + c, qs);
      _tile_loadd(5, k[0] + j, ks[0] * 2);
      _tile_dpbf16ps(0, 5, 4);
      if (pieces > 1) {
        _tile_loadd(6, k[1] + j, ks[1] * 2);
        _tile_dpbf16ps(1, 6, 4);
      }
      if (pieces > 2) {
        _tile_loadd(5, k[2] + j, ks[2] * 2);
        _tile_dpbf16ps(2, 5, 4);
      }
      if (pieces > 3) {
        _tile_loadd(6, k[3] + j, ks[3] * 2);
        _tile_dpbf16ps(3, 6, 4);
      }
    }
    _tile_stored(0, s + c, ss);
    if (pieces > 1) _tile_stored(1, s + 16 * rows_pad + c, ss);
    if (pieces > 2) _tile_stored(2, s + 32 * rows_pad + c, ss);
    if (pieces > 3) _tile_stored(3, s + 48 * rows_pad + c, ss);
  }
}

// The block's weights (s[t][row], t < b) rounded to bfloat16 as pairs of keys and transposed to
// pa[row][32] (pairs past the block's keys zero; pairs 16-31 only where the block has more than
// 32 keys).
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void amx_weights(const float* s, int64_t rows_pad, int64_t b,
                                                                         uint32_t* pa) {
  const __m512i zero = _mm512_setzero_si512();
  const int64_t halves = b > 32 ? 2 : 1;
  for (int64_t c = 0; c < rows_pad; c += 16) {
    for (int64_t h = 0; h < halves; ++h) {
      __m512i w[16];
      for (int64_t u = 0; u < 16; ++u) {
        const int64_t t = 32 * h + 2 * u;
        const __m512i lo = t < b ? half_words(s + t * rows_pad + c) : zero;
        const __m512i hi = t + 1 < b ? half_words(s + (t + 1) * rows_pad + c) : zero;
        w[u] = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
      }
      transpose16(w);
      for (int64_t i = 0; i < 16; ++i) _mm512_storeu_si512(pa + (c + i) * 32 + 16 * h, w[i]);
    }
  }
}

// o[row] *= alpha[row], skipping each 16 rows whose factors are all 1.
__attribute__((target("avx512f"))) void amx_rescale(const float* alpha, int64_t rows_pad, float* o, int64_t D) {
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t c = 0; c < rows_pad; c += 16) {
    if (_mm512_cmp_ps_mask(_mm512_loadu_ps(alpha + c), one, _CMP_NEQ_UQ) == 0) continue;
    for (int64_t r = c; r < c + 16; ++r) {
      const __m512 a = _mm512_set1_ps(alpha[r]);
      for (int64_t d = 0; d < D; d += 16)
        _mm512_storeu_ps(o + r * D + d, _mm512_mul_ps(_mm512_loadu_ps(o + r * D + d), a));
    }
  }
}

// The tile path's online softmax over a block's raw scores (s[t][row], t < b), to the same m, l
// and alpha as softmax_block: the scale is applied inside the exponent (exp(s * scale - m), m the
// running max of the scaled scores: the max of s times the scale, the same value), and where every
// row of the tile sees every key of the block (`open`; most blocks of a long prompt) the mask is not
// computed at all. A visible score's weight is the same arithmetic either way, so a row's bits
// do not depend on whether the rows beside it needed the mask. The max a row's weights are taken
// against is moved only when its scores pass it by more than 8 (FlashAttention-4's lazy rescale:
// the softmax is the same for any reference, the weights stay below e^8, and O is rescaled the less
// often). The exponential is ATen's exp_u20 (20 ulp; what ATen's own flash attention takes for half
// precision): the weights are rounded to bfloat16, 8 bits, next.
constexpr float kStaleMax = 8.f;
__attribute__((target("avx512f"))) void amx_softmax(float* s, int64_t rows_pad, int64_t b, int64_t key0,
                                                     int64_t window, float scale, bool open, const float* pos,
                                                     float* m, float* l, float* alpha) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), sc = _mm512_set1_ps(scale);
  for (int64_t v = 0; v < rows_pad; v += 16) {
    __m512 mx = neg_inf;
    if (open) {  // four chains of maxes, not one chain of b
      __m512 m4[4] = {neg_inf, neg_inf, neg_inf, neg_inf};
      int64_t t = 0;
      for (; t + 4 <= b; t += 4)
        for (int64_t i = 0; i < 4; ++i) m4[i] = _mm512_max_ps(m4[i], _mm512_loadu_ps(s + (t + i) * rows_pad + v));
      for (; t < b; ++t) m4[0] = _mm512_max_ps(m4[0], _mm512_loadu_ps(s + t * rows_pad + v));
      mx = _mm512_max_ps(_mm512_max_ps(m4[0], m4[1]), _mm512_max_ps(m4[2], m4[3]));
    } else {
      const __m512 p = _mm512_loadu_ps(pos + v);
      const __m512 low =  // keys at or below are out
          window > 0 ? _mm512_sub_ps(p, _mm512_set1_ps(static_cast<float>(window))) : _mm512_set1_ps(-1.f);
      for (int64_t t = 0; t < b; ++t) {
        const __m512 kpos = _mm512_set1_ps(static_cast<float>(key0 + t));
        const __mmask16 out = _mm512_cmp_ps_mask(kpos, p, _CMP_GT_OQ) | _mm512_cmp_ps_mask(kpos, low, _CMP_LE_OQ);
        const __m512 x = _mm512_mask_mov_ps(_mm512_loadu_ps(s + t * rows_pad + v), out, neg_inf);
        _mm512_storeu_ps(s + t * rows_pad + v, x);
        mx = _mm512_max_ps(mx, x);
      }
    }
    // A row's reference max moves only when the block's passes it by more than kStaleMax (or it
    // has none yet): the weights then stay below e^8, and most blocks leave O as it is (alpha 1).
    const __m512 m_old = _mm512_loadu_ps(m + v);
    const __m512 seen = _mm512_mul_ps(mx, sc);
    const __mmask16 move = _mm512_cmp_ps_mask(seen, _mm512_add_ps(m_old, _mm512_set1_ps(kStaleMax)), _CMP_GT_OQ) |
                           _mm512_cmp_ps_mask(m_old, neg_inf, _CMP_EQ_OQ);
    const __m512 m_new = _mm512_mask_max_ps(m_old, move, m_old, seen);
    const __m512 safe = _mm512_mask_mov_ps(m_new, _mm512_cmp_ps_mask(m_new, neg_inf, _CMP_EQ_OQ), _mm512_setzero_ps());
    const __m512 a = (Vectorized<float>(_mm512_sub_ps(m_old, safe))).exp();
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < b; ++t) {
      const __m512 e = Vectorized<float>(_mm512_fmsub_ps(_mm512_loadu_ps(s + t * rows_pad + v), sc, safe)).exp_u20();
      _mm512_storeu_ps(s + t * rows_pad + v, e);
      sum = _mm512_add_ps(sum, e);
    }
    _mm512_storeu_ps(l + v, _mm512_fmadd_ps(_mm512_loadu_ps(l + v), a, sum));
    _mm512_storeu_ps(m + v, m_new);
    _mm512_storeu_ps(alpha + v, a);
  }
}

// O += P.V on the tiles (keys 32-63 only where the block has them).
__attribute__((target("amx-tile,amx-bf16"))) void amx_values(const uint32_t* pa, int64_t rows_pad, int64_t b,
                                                              const uint32_t* vw, int64_t D, float* o) {
  for (int64_t c = 0; c < rows_pad; c += 16) {
    _tile_loadd(1, pa + c * 32, 128);
    if (b > 32) _tile_loadd(3, pa + c * 32 + 16, 128);
    for (int64_t f = 0; f < D; f += 16) {
      _tile_loadd(0, o + c * D + f, D * 4);
      _tile_loadd(2, vw + f, D * 4);
      _tile_dpbf16ps(0, 1, 2);
      if (b > 32) {
        _tile_loadd(4, vw + 16 * D + f, D * 4);
        _tile_dpbf16ps(0, 3, 4);
      }
      _tile_stored(0, o + c * D + f, D * 4);
    }
  }
}

// 16 keys' rows for one tile: in place where their slots run in order (a page's), else copied
// into buf (zero rows past n). Returns the rows and sets their stride.
inline const at::BFloat16* key_rows(const at::BFloat16* kp, int64_t k_s0, int64_t kvh_off, const int64_t* slots,
                                    int64_t n, int64_t D, at::BFloat16* buf, int64_t* stride) {
  bool run = n == 16;
  for (int64_t t = 1; run && t < 16; ++t) run = slots[t] == slots[0] + t;
  if (run) {
    *stride = k_s0;
    return kp + slots[0] * k_s0 + kvh_off;
  }
  for (int64_t t = 0; t < 16; ++t) {
    if (t < n)
      std::memcpy(buf + t * D, kp + slots[t] * k_s0 + kvh_off, D * sizeof(at::BFloat16));
    else
      std::memset(static_cast<void*>(buf + t * D), 0, D * sizeof(at::BFloat16));
  }
  *stride = D;
  return buf;
}
#endif

// One work item: query tokens [t0, t1) of sequence `sq`, every query head of KV head `kvh`.
// Tile row rho = token * group + g.
template <typename scalar_t>
void run_item(const Item& it, const Seq& sq, const scalar_t* qp, int64_t q_s0, int64_t q_s1, const scalar_t* kp,
              const scalar_t* vp, int64_t k_s0, int64_t k_s1, int64_t v_s0, int64_t v_s1, const int64_t* slots,
              int64_t group, int64_t D, int64_t window, float scale, bool bf16_dot, bool tiles,
              const uint32_t* value_pairs, scalar_t* op, int64_t o_s0, int64_t o_s1, Tile& tile) {
  const int64_t tokens = it.t1 - it.t0, rows = tokens * group;
  const int64_t rows_pad = (rows + kW - 1) / kW * kW;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  tile.s.resize(kKeys * rows_pad);
  tile.o.assign(rows_pad * D, 0.f);
  tile.m.assign(rows_pad, neg_inf);
  tile.l.assign(rows_pad, 0.f);
  tile.alpha.resize(rows_pad);
  tile.pos.assign(rows_pad, -1.f);  // padding rows see no key
  const int64_t pos0 = sq.ctx - sq.nq + it.t0;  // position of the item's first query token
  for (int64_t tok = 0; tok < tokens; ++tok)
    for (int64_t g = 0; g < group; ++g) tile.pos[tok * group + g] = static_cast<float>(pos0 + tok);
  // The queries, transposed: float32 ([D][rows]) or bfloat16 pairs ([D / 2][rows]).
  const scalar_t* q0 = qp + (sq.row + it.t0) * q_s0 + it.kvh * group * q_s1;
  if (bf16_dot) {
    tile.qw.assign(D / 2 * rows_pad, 0u);
#if defined(__AVX512F__)
    if (D % 32 == 0 && q_s0 % 2 == 0 && q_s1 % 2 == 0) {  // rows of whole 32-bit words
      pack_queries(reinterpret_cast<const uint32_t*>(q0), q_s0 / 2, q_s1 / 2, group, rows, rows_pad, D / 2,
                   tile.qw.data());
    } else
#endif
    for (int64_t tok = 0; tok < tokens; ++tok)
      for (int64_t g = 0; g < group; ++g) {
        const uint32_t* src = reinterpret_cast<const uint32_t*>(q0 + tok * q_s0 + g * q_s1);
        for (int64_t d = 0; d < D / 2; ++d) tile.qw[d * rows_pad + tok * group + g] = src[d];
      }
    tile.pw.resize(kKeys / 2 * rows_pad);
    tile.vw.resize(kKeys / 2 * D);
    if (tiles) tile.s.resize(kTileKeys * rows_pad), tile.pa.resize(rows_pad * kTileKeys / 2),
               tile.vw.resize(kTileKeys / 2 * D), tile.kg.resize(kTileKeys * D);
  } else {
    tile.qt.assign(D * rows_pad, 0.f);
    for (int64_t tok = 0; tok < tokens; ++tok)
      for (int64_t g = 0; g < group; ++g) {
        const scalar_t* src = q0 + tok * q_s0 + g * q_s1;
        for (int64_t d = 0; d < D; ++d) tile.qt[d * rows_pad + tok * group + g] = static_cast<float>(src[d]);
      }
    if constexpr (!std::is_same_v<scalar_t, float>) tile.kbuf.resize(kKeys * D), tile.vbuf.resize(kKeys * D);
  }
  const int64_t last = pos0 + tokens - 1;  // keys past the last query token's position are never seen
  const int64_t key_begin = window > 0 ? std::max<int64_t>(0, pos0 - window + 1) : 0;
  const int64_t* seq_slots = slots + sq.first;
  const float* krow[kKeys];
  const float* vrow[kKeys];
  const scalar_t* kraw[kTileKeys];
  const scalar_t* vraw[kTileKeys];
  // The tile path's blocks start on a multiple of 16 keys (whole pages; the window masks the keys
  // before key_begin), so that each half of a block is one page's slots in place.
  const int64_t block = tiles ? kTileKeys : kKeys;
  for (int64_t t0 = tiles ? key_begin / 16 * 16 : key_begin; t0 <= last; t0 += block) {
    const int64_t b = std::min(block, last + 1 - t0);
    for (int64_t t = 0; t < b; ++t) {
      kraw[t] = kp + seq_slots[t0 + t] * k_s0 + it.kvh * k_s1;
      vraw[t] = vp + seq_slots[t0 + t] * v_s0 + it.kvh * v_s1;
    }
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
      if (tiles) {
        const int pieces = static_cast<int>((b + 15) / 16);
        const at::BFloat16* k[4];
        int64_t ks[4];
        for (int i = 0; i < pieces; ++i)
          k[i] = key_rows(kp, k_s0, it.kvh * k_s1, seq_slots + t0 + 16 * i, std::min<int64_t>(b - 16 * i, 16), D,
                          tile.kg.data() + 16 * i * D, &ks[i]);
        amx_scores(k, ks, pieces, tile.qw.data(), rows_pad, D, tile.s.data());
        // every row of the tile sees every key of the block: past the window of none, at or before the first query
        const bool open = t0 + b - 1 <= pos0 && (window == 0 || t0 > last - window);
        amx_softmax(tile.s.data(), rows_pad, b, t0, window, scale, open, tile.pos.data(), tile.m.data(),
                    tile.l.data(), tile.alpha.data());
        amx_weights(tile.s.data(), rows_pad, b, tile.pa.data());
        // the call's pairs of V rows (`run`), or the block's own
        const uint32_t* vw = value_pairs ? value_pairs + t0 / 2 * D : tile.vw.data();
        if (!value_pairs) pair_values(vraw, b, b > 32 ? 32 : 16, D, tile.vw.data());
        amx_rescale(tile.alpha.data(), rows_pad, tile.o.data(), D);
        amx_values(tile.pa.data(), rows_pad, b, vw, D, tile.o.data());
        continue;
      }
      if (bf16_dot) {
        const uint32_t* kw[kKeys];
        for (int64_t t = 0; t < b; ++t) kw[t] = reinterpret_cast<const uint32_t*>(kraw[t]);
        int64_t t = 0;
        for (; t + 4 <= b; t += 4) qk_keys_bf16<4>(tile.qw.data(), rows_pad, kw + t, D / 2, tile.s.data(), t);
        for (; t < b; ++t) qk_keys_bf16<1>(tile.qw.data(), rows_pad, kw + t, D / 2, tile.s.data(), t);
        softmax_block(tile.s.data(), rows_pad, b, t0, window, scale, tile.pos.data(), tile.m.data(), tile.l.data(),
                      tile.alpha.data());
        pack_pairs_bf16(tile.s.data(), rows_pad, vraw, b, D, tile.pw.data(), tile.vw.data());
        pv_block_bf16(tile.pw.data(), rows_pad, tile.vw.data(), b, tile.alpha.data(), tile.o.data(), D);
        continue;
      }
    }
#endif
    for (int64_t t = 0; t < b; ++t) {
      if constexpr (std::is_same_v<scalar_t, float>) {
        krow[t] = kraw[t];
        vrow[t] = vraw[t];
      } else {
        widen(kraw[t], tile.kbuf.data() + t * D, D);
        widen(vraw[t], tile.vbuf.data() + t * D, D);
        krow[t] = tile.kbuf.data() + t * D;
        vrow[t] = tile.vbuf.data() + t * D;
      }
    }
    int64_t t = 0;
    for (; t + 4 <= b; t += 4) qk_keys<4>(tile.qt.data(), rows_pad, krow + t, D, tile.s.data(), t);
    for (; t < b; ++t) qk_keys<1>(tile.qt.data(), rows_pad, krow + t, D, tile.s.data(), t);
    softmax_block(tile.s.data(), rows_pad, b, t0, window, scale, tile.pos.data(), tile.m.data(), tile.l.data(),
                  tile.alpha.data());
    pv_block(tile.s.data(), rows_pad, vrow, b, tile.alpha.data(), tile.o.data(), D);
  }
  for (int64_t tok = 0; tok < tokens; ++tok)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t rho = tok * group + g;
      const float inv = 1.f / tile.l[rho];
      const float* src = tile.o.data() + rho * D;
      scalar_t* dst = op + (sq.row + it.t0 + tok) * o_s0 + (it.kvh * group + g) * o_s1;
      const fVec vinv(inv);
      int64_t d = 0;
      if constexpr (std::is_same_v<scalar_t, float>) {
        for (; d + kW <= D; d += kW) (fVec::loadu(src + d) * vinv).store(dst + d);
      } else {  // rounded to nearest even, as static_cast
        for (; d + 2 * kW <= D; d += 2 * kW)
          at::vec::convert_from_float<scalar_t>(fVec::loadu(src + d) * vinv, fVec::loadu(src + d + kW) * vinv)
              .store(dst + d);
      }
      for (; d < D; ++d) dst[d] = static_cast<scalar_t>(src[d] * inv);
    }
}

template <typename scalar_t>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const std::vector<Seq>& seqs,
         const int64_t* slots, int64_t window, double scale, bool allow_tiles, at::Tensor& out) {
  const int64_t heads = q.size(1), kv_heads = k_cache.size(1), D = q.size(2), group = heads / kv_heads;
  bool bf16_dot = false, tiles = false;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    bf16_dot = cpu_has_bf16_dot();
    tiles = bf16_dot && tiles_for(D, allow_tiles);
  }
#endif
  std::vector<Item> items;
  double total = 0;
  for (int64_t i = 0; i < static_cast<int64_t>(seqs.size()); ++i) {
    const Seq& sq = seqs[i];
    // A sequence whose K and V outgrow the caches takes tiles four times as tall: each K and V row
    // then comes from memory for four times the query rows.
    const bool tall = sq.ctx * kv_heads * D * 2 * static_cast<int64_t>(sizeof(scalar_t)) >= kTallTileBytes;
    const int64_t tile_tokens = (group == 1 ? 32 : 16) * (tall ? 4 : 1);
    for (int64_t t0 = 0; t0 < sq.nq; t0 += tile_tokens) {
      const int64_t t1 = std::min(sq.nq, t0 + tile_tokens);
      const int64_t last = sq.ctx - sq.nq + t1 - 1;
      const int64_t first_key = window > 0 ? std::max<int64_t>(0, sq.ctx - sq.nq + t0 - window + 1) : 0;
      const double cost = static_cast<double>((t1 - t0) * group) * static_cast<double>(last + 1 - first_key) * D;
      for (int64_t kvh = 0; kvh < kv_heads; ++kvh) {
        items.push_back({i, kvh, t0, t1, cost});
        total += cost;
      }
    }
  }
  // On the tile path, each sequence of several query tiles gets its V rows paired once for the
  // call (every tile of the sequence multiplies the same pairs) where it would pair them in every
  // tile, up to kValuePairsBytes for the call (kept per calling thread, from call to call); blocks
  // then start on multiples of 64 keys, which they do without a window.
  std::vector<const uint32_t*> value_pairs(seqs.size() * kv_heads, nullptr);
#if defined(__AVX512F__)
  if (tiles && window == 0) {
    thread_local std::vector<uint32_t> pairs_buf;
    // a KV head's pairs: one row of D words per two keys, the context rounded up to whole blocks
    auto head_words = [&](const Seq& sq) { return (sq.ctx + kTileKeys - 1) / kTileKeys * kTileKeys / 2 * D; };
    std::vector<int64_t> at(seqs.size(), -1);  // where each sequence's pairs begin, if it has them
    int64_t words = 0;
    for (int64_t i = 0; i < static_cast<int64_t>(seqs.size()); ++i) {
      const int64_t need = head_words(seqs[i]) * kv_heads;
      if (seqs[i].nq <= 16 || (words + need) * 4 > kValuePairsBytes) continue;
      at[i] = words;
      words += need;
    }
    if (words > 0) {
      if (static_cast<int64_t>(pairs_buf.size()) < words) pairs_buf.resize(words);
      std::vector<std::array<int64_t, 3>> blocks;  // (sequence, KV head, first key)
      for (int64_t i = 0; i < static_cast<int64_t>(seqs.size()); ++i) {
        if (at[i] < 0) continue;
        for (int64_t kvh = 0; kvh < kv_heads; ++kvh) {
          value_pairs[i * kv_heads + kvh] = pairs_buf.data() + at[i] + kvh * head_words(seqs[i]);
          for (int64_t t0 = 0; t0 < seqs[i].ctx; t0 += kTileKeys) blocks.push_back({i, kvh, t0});
        }
      }
      uint32_t* const buf = pairs_buf.data();  // this thread's buffer, filled by every thread of the team
      const auto* vb = reinterpret_cast<const at::BFloat16*>(v_cache.data_ptr<scalar_t>());
      std::atomic<int64_t> claim{0};
      const int64_t nb = static_cast<int64_t>(blocks.size());
      auto pair_up = [&](int64_t, int64_t) {
        const at::BFloat16* rows[kTileKeys];
        for (int64_t j = claim.fetch_add(1, std::memory_order_relaxed); j < nb;
             j = claim.fetch_add(1, std::memory_order_relaxed)) {
          const auto [i, kvh, t0] = blocks[j];
          const int64_t b = std::min(kTileKeys, seqs[i].ctx - t0);
          for (int64_t t = 0; t < b; ++t)
            rows[t] = vb + slots[seqs[i].first + t0 + t] * v_cache.stride(0) + kvh * v_cache.stride(1);
          pair_values(rows, b, kTileKeys / 2, D, buf + at[i] + kvh * head_words(seqs[i]) + t0 / 2 * D);
        }
      };
      if (total < kParallelMinWork)
        pair_up(0, 1);
      else
        at::parallel_for(0, at::get_num_threads(), 1, pair_up);
    }
  }
#endif
  // Largest first, one item a claim: a thread the OS takes off its core (the mesh's other
  // processes share the worker's cores) holds back one item while the others take the rest.
  const int64_t threads = total < kParallelMinWork ? 1 : std::min<int64_t>(at::get_num_threads(), items.size());
  std::vector<int64_t> order(items.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return items[a].cost > items[b].cost; });
  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(order.size());
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kp = k_cache.data_ptr<scalar_t>();
  const scalar_t* vp = v_cache.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const float fscale = static_cast<float>(scale);
  auto work = [&](int64_t, int64_t) {
    Tile tile;
#if defined(__AVX512F__)
    if (tiles) kvmesh::amx_start();
#endif
    for (int64_t k = next.fetch_add(1, std::memory_order_relaxed); k < n;
         k = next.fetch_add(1, std::memory_order_relaxed)) {
      const Item& it = items[order[k]];
      run_item<scalar_t>(it, seqs[it.seq], qp, q.stride(0), q.stride(1), kp, vp, k_cache.stride(0), k_cache.stride(1),
                         v_cache.stride(0), v_cache.stride(1), slots, group, D, window, fscale, bf16_dot, tiles,
                         value_pairs[it.seq * kv_heads + it.kvh], op, out.stride(0), out.stride(1), tile);
    }
#if defined(__AVX512F__)
    if (tiles) kvmesh::amx_end();
#endif
  };
  if (threads == 1)
    work(0, 1);
  else
    at::parallel_for(0, threads, 1, work);
}

void prefill_attention_(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& q_starts, const at::Tensor& q_counts, const at::Tensor& indptr,
                        const at::Tensor& slot_ids, int64_t window, double scale, at::Tensor out, bool tiles) {
  kvmesh::check_attention_tensors(q, k_cache, v_cache, out);
  TORCH_CHECK(q.size(2) % 16 == 0 && q.size(2) <= 512, "prefill_attention_: head size must be a multiple of 16 up to 512, got ", q.size(2));
  for (const at::Tensor* t : {&q_starts, &q_counts, &indptr, &slot_ids})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 1,
                "q_starts, q_counts, indptr and slot_ids must be contiguous int64 vectors");
  const int64_t n = q_starts.size(0);
  TORCH_CHECK(q_counts.size(0) == n && indptr.size(0) == n + 1, "one q_count per q_start, and n + 1 indptr entries");
  const int64_t* starts = q_starts.data_ptr<int64_t>();
  const int64_t* counts = q_counts.data_ptr<int64_t>();
  const int64_t* ptr = indptr.data_ptr<int64_t>();
  const int64_t* slots = slot_ids.data_ptr<int64_t>();
  // Reads go wherever the indices point: check them once per call.
  TORCH_CHECK(ptr[0] == 0 && ptr[n] == slot_ids.size(0), "indptr must span slot_ids");
  std::vector<Seq> seqs(n);
  for (int64_t s = 0; s < n; ++s) {
    const int64_t ctx = ptr[s + 1] - ptr[s];
    TORCH_CHECK(counts[s] >= 1 && counts[s] <= ctx, "a sequence's query count must be 1 .. its context length");
    TORCH_CHECK(starts[s] >= 0 && starts[s] + counts[s] <= q.size(0), "query rows out of range");
    seqs[s] = {starts[s], counts[s], ptr[s], ctx};
  }
  kvmesh::check_slots(slot_ids, k_cache, v_cache);
  TORCH_CHECK(window >= 0, "window must be 0 (none) or positive");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "prefill_attention_", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "prefill_attention_: float64 is not supported");
    } else {
      run<scalar_t>(q, k_cache, v_cache, seqs, slots, window, scale, tiles, out);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("prefill_attention_(Tensor q, Tensor k_cache, Tensor v_cache, Tensor q_starts, Tensor q_counts, "
        "Tensor indptr, Tensor slot_ids, int window, float scale, Tensor(a!) out, bool tiles=True) -> ()");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("prefill_attention_", prefill_attention_); }
