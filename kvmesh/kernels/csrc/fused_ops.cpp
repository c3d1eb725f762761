// A decoder layer's elementwise steps, each in one pass over its rows: RMSNorm, the rotary
// embedding of q and k in place, and SiLU(gate) * up; and the sampler's greedy pick (argmax and
// logsumexp of each row of logits) and its draw.
//
// torch runs them as 3 to 8 operators each (RMSNorm in bfloat16 is eight: a cast, pow, mean, add,
// rsqrt, mul, a cast back, mul), each a pass over memory and, above a few thousand elements, an
// OpenMP region whose threads meet at a barrier. A decode step of a 12-layer model ran about 300
// of them. Here each is one operator; rows are split over threads only when there are enough of
// them (torch's grain of 32,768 elements), so a small decode step runs them on the calling thread.
//
// The arithmetic is torch's own (ATen's vectorized float math, the same Sleef exp as torch's SiLU),
// done in the order transformers writes it, rounding to the tensor's dtype where each of
// transformers' operators would: float32 results equal torch's operator by operator (the library
// is built with -ffp-contract=off, so no multiply and add are fused into one rounding), and
// bfloat16 / float16 ones round where transformers rounds. One difference: torch computes the
// tail of a row (past the last full vector) with the C library's exp, this file with Sleef's, so
// a result no longer depends on how a tensor happened to be split between threads. RMSNorm sums
// each row in its own order (torch's mean has another), so its scale factor may be one unit of the
// last place away from torch's.
//
// Registered as torch.ops.kvmesh.rms_norm, torch.ops.kvmesh.rotary_ (in place),
// torch.ops.kvmesh.silu_mul, torch.ops.kvmesh.greedy_pick and torch.ops.kvmesh.draw.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <type_traits>

namespace {

using at::vec::Vectorized;
using fVec = Vectorized<float>;
constexpr int64_t kWidth = fVec::size();
constexpr int64_t kStep = 2 * kWidth;  // elements per chunk: one vector of bfloat16 / float16, two of float
constexpr int64_t kGrain = 32768;      // elements: torch's at::internal::GRAIN_SIZE

// A chunk of up to kStep elements as two float vectors (past the chunk's end: zeros).
struct Pair {
  fVec lo, hi;
};
inline Pair operator+(const Pair& a, const Pair& b) { return {a.lo + b.lo, a.hi + b.hi}; }
inline Pair operator*(const Pair& a, const Pair& b) { return {a.lo * b.lo, a.hi * b.hi}; }
inline Pair operator*(const Pair& a, const fVec& b) { return {a.lo * b, a.hi * b}; }
// torch's SiLU: x / (1 + exp(-x))
inline Pair silu(const Pair& x) {
  const fVec one(1.0f);
  return {x.lo / (one + x.lo.neg().exp()), x.hi / (one + x.hi.neg().exp())};
}

template <typename T>
inline Pair load(const T* p, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return {fVec::loadu(p, std::min(n, kWidth)), n > kWidth ? fVec::loadu(p + kWidth, n - kWidth) : fVec(0.0f)};
  } else {
    auto [lo, hi] = at::vec::convert_to_float<T>(Vectorized<T>::loadu(p, n));
    return {lo, hi};
  }
}

template <typename T>
inline void store(T* p, const Pair& v, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    v.lo.store(p, std::min(n, kWidth));
    if (n > kWidth) v.hi.store(p + kWidth, n - kWidth);
  } else {
    at::vec::convert_from_float<T>(v.lo, v.hi).store(p, n);
  }
}

// v rounded to T and back: where a T-typed torch operator would store its result.
template <typename T>
inline Pair rounded(const Pair& v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    auto [lo, hi] = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(v.lo, v.hi));
    return {lo, hi};
  }
}

// Calls f with a value of the C++ type of `dtype`: float32, bfloat16 or float16.
template <typename F>
void dispatch(at::ScalarType dtype, const char* op, F&& f) {
  switch (dtype) {
    case at::kFloat: return f(float{});
    case at::kBFloat16: return f(at::BFloat16{});
    case at::kHalf: return f(at::Half{});
    default: TORCH_CHECK(false, op, ": dtype must be float32, bfloat16 or float16, got ", dtype);
  }
}

inline int64_t grain_rows(int64_t row_elements) { return std::max<int64_t>(1, kGrain / std::max<int64_t>(1, row_elements)); }

void check_rows(const at::Tensor& x, int64_t dims, const char* op, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), op, ": ", name, " must be on the CPU");
  TORCH_CHECK(x.dim() == dims, op, ": ", name, " must have ", dims, " dimensions, got ", x.dim());
  TORCH_CHECK(x.stride(-1) == 1, op, ": ", name, "'s last dimension must be contiguous");
}

// transformers' LlamaRMSNorm: h = x in float32; h * rsqrt(mean(h^2) + eps), rounded to x's dtype,
// times the weight (in x's dtype).
template <typename T>
void rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out, float eps) {
  const int64_t rows = x.size(0), n = x.size(1), xs = x.stride(0), os = out.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = xp + r * xs;
      Pair acc{fVec(0.0f), fVec(0.0f)};
      for (int64_t j = 0; j < n; j += kStep) {
        const Pair v = load(row + j, std::min(kStep, n - j));
        acc = acc + v * v;
      }
      const float mean = at::vec::vec_reduce_all<float>([](fVec a, fVec b) { return a + b; }, acc.lo + acc.hi) / n;
      const fVec inv(1.0f / std::sqrt(mean + eps));
      T* dst = op + r * os;
      for (int64_t j = 0; j < n; j += kStep) {
        const int64_t m = std::min(kStep, n - j);
        store(dst + j, load(w + j, m) * rounded<T>(load(row + j, m) * inv), m);
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, 2, "rms_norm", "x");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1),
              "rms_norm: weight must be contiguous with x's ", x.size(1), " columns");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm: weight and x must have one dtype");
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  dispatch(x.scalar_type(), "rms_norm",
           [&](auto t) { rms_norm_rows<decltype(t)>(x, weight, out, static_cast<float>(eps)); });
  return out;
}

// transformers' apply_rotary_pos_emb: x * cos + rotate_half(x) * sin, each product and the sum
// rounded to x's dtype. `sin` has its first half negated (rotate_half's sign), so element j pairs
// with element j +- d/2 and the pair is rotated together, in place.
template <typename T>
void rotary_rows(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), cs = cos.stride(0), ss = sin.stride(0);
  T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  at::parallel_for(0, tokens, grain_rows(heads * d), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cp + t * cs;
      const T* s = sp + t * ss;
      for (int64_t h = 0; h < heads; ++h) {
        T* p = xp + t * xs0 + h * xs1;
        for (int64_t j = 0; j < half; j += kStep) {
          const int64_t m = std::min(kStep, half - j);
          const Pair a = load(p + j, m), b = load(p + half + j, m);
          const Pair lo = rounded<T>(a * load(c + j, m)) + rounded<T>(b * load(s + j, m));
          const Pair hi = rounded<T>(b * load(c + half + j, m)) + rounded<T>(a * load(s + half + j, m));
          store(p + j, lo, m);
          store(p + half + j, hi, m);
        }
      }
    }
  });
}

void rotary_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  check_rows(x, 3, "rotary_", "x");
  check_rows(cos, 2, "rotary_", "cos");
  check_rows(sin, 2, "rotary_", "sin");
  TORCH_CHECK(x.size(2) % 2 == 0, "rotary_: head_dim must be even, got ", x.size(2));
  for (const at::Tensor* table : {&cos, &sin}) {
    TORCH_CHECK(table->size(0) == x.size(0) && table->size(1) == x.size(2),
                "rotary_: cos and sin must be [tokens, head_dim] = [", x.size(0), ", ", x.size(2), "]");
    TORCH_CHECK(table->scalar_type() == x.scalar_type(), "rotary_: cos, sin and x must have one dtype");
  }
  dispatch(x.scalar_type(), "rotary_", [&](auto t) { rotary_rows<decltype(t)>(x, cos, sin); });
}

// transformers' LlamaMLP activation: silu(gate) * up, each rounded to the input's dtype; `gate_up`
// is the fused projection's output, gate in its first half of columns, up in the second.
template <typename T>
void silu_mul_rows(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t rows = gate_up.size(0), n = out.size(1), is = gate_up.stride(0), os = out.stride(0);
  const T* in = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = in + r * is;
      const T* u = g + n;
      T* dst = op + r * os;
      for (int64_t j = 0; j < n; j += kStep) {
        const int64_t m = std::min(kStep, n - j);
        store(dst + j, rounded<T>(silu(load(g + j, m))) * load(u + j, m), m);
      }
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, 2, "silu_mul", "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_mul: gate_up must have an even number of columns, got ",
              gate_up.size(1));
  at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  dispatch(gate_up.scalar_type(), "silu_mul", [&](auto t) { silu_mul_rows<decltype(t)>(gate_up, out); });
  return out;
}

// One row of float32 logits, a vector at a time with -inf past its end, so a max or a sum of
// exponentials over whole vectors is the row's.
struct LogitRow {
  const float* p;
  int64_t n;
  fVec chunk(int64_t j) const {
    const fVec lowest(-std::numeric_limits<float>::infinity());
    return n - j >= kWidth ? fVec::loadu(p + j) : fVec::set(lowest, fVec::loadu(p + j, n - j), n - j);
  }
  float max() const {
    fVec m(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < n; j += kWidth) m = at::vec::maximum(m, chunk(j));
    return at::vec::vec_reduce_all<float>([](fVec a, fVec b) { return at::vec::maximum(a, b); }, m);
  }
};

inline float lanes_sum(const fVec& v) {
  return at::vec::vec_reduce_all<float>([](fVec a, fVec b) { return a + b; }, v);
}

// A greedy pick over float32 logits `[rows, vocab]`: each row's argmax (the first of equal maxima,
// as torch.argmax) and logsumexp (max + log(sum(exp(x - max))), the sum in torch's log_softmax's
// terms), so the pick's logprob is its logit minus the logsumexp without writing a log_softmax of
// every row. torch's argmax over a 32,000-token row took 20 us and log_softmax 10 (two threads):
// a step of 64 decodes spent 1.9 ms on them. A row with a NaN has a NaN logsumexp (and id 0): the
// caller's logprob is then not finite, as log_softmax's would be.
void greedy_rows(const at::Tensor& logits, at::Tensor& ids, at::Tensor& lse) {
  const int64_t rows = logits.size(0), n = logits.size(1), xs = logits.stride(0);
  const float* xp = logits.data_ptr<float>();
  int64_t* idp = ids.data_ptr<int64_t>();
  float* lp = lse.data_ptr<float>();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const LogitRow row{xp + r * xs, n};
      const float best = row.max();
      int64_t id = 0;
      const fVec vbest(best);
      for (int64_t j = 0; j < n; j += kWidth) {
        const int unequal = (row.chunk(j) == vbest).zero_mask();  // bit i set: lane i differs from the max
        if (unequal != (1 << kWidth) - 1) {
          id = j + __builtin_ctz(~unequal);
          break;
        }
      }
      fVec sum(0.0f);
      for (int64_t j = 0; j < n; j += kWidth) sum = sum + (row.chunk(j) - vbest).exp();
      idp[r] = id;
      lp[r] = best + std::log(lanes_sum(sum));
    }
  });
}

std::tuple<at::Tensor, at::Tensor> greedy_pick(const at::Tensor& logits) {
  check_rows(logits, 2, "greedy_pick", "logits");
  TORCH_CHECK(logits.scalar_type() == at::kFloat, "greedy_pick: logits must be float32, got ", logits.scalar_type());
  TORCH_CHECK(logits.size(1) > 0, "greedy_pick: logits must have at least one column");
  at::Tensor ids = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  at::Tensor lse = at::empty({logits.size(0)}, logits.options());
  greedy_rows(logits, ids, lse);
  return {ids, lse};
}

// A draw from each row of `scaled` (float32 logits already divided by the temperature and
// filtered, -inf where top-k or top-p removed a token): the first token whose cumulative
// probability, in vocabulary order, passes the row's uniform number u in [0, 1) (kvmesh's sampler,
// services/worker/sampling.py), without writing a softmax and a cumulative sum of every row: the
// exponentials are summed once, then summed again up to u times that total (in double, a vector's
// sum at a time, then the vector's values one by one). Also returns each row's total, which is not
// finite or not above zero exactly where the row's probabilities are not finite (the caller fails
// it). torch's softmax, cumsum and searchsorted took about 40 us a row at 32,000 tokens.
void draw_rows(const at::Tensor& scaled, const at::Tensor& uniforms, at::Tensor& ids, at::Tensor& totals) {
  const int64_t rows = scaled.size(0), n = scaled.size(1), xs = scaled.stride(0);
  const float* xp = scaled.data_ptr<float>();
  const float* up = uniforms.data_ptr<float>();
  int64_t* idp = ids.data_ptr<int64_t>();
  double* tp = totals.data_ptr<double>();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const LogitRow row{xp + r * xs, n};
      const fVec best(row.max());
      double total = 0.0;
      for (int64_t j = 0; j < n; j += kWidth) total += lanes_sum((row.chunk(j) - best).exp());
      tp[r] = total;
      int64_t id = n - 1;
      if (std::isfinite(total) && total > 0.0) {
        // Below the total, always: the token found then has a probability above zero.
        const double target = std::min(static_cast<double>(up[r]) * total, std::nextafter(total, 0.0));
        double acc = 0.0;
        for (int64_t j = 0; j < n; j += kWidth) {
          const fVec e = (row.chunk(j) - best).exp();
          const double next = acc + lanes_sum(e);
          if (next <= target) {
            acc = next;
            continue;
          }
          float lanes[kWidth];
          e.store(lanes);
          const int64_t m = std::min<int64_t>(kWidth, n - j);
          int64_t last = -1;  // the vector's last token of some probability: where rounding leaves the sum short
          for (int64_t i = 0; i < m; ++i) {
            if (lanes[i] > 0.f) last = i;
            acc += lanes[i];
            if (acc > target && lanes[i] > 0.f) {
              last = i;
              break;
            }
          }
          id = j + last;
          break;
        }
      }
      idp[r] = id;
    }
  });
}

std::tuple<at::Tensor, at::Tensor> draw(const at::Tensor& scaled, const at::Tensor& uniforms) {
  check_rows(scaled, 2, "draw", "scaled");
  TORCH_CHECK(scaled.scalar_type() == at::kFloat, "draw: scaled must be float32, got ", scaled.scalar_type());
  TORCH_CHECK(scaled.size(1) > 0, "draw: scaled must have at least one column");
  TORCH_CHECK(uniforms.scalar_type() == at::kFloat && uniforms.dim() == 1 && uniforms.is_contiguous() &&
                  uniforms.size(0) == scaled.size(0),
              "draw: uniforms must be a contiguous float32 vector of one number per row");
  at::Tensor ids = at::empty({scaled.size(0)}, scaled.options().dtype(at::kLong));
  at::Tensor totals = at::empty({scaled.size(0)}, scaled.options().dtype(at::kDouble));
  draw_rows(scaled, uniforms, ids, totals);
  return {ids, totals};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("greedy_pick(Tensor logits) -> (Tensor, Tensor)");
  m.def("draw(Tensor scaled, Tensor uniforms) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("rotary_", rotary_);
  m.impl("silu_mul", silu_mul);
  m.impl("greedy_pick", greedy_pick);
  m.impl("draw", draw);
}
