// Fused causal positive-random-feature attention for CPUs (inference only, float32 compute).
//
// Twin of hf_rfa/ops/linear.py (causal_feature_attention with a positive feature map, no
// autograd): same chunkwise math, same streaming-safe stabilisation, but one task per
// (batch, key/value head) runs the whole sequence chunk by chunk on buffers that stay in the
// core's cache, calling MKL's single-threaded sgemm and vsExp directly (no per-op dispatch, no
// Python loop, no [N, F] tensor). Tasks are spread over threads with at::parallel_for.
//
// Per chunk of C tokens (G query heads share the kv head's keys; Dv1 = Dv + 1, the last value
// column is the denominator's ones):
//   key features   Kf[C,F] = exp(xk W^T + bias - rowmax),  lk = rowmax + coef*|xk|^2 + c0 (+ lk_add)
//   query features Qf[G*C,F] likewise (lq only returned for the unnormalised output)
//   running max    mt_t = max(ref, max_{s<=t} lk_s)
//   output         O = exp(ref - mt_t) * Qf S  +  (Qf Kf^T  .*  [s<=t] exp(lk_s - mt_t)) Va
//   state          S = exp(ref - r_end) S + Kf^T (Va .* exp(lk - r_end)),  ref = r_end = mt_{C-1}
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

template <typename T>
inline void load_rows(const T* src, int64_t stride, int R, int D, float* dst) {
  for (int r = 0; r < R; ++r)
    for (int d = 0; d < D; ++d) dst[(int64_t)r * D + d] = static_cast<float>(src[r * stride + d]);
}

template <typename T>
void run(const at::Tensor& xq, const at::Tensor& xk, const at::Tensor& v, const at::Tensor& W, const at::Tensor& bias,
         double coef, double c0, const at::Tensor& key_mask, const at::Tensor& lk_add, at::Tensor& S, at::Tensor& ref,
         int64_t chunk, double eps, double floor_, at::Tensor& out, const at::Tensor& mt_out, const at::Tensor& lq_out) {
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
  const int C = (int)chunk;
  const float fl = (float)floor_;

  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> xs((size_t)(G + 1) * C * D), Fq((size_t)(G + 1) * C * F), ls((size_t)(G + 1) * C), mt(C);
    std::vector<float> Va((size_t)C * Dv1), Wv((size_t)C * Dv1), A((size_t)G * C * C), dec((size_t)C * C), O((size_t)G * C * Dv1);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, j = task % Hkv;
      float* St = Sp + task * F * Dv1;
      float r = refp[task];
      for (int64_t t0 = 0; t0 < N; t0 += C) {
        const int c = (int)std::min<int64_t>(C, N - t0);
        // ---- features of the chunk's keys (rows 0..c) and of its G query heads (rows c..(G+1)c), one gemm
        load_rows(xkp + b * skb + j * skh + t0 * skn, skn, c, (int)D, xs.data());
        for (int64_t g = 0; g < G; ++g)
          load_rows(xqp + b * sqb + (j * G + g) * sqh + t0 * sqn, sqn, c, (int)D, xs.data() + (1 + g) * c * D);
        features(xs.data(), (int)((G + 1) * c), (int)D, Wp, bp, (int)F, (float)coef, (float)c0, fl, Fq.data(), ls.data());
        const float* Kf = Fq.data();
        const float* Qf = Fq.data() + (int64_t)c * F;
        float* lk = ls.data();
        const float* lq = ls.data() + c;
        // key log scales; masked keys: zero features, log scale NEG
        for (int s = 0; s < c; ++s) {
          if (lap != nullptr) lk[s] += lap[task * N + t0 + s];
          if (kmp != nullptr && !kmp[b * N + t0 + s]) {
            lk[s] = -1e30f;
            std::fill(Fq.begin() + (int64_t)s * F, Fq.begin() + (int64_t)(s + 1) * F, 0.0f);
          }
        }
        // ---- values with the ones column
        for (int s = 0; s < c; ++s) {
          const T* vr = vp + b * svb + j * svh + (t0 + s) * svn;
          for (int64_t d = 0; d < Dv; ++d) Va[(int64_t)s * Dv1 + d] = static_cast<float>(vr[d]);
          Va[(int64_t)s * Dv1 + Dv] = 1.0f;
        }
        // ---- running max and intra-chunk decay [s <= t] exp(lk_s - mt_t)
        float m = r;
        for (int t = 0; t < c; ++t) mt[t] = m = std::max(m, lk[t]);
        for (int t = 0; t < c; ++t)
          for (int s = 0; s < c; ++s) dec[(int64_t)t * c + s] = s <= t ? std::max(lk[s] - mt[t], fl) : fl;
        exp_inplace(dec.data(), c * c);
        for (int t = 0; t < c; ++t)
          for (int s = t + 1; s < c; ++s) dec[(int64_t)t * c + s] = 0.0f;
        // ---- inter-chunk part: O = exp(r - mt_t) Qf S
        gemm(false, false, (int)(G * c), (int)Dv1, (int)F, Qf, (int)F, St, (int)Dv1, 0.0f, O.data(), (int)Dv1);
        for (int t = 0; t < c; ++t) {
          const float w = std::exp(std::max(r - mt[t], fl));
          if (w != 1.0f)
            for (int64_t g = 0; g < G; ++g) {
              float* o = O.data() + (g * c + t) * Dv1;
#pragma omp simd
              for (int64_t d = 0; d < Dv1; ++d) o[d] *= w;
            }
        }
        // ---- intra-chunk part: O += (Qf Kf^T .* dec) Va
        gemm(false, true, (int)(G * c), c, (int)F, Qf, (int)F, Kf, (int)F, 0.0f, A.data(), c);
        for (int64_t g = 0; g < G; ++g) {
          float* a = A.data() + g * c * c;
#pragma omp simd
          for (int64_t i = 0; i < (int64_t)c * c; ++i) a[i] *= dec[i];
        }
        gemm(false, false, (int)(G * c), (int)Dv1, c, A.data(), c, Va.data(), (int)Dv1, 1.0f, O.data(), (int)Dv1);
        // ---- state: S = exp(r - r_end) S + Kf^T (Va .* exp(lk - r_end))
        const float r_end = mt[c - 1];
        for (int s = 0; s < c; ++s) {
          const float w = std::exp(std::max(lk[s] - r_end, fl));
#pragma omp simd
          for (int64_t d = 0; d < Dv1; ++d) Wv[(int64_t)s * Dv1 + d] = Va[(int64_t)s * Dv1 + d] * w;
        }
        const float carry = std::exp(std::max(r - r_end, fl));
        if (carry != 1.0f)
#pragma omp simd
          for (int64_t i = 0; i < F * Dv1; ++i) St[i] *= carry;
        gemm(true, false, (int)F, (int)Dv1, c, Kf, (int)F, Wv.data(), (int)Dv1, 1.0f, St, (int)Dv1);
        r = r_end;
        // ---- emit
        for (int64_t g = 0; g < G; ++g) {
          const int64_t h = j * G + g;
          for (int t = 0; t < c; ++t) {
            const float* o = O.data() + (g * c + t) * Dv1;
            if (norm) {
              float* dst = outp + ((b * H + h) * N + t0 + t) * Dv;
              const float den = std::max(o[Dv], (float)eps);
#pragma omp simd
              for (int64_t d = 0; d < Dv; ++d) dst[d] = o[d] / den;
            } else {
              float* dst = outp + ((b * H + h) * N + t0 + t) * Dv1;
              std::copy(o, o + Dv1, dst);
              lqp[(b * H + h) * N + t0 + t] = lq[g * c + t];
            }
          }
        }
        if (!norm)
          for (int t = 0; t < c; ++t) mtp[task * N + t0 + t] = mt[t];
      }
      refp[task] = r;
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
                     at::Tensor mt_out, at::Tensor lq_out) {
  TORCH_CHECK(available(), "hf_rfa native kernel: no sgemm in this PyTorch build");
  TORCH_CHECK(xq.scalar_type() == xk.scalar_type() && xk.scalar_type() == v.scalar_type(), "q, k, v dtypes differ");
  TORCH_CHECK(xq.stride(3) == 1 && xk.stride(3) == 1 && v.stride(3) == 1, "q, k, v need unit inner stride");
  TORCH_CHECK(W.is_contiguous() && S.is_contiguous() && ref.is_contiguous() && out.is_contiguous(), "contiguous buffers");
  TORCH_CHECK(W.scalar_type() == at::kFloat && S.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "float32 buffers");
  if (xq.scalar_type() == at::kFloat) {
    run<float>(xq, xk, v, W, bias, coef, c0, key_mask, lk_add, S, ref, chunk, eps, floor_, out, mt_out, lq_out);
  } else if (xq.scalar_type() == at::kBFloat16) {
    run<at::BFloat16>(xq, xk, v, W, bias, coef, c0, key_mask, lk_add, S, ref, chunk, eps, floor_, out, mt_out, lq_out);
  } else if (xq.scalar_type() == at::kHalf) {
    run<at::Half>(xq, xk, v, W, bias, coef, c0, key_mask, lk_add, S, ref, chunk, eps, floor_, out, mt_out, lq_out);
  } else {
    TORCH_CHECK(false, "q/k/v must be float32, bfloat16 or float16");
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "whether sgemm was found in this PyTorch build");
  m.def("causal_positive", &causal_positive, "fused causal positive-feature attention (inference)");
}
