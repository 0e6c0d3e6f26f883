// Compiled CPU kernels for causal inference (no autograd, float32 compute):
//   causal_positive  fused causal attention with positive random features (FAVOR+ family)
//   causal_band      the exact part of a causal hybrid: local window + attention sinks
//
// causal_positive is the twin of hf_rfa/ops/linear.py (causal_feature_attention with a positive
// feature map, no autograd): same chunkwise math, same streaming-safe stabilisation, but one
// task per (batch, key/value head) runs the whole sequence chunk by chunk on buffers that stay
// in the core's cache, calling MKL's single-threaded sgemm and vsExp directly (no per-op
// dispatch, no Python loop, no [N, F] tensor). Tasks are spread over threads with
// at::parallel_for.
//
// Per chunk of C tokens (G query heads share the kv head's keys; the state is kept as its value
// part Sv [F,Dv] and its denominator part z [F]):
//   key features   Kf[C,F] = exp(xk W^T + bias - rowmax),  lk = rowmax + coef*|xk|^2 + c0 (+ lk_add)
//   query features Qf[G*C,F] likewise (lq only returned for the unnormalised output)
//   running max    mt_t = max(ref, max_{s<=t} lk_s)
//   output         O = exp(ref - mt_t) * Qf [Sv, z]  +  (Qf Kf^T  .*  [s<=t] exp(lk_s - mt_t)) [V, 1]
//   state          [Sv, z] = exp(ref - r_end) [Sv, z] + Kf^T ([V, 1] .* exp(lk - r_end)),  ref = r_end = mt_{C-1}
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

extern "C" {
// MKL (linked into libtorch_cpu on x86 builds); weak: null when the build has no MKL
void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*, const float*, const int*,
            const float*, const int*, const float*, float*, const int*) __attribute__((weak));
void vsExp(const int, const float*, float*) __attribute__((weak));
}

namespace {

// chunks whose q/k features are computed by one gemm (amortises packing the projection)
constexpr int kChunksPerFeatureBlock = 4;

bool available() { return sgemm_ != nullptr; }

// row-major C[M,N] = op(A)[M,K] op(B)[K,N] + beta C
inline void gemm(bool ta, bool tb, int M, int N, int K, const float* A, int lda, const float* B, int ldb, float beta,
                 float* C, int ldc) {
  const char tA = ta ? 'T' : 'N', tB = tb ? 'T' : 'N';
  const float one = 1.0f;
  sgemm_(&tB, &tA, &N, &M, &K, &one, B, &ldb, A, &lda, &beta, C, &ldc);
}

inline void exp_inplace(float* x, int n) {
  if (vsExp != nullptr) {
    vsExp(n, x, x);
  } else {
    for (int i = 0; i < n; ++i) x[i] = std::exp(x[i]);
  }
}

// rows X[R,D] -> features F[R,F] = exp(X W^T + bias - rowmax) (exponents floored), log scale out
// ls[r] = rowmax + coef*|x_r|^2 + c0
void features(const float* X, int R, int D, const float* W, const float* bias, int F, float coef, float c0,
              float floor_, float* Fo, float* ls) {
  gemm(false, true, R, F, D, X, D, W, D, 0.0f, Fo, F);
  for (int r = 0; r < R; ++r) {
    float* row = Fo + (int64_t)r * F;
    if (bias != nullptr) {
#pragma omp simd
      for (int j = 0; j < F; ++j) row[j] += bias[j];
    }
    float mx = row[0];
#pragma omp simd reduction(max : mx)
    for (int j = 0; j < F; ++j) mx = row[j] > mx ? row[j] : mx;
#pragma omp simd
    for (int j = 0; j < F; ++j) {
      const float e = row[j] - mx;
      row[j] = e > floor_ ? e : floor_;
    }
    const float* x = X + (int64_t)r * D;
    float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
    for (int d = 0; d < D; ++d) sq += x[d] * x[d];
    ls[r] = mx + coef * sq + c0;
  }
  exp_inplace(Fo, R * F);
}

// the checks both kernels make of q, k, v; then fn(T{}) with T their element type
template <typename Fn>
void dispatch_qkv(const at::Tensor& xq, const at::Tensor& xk, const at::Tensor& v, Fn&& fn) {
  TORCH_CHECK(available(), "hf_rfa native kernel: no sgemm in this PyTorch build");
  TORCH_CHECK(xq.scalar_type() == xk.scalar_type() && xk.scalar_type() == v.scalar_type(), "q, k, v dtypes differ");
  TORCH_CHECK(xq.stride(3) == 1 && xk.stride(3) == 1 && v.stride(3) == 1, "q, k, v need unit inner stride");
  switch (xq.scalar_type()) {
    case at::kFloat: return fn(float{});
    case at::kBFloat16: return fn(at::BFloat16{});
    case at::kHalf: return fn(at::Half{});
    default: TORCH_CHECK(false, "q/k/v must be float32, bfloat16 or float16");
  }
}

template <typename T>
inline void load_rows(const T* src, int64_t stride, int R, int D, float* dst) {
  for (int r = 0; r < R; ++r)
    for (int d = 0; d < D; ++d) dst[(int64_t)r * D + d] = static_cast<float>(src[r * stride + d]);
}

// largest chunk length accepted (the per-thread tiles are C x C floats)
constexpr int64_t kMaxChunk = 4096;

// sizes both kernels rely on: 4-D q/k/v, kv heads dividing the query heads, matching batch,
// length and head dim, 1 <= chunk <= kMaxChunk (the Python wrappers check these first; this
// keeps a direct call from dividing by zero or allocating chunk^2 floats)
void check_sizes(const at::Tensor& xq, const at::Tensor& xk, const at::Tensor& v, int64_t chunk) {
  TORCH_CHECK(xq.dim() == 4 && xk.dim() == 4 && v.dim() == 4, "q, k, v must be 4-D");
  TORCH_CHECK(xk.size(1) >= 1 && xq.size(1) % xk.size(1) == 0, "kv heads must be >= 1 and divide the query heads");
  TORCH_CHECK(xq.size(0) == xk.size(0) && xk.size(0) == v.size(0) && xq.size(2) == xk.size(2) && xk.size(2) == v.size(2),
              "q, k, v must agree in batch and length");
  TORCH_CHECK(xq.size(3) == xk.size(3) && xk.size(1) == v.size(1), "q/k head dim and k/v heads must agree");
  TORCH_CHECK(chunk >= 1 && chunk <= kMaxChunk, "chunk must be in [1, 4096]");
}

template <typename T>
void run(const at::Tensor& xq, const at::Tensor& xk, const at::Tensor& v, const at::Tensor& W, const at::Tensor& bias,
         double coef, double c0, const at::Tensor& key_mask, const at::Tensor& lk_add, at::Tensor& S, at::Tensor& ref,
         int64_t chunk, double eps, double floor_, at::Tensor& out, const at::Tensor& mt_out, const at::Tensor& lq_out,
         int64_t segments) {
  const int64_t B = xq.size(0), H = xq.size(1), N = xq.size(2), D = xq.size(3);
  const int64_t Hkv = xk.size(1), G = H / Hkv, Dv = v.size(3), Dv1 = Dv + 1, F = W.size(0);
  const bool norm = eps >= 0.0;
  const float* Wp = W.data_ptr<float>();
  const float* bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  const bool* kmp = key_mask.numel() ? key_mask.data_ptr<bool>() : nullptr;
  const float* lap = lk_add.numel() ? lk_add.data_ptr<float>() : nullptr;
  const T* xqp = xq.data_ptr<T>();
  const T* xkp = xk.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  float* Sp = S.data_ptr<float>();
  float* refp = ref.data_ptr<float>();
  float* outp = out.data_ptr<float>();
  float* mtp = norm ? nullptr : mt_out.data_ptr<float>();
  float* lqp = norm ? nullptr : lq_out.data_ptr<float>();
  const int64_t sqn = xq.stride(2), sqh = xq.stride(1), sqb = xq.stride(0);
  const int64_t skn = xk.stride(2), skh = xk.stride(1), skb = xk.stride(0);
  const int64_t svn = v.stride(2), svh = v.stride(1), svb = v.stride(0);
  const int C = (int)std::min<int64_t>(chunk, N);  // checked 1 <= chunk <= kMaxChunk, N >= 1 by the caller
  const float fl = (float)floor_;

  // the state's value part Sv [F,Dv] and its denominator part z [F] are kept apart: every
  // matmul then has width Dv (64, a multiple of the vector width) instead of Dv+1
  const int64_t TB = (int64_t)C * kChunksPerFeatureBlock;  // tokens whose features are computed together
  struct Scratch {
    std::vector<float> xs, Fq, ls, mt, V, Wv, w, A, dec, O, den;
    Scratch(int64_t G, int64_t TB, int64_t C, int64_t D, int64_t F, int64_t Dv)
        : xs((G + 1) * TB * D), Fq((G + 1) * TB * F), ls((G + 1) * TB), mt(C), V(C * Dv), Wv(C * Dv), w(C),
          A(G * C * C), dec(C * C), O(G * C * Dv), den(G * C) {}
  };
  // scan tokens [n0, n1) of one (batch, kv head) from the state (Sv, z, r), which it advances;
  // emit: also the queries and outputs (else only the keys' state increments)
  auto scan = [&](Scratch& sc, int64_t task, int64_t n0, int64_t n1, float* Sv, float* z, float& r, bool emit) {
    auto &xs = sc.xs, &Fq = sc.Fq, &ls = sc.ls, &mt = sc.mt, &V = sc.V, &Wv = sc.Wv, &w = sc.w, &A = sc.A;
    auto &dec = sc.dec, &O = sc.O, &den = sc.den;
    const int64_t b = task / Hkv, j = task % Hkv;
      for (int64_t b0 = n0; b0 < n1; b0 += TB) {
        // ---- features of a block of up to TB tokens in one gemm: rows [keys of the block] then,
        // chunk by chunk, [queries of head 0, …, head G-1] (each chunk's G·c query rows contiguous)
        const int64_t tb = std::min<int64_t>(TB, n1 - b0);
        load_rows(xkp + b * skb + j * skh + b0 * skn, skn, (int)tb, (int)D, xs.data());
        for (int64_t c0 = 0; emit && c0 < tb; c0 += C) {
          const int64_t cc = std::min<int64_t>(C, tb - c0);
          for (int64_t g = 0; g < G; ++g)
            load_rows(xqp + b * sqb + (j * G + g) * sqh + (b0 + c0) * sqn, sqn, (int)cc, (int)D, xs.data() + (tb + G * c0 + g * cc) * D);
        }
        features(xs.data(), (int)((emit ? G + 1 : 1) * tb), (int)D, Wp, bp, (int)F, (float)coef, (float)c0, fl, Fq.data(), ls.data());
        // key log scales; masked keys: zero features, log scale NEG
        for (int64_t s = 0; s < tb; ++s) {
          if (lap != nullptr) ls[s] += lap[task * N + b0 + s];
          if (kmp != nullptr && !kmp[b * N + b0 + s]) {
            ls[s] = -1e30f;
            std::fill(Fq.begin() + s * F, Fq.begin() + (s + 1) * F, 0.0f);
          }
        }
      for (int64_t t0 = b0; t0 < b0 + tb; t0 += C) {
        const int c = (int)std::min<int64_t>(C, b0 + tb - t0);
        const int gc = (int)(G * c);
        const float* Kf = Fq.data() + (t0 - b0) * F;
        const float* Qf = Fq.data() + (tb + G * (t0 - b0)) * F;
        const float* lk = ls.data() + (t0 - b0);
        const float* lq = ls.data() + tb + G * (t0 - b0);
        load_rows(vp + b * svb + j * svh + t0 * svn, svn, c, (int)Dv, V.data());
        // ---- running max and intra-chunk decay [s <= t] exp(lk_s - mt_t)
        float m = r;
        for (int t = 0; t < c; ++t) mt[t] = m = std::max(m, lk[t]);
        if (emit) {
        for (int t = 0; t < c; ++t) {
          float* dr = dec.data() + (int64_t)t * c;
          const float mtt = mt[t];
#pragma omp simd
          for (int s = 0; s < c; ++s) {
            const float e = lk[s] - mtt;
            dr[s] = e > fl ? e : fl;
          }
        }
        exp_inplace(dec.data(), c * c);
        for (int t = 0; t < c; ++t)
          for (int s = t + 1; s < c; ++s) dec[(int64_t)t * c + s] = 0.0f;
        // ---- inter-chunk part: O = exp(r - mt_t) Qf Sv, den = exp(r - mt_t) Qf z
        gemm(false, false, gc, (int)Dv, (int)F, Qf, (int)F, Sv, (int)Dv, 0.0f, O.data(), (int)Dv);
        for (int i = 0; i < gc; ++i) {
          const float* qr = Qf + (int64_t)i * F;
          float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
          for (int64_t f = 0; f < F; ++f) acc += qr[f] * z[f];
          den[i] = acc;
        }
        for (int t = 0; t < c; ++t) {
          const float wt = std::exp(std::max(r - mt[t], fl));
          if (wt != 1.0f)
            for (int64_t g = 0; g < G; ++g) {
              float* o = O.data() + (g * c + t) * Dv;
#pragma omp simd
              for (int64_t d = 0; d < Dv; ++d) o[d] *= wt;
              den[g * c + t] *= wt;
            }
        }
        // ---- intra-chunk part: O += (Qf Kf^T .* dec) V, den += row sums of the same tile
        gemm(false, true, gc, c, (int)F, Qf, (int)F, Kf, (int)F, 0.0f, A.data(), c);
        for (int64_t g = 0; g < G; ++g)
          for (int t = 0; t < c; ++t) {
            float* ar = A.data() + (g * c + t) * c;
            const float* dr = dec.data() + (int64_t)t * c;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int s = 0; s < c; ++s) {
              ar[s] *= dr[s];
              acc += ar[s];
            }
            den[g * c + t] += acc;
          }
        gemm(false, false, gc, (int)Dv, c, A.data(), c, V.data(), (int)Dv, 1.0f, O.data(), (int)Dv);
        }
        // ---- state: Sv = e^(r - r_end) Sv + Kf^T (V .* w), z = e^(r - r_end) z + Kf^T w, w = e^(lk - r_end)
        const float r_end = mt[c - 1];
        for (int s = 0; s < c; ++s) {
          const float ws = std::exp(std::max(lk[s] - r_end, fl));
          w[s] = ws;
          const float* vr = V.data() + (int64_t)s * Dv;
          float* wr = Wv.data() + (int64_t)s * Dv;
#pragma omp simd
          for (int64_t d = 0; d < Dv; ++d) wr[d] = vr[d] * ws;
        }
        const float carry = std::exp(std::max(r - r_end, fl));
        if (carry != 1.0f) {
#pragma omp simd
          for (int64_t i = 0; i < F * Dv; ++i) Sv[i] *= carry;
#pragma omp simd
          for (int64_t f = 0; f < F; ++f) z[f] *= carry;
        }
        gemm(true, false, (int)F, (int)Dv, c, Kf, (int)F, Wv.data(), (int)Dv, 1.0f, Sv, (int)Dv);
        for (int s = 0; s < c; ++s) {
          const float* kr = Kf + (int64_t)s * F;
          const float ws = w[s];
#pragma omp simd
          for (int64_t f = 0; f < F; ++f) z[f] += kr[f] * ws;
        }
        r = r_end;
        // ---- emit
        for (int64_t g = 0; emit && g < G; ++g) {
          const int64_t h = j * G + g;
          for (int t = 0; t < c; ++t) {
            const float* o = O.data() + (g * c + t) * Dv;
            const float dn = den[g * c + t];
            if (norm) {
              float* dst = outp + ((b * H + h) * N + t0 + t) * Dv;
              const float inv = 1.0f / std::max(dn, (float)eps);
#pragma omp simd
              for (int64_t d = 0; d < Dv; ++d) dst[d] = o[d] * inv;
            } else {
              float* dst = outp + ((b * H + h) * N + t0 + t) * Dv1;
              std::copy(o, o + Dv, dst);
              dst[Dv] = dn;
              lqp[(b * H + h) * N + t0 + t] = lq[g * c + t];
            }
          }
        }
        if (emit && !norm)
          for (int t = 0; t < c; ++t) mtp[task * N + t0 + t] = mt[t];
      }
      }
  };

  // Tokens of a scan are split into P segments when there are fewer scans than 2x threads: the
  // segments' own state increments are computed in parallel (keys only), combined in order,
  // and then every segment runs in parallel from its incoming state (P = 1: one pass).
  const int64_t tasks = B * Hkv, nch = (N + C - 1) / C;
  int64_t P = segments > 0 ? segments : (2 * at::get_num_threads() + tasks - 1) / tasks;
  P = std::max<int64_t>(1, std::min<int64_t>(P, nch));
  const int64_t seg = (nch + P - 1) / P * C;  // tokens per segment (whole chunks)
  P = (N + seg - 1) / seg;
  std::vector<float> segS((size_t)tasks * P * F * Dv1);  // per (task, segment): incoming [Sv | z]
  std::vector<float> segR((size_t)tasks * P);
  for (int64_t task = 0; task < tasks; ++task) {  // segment 0: the incoming state, split
    const float* St = Sp + task * F * Dv1;
    float* S0 = segS.data() + task * P * F * Dv1;
    for (int64_t f = 0; f < F; ++f) {
      std::copy(St + f * Dv1, St + f * Dv1 + Dv, S0 + f * Dv);
      S0[F * Dv + f] = St[f * Dv1 + Dv];
    }
    segR[task * P] = refp[task];
  }
  if (P > 1) {
    // increments of segments 0..P-2, relative to their own running max
    std::vector<float> inc((size_t)tasks * (P - 1) * F * Dv1, 0.0f), incR((size_t)tasks * (P - 1), -1e30f);
    at::parallel_for(0, tasks * (P - 1), 1, [&](int64_t begin, int64_t end) {
      Scratch sc(G, TB, C, D, F, Dv);
      for (int64_t u = begin; u < end; ++u) {
        const int64_t task = u / (P - 1), p = u % (P - 1);
        float* Sv = inc.data() + u * F * Dv1;
        scan(sc, task, p * seg, std::min<int64_t>(N, (p + 1) * seg), Sv, Sv + F * Dv, incR[u], false);
      }
    });
    // incoming state of segment p: that of p-1 advanced by p-1's increment
    for (int64_t task = 0; task < tasks; ++task)
      for (int64_t p = 1; p < P; ++p) {
        const float* prev = segS.data() + (task * P + p - 1) * F * Dv1;
        const float* add = inc.data() + (task * (P - 1) + p - 1) * F * Dv1;
        const float ra = segR[task * P + p - 1], rb = incR[task * (P - 1) + p - 1], rn = std::max(ra, rb);
        const float wa = std::exp(std::max(ra - rn, fl)), wb = std::exp(std::max(rb - rn, fl));
        float* cur = segS.data() + (task * P + p) * F * Dv1;
#pragma omp simd
        for (int64_t i = 0; i < F * Dv1; ++i) cur[i] = wa * prev[i] + wb * add[i];
        segR[task * P + p] = rn;
      }
  }
  // every segment from its incoming state; the last one's final state is the result
  at::parallel_for(0, tasks * P, 1, [&](int64_t begin, int64_t end) {
    Scratch sc(G, TB, C, D, F, Dv);
    for (int64_t u = begin; u < end; ++u) {
      const int64_t task = u / P, p = u % P;
      float* Sv = segS.data() + u * F * Dv1;
      float r = segR[u];
      scan(sc, task, p * seg, std::min<int64_t>(N, (p + 1) * seg), Sv, Sv + F * Dv, r, true);
      if (p == P - 1) {
        float* St = Sp + task * F * Dv1;
        for (int64_t f = 0; f < F; ++f) {
          std::copy(Sv + f * Dv, Sv + f * Dv + Dv, St + f * Dv1);
          St[f * Dv1 + Dv] = Sv[F * Dv + f];
        }
        refp[task] = r;
      }
    }
  });
}

// xq [B,H,N,D], xk [B,Hkv,N,D], v [B,Hkv,N,Dv] (float32 or bfloat16, unit inner stride); W [F,D],
// bias [F] or empty; key_mask [B,N] bool or empty; lk_add [B,Hkv,N] or empty; S [B,Hkv,F,Dv+1]
// and ref [B,Hkv] updated in place. eps >= 0: out [B,H,N,Dv] normalised; eps < 0: out
// [B,H,N,Dv+1] (numerator, denominator), mt_out [B,Hkv,N] (running key max), lq_out [B,H,N].
void causal_positive(const at::Tensor& xq, const at::Tensor& xk, const at::Tensor& v, const at::Tensor& W,
                     const at::Tensor& bias, double coef, double c0, const at::Tensor& key_mask, const at::Tensor& lk_add,
                     at::Tensor S, at::Tensor ref, int64_t chunk, double eps, double floor_, at::Tensor out,
                     at::Tensor mt_out, at::Tensor lq_out, int64_t segments) {
  TORCH_CHECK(W.is_contiguous() && S.is_contiguous() && ref.is_contiguous() && out.is_contiguous(), "contiguous buffers");
  TORCH_CHECK(W.scalar_type() == at::kFloat && S.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "float32 buffers");
  check_sizes(xq, xk, v, chunk);
  if (xq.numel() == 0 || v.size(3) == 0) return;  // nothing to compute (and no task to divide by)
  dispatch_qkv(xq, xk, v, [&](auto tag) {
    run<decltype(tag)>(xq, xk, v, W, bias, coef, c0, key_mask, lk_add, S, ref, chunk, eps, floor_, out, mt_out, lq_out, segments);
  });
}

// ---------------------------------------------------------------------------------------------
// Exact part of a causal hybrid: softmax weights over the local window (t-W < s <= t) and the
// sinks (the first real tokens, when outside the window), as a Partial in log space: per query
// num = sum_s p_s v_s, den = sum_s p_s, ls = max visible score, p_s = exp(score_s - ls).
// Twin of ops/hybrid.exact_local (causal). Chunks of queries are independent: one task per
// (batch, kv head, chunk), the G query heads of the kv head stacked as rows of one gemm.
template <typename T>
void band_run(const at::Tensor& xq, const at::Tensor& xk, const at::Tensor& v, double scale, const at::Tensor& key_mask,
              int64_t window, const at::Tensor& sink_pos, const at::Tensor& sink_ok, int64_t chunk, double floor_,
              at::Tensor& num, at::Tensor& den, at::Tensor& ls) {
  const int64_t B = xq.size(0), H = xq.size(1), N = xq.size(2), D = xq.size(3);
  const int64_t Hkv = xk.size(1), G = H / Hkv, Dv = v.size(3);
  const int64_t W = window, C = std::min<int64_t>(chunk, N), NS = sink_pos.numel() ? sink_pos.size(1) : 0;
  const int64_t nch = (N + C - 1) / C;
  const int64_t KW = C + std::min<int64_t>(std::max<int64_t>(W, 1), N) - 1;  // band keys of a full chunk
  const T* xqp = xq.data_ptr<T>();
  const T* xkp = xk.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const bool* kmp = key_mask.numel() ? key_mask.data_ptr<bool>() : nullptr;
  const int64_t* spp = NS ? sink_pos.data_ptr<int64_t>() : nullptr;
  const bool* sop = NS ? sink_ok.data_ptr<bool>() : nullptr;
  float* nump = num.data_ptr<float>();
  float* denp = den.data_ptr<float>();
  float* lsp = ls.data_ptr<float>();
  const int64_t sqn = xq.stride(2), sqh = xq.stride(1), sqb = xq.stride(0);
  const int64_t skn = xk.stride(2), skh = xk.stride(1), skb = xk.stride(0);
  const int64_t svn = v.stride(2), svh = v.stride(1), svb = v.stride(0);
  const float fl = (float)floor_, sc = (float)scale;

  at::parallel_for(0, B * Hkv * nch, 1, [&](int64_t begin, int64_t end) {
    const int64_t K = KW + NS;  // band keys, then sinks
    std::vector<float> Q((size_t)G * C * D), Kb((size_t)K * D), Vb((size_t)K * Dv), P((size_t)G * C * K), O((size_t)G * C * Dv);
    std::vector<float> kneg(K), kmul(K);  // per band key: 0 / -inf and 1 / 0 (padding)
    std::vector<int64_t> spos(NS);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bj = task / nch, ci = task % nch;
      const int64_t b = bj / Hkv, j = bj % Hkv;
      const int64_t t0 = ci * C;
      const int64_t c = std::min<int64_t>(C, N - t0);
      const int64_t s0 = W > 0 ? std::max<int64_t>(0, t0 - W + 1) : t0;  // first band key
      const int64_t nb = W > 0 ? t0 + c - s0 : 0;                        // band keys of this chunk
      // keys: the band, then the sinks that exist (positions kept for the visibility test)
      load_rows(xkp + b * skb + j * skh + s0 * skn, skn, (int)nb, (int)D, Kb.data());
      load_rows(vp + b * svb + j * svh + s0 * svn, svn, (int)nb, (int)Dv, Vb.data());
      for (int64_t i = 0; i < nb; ++i) {
        const bool real = kmp == nullptr || kmp[b * N + s0 + i];
        kneg[i] = real ? 0.0f : -INFINITY;
        kmul[i] = real ? 1.0f : 0.0f;
      }
      int64_t nk = nb;
      for (int64_t i = 0; i < NS; ++i) {
        if (!sop[b * NS + i]) continue;
        const int64_t p = spp[b * NS + i];
        load_rows(xkp + b * skb + j * skh + p * skn, skn, 1, (int)D, Kb.data() + nk * D);
        load_rows(vp + b * svb + j * svh + p * svn, svn, 1, (int)Dv, Vb.data() + nk * Dv);
        spos[nk - nb] = p;
        ++nk;
      }
      for (int64_t g = 0; g < G; ++g)
        load_rows(xqp + b * sqb + (j * G + g) * sqh + t0 * sqn, sqn, (int)c, (int)D, Q.data() + g * c * D);
      const int gc = (int)(G * c);
      if (nk > 0) gemm(false, true, gc, (int)nk, (int)D, Q.data(), (int)D, Kb.data(), (int)D, 0.0f, P.data(), (int)nk);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t t = 0; t < c; ++t) {
          const int64_t tq = t0 + t;
          float* pr = P.data() + (g * c + t) * nk;
          // visible: band keys i in [lo, hi] (tq-W < s <= tq) that are real; sinks p <= tq - W
          const int64_t lo = W > 0 ? std::max<int64_t>(0, tq - W + 1 - s0) : 0, hi = W > 0 ? tq - s0 : -1;
          float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
          for (int64_t i = lo; i <= hi; ++i) {
            const float x = pr[i] * sc + kneg[i];
            pr[i] = x;
            mx = x > mx ? x : mx;
          }
          for (int64_t i = nb; i < nk; ++i) {
            if (spos[i - nb] <= tq - W) {
              pr[i] *= sc;
              mx = std::max(mx, pr[i]);
            }
          }
          const bool any = mx > -INFINITY;
          const int64_t row = ((b * H + j * G + g) * N + tq);
          lsp[row] = any ? mx : -1e30f;
          float dsum = 0.0f;
          std::fill(pr, pr + lo, 0.0f);
          std::fill(pr + std::max<int64_t>(hi + 1, 0), pr + nb, 0.0f);
          if (any) {
#pragma omp simd
            for (int64_t i = lo; i <= hi; ++i) {
              const float e = pr[i] - mx;
              pr[i] = e > fl ? e : fl;
            }
            if (hi >= lo) exp_inplace(pr + lo, (int)(hi - lo + 1));
#pragma omp simd reduction(+ : dsum)
            for (int64_t i = lo; i <= hi; ++i) {
              pr[i] *= kmul[i];
              dsum += pr[i];
            }
            for (int64_t i = nb; i < nk; ++i) {
              pr[i] = spos[i - nb] <= tq - W ? std::exp(std::max(pr[i] - mx, fl)) : 0.0f;
              dsum += pr[i];
            }
          } else {
            std::fill(pr, pr + nk, 0.0f);
          }
          denp[row] = dsum;
        }
      if (nk > 0) {
        gemm(false, false, gc, (int)Dv, (int)nk, P.data(), (int)nk, Vb.data(), (int)Dv, 0.0f, O.data(), (int)Dv);
      } else {
        std::fill(O.begin(), O.end(), 0.0f);
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t t = 0; t < c; ++t)
          std::copy(O.data() + (g * c + t) * Dv, O.data() + (g * c + t + 1) * Dv, nump + ((b * H + j * G + g) * N + t0 + t) * Dv);
    }
  });
}

// xq [B,H,N,D], xk [B,Hkv,N,D], v [B,Hkv,N,Dv] (float32/bfloat16/float16, unit inner stride),
// scores scale * q.k; key_mask [B,N] bool or empty; window W >= 0; sink_pos [B,S] int64 and
// sink_ok [B,S] bool (or empty); outputs num [B,H,N,Dv], den [B,H,N], ls [B,H,N] float32.
void causal_band(const at::Tensor& xq, const at::Tensor& xk, const at::Tensor& v, double scale, const at::Tensor& key_mask,
                 int64_t window, const at::Tensor& sink_pos, const at::Tensor& sink_ok, int64_t chunk, double floor_,
                 at::Tensor num, at::Tensor den, at::Tensor ls) {
  TORCH_CHECK(num.is_contiguous() && den.is_contiguous() && ls.is_contiguous(), "contiguous outputs");
  TORCH_CHECK(window >= 0, "window >= 0");
  check_sizes(xq, xk, v, chunk);
  if (xq.numel() == 0 || v.size(3) == 0) return;
  dispatch_qkv(xq, xk, v, [&](auto tag) {
    band_run<decltype(tag)>(xq, xk, v, scale, key_mask, window, sink_pos, sink_ok, chunk, floor_, num, den, ls);
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "whether sgemm was found in this PyTorch build");
  m.def("causal_positive", &causal_positive, "fused causal positive-feature attention (inference)");
  m.def("causal_band", &causal_band, "exact part of a causal hybrid: window + sinks (inference)");
}
