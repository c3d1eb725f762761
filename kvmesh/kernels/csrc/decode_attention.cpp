// Decode attention over a paged KV cache: one query token per sequence, every sequence in one call.
//
// torch's fused attention is called once per sequence and pays a fixed cost per call that is
// several times what one decode query's memory traffic needs; a step with 32 decoding sequences
// made 32 calls per layer. This kernel takes all decoding sequences of a step at once, reads each
// sequence's K and V in place through its slot list (no gather), and splits the work over
// chunks of up to kChunkTokens of a sequence's context (all KV heads of a slot's row together, so
// rows stream in order) or, with fewer chunks than twice the threads, (chunk, KV head) pairs, with
// ATen's thread pool. Softmax is in float32, as in SDPA. With AVX-512 and a head size that is a
// multiple of 16 (float32, bfloat16 and float16 alike), each K and V row is read once for all
// query heads of its GQA group, in one pass with an online softmax; 16 keys' scores are reduced
// together (`sum16`) and the weighted sum of V runs four accumulator sets, so neither waits on one
// instruction's latency;
// bfloat16 keys go straight into AVX512-BF16 dot products where the CPU has them (2026-12-01, 32
// sequences of 620 tokens, 12 heads over 4, head_dim 64, two threads: bfloat16 0.96 -> 0.63 ms
// per call, float32 1.63 -> 1.24 ms), and so do bfloat16 V rows, two tokens at a time against
// their weights rounded to bfloat16 (AMD EPYC Zen 4, one thread, 32 sequences of about 600
// tokens: 2.95-4.19 -> 2.33-3.44 ms per call over five alternated runs); that path now goes a page
// at a time, each token's K row once for every query head, the heads' softmax in vector lanes
// (heads_bf16_pages; Intel Xeon with AMX, 50 sequences of about 350 tokens: one thread 1.46-1.54
// -> 1.30-1.38 ms per call, two threads 0.79-0.89 -> 0.66-0.74). Without AVX512-BF16
// (Intel Skylake-SP to Ice Lake), bfloat16 rows are read as stored too, each 32-value load split
// into its even and odd values as float32 (split32) where they were widened into a float32 copy
// first (Intel Xeon, Ice Lake, one thread, 32 sequences: about 600 tokens 3.0-3.3 -> 2.2-2.3 ms
// per call, about 4,096 tokens 23.0 -> 16.3 ms). With AVX2 and FMA
// but no AVX-512 (AMD Zen 1-3, older Intel), the same one-pass algorithm in 8-lane vectors takes
// every head size `run` is compiled for (AMD EPYC, one thread, 32 sequences of 600 tokens, 12
// heads over 4 of 64: float32 11.5 -> 7.1 ms per call, bfloat16 10.7 -> 4.6 ms; the cheap model's
// 16-wide heads, 128 sequences, two threads: 3.1 -> 2.1 ms). The AVX-512 path prefetches the
// next block's rows into L2 while a block is computed (`Ahead`; Zen 4: float32 6.2 -> 3.9 ms,
// bfloat16 4.4 -> 2.2 ms per call). The AVX2 path now goes a page at a time, each token's K row
// once for every query head (heads_avx2: 1.4-1.5x less time per call on one thread than the
// per-head passes it replaced, 1.3-1.6x with 16-wide heads; AMD EPYC Zen 3, docs/benchmarks.md),
// and so does the AVX-512 float32 path (heads_f32_pages; AMD EPYC Zen 5, one thread, 53 sequences
// of about 330 tokens: 2.07-2.11 -> 1.33-1.42 ms per call) for models of eight query heads or more;
// the per-head block path (heads_avx512) is left to float32 models with fewer and to half
// precision without AVX512-BF16's dot products. A context past kChunkTokens is cut into chunks
// computed as items of their own and merged after (as flash-decoding does), so one long sequence
// streams whole rows on every thread where each thread read one KV head's piece of every row
// (AMD EPYC Zen 4, two threads, float32, one sequence of 32,768 tokens with the benchmark model's
// heads: 10.8 -> 4.4-4.7 ms a call; 8,192 tokens with 32 heads over 8 of 128: 9.0 -> 4.5-4.8).
// Sequences that share a prefix's pages (a cached system prompt) are computed together over those
// pages on the page-at-a-time AVX-512 paths (`shared_units`): each shared K and V row is read once
// for the query heads of every sequence that sees it, where each sequence read it again (from
// memory, once the step's other work had evicted it), with the bits each sequence has alone.
//
// Registered as torch.ops.kvmesh.decode_attention_ (writes into `out`).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "claims.h"
#include "paged_cache.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <unordered_map>
#include <vector>

namespace {

// Below this many K values per call (1 MB of K and V in float32, some tens of microseconds on
// one core) the work stays on the calling thread.
constexpr int64_t kParallelMinElements = 1 << 17;

// A sequence's context is cut into chunks of this many tokens (a multiple of every path's page and
// block), computed as separate items and merged (`run`). Contexts up to it are computed whole, as
// before the cut; 512 was no faster on two threads, and would cut the served workload's contexts.
constexpr int64_t kChunkTokens = 1024;

// Chunks of sequences that share a prefix's pages are computed together over this many slots or
// more (`run`'s units), cut at a multiple of kSharedRows: the page-at-a-time paths' page, so a
// member's own slots start on the page boundary they would alone.
constexpr int64_t kMinSharedTokens = 64;
// At most this many sequences in a unit: their query heads' queries and accumulators (48 KiB for
// eight of the benchmark model's twelve heads of 64 in float32) stay in L2 while the shared pages
// are read for them. Twelve layers' calls over sequences that share a 1,024-token prefix, with a
// layer's weights read between calls (`bench/shared_prefix_decode.py`; AMD EPYC Zen 4, one thread,
// float32, eight sequences; 32): 4 a unit 10.5-10.7 ms (35-36), 8 a unit 8.9-9.2 (33-35).
constexpr int64_t kMaxMembers = 8;
constexpr int64_t kSharedRows = 16;

// A page of a sequence's slots (up to `size` from `t0`) for the paths that go a page at a time,
// and the slots whose rows are fetched while it is computed: the next page's, or after the last
// page the next sequence's first (`next_slots`, null where this thread takes none).
struct Page {
  const int64_t* block;
  int64_t rows;
  const int64_t* ahead;
  int64_t ahead_rows;
};

inline Page page_at(const int64_t* slots, int64_t n, int64_t t0, int64_t size, const int64_t* next_slots,
                    int64_t next_n) {
  const bool last = t0 + size >= n;
  return {slots + t0, std::min(size, n - t0), last ? next_slots : slots + t0 + size,
          last ? (next_slots ? std::min(size, next_n) : 0) : std::min(size, n - t0 - size)};
}

// Each of nh query heads' K offset in a row (`group` heads per KV head, `heads` KV heads a member:
// the heads of several sequences that share the rows are stacked, member after member), and,
// where `fresh`, the online softmax's running max and sum before the first page, for `ld` lanes.
inline void start_heads(int64_t nh, int64_t ld, int64_t group, int64_t heads, int64_t k_s1, int64_t* koff, float* m,
                        float* sums, bool fresh = true) {
  for (int64_t h = 0; h < nh; ++h) koff[h] = ((h / group) % heads) * k_s1;
  if (fresh)
    for (int64_t h = 0; h < ld; ++h) m[h] = -std::numeric_limits<float>::infinity(), sums[h] = 0.f;
}

// How many vectors of a row the weighted sum of V keeps in registers at once (a divisor of the row's
// kVec, at most 8: AVX2 has 16 registers), and how many tokens it accumulates side by side, so that
// at least 8 independent FMA chains hide each FMA's latency (heads_avx2, heads_f32_pages).
constexpr int64_t chunk_of(int64_t vecs) {
  for (int64_t c = 8; c > 1; --c)
    if (vecs % c == 0) return c;
  return 1;
}

#if defined(__AVX512F__) || defined(__AVX2__)
// The steps of the float32 page-at-a-time paths that do not depend on how a page's scores were
// made, written once over a vector width `X` (Lanes16 for heads_f32_pages, Lanes8 for heads_avx2):
// a build has one of the two.

// `lines` cache lines from `p` into L2: every page-at-a-time path fetches a page's rows there, not
// into L1, which a page's rows and the next page's overrun or nearly do (see each path).
inline void prefetch_lines(const void* p, int64_t lines) {
  const char* c = static_cast<const char*>(p);
  for (int64_t l = 0; l < lines; ++l) _mm_prefetch(c + 64 * l, _MM_HINT_T1);
}

// The page's weights of heads [h0, h0 + X::kN), in place of their scores ([b][ld], the heads in
// the lanes): `m` and `sums` take the page in, and each head's rescale of its accumulator goes to
// `alpha` (X::kN values).
template <class X>
inline void page_weights(float* scores, int64_t ld, int64_t b, int64_t h0, float* m, float* sums, float* alpha) {
  using V = typename X::V;
  V top = X::set1(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < b; ++t) top = X::max(top, X::load(scores + t * ld + h0));
  const V m_old = X::load(m + h0), m_new = X::max(m_old, top);
  V total = X::zero();
  for (int64_t t = 0; t < b; ++t) {
    const V e = X::exp(X::sub(X::load(scores + t * ld + h0), m_new));
    X::store(scores + t * ld + h0, e);
    total = X::add(total, e);
  }
  const V a = X::exp(X::sub(m_old, m_new));  // ~0 on the first page (m = -inf)
  X::store(m + h0, m_new);
  X::store(sums + h0, X::add(X::mul(X::load(sums + h0), a), total));
  X::store(alpha, a);
}

// kHeads query heads of one KV head: each one's accumulator (`acc` + i * D, D = kVec * X::kN
// values), rescaled by `alpha[i]`, plus the page's V rows of the KV head (`vh`, the b slots of
// `block`, v_s0 apart) at the head's weights (`w[t * ld + i]`): kChunk vectors of the row at a
// time, in kSets accumulator sets over alternate tokens, so that at least eight FMA chains hide
// each FMA's latency. Each V row is loaded once for all kHeads heads; a head's sums are the same
// operations in the same order whatever kHeads, so its bits are too. kHeads * kSets * kChunk
// accumulators stay in registers (24 for three of the benchmark model's heads of 64 in 16 lanes).
template <class X, int64_t kVec, int64_t kHeads, typename scalar_t>
inline void add_values(float* acc, const float* alpha, const scalar_t* vh, const int64_t* block, int64_t b,
                       int64_t v_s0, const float* w, int64_t ld) {
  using V = typename X::V;
  constexpr int64_t kChunk = chunk_of(kVec);
  constexpr int64_t kSets = kChunk >= 8 ? 1 : (8 + kChunk - 1) / kChunk;
  constexpr int64_t D = kVec * X::kN;
  for (int64_t j0 = 0; j0 < kVec; j0 += kChunk) {
    V sets[kHeads][kSets][kChunk];
    for (int64_t i = 0; i < kHeads; ++i) {
      const V scale_acc = X::set1(alpha[i]);
      for (int64_t j = 0; j < kChunk; ++j) {
        sets[i][0][j] = X::mul(scale_acc, X::load(acc + i * D + X::kN * (j0 + j)));
        for (int64_t u = 1; u < kSets; ++u) sets[i][u][j] = X::zero();
      }
    }
    int64_t t = 0;
    for (; t + kSets <= b; t += kSets) {
      for (int64_t u = 0; u < kSets; ++u) {
        const scalar_t* value = vh + block[t + u] * v_s0 + X::kN * j0;
        V row[kChunk];
        for (int64_t j = 0; j < kChunk; ++j) row[j] = X::load(value + X::kN * j);
        for (int64_t i = 0; i < kHeads; ++i) {
          const V p = X::set1(w[(t + u) * ld + i]);
          for (int64_t j = 0; j < kChunk; ++j) sets[i][u][j] = X::fmadd(p, row[j], sets[i][u][j]);
        }
      }
    }
    for (; t < b; ++t) {
      const scalar_t* value = vh + block[t] * v_s0 + X::kN * j0;
      V row[kChunk];
      for (int64_t j = 0; j < kChunk; ++j) row[j] = X::load(value + X::kN * j);
      for (int64_t i = 0; i < kHeads; ++i) {
        const V p = X::set1(w[t * ld + i]);
        for (int64_t j = 0; j < kChunk; ++j) sets[i][0][j] = X::fmadd(p, row[j], sets[i][0][j]);
      }
    }
    for (int64_t i = 0; i < kHeads; ++i)
      for (int64_t j = 0; j < kChunk; ++j) {
        V total_j = sets[i][0][j];
        for (int64_t u = 1; u < kSets; ++u) total_j = X::add(total_j, sets[i][u][j]);
        X::store(acc + i * D + X::kN * (j0 + j), total_j);
      }
  }
}
#endif

#if defined(__AVX512F__)
// Prefetches the next block's K and V rows while this block is computed (the AVX-512 path), a few
// cache lines at each step of the block's work (each 16 keys' scores), whole rows in address
// order. Without it every block waited on memory first and computed after: a block's rows for one
// KV head are 256-byte pieces at the row's stride (1 KiB for the benchmark model), which the
// hardware prefetchers follow badly (read so, K and V arrive at about 15 GB/s on an AMD EPYC Zen 3
// core; whole rows in order, 21-24). The lines are spread over the block's steps rather than
// issued at its start: a burst of a thousand prefetches waits on the core's few miss buffers and
// gained nothing. `kHint` is the cache level: the AVX-512 path fetches into L2 (_MM_HINT_T1): a
// float32 block of the benchmark model's K and V is 64 KiB, twice an L1, and fetched into L1 it
// was evicted before use (AMD EPYC Zen 4, one thread, 32 sequences of about 600 tokens: into L1
// float32 6.2 -> 6.1 ms per call, bfloat16 4.4 -> 2.6; into L2 3.9 and 2.2).
template <int kHint>
struct Ahead {
  const char* k;
  const char* v;
  int64_t k_row_bytes, v_row_bytes;  // a slot's stride in the caches
  int64_t lines;                     // cache lines of one slot's K row (and V row) that the call reads
  const int64_t* slots = nullptr;    // the block to fetch: `rows` slots
  int64_t rows = 0, row = 0, line = 0;

  void start(const int64_t* block, int64_t n) {
    slots = block;
    rows = n;
    row = line = 0;
  }
  // `count` more lines: a row's K lines, then its V lines, then the next row's. The row's addresses
  // are computed once per visit, not once per line (a multiply and a load of the slot each):
  // that was a third of the AVX-512 bfloat16 path's instructions.
  inline void step(int64_t count) {
    while (count > 0 && row < rows) {
      const char* kr = k + slots[row] * k_row_bytes;
      const char* vr = v + slots[row] * v_row_bytes;
      const int64_t end = std::min(2 * lines, line + count);
      count -= end - line;
      for (; line < end && line < lines; ++line) _mm_prefetch(kr + 64 * line, static_cast<_mm_hint>(kHint));
      for (; line < end; ++line) _mm_prefetch(vr + 64 * (line - lines), static_cast<_mm_hint>(kHint));
      if (line == 2 * lines) line = 0, ++row;
    }
  }
};

#endif

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

// The 16 horizontal sums of x[0..15] as one vector (lane i = sum of x[i]'s lanes): a transpose
// and add in four levels, about 46 instructions, where 16 separate reductions take three times as
// many, each a chain of dependent shuffles. Scores of 16 keys come out of one call.
inline __m512 sum16(__m512* x) {
  __m512 y[8], z[4];
  for (int i = 0; i < 8; ++i)  // 256-bit halves folded: [x2i c0+c2, c1+c3, x2i+1 c0+c2, c1+c3]
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit chunk c holds 4 partial sums of x[4i + c]
    z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0xDD));
  const __m512 u0 = _mm512_add_ps(_mm512_unpacklo_ps(z[0], z[1]), _mm512_unpackhi_ps(z[0], z[1]));
  const __m512 u1 = _mm512_add_ps(_mm512_unpacklo_ps(z[2], z[3]), _mm512_unpackhi_ps(z[2], z[3]));
  const __m512 w = _mm512_add_ps(_mm512_shuffle_ps(u0, u1, 0x44), _mm512_shuffle_ps(u0, u1, 0xEE));
  // w's lane 4c + j is the sum of x[4j + c]: put lane i at x[i].
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, w);
}

// sum16's lanes 0..3 for x[0..3] alone (the rest of x zero), by sum16's own tree, so a head's sum
// has the same bits in a batch of four as in one of sixteen; the other lanes are 0. About 12
// instructions: the scores of the few query heads of one KV head's group (a call's work split by
// KV head) and a batch's last heads.
inline __m512 sum4(const __m512* x) {
  const __m512 zero = _mm512_setzero_ps();
  const __m512 y0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x44), _mm512_shuffle_f32x4(x[0], x[1], 0xEE));
  const __m512 y1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x44), _mm512_shuffle_f32x4(x[2], x[3], 0xEE));
  const __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, 0x88), _mm512_shuffle_f32x4(y0, y1, 0xDD));
  const __m512 u0 = _mm512_add_ps(_mm512_unpacklo_ps(z0, zero), _mm512_unpackhi_ps(z0, zero));
  const __m512 w = _mm512_add_ps(_mm512_shuffle_ps(u0, zero, 0x44), _mm512_shuffle_ps(u0, zero, 0xEE));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, w);
}

// 16 float32 lanes, for the shared page steps (page_weights, add_values).
struct Lanes16 {
  using V = __m512;
  static constexpr int64_t kN = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  template <typename scalar_t>
  static V load(const scalar_t* p) { return load16(p); }
  static void store(float* p, V x) { _mm512_storeu_ps(p, x); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V exp(V x) { return exp16(x); }
};

// Tokens per block of the online softmax: a block of K and V rows (32 x 128 float32 values is
// 16 KiB each) stays in L1/L2 while every query head of the group goes over it, so each row comes
// from memory once per group; the running max and the accumulators are rescaled once per block.
constexpr int64_t kBlock = 32;
constexpr int64_t kLanes = 16;  // float32 lanes of a vector: head sizes that are a multiple take this path

bool cpu_has_bf16_dot() {
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
}

// A block's bfloat16 V rows of one KV head, interleaved in pairs of tokens (t, t + 1) as
// `vdpbf16ps` takes them: for pair i and V vector j (values 32j..32j+31), `out[2 * (i * vecs32 + j)]`
// is unpacklo_epi16 of the two rows' vectors and the next one unpackhi. An odd block's last token is
// paired with itself (its partner's weight is 0). Done once per KV head and block, for all the
// query heads of its group (each head interleaved the rows itself before: 3x the shuffles).
__attribute__((target("avx512f,avx512bw"))) void interleave_v(const at::BFloat16* vh, const int64_t* block, int64_t b,
                                                               int64_t v_s0, int64_t vecs32, __m512i* out) {
  for (int64_t t = 0; t < b; t += 2) {
    const uint16_t* r0 = reinterpret_cast<const uint16_t*>(vh + block[t] * v_s0);
    const uint16_t* r1 = t + 1 < b ? reinterpret_cast<const uint16_t*>(vh + block[t + 1] * v_s0) : r0;
    __m512i* o = out + 2 * (t / 2) * vecs32;
    for (int64_t j = 0; j < vecs32; ++j) {
      const __m512i x0 = _mm512_loadu_si512(r0 + 32 * j), x1 = _mm512_loadu_si512(r1 + 32 * j);
      _mm512_storeu_si512(o + 2 * j, _mm512_unpacklo_epi16(x0, x1));
      _mm512_storeu_si512(o + 2 * j + 1, _mm512_unpackhi_epi16(x0, x1));
    }
  }
}

// The accumulators' pair order (heads_bf16_pages: for V vector j, values 32j..32j+31, `acc[32j + 4L + i]`
// holds value 32j + 8L + i and `acc[32j + 16 + 4L + i]` value 32j + 8L + 4 + i, L being the 128-bit
// lane, i < 4: unpacklo/hi_epi16's order) back to value order, for one head of D = 32 * vecs32 values.
void natural_order(float* acc, int64_t vecs32) {
  float tmp[32];
  for (int64_t j = 0; j < vecs32; ++j) {
    float* x = acc + 32 * j;
    for (int64_t L = 0; L < 4; ++L)
      for (int64_t i = 0; i < 4; ++i) {
        tmp[8 * L + i] = x[4 * L + i];
        tmp[8 * L + 4 + i] = x[16 + 4 * L + i];
      }
    std::memcpy(x, tmp, sizeof tmp);
  }
}

// bfloat16 values 2i and 2i + 1 share 32-bit lane i of a load, the first in its low half: shifted
// up, it is a float32 (the even values); masked, the high half is one too (the odd values). So a
// CPU without AVX512-BF16 reads bfloat16 K and V rows as stored, 32 values a load and one
// instruction per 16 of them, instead of widening each row into a float32 copy first; the dot
// products and the weighted sum of V run on the values in this split order (queries permuted to
// match, `split_query`), which a sum does not mind, and `split_to_natural` puts the output back.
inline void split32(const at::BFloat16* p, __m512& even, __m512& odd) {
  const __m512i x = _mm512_loadu_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// Float32 values 32j..32j+31 of `x` in split order: `even` gets values 32j + 2i, `odd` 32j + 2i + 1.
inline void split_query(const float* x, __m512& even, __m512& odd) {
  const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512 lo = _mm512_loadu_ps(x), hi = _mm512_loadu_ps(x + 16);
  even = _mm512_permutex2var_ps(lo, evens, hi);
  odd = _mm512_permutex2var_ps(lo, _mm512_add_epi32(evens, _mm512_set1_epi32(1)), hi);
}

// One head's accumulator (D = 32 * vecs32 floats) from split order (each 32 values as 16 even, 16
// odd) back to value order.
void split_to_natural(float* acc, int64_t vecs32) {
  float tmp[32];
  for (int64_t j = 0; j < vecs32; ++j) {
    float* x = acc + 32 * j;
    for (int64_t i = 0; i < 16; ++i) {
      tmp[2 * i] = x[i];
      tmp[2 * i + 1] = x[16 + i];
    }
    std::memcpy(x, tmp, sizeof tmp);
  }
}

// bfloat16 with AVX512-BF16, a page of slots at a time (kRowsBf16), as heads_avx2 goes:
// - scores: each token's K row is read once for every query head of the item, 16 heads' dot
//   products (`vdpbf16ps` on the rows as stored) reduced together by sum16 (a batch's last four
//   or fewer by sum4, the same tree), so the token's scores come out with the heads in the lanes
//   of one vector; meanwhile the next page's K and V rows (or the next sequence's first,
//   `next_slots`) are prefetched whole into L2 (a page of the benchmark model's rows is 16 KiB, so
//   this page's and the next's fill a 32 KiB L1; fetched into L1, rows from memory came 1.25-1.9x
//   slower: AMD EPYC Zen 4, 112 sequences of about 640 tokens, 73 MB of K and V, median wall time
//   a call, two threads 6.2-6.9 -> 4.0-5.0 ms, one thread 11.0-13.1 -> 6.0-6.9; in cache level.
//   The case measured when L1 was chosen, 37 MB, sat partly in the L3);
// - the online softmax in those lanes, 16 heads at a time, with no horizontal reduction, and each
//   pair of tokens' weights rounded to bfloat16 and packed as `vdpbf16ps` takes them (`wpair`);
// - the weighted sum of V, one KV head's rows interleaved in pairs once (interleave_v), then one
//   query head of its group at a time, its accumulators in registers over the page.
// heads_avx512 went a 32-slot block at a time, each query head over the block's keys on its own:
// its scores, reductions and softmax were done per head, and the K rows read once per head of
// the group (Intel Xeon with AMX, one thread, 50 sequences of about 350 tokens: 12.7 GB/s of K and
// V, where the float32 path reads 18.6; docs/benchmarks.md). A head's score is its own dot product
// summed by sum16's tree, the same in any batch of heads, so the bits do not depend on how a
// call's work was split among the threads. `q` points at the item's first query head (heads
// `q_s1` apart); `koff` (nh), `acc` ([nh][D]), `scores` ([kRowsBf16][ld]), `wpair`
// ([kRowsBf16 / 2][ld]), `alpha`, `m` and `sums` (ld) are scratch, ld being nh rounded up to 16;
// `vpairs` has room for a page's interleaved V rows of one KV head. On return acc[h] / sums[h] is
// query head h's output, in value order. With `members` > 1 the query heads of that many sequences
// that share these slots are stacked in q (member after member, `heads` KV heads each); without
// `fresh` the running max, sum and accumulators go on from what acc, m and sums hold; without
// `finish` acc stays in the pair order (natural_order puts it back), so that a later call can go on.
constexpr int64_t kRowsBf16 = 16;

// One pair of tokens' V values (interleave_v's `pv`, kN vectors) at the pair's weights (two
// bfloat16 in one 32-bit value) into `sum`.
template <int64_t kN>
__attribute__((target("avx512f,avx512bw,avx512bf16"), always_inline)) inline void add_pair(__m512* sum, uint32_t weights,
                                                                                           const __m512i* pv) {
  const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(weights));
#pragma GCC unroll 16
  for (int64_t j = 0; j < kN; ++j) sum[j] = _mm512_dpbf16_ps(sum[j], w, (__m512bh)_mm512_load_si512(pv + j));
}

template <int64_t kVec>
__attribute__((target("avx512f,avx512bw,avx512dq,avx512bf16"))) void heads_bf16_pages(
    const at::BFloat16* q, int64_t q_s1, const at::BFloat16* k, const at::BFloat16* v, int64_t k_s1, int64_t v_s1,
    const int64_t* slots, int64_t n, int64_t k_s0, int64_t v_s0, int64_t heads, int64_t group, float scale,
    float* acc, float* scores, uint32_t* wpair, float* alpha, float* m, float* sums, int64_t* koff,
    __m512i* vpairs, const int64_t* next_slots, int64_t next_n, int64_t members = 1, bool fresh = true,
    bool finish = true) {
  constexpr int64_t D = kVec * 16, kPairs32 = kVec / 2;  // a head row: kPairs32 vectors of 32 values
  constexpr int64_t B = kRowsBf16;
  const int64_t nh = members * heads * group, ld = (nh + 15) / 16 * 16;
  const int64_t lines = (heads * D * static_cast<int64_t>(sizeof(at::BFloat16)) + 63) / 64;  // of a K (or V) row
  start_heads(nh, ld, group, heads, k_s1, koff, m, sums, fresh);
  if (fresh)
    for (int64_t i = 0; i < nh * D; ++i) acc[i] = 0.f;
  const __m512 scale_v = _mm512_set1_ps(scale);
  for (int64_t t0 = 0; t0 < n; t0 += B) {
    const Page page = page_at(slots, n, t0, B, next_slots, next_n);
    const int64_t b = page.rows;
    const int64_t* block = page.block;
    for (int64_t t = 0; t < b; ++t) {
      if (t < page.ahead_rows) {
        prefetch_lines(k + page.ahead[t] * k_s0, lines);
        prefetch_lines(v + page.ahead[t] * v_s0, lines);
      }
      const at::BFloat16* krow = k + block[t] * k_s0;
      for (int64_t h0 = 0; h0 < ld; h0 += 16) {
        const int64_t hb = std::min<int64_t>(16, nh - h0);
        __m512 d[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) {
          if (i >= hb) {
            d[i] = _mm512_setzero_ps();
            continue;
          }
          const at::BFloat16* qh = q + (h0 + i) * q_s1;
          const at::BFloat16* kh = krow + koff[h0 + i];
          __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(qh),
                                        (__m512bh)_mm512_loadu_si512(kh));
#pragma GCC unroll 8
          for (int64_t j = 1; j < kPairs32; ++j)
            dot = _mm512_dpbf16_ps(dot, (__m512bh)_mm512_loadu_si512(qh + 32 * j),
                                   (__m512bh)_mm512_loadu_si512(kh + 32 * j));
          d[i] = dot;
        }
        _mm512_storeu_ps(scores + t * ld + h0, _mm512_mul_ps(hb <= 4 ? sum4(d) : sum16(d), scale_v));
      }
    }
    // The page's weights, 16 heads at a time; `m` and `sums` take the page in, `alpha` is each
    // head's rescale of its accumulator; pairs of tokens' weights rounded to bfloat16 into wpair
    // (an odd page's last token is paired with a weight of 0).
    for (int64_t h0 = 0; h0 < ld; h0 += 16) {
      __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      for (int64_t t = 0; t < b; ++t) top = _mm512_max_ps(top, _mm512_loadu_ps(scores + t * ld + h0));
      const __m512 m_old = _mm512_loadu_ps(m + h0), m_new = _mm512_max_ps(m_old, top);
      __m512 total = _mm512_setzero_ps();
      for (int64_t t = 0; t < b; t += 2) {
        const __m512 e0 = exp16(_mm512_sub_ps(_mm512_loadu_ps(scores + t * ld + h0), m_new));
        const __m512 e1 = t + 1 < b ? exp16(_mm512_sub_ps(_mm512_loadu_ps(scores + (t + 1) * ld + h0), m_new))
                                    : _mm512_setzero_ps();
        total = _mm512_add_ps(_mm512_add_ps(total, e0), e1);
        const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(e0));
        const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(e1));
        _mm512_storeu_si512(wpair + (t / 2) * ld + h0, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
      }
      const __m512 a = exp16(_mm512_sub_ps(m_old, m_new));  // ~0 on the first page (m = -inf)
      _mm512_storeu_ps(m + h0, m_new);
      _mm512_storeu_ps(sums + h0, _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(sums + h0), a), total));
      _mm512_storeu_ps(alpha + h0, a);
    }
    const int64_t pairs = (b + 1) / 2;
    for (int64_t kvh = 0; kvh < heads; ++kvh) {
      interleave_v(v + kvh * v_s1, block, b, v_s0, kPairs32, vpairs);
      for (int64_t member = 0; member < members; ++member)  // the KV head's query heads in every member
        for (int64_t g = 0; g < group; ++g) {
          const int64_t h = (member * heads + kvh) * group + g;
          float* ah = acc + h * D;
          __m512 av[2 * kPairs32], bv[2 * kPairs32];  // two sets, for alternate pairs of tokens
          const __m512 al = _mm512_set1_ps(alpha[h]);
#pragma GCC unroll 16
          for (int64_t j = 0; j < 2 * kPairs32; ++j) {
            av[j] = _mm512_mul_ps(al, _mm512_loadu_ps(ah + 16 * j));
            bv[j] = _mm512_setzero_ps();
          }
          int64_t i = 0;
          for (; i + 2 <= pairs; i += 2) {  // pairs 0, 2, 4, ... into av, 1, 3, ... into bv
            add_pair<2 * kPairs32>(av, wpair[i * ld + h], vpairs + 2 * i * kPairs32);
            add_pair<2 * kPairs32>(bv, wpair[(i + 1) * ld + h], vpairs + 2 * (i + 1) * kPairs32);
          }
          if (i < pairs) add_pair<2 * kPairs32>(av, wpair[i * ld + h], vpairs + 2 * i * kPairs32);
#pragma GCC unroll 16
          for (int64_t j = 0; j < 2 * kPairs32; ++j) _mm512_storeu_ps(ah + 16 * j, _mm512_add_ps(av[j], bv[j]));
        }
    }
  }
  if (finish)
    for (int64_t h = 0; h < nh; ++h) natural_order(acc + h * D, kPairs32);
}

// float32, a page of slots at a time (kRowsF32), as heads_avx2 goes in 8 lanes:
// - scores: each token's K row is read once, in address order, for every query head of the item,
//   16 heads' dot products reduced together by sum16 (a batch's last four or fewer by sum4, the
//   same tree; the token's scores come out with the heads in the lanes of one vector), while that
//   token's V row and the next page's K row (or the next sequence's first, `next_slots`) are
//   prefetched whole into L2: a page's float32 K and V rows of the benchmark model are 32 KiB, with
//   the next page's K as much as Zen 4's L1, and fetched into L1 they were evicted before use (AMD
//   EPYC Zen 4, two threads, 112 sequences of about 320 tokens: 7.3-7.8 -> 6.4-6.7 ms of CPU time
//   a call; a decode step of the engine at 112 rows 158-168 -> 148-150 ms);
// - the online softmax in those lanes, 16 heads at a time, with no horizontal reduction;
// - the weighted sum of V, up to three query heads of a KV head at a time over the page's rows (in
//   L1 or L2 by then), each row loaded once for them, kChunk vectors of the row at a time in kSets
//   accumulator sets (at least eight FMA chains); the scores likewise load a KV head's K row once
//   for the heads of its group. Each head loaded the rows itself before, with the same sums and so
//   the same bits: one thread, 32 sequences of about 160 tokens (in cache), 0.47 -> 0.36-0.37 ms of
//   CPU time a call; from memory (112 sequences of about 320 tokens, two threads) 3-4% less; AMD
//   EPYC Zen 4.
// heads_avx512 went a 32-slot block at a time, each query head over the block's keys on its own, a
// KV head's quarter of each row at a time (AMD EPYC Zen 5, one thread, 53 sequences of about 330
// tokens: 19.7 GB/s of K and V; docs/benchmarks.md). A head's score is its own dot product summed
// by sum16's tree, the same in any batch of heads, so the bits do not depend on how a call's work
// was split among the threads. `q` points at the item's first query head (heads `q_s1` apart,
// read as stored); `koff` (nh), `acc` ([nh][D]), `scores` ([kRowsF32][ld]), `alpha`, `m` and
// `sums` (ld) are scratch, ld being nh rounded up to 16. On return acc[h] / sums[h] is query head
// h's output. `members` and `fresh` as in heads_bf16_pages: several sequences' heads over slots they
// share, and going on from a state.
constexpr int64_t kRowsF32 = 16;
static_assert(kRowsF32 == kSharedRows && kRowsBf16 == kSharedRows, "shared units cut at the pages' boundary");
// Models with fewer query heads keep heads_avx512's per-head blocks in float32: with the heads in
// the lanes, a page's softmax costs a vector exp per token whatever the heads, and four heads of
// sixteen lanes (the cheap model's, head size 16) ran about 1.25x slower a call that way. The
// choice is by the model, not by a call's split of its work (whole sequences, or one KV head's
// group), so a head's bits do not depend on the split.
constexpr int64_t kPagesMinHeads = 8;

template <int64_t kVec>
void heads_f32_pages(const float* q, int64_t q_s1, const float* k, const float* v, int64_t k_s1, int64_t v_s1,
                     const int64_t* slots, int64_t n, int64_t k_s0, int64_t v_s0, int64_t heads, int64_t group,
                     float scale, float* acc, float* scores, float* alpha, float* m, float* sums, int64_t* koff,
                     const int64_t* next_slots, int64_t next_n, int64_t members = 1, bool fresh = true) {
  constexpr int64_t D = kVec * 16, B = kRowsF32;
  const int64_t nh = members * heads * group, ld = (nh + 15) / 16 * 16;
  const int64_t lines = (heads * D * static_cast<int64_t>(sizeof(float)) + 63) / 64;  // of a K (or V) row
  start_heads(nh, ld, group, heads, k_s1, koff, m, sums, fresh);
  if (fresh)
    for (int64_t i = 0; i < nh * D; ++i) acc[i] = 0.f;
  const __m512 scale_v = _mm512_set1_ps(scale);
  for (int64_t t0 = 0; t0 < n; t0 += B) {
    const Page page = page_at(slots, n, t0, B, next_slots, next_n);
    const int64_t b = page.rows;
    const int64_t* block = page.block;
    for (int64_t t = 0; t < b; ++t) {
      prefetch_lines(v + block[t] * v_s0, lines);
      if (t < page.ahead_rows) prefetch_lines(k + page.ahead[t] * k_s0, lines);
      const float* krow = k + block[t] * k_s0;
      for (int64_t h0 = 0; h0 < ld; h0 += 16) {
        const int64_t hb = std::min<int64_t>(16, nh - h0);
        __m512 d[16];
        __m512 kh[kVec];  // the KV head's K row, loaded once for the heads of its group
        int64_t loaded = -1;
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) {
          if (i >= hb) {
            d[i] = _mm512_setzero_ps();
            continue;
          }
          const float* qh = q + (h0 + i) * q_s1;
          if (koff[h0 + i] != loaded) {
            loaded = koff[h0 + i];
#pragma GCC unroll 16
            for (int64_t j = 0; j < kVec; ++j) kh[j] = _mm512_loadu_ps(krow + loaded + 16 * j);
          }
          __m512 dot = _mm512_mul_ps(_mm512_loadu_ps(qh), kh[0]);
#pragma GCC unroll 16
          for (int64_t j = 1; j < kVec; ++j) dot = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * j), kh[j], dot);
          d[i] = dot;
        }
        _mm512_storeu_ps(scores + t * ld + h0, _mm512_mul_ps(hb <= 4 ? sum4(d) : sum16(d), scale_v));
      }
    }
    for (int64_t h0 = 0; h0 < ld; h0 += 16) page_weights<Lanes16>(scores, ld, b, h0, m, sums, alpha + h0);
    // the query heads of each KV head over its V rows, up to three at once (the KV heads again for
    // each member)
    for (int64_t h = 0; h < nh;) {
      const int64_t together = std::min<int64_t>({group - h % group, nh - h, 3});
      const float* vh = v + ((h / group) % heads) * v_s1;
      if (together == 3)
        add_values<Lanes16, kVec, 3>(acc + h * D, alpha + h, vh, block, b, v_s0, scores + h, ld);
      else if (together == 2)
        add_values<Lanes16, kVec, 2>(acc + h * D, alpha + h, vh, block, b, v_s0, scores + h, ld);
      else
        add_values<Lanes16, kVec, 1>(acc + h * D, alpha + h, vh, block, b, v_s0, scores + h, ld);
      h += together;
    }
  }
}

// Half precision without AVX512-BF16's dot products, and float32 for models of fewer than eight
// query heads (heads_f32_pages takes the others; bfloat16 with AVX512-BF16 heads_bf16_pages): one
// sequence, KV heads [0, heads) of the pointers given: every query head of each KV head's GQA
// group, block by block over the context, with an online softmax in float32. Within a block the
// KV heads go one after another over the same rows, so a block's rows (all heads of a slot are
// contiguous) stream from memory once, in order, and are read again from cache. `qf` holds the
// queries in float32 ([heads][group][D]); `acc` ([heads][group][D]), `scores` ([group][kBlock]),
// `m` and `sums` ([heads][group]) are scratch; on return acc[h] / sums[h] is query head h's output.
template <typename scalar_t, int64_t kVec>
void heads_avx512(const float* qf, const scalar_t* k, const scalar_t* v, int64_t k_s1, int64_t v_s1,
                  const int64_t* slots, int64_t n, int64_t k_s0, int64_t v_s0, int64_t heads,
                  int64_t group, float scale, float* acc, float* scores, float* m, float* sums, float* kbuf,
                  float* vbuf, const int64_t* next_slots, int64_t next_n) {
  constexpr int64_t D = kVec * 16;
  constexpr bool kWide = std::is_same_v<scalar_t, float>;
  Ahead<_MM_HINT_T1> ahead{reinterpret_cast<const char*>(k), reinterpret_cast<const char*>(v),
              k_s0 * static_cast<int64_t>(sizeof(scalar_t)), v_s0 * static_cast<int64_t>(sizeof(scalar_t)),
              (heads * D * static_cast<int64_t>(sizeof(scalar_t)) + 63) / 64};
  // The next block's lines (then the next sequence's first block) are spread over this block's
  // chunks of 16 keys, one visit per query head.
  const int64_t visits = heads * group * (kBlock / 16);
  const int64_t per_visit = (2 * ahead.lines * kBlock + visits - 1) / visits;
  // bfloat16 rows of a head size that is a multiple of 32 are read in split order (split32) on a
  // CPU without AVX512-BF16 (with it they take heads_bf16_pages); other half-precision rows are
  // widened to float32 first.
  constexpr bool kSplit = std::is_same_v<scalar_t, at::BFloat16> && kVec % 2 == 0;
  for (int64_t h = 0; h < heads * group; ++h) {
    m[h] = -std::numeric_limits<float>::infinity();
    sums[h] = 0.f;
    for (int64_t d = 0; d < D; ++d) acc[h * D + d] = 0.f;
  }
  for (int64_t t0 = 0; t0 < n; t0 += kBlock) {
    const int64_t b = std::min(kBlock, n - t0);
    const int64_t* block = slots + t0;
    if (t0 + b < n)
      ahead.start(block + b, std::min(kBlock, n - t0 - b));
    else
      ahead.start(next_slots, next_slots ? std::min(kBlock, next_n) : 0);
    for (int64_t kvh = 0; kvh < heads; ++kvh) {
      const scalar_t* kh = k + kvh * k_s1;
      const scalar_t* vh = v + kvh * v_s1;
      if constexpr (!kWide && !kSplit) {  // half precision: widen the block's rows once, not once per query head
        for (int64_t t = 0; t < b; ++t) {
          const scalar_t* key = kh + block[t] * k_s0;
          const scalar_t* value = vh + block[t] * v_s0;
          for (int64_t j = 0; j < kVec; ++j) {
            _mm512_storeu_ps(kbuf + t * D + 16 * j, load16(key + 16 * j));
            _mm512_storeu_ps(vbuf + t * D + 16 * j, load16(value + 16 * j));
          }
        }
      }
      auto key_row = [&](int64_t t) -> const float* {
        if constexpr (kWide) return kh + block[t] * k_s0; else return kbuf + t * D;
      };
      auto value_row = [&](int64_t t) -> const float* {
        if constexpr (kWide) return vh + block[t] * v_s0; else return vbuf + t * D;
      };
      for (int64_t g = 0; g < group; ++g) {
        const int64_t h = kvh * group + g;
        __m512 qv[kVec], av[kVec];
        if constexpr (kSplit) {
          for (int64_t j = 0; j + 1 < kVec; j += 2) split_query(qf + h * D + 16 * j, qv[j], qv[j + 1]);
        } else {
          for (int64_t j = 0; j < kVec; ++j) qv[j] = _mm512_loadu_ps(qf + h * D + 16 * j);
        }
        float* sg = scores + g * kBlock;
        __m512 maxv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
        for (int64_t i0 = 0; i0 < b; i0 += 16) {  // 16 keys' dot products, summed together
          const int64_t c = std::min<int64_t>(16, b - i0);
          ahead.step(per_visit);
          __m512 dots[16];
          if constexpr (kSplit) {
            for (int64_t i = 0; i < 16; ++i) {
              if (i >= c) {
                dots[i] = _mm512_setzero_ps();
                continue;
              }
              const scalar_t* key = kh + block[i0 + i] * k_s0;
              __m512 even, odd;
              split32(key, even, odd);
              __m512 dot = _mm512_fmadd_ps(qv[1], odd, _mm512_mul_ps(qv[0], even));
              for (int64_t j = 2; j < kVec; j += 2) {
                split32(key + 16 * j, even, odd);
                dot = _mm512_fmadd_ps(qv[j + 1], odd, _mm512_fmadd_ps(qv[j], even, dot));
              }
              dots[i] = dot;
            }
          }
          for (int64_t i = 0; i < 16 && !kSplit; ++i) {
            if (i >= c) {
              dots[i] = _mm512_setzero_ps();
              continue;
            }
            const float* key = key_row(i0 + i);
            __m512 dot = _mm512_mul_ps(qv[0], _mm512_loadu_ps(key));
            for (int64_t j = 1; j < kVec; ++j) dot = _mm512_fmadd_ps(qv[j], _mm512_loadu_ps(key + 16 * j), dot);
            dots[i] = dot;
          }
          const __mmask16 lanes = c == 16 ? __mmask16(0xFFFF) : __mmask16((1u << c) - 1);
          const __m512 sc = _mm512_mul_ps(sum16(dots), _mm512_set1_ps(scale));
          _mm512_mask_storeu_ps(sg + i0, lanes, sc);
          maxv = _mm512_mask_max_ps(maxv, lanes, maxv, sc);
        }
        const float m_new = std::max(m[h], _mm512_reduce_max_ps(maxv));
        const float alpha = std::exp(m[h] - m_new);  // 0 on the first block (m = -inf)
        const __m512 mv = _mm512_set1_ps(m_new);
        __m512 sumv = _mm512_setzero_ps();
        for (int64_t t = 0; t < b; t += 16) {
          const __mmask16 lanes = b - t >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (b - t)) - 1);
          const __m512 e = _mm512_maskz_mov_ps(lanes, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, sg + t), mv)));
          _mm512_mask_storeu_ps(sg + t, lanes, e);
          sumv = _mm512_add_ps(sumv, e);
        }
        sums[h] = sums[h] * alpha + _mm512_reduce_add_ps(sumv);
        m[h] = m_new;
        // Four accumulator sets, one per token of four in turn: one set would wait on each FMA's
        // latency at every token.
        const __m512 a = _mm512_set1_ps(alpha);
        __m512 a1[kVec], a2[kVec], a3[kVec];
        for (int64_t j = 0; j < kVec; ++j) {
          av[j] = _mm512_mul_ps(a, _mm512_loadu_ps(acc + h * D + 16 * j));
          a1[j] = a2[j] = a3[j] = _mm512_setzero_ps();
        }
        int64_t t = 0;
        if constexpr (kSplit) {  // acc in split order: vector j even values, j + 1 odd, of values 16j..16j+31
          auto add_row = [&](int64_t token, __m512* sum) {
            const scalar_t* value = vh + block[token] * v_s0;
            const __m512 p = _mm512_set1_ps(sg[token]);
            for (int64_t j = 0; j < kVec; j += 2) {
              __m512 even, odd;
              split32(value + 16 * j, even, odd);
              sum[j] = _mm512_fmadd_ps(p, even, sum[j]);
              sum[j + 1] = _mm512_fmadd_ps(p, odd, sum[j + 1]);
            }
          };
          for (; t + 4 <= b; t += 4) {
            add_row(t, av);
            add_row(t + 1, a1);
            add_row(t + 2, a2);
            add_row(t + 3, a3);
          }
          for (; t < b; ++t) add_row(t, av);
          for (int64_t j = 0; j < kVec; ++j)
            _mm512_storeu_ps(acc + h * D + 16 * j, _mm512_add_ps(_mm512_add_ps(av[j], a1[j]), _mm512_add_ps(a2[j], a3[j])));
          continue;
        }
        for (; t + 4 <= b; t += 4) {
          const float *v0 = value_row(t), *v1 = value_row(t + 1), *v2 = value_row(t + 2), *v3 = value_row(t + 3);
          const __m512 p0 = _mm512_set1_ps(sg[t]), p1 = _mm512_set1_ps(sg[t + 1]);
          const __m512 p2 = _mm512_set1_ps(sg[t + 2]), p3 = _mm512_set1_ps(sg[t + 3]);
          for (int64_t j = 0; j < kVec; ++j) {
            av[j] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(v0 + 16 * j), av[j]);
            a1[j] = _mm512_fmadd_ps(p1, _mm512_loadu_ps(v1 + 16 * j), a1[j]);
            a2[j] = _mm512_fmadd_ps(p2, _mm512_loadu_ps(v2 + 16 * j), a2[j]);
            a3[j] = _mm512_fmadd_ps(p3, _mm512_loadu_ps(v3 + 16 * j), a3[j]);
          }
        }
        for (; t < b; ++t) {
          const float* value = value_row(t);
          const __m512 p = _mm512_set1_ps(sg[t]);
          for (int64_t j = 0; j < kVec; ++j) av[j] = _mm512_fmadd_ps(p, _mm512_loadu_ps(value + 16 * j), av[j]);
        }
        for (int64_t j = 0; j < kVec; ++j)
          _mm512_storeu_ps(acc + h * D + 16 * j, _mm512_add_ps(_mm512_add_ps(av[j], a1[j]), _mm512_add_ps(a2[j], a3[j])));
      }
    }
  }
  if constexpr (kSplit)
    for (int64_t h = 0; h < heads * group; ++h) split_to_natural(acc + h * D, kVec / 2);
}
#elif defined(__AVX2__)
// The same algorithm as heads_avx512 in 8-lane vectors, for CPUs with AVX2 and FMA but no
// AVX-512 (AMD Zen 1-3, Intel before Skylake-SP, most laptops): without it they took the portable
// path, a scalar exp per score and two passes over K and V (3.6 GB/s of K+V on an AMD EPYC core).

// 8 values as float32 lanes: float32 loaded as is, bfloat16 widened, float16 converted (F16C).
template <typename scalar_t>
inline __m256 load8(const scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return _mm256_loadu_ps(p);
  } else if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  } else {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
}

// exp of 8 float32 lanes, Cephes' expf as exp16 above; 2^n is built in the exponent bits, so the
// input is clamped to [-87.3, 88] (n within the normal range): softmax inputs are <= 0, and
// e^-87.3 (1e-38) is as good as 0 beside the block's largest term, which is 1.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n));
}

// The 8 horizontal sums of x[0..7] as one vector (lane i = sum of x[i]'s lanes): two levels of
// pairwise adds within 128-bit halves, then the halves added across.
inline __m256 sum8(const __m256* x) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(x[0], x[1]), _mm256_hadd_ps(x[2], x[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(x[4], x[5]), _mm256_hadd_ps(x[6], x[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

inline float reduce_add8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float reduce_max8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// 8 float32 lanes, for the shared page steps (page_weights, add_values).
struct Lanes8 {
  using V = __m256;
  static constexpr int64_t kN = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  template <typename scalar_t>
  static V load(const scalar_t* p) { return load8(p); }
  static void store(float* p, V x) { _mm256_storeu_ps(p, x); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V exp(V x) { return exp8(x); }
};

// Tokens per block of the online softmax: 16 slots (a page at the default page size), whose K and
// V rows (16 KiB each for the benchmark model in float32) stay in L1 while every query head goes
// over them.
constexpr int64_t kRowsAvx2 = 16;
constexpr int64_t kLanes = 8;  // float32 lanes of a vector: head sizes that are a multiple take this path

// The scores of HB query heads (queries D floats apart, from q) against one token's K row, the
// heads' K vectors at `koff` from the row, scaled, into out[0..HB): HB independent FMA chains
// over the row, then one horizontal reduction for all of them. Every batch size sums a head's
// lanes in one order: which batch a head falls in depends on how the call's work was split among
// the threads, and a team that changes size must not change a token or a logprob.
template <typename scalar_t, int64_t kVec, int HB>
__attribute__((always_inline)) inline void scores_of_row(const float* q, const scalar_t* krow, const int64_t* koff,
                                                         float scale, float* out) {
  constexpr int64_t D = kVec * 8;
  __m256 d[HB];
#pragma GCC unroll 8
  for (int i = 0; i < HB; ++i) d[i] = _mm256_mul_ps(_mm256_loadu_ps(q + i * D), load8(krow + koff[i]));
#pragma GCC unroll 32
  for (int64_t j = 1; j < kVec; ++j)
#pragma GCC unroll 8
    for (int i = 0; i < HB; ++i)
      d[i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + i * D + 8 * j), load8(krow + koff[i] + 8 * j), d[i]);
  if constexpr (HB == 8) {
    _mm256_storeu_ps(out, _mm256_mul_ps(sum8(d), _mm256_set1_ps(scale)));
  } else if constexpr (HB == 4) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(d[0], d[1]), _mm256_hadd_ps(d[2], d[3]));
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    _mm_storeu_ps(out, _mm_mul_ps(s, _mm_set1_ps(scale)));
  } else {  // the lanes summed in sum8's order, so a head's score is the same in any batch
    for (int i = 0; i < HB; ++i) {
      const __m256 pairs = _mm256_hadd_ps(d[i], d[i]), quads = _mm256_hadd_ps(pairs, pairs);
      out[i] = _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(quads), _mm256_extractf128_ps(quads, 1))) * scale;
    }
  }
}

// One sequence, KV heads [0, heads) and their `group` query heads each (nh = heads * group), a
// page of slots at a time (kRowsAvx2), with an online softmax in float32:
// - scores: each token's K row is read once, in address order, for every query head (batches of
//   eight heads, eight FMA chains), while that token's V row and the next block's K row (or the
//   next sequence's first, `next_slots`, on the same heads) are prefetched into L2, whole rows in
//   order (into L1 a page's float32 K and V rows and the next page's K, 48 KiB for the benchmark
//   model, were more than an L1: this build run on an AMD EPYC Zen 4, two threads, 73 MB of K and
//   V, float32 5.1-5.9 -> 3.6-4.3 ms a call (median; one outlier 7.1), bfloat16 5.7-6.5 -> 4.8-5.5;
//   in cache level; not measured on an AVX2-only CPU);
// - the block's weights, the heads in the lanes of `scores` ([kRowsAvx2][nh rounded up to 8]);
// - the weighted sum of V, one query head at a time over the block's rows (in L1 or L2 by then).
// Every query head's scores used to come from its own pass over the block's rows (eight keys side
// by side), a quarter of each row per KV head: AMD EPYC Zen 3, one thread, the benchmark model's
// heads (12 over 4 of 64, float32), rows in L2: 15-18 -> 26 GB/s of K and V; 64 sequences of about
// 1,200 tokens (157 MB, from memory): 8.7-9.6 -> 10.5-12 GB/s (docs/benchmarks.md).
// `qf` holds the queries in float32 ([nh][D]); `koff` (nh) and `acc` ([nh][D]) are scratch, `m`
// and `sums` have room for nh rounded up to 8; on return acc[h] / sums[h] is query head h's output.
template <typename scalar_t, int64_t kVec>
void heads_avx2(const float* qf, const scalar_t* k, const scalar_t* v, int64_t k_s1, int64_t v_s1,
                const int64_t* slots, int64_t n, int64_t k_s0, int64_t v_s0, int64_t heads, int64_t group, float scale,
                float* acc, float* scores, float* m, float* sums, int64_t* koff, const int64_t* next_slots,
                int64_t next_n) {
  constexpr int64_t D = kVec * 8;
  constexpr int64_t B = kRowsAvx2;
  const int64_t nh = heads * group, ld = (nh + 7) / 8 * 8;  // scores: [B][ld]
  const int64_t lines = (heads * D * static_cast<int64_t>(sizeof(scalar_t)) + 63) / 64;  // of a K (or V) row
  start_heads(nh, ld, group, heads, k_s1, koff, m, sums);
  for (int64_t t = 0; t < B; ++t)
    for (int64_t h = nh; h < ld; ++h) scores[t * ld + h] = 0.f;  // lanes past the heads stay finite
  for (int64_t i = 0; i < nh * D; ++i) acc[i] = 0.f;
  for (int64_t t0 = 0; t0 < n; t0 += B) {
    const Page page = page_at(slots, n, t0, B, next_slots, next_n);
    const int64_t b = page.rows;
    const int64_t* block = page.block;
    for (int64_t t = 0; t < b; ++t) {
      prefetch_lines(v + block[t] * v_s0, lines);
      if (t < page.ahead_rows) prefetch_lines(k + page.ahead[t] * k_s0, lines);
      const scalar_t* krow = k + block[t] * k_s0;
      float* st = scores + t * ld;
      int64_t h = 0;
      for (; h + 8 <= nh; h += 8) scores_of_row<scalar_t, kVec, 8>(qf + h * D, krow, koff + h, scale, st + h);
      for (; h + 4 <= nh; h += 4) scores_of_row<scalar_t, kVec, 4>(qf + h * D, krow, koff + h, scale, st + h);
      for (; h < nh; ++h) scores_of_row<scalar_t, kVec, 1>(qf + h * D, krow, koff + h, scale, st + h);
    }
    // The block's weights, eight heads at a time, then each of those heads' sum of V.
    alignas(32) float alpha[8];
    for (int64_t h0 = 0; h0 < ld; h0 += 8) {
      page_weights<Lanes8>(scores, ld, b, h0, m, sums, alpha);
      for (int64_t h = h0; h < std::min(h0 + 8, nh); ++h)
        add_values<Lanes8, kVec, 1>(acc + h * D, alpha + (h - h0), v + (h / group) * v_s1, block, b, v_s0, scores + h,
                                    ld);
    }
  }
}
#endif

// Whether a call of this type, head size and model's query heads goes a page at a time on AVX-512
// (heads_f32_pages, heads_bf16_pages): the paths that take shared units, so the item loop and the
// units ask the same question and a shared head goes the path it would go alone.
template <typename scalar_t, int64_t kHeadDim>
bool pages_path(int64_t heads) {
#if defined(__AVX512F__)
  if constexpr (kHeadDim > 0 && kHeadDim % 16 == 0) {
    if constexpr (std::is_same_v<scalar_t, float>) return heads >= kPagesMinHeads;
    if constexpr (std::is_same_v<scalar_t, at::BFloat16> && kHeadDim % 32 == 0 && kHeadDim <= 256)
      return cpu_has_bf16_dot();
  }
#endif
  (void)heads;
  return false;
}

// A chunk of a sequence's context: its sequence, its first slot's index in slot_ids, how many.
struct Span {
  int64_t seq, first, n;
};

// The chunks of every sequence (indptr `ptr`), in order: kChunkTokens each, the last shorter;
// sequence s's are [chunk_ptr[s], chunk_ptr[s + 1]).
std::vector<Span> cut_chunks(const int64_t* ptr, int64_t num_seqs, std::vector<int64_t>& chunk_ptr) {
  chunk_ptr.assign(num_seqs + 1, 0);
  for (int64_t s = 0; s < num_seqs; ++s)
    chunk_ptr[s + 1] = chunk_ptr[s] + (ptr[s + 1] - ptr[s] + kChunkTokens - 1) / kChunkTokens;
  std::vector<Span> spans(chunk_ptr[num_seqs]);
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int64_t c = chunk_ptr[s]; c < chunk_ptr[s + 1]; ++c) {
      const int64_t t0 = (c - chunk_ptr[s]) * kChunkTokens;
      spans[c] = Span{s, ptr[s] + t0, std::min(kChunkTokens, ptr[s + 1] - ptr[s] - t0)};
    }
  return spans;
}

// Chunks computed together: unit_chunks[first, first + members), the leader first, whose first
// `shared` slots are the same for every member (0 for a chunk alone).
struct Unit {
  int64_t first, members, shared;
};

// The units a call's chunks are computed in. Sequences that share a prefix's pages (a system
// prompt, a few-shot preamble) have chunks that begin with the same slots; where `can_share` (the
// page-at-a-time AVX-512 paths), a chunk joins the first chunk that begins with its first slot if
// the two agree on kMinSharedTokens slots or more, and the unit's shared slots are what all its
// members agree on with the leader, in whole pages (kSharedRows). Every other chunk is a unit of its
// own. Then units of more than `most` members, and while there are fewer than `min_units` the
// largest unit, are halved (halves share what the unit shared): a unit is one thread's work (split
// at most by KV head), so one unit of many sequences would leave the other threads idle.
void shared_units(const std::vector<Span>& spans, const int64_t* slots, bool can_share, int64_t most,
                  int64_t min_units, std::vector<int64_t>& unit_chunks, std::vector<Unit>& units) {
  const int64_t chunks = static_cast<int64_t>(spans.size());
  unit_chunks.clear(), units.clear();
  std::vector<std::vector<int64_t>> joined(can_share ? chunks : 0);
  std::vector<int64_t> agree(chunks, 0);
  std::vector<bool> member(chunks, false);
  if (can_share && chunks > 1) {
    std::unordered_map<int64_t, int64_t> by_first;  // first slot -> leader chunk
    for (int64_t c = 0; c < chunks; ++c) {
      const Span sp = spans[c];
      auto [it, fresh] = by_first.try_emplace(slots[sp.first], c);
      if (fresh) continue;
      const Span lead = spans[it->second];
      const int64_t overlap = std::min(sp.n, lead.n);
      int64_t same = 0;
      while (same < overlap && slots[sp.first + same] == slots[lead.first + same]) ++same;
      same = same / kSharedRows * kSharedRows;  // whole pages: a member's own slots keep their page boundaries
      if (same < kMinSharedTokens) continue;
      auto& j = joined[it->second];
      agree[it->second] = j.empty() ? same : std::min(agree[it->second], same);
      j.push_back(c), member[c] = true;
    }
  }
  for (int64_t c = 0; c < chunks; ++c) {
    if (member[c]) continue;
    const int64_t others = can_share ? static_cast<int64_t>(joined[c].size()) : 0;
    units.push_back({static_cast<int64_t>(unit_chunks.size()), 1 + others, agree[c]});
    unit_chunks.push_back(c);
    if (others) unit_chunks.insert(unit_chunks.end(), joined[c].begin(), joined[c].end());
  }
  while (!units.empty()) {
    const auto largest = std::max_element(units.begin(), units.end(),
                                          [](const Unit& a, const Unit& b) { return a.members < b.members; });
    if (largest->members < 2 || (largest->members <= most && static_cast<int64_t>(units.size()) >= min_units)) break;
    const int64_t half = largest->members / 2;
    const Unit rest{largest->first + half, largest->members - half, largest->members - half > 1 ? largest->shared : 0};
    largest->members = half;
    if (half < 2) largest->shared = 0;
    units.insert(largest + 1, rest);
  }
  // Each unit where its first member's chunk is: the halves of a large unit spread among the other
  // chunks, so that the threads' first claims (runs of units in this order) each take some of them.
  std::stable_sort(units.begin(), units.end(), [&](const Unit& a, const Unit& b) {
    return unit_chunks[a.first] < unit_chunks[b.first];
  });
}

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

  // A sequence longer than kChunkTokens is cut along its context into chunks of that many tokens
  // (the last may be shorter), each computed on its own, as flash-decoding does, and the chunks'
  // partial softmaxes are merged in chunk order after them. One long sequence then streams whole
  // rows on every thread instead of one KV head's piece of each row per thread. The cut depends on
  // the sequence's length alone, so its bits do not depend on the threads or on the batch.
  std::vector<int64_t> chunk_ptr;  // sequence s's chunks: [chunk_ptr[s], chunk_ptr[s + 1])
  const std::vector<Span> spans = cut_chunks(ptr, num_seqs, chunk_ptr);
  const int64_t chunks = chunk_ptr[num_seqs];
  // Each chunk's sequence, and where a chunk of a cut sequence keeps its partial result (-1: the
  // sequence's only chunk, written straight to the output).
  std::vector<int64_t> chunk_seq(chunks), part(chunks, -1);
  std::vector<int64_t> cut;  // the sequences that were cut
  int64_t parts = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const bool whole = chunk_ptr[s + 1] - chunk_ptr[s] == 1;
    if (!whole) cut.push_back(s);
    for (int64_t c = chunk_ptr[s]; c < chunk_ptr[s + 1]; ++c) chunk_seq[c] = s, part[c] = whole ? -1 : parts++;
  }
  // The partials: each query head's unnormalised output (head_dim values), running max and sum.
  thread_local std::vector<float> partials;
  partials.resize(parts * heads * (head_dim + 2));
  float* part_acc = partials.data();
  float* part_max = part_acc + parts * heads * head_dim;
  float* part_sum = part_max + parts * heads;

  // The units the chunks are computed in (`shared_units`).
  auto span = [&](int64_t c) { return spans[c]; };
  const bool can_share = pages_path<scalar_t, kHeadDim>(heads);
  std::vector<int64_t> unit_chunks;
  std::vector<Unit> units;
  // Units of at most kMaxMembers, and with several threads no more than an even share of the
  // chunks each (two claims a thread) and enough units for every thread where they split by KV head.
  const int64_t threads = at::get_num_threads();
  const int64_t most = threads > 1 ? std::min(kMaxMembers, std::max<int64_t>(2, chunks / (2 * threads))) : kMaxMembers;
  shared_units(spans, slots, can_share, most, threads > 1 ? (2 * threads + kv_heads - 1) / kv_heads : 1, unit_chunks,
               units);
  const int64_t num_units = static_cast<int64_t>(units.size());
  int64_t most_members = 1;
  for (const Unit& u : units) most_members = std::max(most_members, u.members);

  // Like torch's own kernels, stay on the calling thread when the work is small: a parallel region
  // costs more than a few thousand dot products, and idle pool threads spin on shared cores.
  // A work item is one unit with all its KV heads (its rows stream in order) when there are
  // enough units to share among the threads, or only one thread, else one (unit, KV head).
  // Every path computes a head the same whatever heads share its item.
  const int64_t key_elements = slot_ids.size(0) * kv_heads * head_dim;  // K (and V) values read
  const bool whole_rows = threads == 1 || num_units >= 2 * threads;
  const int64_t heads_per_item = whole_rows ? kv_heads : 1;
  const int64_t items_per_unit = kv_heads / heads_per_item;
  const int64_t work_items = num_units * items_per_unit;
  const int64_t grain = key_elements < kParallelMinElements ? std::max<int64_t>(work_items, 1) : 1;
  // Sequences differ in length, and a thread may be taken off its core: items go out in claims.
  struct Scratch {
    std::vector<float> qf, acc, sums, maxes, scores;
    std::vector<float> kbuf, vbuf;  // a block of K and V rows widened to float32 (AVX-512, half precision only)
    std::vector<int64_t> koff;      // each query head's K offset in a row (AVX2; AVX-512 float32, bfloat16)
    std::vector<uint32_t> wpair;    // pairs of tokens' weights in bfloat16 (AVX-512 bfloat16)
    std::vector<float> alpha;       // each head's rescale at a page (AVX-512 float32, bfloat16)
    std::vector<scalar_t> stacked;  // a shared unit's members' queries, member after member
    std::vector<float> own_acc, own_sums, own_maxes;  // a member's state over the rest of its chunk
  };
  auto scratch = [&] {
    Scratch st;
    st.qf.resize(kv_heads * group * head_dim), st.acc.resize(most_members * kv_heads * group * head_dim);
    // room for the heads (of every member of the largest unit) rounded up to 16 (the softmax of the
    // AVX2 path and of the AVX-512 float32 and bfloat16 paths takes 8 or 16 heads at a time)
    const int64_t ld = (most_members * kv_heads * group + 15) / 16 * 16;
    st.sums.resize(ld), st.maxes.resize(ld);
#if defined(__AVX512F__)
    if constexpr (!std::is_same_v<scalar_t, float>) st.kbuf.resize(kBlock * head_dim), st.vbuf.resize(kBlock * head_dim);
    if constexpr (std::is_same_v<scalar_t, at::BFloat16>)
      st.koff.resize(ld), st.wpair.resize(kRowsBf16 / 2 * ld), st.alpha.resize(ld);
    if constexpr (std::is_same_v<scalar_t, float>) st.koff.resize(ld), st.alpha.resize(ld);
#elif defined(__AVX2__)
    st.koff.resize(kv_heads * group);
#endif
    return st;
  };
  // A shared unit's KV heads [kv0, kv0 + heads_per_item): its shared slots for every member's query
  // heads at once, then each member's own rest (write_out as in the item loop below).
  auto shared_unit = [&](Scratch& st, const Unit& unit, int64_t kv0, auto& write_out) {
#if defined(__AVX512F__)
    if constexpr (kHeadDim > 0 && kHeadDim % 16 == 0) {
      const int64_t h0 = kv0 * group, nh = heads_per_item * group, D = head_dim;
      const int64_t members = unit.members, ld = (nh + 15) / 16 * 16;
      const int64_t* chunk = unit_chunks.data() + unit.first;
      st.stacked.resize(members * nh * D);
      for (int64_t i = 0; i < members; ++i) {
        const scalar_t* src = qp + rows[chunk_seq[chunk[i]]] * q_s0;
        for (int64_t h = 0; h < nh; ++h)
          std::copy(src + (h0 + h) * q_s1, src + (h0 + h) * q_s1 + D, st.stacked.data() + (i * nh + h) * D);
      }
      st.own_acc.resize(nh * D), st.own_sums.resize(ld), st.own_maxes.resize(ld);
      __m512i* vpairs =
          reinterpret_cast<__m512i*>((reinterpret_cast<uintptr_t>(st.vbuf.data()) + 63) & ~uintptr_t{63});
      // The page-at-a-time path over n slots for the query heads of m_count members (stacked in q,
      // q_s1_ apart), from a fresh state or from the one in a, mx and sm.
      auto pages = [&](const scalar_t* q, int64_t q_s1_, const int64_t* sl, int64_t n, int64_t m_count, bool fresh,
                       float* a, float* mx, float* sm) {
        if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
          st.scores.resize(kRowsBf16 * st.alpha.size());
          heads_bf16_pages<kHeadDim / 16>(q, q_s1_, kp + kv0 * k_s1, vp + kv0 * v_s1, k_s1, v_s1, sl, n, k_s0, v_s0,
                                          heads_per_item, group, fscale, a, st.scores.data(), st.wpair.data(),
                                          st.alpha.data(), mx, sm, st.koff.data(), vpairs, nullptr, 0, m_count,
                                          fresh, /*finish=*/false);
        } else if constexpr (std::is_same_v<scalar_t, float>) {
          st.scores.resize(kRowsF32 * st.alpha.size());
          heads_f32_pages<kHeadDim / 16>(q, q_s1_, kp + kv0 * k_s1, vp + kv0 * v_s1, k_s1, v_s1, sl, n, k_s0, v_s0,
                                         heads_per_item, group, fscale, a, st.scores.data(), st.alpha.data(), mx, sm,
                                         st.koff.data(), nullptr, 0, m_count, fresh);
        }
      };
      pages(st.stacked.data(), D, slots + span(chunk[0]).first, unit.shared, members, true, st.acc.data(),
            st.maxes.data(), st.sums.data());
      for (int64_t i = 0; i < members; ++i) {
        const Span sp = span(chunk[i]);
        float *a = st.acc.data() + i * nh * D, *mx = st.maxes.data() + i * nh, *sm = st.sums.data() + i * nh;
        if (sp.n > unit.shared) {  // the member's own slots, from where the shared ones left its heads
          std::copy(a, a + nh * D, st.own_acc.data());
          std::copy(mx, mx + nh, st.own_maxes.data()), std::copy(sm, sm + nh, st.own_sums.data());
          std::fill(st.own_maxes.begin() + nh, st.own_maxes.end(), -std::numeric_limits<float>::infinity());
          std::fill(st.own_sums.begin() + nh, st.own_sums.end(), 0.f);
          a = st.own_acc.data(), mx = st.own_maxes.data(), sm = st.own_sums.data();
          pages(qp + rows[sp.seq] * q_s0 + h0 * q_s1, q_s1, slots + sp.first + unit.shared, sp.n - unit.shared, 1,
                false, a, mx, sm);
        }
        if constexpr (std::is_same_v<scalar_t, at::BFloat16>)
          for (int64_t h = 0; h < nh; ++h) natural_order(a + h * D, kHeadDim / 32);
        write_out(h0, nh, chunk[i], a, mx, sm);
      }
    }
#endif
  };
  kvmesh::parallel_claims(work_items, grain, scratch, [&](Scratch& st, int64_t begin, int64_t end) {
    auto &qf = st.qf, &acc = st.acc, &sums = st.sums, &maxes = st.maxes, &scores = st.scores;
    // query heads [h0, h0 + nh) of chunk c, a[h] / s[h] with running mx[h] (by default the
    // scratch's): into the output where the chunk is its sequence's only one, else into the chunk's
    // partials
    auto write_out = [&](int64_t h0, int64_t nh, int64_t c, const float* a = nullptr, const float* mx = nullptr,
                         const float* s = nullptr) {
      if (!a) a = acc.data(), mx = maxes.data(), s = sums.data();
      if (part[c] >= 0) {
        const int64_t at = part[c] * heads + h0;
        std::copy(a, a + nh * head_dim, part_acc + at * head_dim);
        std::copy(mx, mx + nh, part_max + at);
        std::copy(s, s + nh, part_sum + at);
        return;
      }
      const int64_t row = rows[chunk_seq[c]];
      for (int64_t h = 0; h < nh; ++h) {
        scalar_t* dst = op + row * o_s0 + (h0 + h) * o_s1;
        const float inv = 1.f / s[h];
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(a[h * head_dim + d] * inv);
      }
    };
    for (int64_t work = begin; work < end; ++work) {
      const Unit& unit = units[work / items_per_unit];
      const int64_t c = unit_chunks[unit.first], kv0 = (work % items_per_unit) * heads_per_item;
#if defined(__AVX512F__)
      if constexpr (kHeadDim > 0 && kHeadDim % 16 == 0) {
        if (unit.members > 1) {
          shared_unit(st, unit, kv0, write_out);
          continue;
        }
      }
#endif
      const Span here = span(c);
      const int64_t row = rows[here.seq], first = here.first, n = here.n;
#if defined(__AVX512F__) || defined(__AVX2__)
      if constexpr (kHeadDim > 0 && kHeadDim % kLanes == 0) {
        const int64_t h0 = kv0 * group, nh = heads_per_item * group;  // query heads [h0, h0 + nh)
        // The next chunk this thread takes (the same sequence's next, or the next sequence's first)
        // reads the same heads' pointers where items are whole rows: its first rows are fetched ahead.
        const bool next = whole_rows && work + 1 < end;
        const Span after = next ? span(unit_chunks[units[(work + 1) / items_per_unit].first]) : Span{0, 0, 0};
        const int64_t* next_slots = next ? slots + after.first : nullptr;
#if defined(__AVX512F__)
        if constexpr (std::is_same_v<scalar_t, at::BFloat16> && kHeadDim % 32 == 0 && kHeadDim <= 256) {
          if (pages_path<scalar_t, kHeadDim>(heads)) {
            scores.resize(kRowsBf16 * st.alpha.size());
            // interleave_v's pairs, on a cache line boundary, in vbuf (a page of one KV head's V
            // rows takes a quarter of it)
            __m512i* vpairs =
                reinterpret_cast<__m512i*>((reinterpret_cast<uintptr_t>(st.vbuf.data()) + 63) & ~uintptr_t{63});
            heads_bf16_pages<kHeadDim / 16>(qp + row * q_s0 + h0 * q_s1, q_s1, kp + kv0 * k_s1, vp + kv0 * v_s1, k_s1,
                                            v_s1, slots + first, n, k_s0, v_s0, heads_per_item, group, fscale,
                                            acc.data(), scores.data(), st.wpair.data(), st.alpha.data(),
                                            maxes.data(), sums.data(), st.koff.data(), vpairs,
                                            next_slots, after.n);
            write_out(h0, nh, c);
            continue;
          }
        }
        if constexpr (std::is_same_v<scalar_t, float>) {
          if (pages_path<scalar_t, kHeadDim>(heads)) {
            scores.resize(kRowsF32 * st.alpha.size());
            heads_f32_pages<kHeadDim / 16>(qp + row * q_s0 + h0 * q_s1, q_s1, kp + kv0 * k_s1, vp + kv0 * v_s1, k_s1,
                                           v_s1, slots + first, n, k_s0, v_s0, heads_per_item, group, fscale,
                                           acc.data(), scores.data(), st.alpha.data(), maxes.data(), sums.data(),
                                           st.koff.data(), next_slots, after.n);
            write_out(h0, nh, c);
            continue;
          }
        }
#endif
        for (int64_t h = 0; h < nh; ++h) {  // the queries in float32 (the pages paths read them as stored)
          const scalar_t* src = qp + row * q_s0 + (h0 + h) * q_s1;
          for (int64_t d = 0; d < head_dim; ++d) qf[h * head_dim + d] = static_cast<float>(src[d]);
        }
#if defined(__AVX512F__)
        scores.resize(group * kBlock);
        heads_avx512<scalar_t, kHeadDim / 16>(qf.data(), kp + kv0 * k_s1, vp + kv0 * v_s1, k_s1, v_s1, slots + first, n,
                                              k_s0, v_s0, heads_per_item, group, fscale, acc.data(), scores.data(),
                                              maxes.data(), sums.data(), st.kbuf.data(), st.vbuf.data(),
                                              next_slots, after.n);
#else
        scores.resize(kRowsAvx2 * ((nh + 7) / 8 * 8));
        heads_avx2<scalar_t, kHeadDim / 8>(qf.data(), kp + kv0 * k_s1, vp + kv0 * v_s1, k_s1, v_s1, slots + first, n,
                                           k_s0, v_s0, heads_per_item, group, fscale, acc.data(), scores.data(),
                                           maxes.data(), sums.data(), st.koff.data(),
                                           next_slots, after.n);
#endif
        write_out(h0, nh, c);
        continue;
      }
#endif
      // The portable path, one KV head at a time.
      for (int64_t kvh = kv0; kvh < kv0 + heads_per_item; ++kvh) {
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
          sums[g] = sum, maxes[g] = m;
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
        write_out(kvh * group, group, c);
      }
    }
  });

  // Each cut sequence's heads: its chunks' partials rescaled to their largest max and summed in
  // chunk order.
  const int64_t merges = static_cast<int64_t>(cut.size()) * heads;
  const int64_t merge_grain = parts * heads * head_dim < kParallelMinElements ? std::max<int64_t>(merges, 1) : 1;
  at::parallel_for(0, merges, merge_grain, [&](int64_t begin, int64_t end) {
    std::vector<float> total(head_dim);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t s = cut[i / heads], h = i % heads;
      const int64_t p0 = part[chunk_ptr[s]], p1 = p0 + chunk_ptr[s + 1] - chunk_ptr[s];
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t p = p0; p < p1; ++p) top = std::max(top, part_max[p * heads + h]);
      float sum = 0.f;
      std::fill(total.begin(), total.end(), 0.f);
      for (int64_t p = p0; p < p1; ++p) {
        const float w = std::exp(part_max[p * heads + h] - top);
        sum += w * part_sum[p * heads + h];
        const float* a = part_acc + (p * heads + h) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) total[d] += w * a[d];
      }
      scalar_t* dst = op + rows[s] * o_s0 + h * o_s1;
      const float inv = 1.f / sum;
      for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(total[d] * inv);
    }
  });
}

void decode_attention_(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& q_rows, const at::Tensor& indptr, const at::Tensor& slot_ids, double scale,
                       at::Tensor out) {
  kvmesh::check_attention_tensors(q, k_cache, v_cache, out);
  TORCH_CHECK(q_rows.scalar_type() == at::kLong && indptr.scalar_type() == at::kLong &&
                  slot_ids.scalar_type() == at::kLong && q_rows.is_contiguous() && indptr.is_contiguous() &&
                  slot_ids.is_contiguous(),
              "q_rows, indptr and slot_ids must be contiguous int64");
  TORCH_CHECK(indptr.size(0) == q_rows.size(0) + 1, "indptr must have one more entry than q_rows");
  {  // Reads go wherever the indices point: check them once per call (microseconds).
    const int64_t* ptr = indptr.data_ptr<int64_t>();
    const int64_t* rows = q_rows.data_ptr<int64_t>();
    TORCH_CHECK(ptr[0] == 0 && ptr[q_rows.size(0)] == slot_ids.size(0), "indptr must span slot_ids");
    for (int64_t s = 0; s < q_rows.size(0); ++s) {
      TORCH_CHECK(ptr[s + 1] > ptr[s], "every sequence must see at least one slot");
      TORCH_CHECK(rows[s] >= 0 && rows[s] < q.size(0) && rows[s] < out.size(0), "q_rows out of range");
    }
  }
  kvmesh::check_slots(slot_ids, k_cache, v_cache);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention_", [&] {
    switch (q.size(2)) {
      case 16: run<scalar_t, 16>(q, k_cache, v_cache, q_rows, indptr, slot_ids, scale, out); break;
      case 24: run<scalar_t, 24>(q, k_cache, v_cache, q_rows, indptr, slot_ids, scale, out); break;
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

// The units decode_attention_ computes a call's chunks in where sharing applies (float32 models of
// eight query heads or more, bfloat16 with AVX512-BF16; head sizes that are multiples of 16 or 32 on
// AVX-512): for each chunk, in order of sequence then position, its unit's index, member count and
// shared slots, with units of more than `most` members halved, and the largest halved until there
// are `min_units` (the kernel asks for kMaxMembers, 8, and less with several threads, so that they
// all have work). For tests and benchmarks: what the kernel finds to share in a step.
at::Tensor decode_shared_units(const at::Tensor& indptr, const at::Tensor& slot_ids, int64_t most, int64_t min_units) {
  TORCH_CHECK(indptr.scalar_type() == at::kLong && slot_ids.scalar_type() == at::kLong && indptr.is_contiguous() &&
                  slot_ids.is_contiguous() && indptr.dim() == 1 && indptr.size(0) >= 1,
              "indptr and slot_ids must be contiguous int64");
  const int64_t* ptr = indptr.data_ptr<int64_t>();
  const int64_t num_seqs = indptr.size(0) - 1;
  TORCH_CHECK(ptr[0] == 0 && ptr[num_seqs] == slot_ids.size(0), "indptr must span slot_ids");
  for (int64_t s = 0; s < num_seqs; ++s) TORCH_CHECK(ptr[s + 1] > ptr[s], "every sequence must see at least one slot");
  std::vector<int64_t> chunk_ptr, unit_chunks;
  std::vector<Unit> units;
  const std::vector<Span> spans = cut_chunks(ptr, num_seqs, chunk_ptr);
  shared_units(spans, slot_ids.data_ptr<int64_t>(), true, most, min_units, unit_chunks, units);
  at::Tensor out = at::empty({static_cast<int64_t>(spans.size()), 3}, indptr.options());
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t u = 0; u < static_cast<int64_t>(units.size()); ++u)
    for (int64_t i = 0; i < units[u].members; ++i) {
      int64_t* row = o + 3 * unit_chunks[units[u].first + i];
      row[0] = u, row[1] = units[u].members, row[2] = units[u].shared;
    }
  return out;
}

}  // namespace

TORCH_LIBRARY(kvmesh, m) {
  m.def("decode_shared_units(Tensor indptr, Tensor slot_ids, int most=8, int min_units=1) -> Tensor");
  m.def("decode_attention_(Tensor q, Tensor k_cache, Tensor v_cache, Tensor q_rows, Tensor indptr, Tensor slot_ids, "
        "float scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) {
  m.impl("decode_attention_", decode_attention_);
  m.impl("decode_shared_units", decode_shared_units);
}
