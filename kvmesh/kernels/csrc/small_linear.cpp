// Matrix products for few rows (decode steps): y = x @ W.T (+ bias) (+ residual), with W in a
// layout read once, front to back, at the memory's speed.
//
// With few rows a product is bound by reading the weights, and oneDNN's kernels read them well
// below the memory's rate when they are not in cache, as in a model's pass, where each layer's
// weights were evicted by the others (AMD EPYC Zen 4, two threads, the benchmark model's twelve
// layers in turn, bench/linear_rows.py: bfloat16 at 14-17 GB/s for one row, 5-9.5 GB/s for 32;
// float32 15-20 GB/s for one row; this kernel 23-29 and 25-32). Here W is packed at load into
// blocks of 32 output columns (16 in the AVX2 path below), each block's values in the
// order the kernel reads them (float32: `[N/32][K][32]`; bfloat16: `[N/32][K/2][32][2]`, the pairs
// `vdpbf16ps` multiplies), so a thread streams its blocks front to back while prefetching the
// block after next into L2, and a tile of up to 12 rows keeps 24 accumulators in registers:
// every value of W is read once from memory per call, and again from L2 for each further tile.
// Each output value is summed in one order (K ascending, in pairs for bfloat16) whatever the
// number of rows. Past about 48 rows oneDNN's AVX-512 kernels are as fast or faster
// (kernels/linear.py sends them the rest); oneDNN's AVX2 kernels were slower than the AVX2 build
// at every row count, so on those CPUs this kernel takes every product (kernels/linear.py).
// bfloat16 needs AVX512-BF16 (the caller checks); the products are exact in float32, summed in
// float32, rounded to bfloat16 once at the end (after the bias and the residual, as oneDNN's
// fused add does). Where the CPU has AMX, bfloat16 goes on its tile units instead (run_amx).
// Where it has neither, a bfloat16 model multiplies in float32 (kernels/linear.py), and the
// kernel takes float32 rows against the bfloat16 layout (AVX-512 and AVX2 builds): each pair row
// is widened in registers (shifts, or a shift and a mask: bfloat16 is float32's upper half), so a
// decode step reads half the bytes of a float32 copy, and the sums are the float32 path's bit for
// bit (the same products of the same values, in the same order).
//
// Registered as torch.ops.kvmesh.small_linear (AVX-512 and AVX2 builds; the caller checks).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "amx.h"
#include "claims.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>


namespace {

// The output of one tile: where it goes and what is added before the store.
template <typename scalar_t>
struct Epilogue {
  int64_t valid;             // real columns of the block (the last block may be padded)
  const float* bias;         // the block's bias values, or null
  const scalar_t* residual;  // the tile's first row of the residual, or null
  int64_t ld;                // row stride of the residual and the output (out_features)
  scalar_t* out;             // the tile's first row of the output
};

#if defined(__AVX512F__)
constexpr int64_t kCols = 32;  // output columns per block: two vectors of 16 float32 lanes
constexpr int64_t kTile = 12;  // rows per tile: 24 accumulators, the weights' two vectors, a broadcast

// The tile's results (rows x 32 columns, `valid` of them real) plus bias and residual, stored in
// out's dtype.
template <typename scalar_t>
__attribute__((always_inline)) inline void store_tile(const __m512* acc, int rows, int64_t valid, const float* bias, const scalar_t* residual,
                       int64_t ld, scalar_t* out) {
  const __mmask16 m0 = valid >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
  const __mmask16 m1 = valid >= 32 ? __mmask16(0xFFFF) : valid <= 16 ? __mmask16(0) : __mmask16((1u << (valid - 16)) - 1);
  const __mmask16 mask[2] = {m0, m1};
#pragma GCC unroll 12
  for (int r = 0; r < rows; ++r) {
    for (int h = 0; h < 2; ++h) {
      __m512 y = acc[2 * r + h];
      if (bias) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(mask[h], bias + 16 * h));
      if constexpr (std::is_same_v<scalar_t, float>) {
        if (residual) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(mask[h], residual + r * ld + 16 * h));
        _mm512_mask_storeu_ps(out + r * ld + 16 * h, mask[h], y);
      } else {
        if (residual) {
          const __m256i raw = _mm256_maskz_loadu_epi16(mask[h], residual + r * ld + 16 * h);
          y = _mm512_add_ps(y, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)));
        }
        // round to nearest even, as torch's float -> bfloat16
        const __m512i bits = _mm512_castps_si512(y);
        const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
        const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
        const __mmask16 nan = _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q);
        const __m512i value = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC00000));  // torch's NaN
        _mm256_mask_storeu_epi16(out + r * ld + 16 * h, mask[h], _mm512_cvtepi32_epi16(_mm512_srli_epi32(value, 16)));
      }
    }
  }
}

// R rows of x (float32, row stride K) against one float32 block (K x 32), prefetching `pf`'s block.
// The accumulators are this function's own: passed in from outside, GCC kept them in memory.
template <int R>
inline void tile_f32(const float* x, int64_t K, const float* w, const char* pf, const Epilogue<float>& e) {
  __m512 acc[2 * R];
#pragma GCC unroll 24
  for (int r = 0; r < 2 * R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 w0 = _mm512_loadu_ps(w + kCols * k);
    const __m512 w1 = _mm512_loadu_ps(w + kCols * k + 16);
    _mm_prefetch(pf + 128 * k, _MM_HINT_T1);
    _mm_prefetch(pf + 128 * k + 64, _MM_HINT_T1);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * K + k]);
      acc[2 * r] = _mm512_fmadd_ps(xb, w0, acc[2 * r]);
      acc[2 * r + 1] = _mm512_fmadd_ps(xb, w1, acc[2 * r + 1]);
    }
  }
  store_tile<float>(acc, R, e.valid, e.bias, e.residual, e.ld, e.out);
}

// R rows of x (bfloat16, row stride K, K even) against one bfloat16 block (K/2 x 32 pairs).
template <int R>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) inline void tile_bf16(const at::BFloat16* x, int64_t K,
                                                                               const at::BFloat16* w, const char* pf,
                                                                               const Epilogue<at::BFloat16>& e) {
  __m512 acc[2 * R];
#pragma GCC unroll 24
  for (int r = 0; r < 2 * R; ++r) acc[r] = _mm512_setzero_ps();
  const int32_t* xp = reinterpret_cast<const int32_t*>(x);  // a pair of bfloat16 values as one 32-bit lane
  const int64_t ld = K / 2;
  for (int64_t p = 0; p < ld; ++p) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + 2 * kCols * p);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + 2 * kCols * p + 32);
    _mm_prefetch(pf + 128 * p, _MM_HINT_T1);
    _mm_prefetch(pf + 128 * p + 64, _MM_HINT_T1);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(xp[r * ld + p]);
      acc[2 * r] = _mm512_dpbf16_ps(acc[2 * r], xb, w0);
      acc[2 * r + 1] = _mm512_dpbf16_ps(acc[2 * r + 1], xb, w1);
    }
  }
  store_tile<at::BFloat16>(acc, R, e.valid, e.bias, e.residual, e.ld, e.out);
}

// R rows of x (float32, row stride K, K even) against one bfloat16 block (K/2 x 32 pairs), each
// pair row widened to float32 in registers: the low half of each 32-bit lane is the pair's first
// value (row 2p of the block), the high half its second (2p + 1). The sums run k ascending, as
// tile_f32's over the widened weights.
template <int R>
inline void tile_widened(const float* x, int64_t K, const at::BFloat16* w, const char* pf, const Epilogue<float>& e) {
  __m512 acc[2 * R];
#pragma GCC unroll 24
  for (int r = 0; r < 2 * R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t p = 0; p < K / 2; ++p) {
    const __m512i raw0 = _mm512_loadu_si512(w + 2 * kCols * p);
    const __m512i raw1 = _mm512_loadu_si512(w + 2 * kCols * p + 32);
    _mm_prefetch(pf + 128 * p, _MM_HINT_T1);
    _mm_prefetch(pf + 128 * p + 64, _MM_HINT_T1);
    const __m512 even0 = _mm512_castsi512_ps(_mm512_slli_epi32(raw0, 16));
    const __m512 even1 = _mm512_castsi512_ps(_mm512_slli_epi32(raw1, 16));
    const __m512 odd0 = _mm512_castsi512_ps(_mm512_and_si512(raw0, high));
    const __m512 odd1 = _mm512_castsi512_ps(_mm512_and_si512(raw1, high));
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512 xe = _mm512_set1_ps(x[r * K + 2 * p]);
      const __m512 xo = _mm512_set1_ps(x[r * K + 2 * p + 1]);
      acc[2 * r] = _mm512_fmadd_ps(xo, odd0, _mm512_fmadd_ps(xe, even0, acc[2 * r]));
      acc[2 * r + 1] = _mm512_fmadd_ps(xo, odd1, _mm512_fmadd_ps(xe, even1, acc[2 * r + 1]));
    }
  }
  store_tile<float>(acc, R, e.valid, e.bias, e.residual, e.ld, e.out);
}

// x's dtype, the weights' dtype, R rows: float32 against float32, bfloat16 against bfloat16,
// float32 against bfloat16 widened.
template <typename x_t, typename w_t, int R>
inline void tile(const x_t* x, int64_t K, const w_t* w, const char* pf, const Epilogue<x_t>& e) {
  if constexpr (std::is_same_v<w_t, float>)
    tile_f32<R>(x, K, w, pf, e);
  else if constexpr (std::is_same_v<x_t, float>)
    tile_widened<R>(x, K, w, pf, e);
  else
    tile_bf16<R>(x, K, w, pf, e);
}

#elif defined(__AVX2__)
// AVX2 and FMA (AMD Zen 1-3, Intel before Skylake-SP): 16 registers of 8 lanes, so blocks of 16
// columns and tiles of 6 rows (12 accumulators, two weight vectors, a broadcast); float32 rows
// (a half-precision model multiplies in float32 on these CPUs: kernels/linear.py), against
// float32 weights or bfloat16 ones widened in registers as the AVX-512 path's tile_widened does.
constexpr int64_t kCols = 16;
constexpr int64_t kTile = 6;
// Rows per tile against bfloat16 weights: with 12 accumulators GCC kept one in memory (a
// store-to-load chain through every step of k, half the float32 tile's speed); 10 fit.
template <typename w_t>
constexpr int64_t kTileOf = std::is_same_v<w_t, float> ? kTile : 5;

__attribute__((always_inline)) inline void store_tile(const __m256* acc, int rows, const Epilogue<float>& e) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i mask[2] = {_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(e.valid)), lane),
                           _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(e.valid) - 8), lane)};
#pragma GCC unroll 6
  for (int r = 0; r < rows; ++r) {
    for (int h = 0; h < 2; ++h) {
      __m256 y = acc[2 * r + h];
      if (e.bias) y = _mm256_add_ps(y, _mm256_maskload_ps(e.bias + 8 * h, mask[h]));
      if (e.residual) y = _mm256_add_ps(y, _mm256_maskload_ps(e.residual + r * e.ld + 8 * h, mask[h]));
      _mm256_maskstore_ps(e.out + r * e.ld + 8 * h, mask[h], y);
    }
  }
}

template <int R>
inline void tile_f32(const float* x, int64_t K, const float* w, const char* pf, const Epilogue<float>& e) {
  __m256 acc[2 * R];
#pragma GCC unroll 12
  for (int r = 0; r < 2 * R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_loadu_ps(w + kCols * k);
    const __m256 w1 = _mm256_loadu_ps(w + kCols * k + 8);
    _mm_prefetch(pf + 64 * k, _MM_HINT_T1);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * K + k);
      acc[2 * r] = _mm256_fmadd_ps(xb, w0, acc[2 * r]);
      acc[2 * r + 1] = _mm256_fmadd_ps(xb, w1, acc[2 * r + 1]);
    }
  }
  store_tile(acc, R, e);
}

// R rows of x (float32, row stride K, K even) against one bfloat16 block (K/2 x 16 pairs, a
// 64-byte line a pair row), widened to float32 in registers: each pair row's even values (the low
// halves of its 32-bit lanes, shifted up) multiply first, then its odd ones (the high halves, the
// low bits cleared by two shifts, no mask register), k ascending as in tile_f32. The pair row is
// loaded twice (from L1 the second time) so that only two weight vectors are live beside the
// accumulators and a broadcast; even so GCC kept one of 12 accumulators in memory, so these tiles
// are of 5 rows (kTileOf).
template <int R>
inline void tile_widened(const float* x, int64_t K, const at::BFloat16* w, const char* pf, const Epilogue<float>& e) {
  __m256 acc[2 * R];
#pragma GCC unroll 12
  for (int r = 0; r < 2 * R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t p = 0; p < K / 2; ++p) {
    const __m256i* row = reinterpret_cast<const __m256i*>(w + 2 * kCols * p);
    _mm_prefetch(pf + 64 * p, _MM_HINT_T1);
    const __m256 even0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(row), 16));
    const __m256 even1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(row + 1), 16));
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * K + 2 * p);
      acc[2 * r] = _mm256_fmadd_ps(xb, even0, acc[2 * r]);
      acc[2 * r + 1] = _mm256_fmadd_ps(xb, even1, acc[2 * r + 1]);
    }
    const __m256 odd0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(_mm256_loadu_si256(row), 16), 16));
    const __m256 odd1 =
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(_mm256_loadu_si256(row + 1), 16), 16));
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * K + 2 * p + 1);
      acc[2 * r] = _mm256_fmadd_ps(xb, odd0, acc[2 * r]);
      acc[2 * r + 1] = _mm256_fmadd_ps(xb, odd1, acc[2 * r + 1]);
    }
  }
  store_tile(acc, R, e);
}

// float32 rows against float32 weights, or against bfloat16 weights widened.
template <typename x_t, typename w_t, int R>
inline void tile(const x_t* x, int64_t K, const w_t* w, const char* pf, const Epilogue<x_t>& e) {
  static_assert(std::is_same_v<x_t, float>, "float32 rows only in the AVX2 build");
  if constexpr (std::is_same_v<w_t, float>)
    tile_f32<R>(x, K, w, pf, e);
  else
    tile_widened<R>(x, K, w, pf, e);
}
#endif

#if defined(__AVX512F__)
template <typename w_t>
constexpr int64_t kTileOf = kTile;  // rows per tile, whatever the weights' dtype
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
// A tile of `rows` rows (1..kTileOf), its row count fixed at compile time: one instance per count.
template <typename x_t, typename w_t, int... R>
inline void tile_of(std::integer_sequence<int, R...>, int rows, const x_t* x, int64_t K, const w_t* w, const char* pf,
                    const Epilogue<x_t>& e) {
  ((rows == R + 1 && (tile<x_t, w_t, R + 1>(x, K, w, pf, e), true)) || ...);
}

template <typename x_t, typename w_t>
void any_tile(int rows, const x_t* x, int64_t K, const w_t* w, const char* pf, const Epilogue<x_t>& e) {
  tile_of<x_t, w_t>(std::make_integer_sequence<int, kTileOf<w_t>>{}, rows, x, K, w, pf, e);
}

// x, the residual and the output in x_t, the packed weights in w_t (x_t, or bfloat16 widened for
// float32 rows).
template <typename x_t, typename w_t>
void run(const at::Tensor& x, const at::Tensor& packed, int64_t n, const float* bias,
         const std::optional<at::Tensor>& residual, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0);
  const int64_t block_elems = K * kCols;  // a block's values in either layout
  const x_t* xs = x.data_ptr<x_t>();
  const w_t* w = packed.data_ptr<w_t>();
  const x_t* res = residual ? residual->data_ptr<x_t>() : nullptr;
  x_t* o = out.data_ptr<x_t>();
  if (M == 0) return;
  // Work items are (block, chunk of rows): one chunk per block while there are enough blocks to
  // share among the threads, rows split too where there are not (few output columns, many rows).
  // Each output value is still summed by one tile in one order, whatever the split.
  constexpr int64_t kTile = kTileOf<w_t>;
  const int64_t threads = at::get_num_threads();
  int64_t chunks = 1;
  if (blocks < 4 * threads && M > 8 * kTile)
    chunks = std::min((M + 4 * kTile - 1) / (4 * kTile), (4 * threads + blocks - 1) / blocks);
  const int64_t chunk_rows = ((M + chunks - 1) / chunks + kTile - 1) / kTile * kTile;
  chunks = (M + chunk_rows - 1) / chunk_rows;
  // below about 64K multiply-adds per claim the threads cost more than they save
  const int64_t items = blocks * chunks;
  const int64_t grain =
      std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, std::min(chunk_rows, M) * block_elems));
  struct NoScratch {};
  kvmesh::parallel_claims(items, grain, [] { return NoScratch{}; }, [&](NoScratch, int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / chunks, m_begin = (i % chunks) * chunk_rows, m_end = std::min(M, m_begin + chunk_rows);
      const w_t* wb = w + b * block_elems;
      const int64_t col = b * kCols, valid = std::min(kCols, n - col);
      // the block after next (when this claim holds it) is fetched during the block's first tile
      const bool first = m_begin == 0 || i == i0;
      const int64_t ahead = first && (b + 2) * chunks < i1 ? b + 2 : b;
      for (int64_t m0 = m_begin; m0 < m_end; m0 += kTile) {
        const int rows = static_cast<int>(std::min(kTile, m_end - m0));
        const char* pf = reinterpret_cast<const char*>(w + (m0 == m_begin ? ahead : b) * block_elems);
        const Epilogue<x_t> e{valid, bias ? bias + col : nullptr, res ? res + m0 * n + col : nullptr, n,
                                   o + m0 * n + col};
        any_tile<x_t, w_t>(rows, xs + m0 * K, K, wb, pf, e);
      }
    }
  });
}

#endif

#if defined(__AVX512F__)
// bfloat16 products on AMX's tile units (Intel Xeon from Sapphire Rapids), from the same packed
// layout: a block's pair rows are 128 bytes (32 columns x 2 values), so columns 0-15 and 16-31 of
// 16 pair rows are two tiles at a 128-byte stride, and 16 of x's rows are a tile as they lie (32
// values, 64 bytes, of each row). oneDNN multiplies bfloat16 on the same tiles, but at decode sizes
// it read a model's weights at 14-23 GB/s (about 20 us a call outside its kernel, too), this path
// at 18-32 (Intel Xeon with AMX, two threads, bench/linear_rows.py: 1.3-1.5x faster at 1-32 rows,
// 1.07-1.19x at 128, level at 160-192). Each block of 32 columns is read from memory once per call (the claim's next
// block prefetched into L2 meanwhile: 32 rows 1.18x -> 1.41x oneDNN's speed) and from L2 for each
// further 32 rows; the sums are rounded by `vcvtneps2bf16` (amx_store: 128 rows 1.07-1.13x ->
// 1.14-1.19x oneDNN's speed, against store_tile's rounding in integer steps). A row's outputs are the tile unit's sums over K in steps of 32, the same bits
// whatever the number of rows beside it or the split among threads, so every row count takes
// this path where the CPU has AMX (one row as fast as on the AVX-512 path); kernels/linear.py sends
// products of more rows to oneDNN.

using kvmesh::amx_end;
using kvmesh::amx_ready;
using kvmesh::amx_start;

// The shared configuration's tiles here: 0-3 the sums of 32 rows x 32 columns (float32), 4-5 two
// 16-row pieces of x, 6-7 the block's two 16-column halves.

// Rows [0, rows) (rows <= 32; x padded to whole 16-row pieces) of x against one block (K/2 pair
// rows of 128 bytes), the sums into c ([32][32] float32).
__attribute__((target("amx-tile,amx-bf16"))) void amx_block(const at::BFloat16* x, int64_t x_stride, int rows,
                                                             int64_t K, const at::BFloat16* w, const char* pf,
                                                             float* c) {
  const int64_t xs = x_stride * static_cast<int64_t>(sizeof(at::BFloat16));
  _tile_zero(0);
  _tile_zero(1);
  if (rows > 16) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t k = 0; k < K; k += 32) {  // 16 pair rows of the block: 2 KiB
    if (pf)
      for (int64_t line = 0; line < 32; ++line) _mm_prefetch(pf + 64 * k + 64 * line, _MM_HINT_T1);
    _tile_loadd(6, w + 32 * k, 128);
    _tile_loadd(7, w + 32 * k + 32, 128);
    _tile_loadd(4, x + k, xs);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (rows > 16) {
      _tile_loadd(5, x + 16 * x_stride + k, xs);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 128);
  _tile_stored(1, c + 16, 128);
  if (rows > 16) {
    _tile_stored(2, c + 16 * 32, 128);
    _tile_stored(3, c + 16 * 32 + 16, 128);
  }
}

// The sums of `rows` rows x 32 columns (`valid` of them real) plus bias and residual, rounded to
// bfloat16 by `vcvtneps2bf16` (to nearest even, as torch; a NaN stays a NaN) into out's rows.
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void amx_store(const float* c, int rows, int64_t valid,
                                                                        const float* bias,
                                                                        const at::BFloat16* residual, int64_t ld,
                                                                        at::BFloat16* out) {
  const __mmask16 m0 = valid >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
  const __mmask16 m1 = valid >= 32 ? __mmask16(0xFFFF) : valid <= 16 ? __mmask16(0) : __mmask16((1u << (valid - 16)) - 1);
  const __mmask16 mask[2] = {m0, m1};
  __m512 b[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  if (bias) b[0] = _mm512_maskz_loadu_ps(m0, bias), b[1] = _mm512_maskz_loadu_ps(m1, bias + 16);
  for (int r = 0; r < rows; ++r) {
    for (int h = 0; h < 2; ++h) {
      __m512 y = _mm512_add_ps(_mm512_load_ps(c + 32 * r + 16 * h), b[h]);
      if (residual) {
        const __m256i raw = _mm256_maskz_loadu_epi16(mask[h], residual + r * ld + 16 * h);
        y = _mm512_add_ps(y, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)));
      }
      _mm256_mask_storeu_epi16(out + r * ld + 16 * h, mask[h], (__m256i)_mm512_cvtneps_pbh(y));
    }
  }
}

void run_amx(const at::Tensor& x, const at::Tensor& packed, int64_t n, const float* bias,
             const std::optional<at::Tensor>& residual, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0);
  const at::BFloat16* w = packed.data_ptr<at::BFloat16>();
  const at::BFloat16* res = residual ? residual->data_ptr<at::BFloat16>() : nullptr;
  at::BFloat16* o = out.data_ptr<at::BFloat16>();
  // The last rows short of a 16-row piece go through a zero-padded copy (a tile reads 16 rows), in
  // the calling thread's buffer, kept from call to call.
  const int64_t whole = M / 16 * 16;
  const at::BFloat16* xs = x.data_ptr<at::BFloat16>();
  thread_local std::vector<at::BFloat16> tail;
  if (whole < M) {
    tail.resize(16 * K);
    std::memcpy(tail.data(), xs + whole * K, (M - whole) * K * sizeof(at::BFloat16));
    std::memset(static_cast<void*>(tail.data() + (M - whole) * K), 0, (16 - (M - whole)) * K * sizeof(at::BFloat16));
  }
  const at::BFloat16* xt = whole < M ? tail.data() : nullptr;
  struct Sums {
    alignas(64) float c[32 * 32];
  };
  kvmesh::parallel_claims(blocks, 1, [] { return Sums{}; }, [&](Sums& sums, int64_t b0, int64_t b1) {
    amx_start();
    for (int64_t b = b0; b < b1; ++b) {
      const at::BFloat16* wb = w + b * K * kCols;
      const int64_t col = b * kCols, valid = std::min(kCols, n - col);
      // the next block of the claim is fetched into L2 while this one's first rows are multiplied
      const char* next = b + 1 < b1 ? reinterpret_cast<const char*>(wb + K * kCols) : nullptr;
      for (int64_t m0 = 0; m0 < M; m0 += 32) {
        const char* pf = m0 == 0 ? next : nullptr;
        const int rows = static_cast<int>(std::min<int64_t>(32, M - m0));
        if (m0 + 16 <= whole && (rows <= 16 || m0 + 32 <= whole)) {
          amx_block(xs + m0 * K, K, rows, K, wb, pf, sums.c);
        } else if (m0 == whole) {  // the whole piece is the tail
          amx_block(xt, K, rows, K, wb, pf, sums.c);
        } else {  // a whole 16-row piece, then the tail: two calls of 16 rows
          amx_block(xs + m0 * K, K, 16, K, wb, pf, sums.c);
          alignas(64) float c2[32 * 32];
          amx_block(xt, K, rows - 16, K, wb, nullptr, c2);
          std::memcpy(sums.c + 16 * 32, c2, 16 * 32 * sizeof(float));
        }
        amx_store(sums.c, rows, valid, bias ? bias + col : nullptr, res ? res + m0 * n + col : nullptr, n,
                  o + m0 * n + col);
      }
    }
    amx_end();
  });
}
#endif

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const std::optional<at::Tensor>& bias,
                        const std::optional<at::Tensor>& residual) {
#if defined(__AVX512F__) || defined(__AVX2__)
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "small_linear: x must be a contiguous [rows, in_features] matrix");
  const bool widened = x.scalar_type() == at::kFloat && packed.scalar_type() == at::kBFloat16;
  TORCH_CHECK(packed.dim() >= 3 && packed.is_contiguous() && (packed.scalar_type() == x.scalar_type() || widened),
              "small_linear: packed must be small_linear's layout of a weight in x's dtype (or bfloat16 for float32 x)");
  const int64_t K = x.size(1), blocks = packed.size(0);
  TORCH_CHECK(!widened || K % 2 == 0, "small_linear: a bfloat16 weight needs an even number of in_features, x has ", K);
  TORCH_CHECK(packed.numel() == blocks * K * kCols, "small_linear: packed weight is for ", packed.numel() / (blocks * kCols),
              " in_features, x has ", K);
  TORCH_CHECK(n > (blocks - 1) * kCols && n <= blocks * kCols, "small_linear: ", n, " out_features for ", blocks,
              " blocks of ", kCols);
  at::Tensor b32;
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "small_linear: bias must have out_features values");
    b32 = bias->to(at::kFloat).contiguous();
  }
  if (residual)
    TORCH_CHECK(residual->sizes() == at::IntArrayRef({x.size(0), n}) && residual->is_contiguous() &&
                    residual->scalar_type() == x.scalar_type(),
                "small_linear: residual must be a contiguous [rows, out_features] matrix in x's dtype");
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  const float* bp = bias ? b32.data_ptr<float>() : nullptr;
  if (widened) {
    run<float, at::BFloat16>(x, packed, n, bp, residual, out);
  } else if (x.scalar_type() == at::kFloat) {
    run<float, float>(x, packed, n, bp, residual, out);
  } else {
#if defined(__AVX512F__)
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 && K % 2 == 0,
                "small_linear: float32, or bfloat16 with an even number of in_features");
    if (K % 32 == 0 && amx_ready())  // every row count, so a row's result is the same bits beside any others
      run_amx(x, packed, n, bp, residual, out);
    else
      run<at::BFloat16, at::BFloat16>(x, packed, n, bp, residual, out);
#else
    TORCH_CHECK(false, "small_linear: float32 rows only in an AVX2 build");
#endif
  }
  return out;
#else
  TORCH_CHECK(false, "small_linear needs an AVX-512 or AVX2 build");
#endif
}

// Whether small_linear multiplies bfloat16 on AMX's tile units here (kernels/linear.py sets the
// rows it takes by it).
bool amx_tiles_ready() {
#if defined(__AVX512F__)
  return amx_ready();
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("small_linear(Tensor x, Tensor packed, int n, Tensor? bias, Tensor? residual) -> Tensor");
  m.def("amx_tiles_ready() -> bool", amx_tiles_ready);
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("small_linear", small_linear); }
