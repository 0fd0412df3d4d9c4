#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/native/TopKImpl.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "bf16.h"
#include "simd.h"

// Fused elementwise chains of the decoder layer on CPU, float32 or bfloat16 rows: each replaces 4-9
// torch ops (and their Python calls and temporaries) by one pass over the rows; so does a MoE router's
// softmax and top-k (moe_route, below). The float operations are HF Llama's, per element in the same
// order (built without -ffast-math and with -ffp-contract=off: no fused multiply-adds where torch has
// none), except the RMS sum of squares, accumulated in another order, and SiLU's exponential, a
// vectorizable polynomial within 2e-7 of expf (a call to expf does not vectorize without -ffast-math,
// and a 2048-token prompt chunk needs millions). In bfloat16 each value is rounded to bf16 where HF's
// bf16 modules round it: torch runs a bf16 op in float32 and rounds its result, so rotary rounds each
// product and each sum, SiLU-and-mul the SiLU and the product, and RMSNorm (float32 statistics) the
// normalised row and its product with the bf16 weight.

namespace {

// rows per task: small tensors (a batch-1 decode) stay on the calling thread
inline int64_t grain(int64_t row_floats) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_floats, 1)); }

using namespace ecoserve_simd;

// The loops over c10::BFloat16 elements do not vectorize on their own: bf16 rows take explicit vector
// loops (the same operations in the same order per element), float32 rows the compiler's.
template <typename T>
constexpr bool explicit_simd() {
#ifdef ECOSERVE_SIMD
  return std::is_same_v<T, c10::BFloat16>;
#else
  return false;
#endif
}

template <typename T>
inline void rms_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  float ss = 0.f;
  int64_t i = 0;
#ifdef ECOSERVE_SIMD
  if constexpr (explicit_simd<T>()) {
    vec acc = vset1(0.f);
    for (; i + W <= n; i += W) {
      const vec xi = vload(x + i);
      acc = vadd(acc, vmul(xi, xi));
    }
    ss = vsum(acc);
  }
#endif
#pragma omp simd reduction(+:ss)
  for (int64_t j = i; j < n; ++j) ss += to_float(x[j]) * to_float(x[j]);
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  i = 0;
#ifdef ECOSERVE_SIMD
  if constexpr (explicit_simd<T>()) {
    const vec vinv = vset1(inv);
    for (; i + W <= n; i += W) vstore(out + i, vmul(vload(w + i), vround_bf16(vmul(vload(x + i), vinv))));
  }
#endif
#pragma omp simd
  for (int64_t j = i; j < n; ++j) out[j] = from_float<T>(to_float(w[j]) * round_to<T>(to_float(x[j]) * inv));
}

bool is_supported(const torch::Tensor& x) { return x.dtype() == torch::kFloat32 || x.dtype() == torch::kBFloat16; }

void check_rows(const torch::Tensor& x, const torch::Tensor& w, const char* what) {
  TORCH_CHECK(is_supported(x) && w.dtype() == x.dtype(), what, ": float32 or bfloat16 rows and weight alike, got ",
              x.dtype(), " and ", w.dtype());
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), what, ": contiguous tensors only");
  TORCH_CHECK(x.size(-1) == w.numel(), what, ": the weight must have the rows' length");
}

template <typename T>
void rms_rows(const torch::Tensor& x, const torch::Tensor& weight, torch::Tensor& out, float eps) {
  const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
  const T *xp = x.data_ptr<T>(), *wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, grain(n), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) rms_row(xp + r * n, wp, op + r * n, n, eps);
  });
}

// Each head's row of x [T, H, D] (contiguous heads, rows strided) normalised in place as rms_rows does.
template <typename T>
void rms_heads(torch::Tensor& x, const torch::Tensor& weight, float eps) {
  const int64_t tokens = x.size(0), H = x.size(1), D = x.size(2), row = x.stride(0);
  T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  at::parallel_for(0, tokens, grain(H * D), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t)
      for (int64_t h = 0; h < H; ++h) rms_row(xp + t * row + h * D, wp, xp + t * row + h * D, D, eps);
  });
}

// The half-split rotation in place: x1 cos - x2 sin, x2 cos + x1 sin, each product and sum a torch op.
template <typename T>
void rotate_rows(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const int64_t tokens = x.size(0), H = x.size(1), D = x.size(2), half = D / 2, row = x.stride(0);
  T* xp = x.data_ptr<T>();
  const T *cp = cos.data_ptr<T>(), *sp = sin.data_ptr<T>();
  at::parallel_for(0, tokens, grain(H * D), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const T *c = cp + t * half, *s = sp + t * half;
      for (int64_t h = 0; h < H; ++h) {
        T* x1 = xp + t * row + h * D;
        T* x2 = x1 + half;
        int64_t i = 0;
#ifdef ECOSERVE_SIMD
        if constexpr (explicit_simd<T>()) {
          for (; i + W <= half; i += W) {
            const vec a = vload(x1 + i), b2 = vload(x2 + i), ci = vload(c + i), si = vload(s + i);
            vstore(x1 + i, vsub(vround_bf16(vmul(a, ci)), vround_bf16(vmul(b2, si))));
            vstore(x2 + i, vadd(vround_bf16(vmul(b2, ci)), vround_bf16(vmul(a, si))));
          }
        }
#endif
#pragma omp simd
        for (int64_t j = i; j < half; ++j) {
          const float a = to_float(x1[j]), b2 = to_float(x2[j]), ci = to_float(c[j]), si = to_float(s[j]);
          x1[j] = from_float<T>(round_to<T>(a * ci) - round_to<T>(b2 * si));
          x2[j] = from_float<T>(round_to<T>(b2 * ci) + round_to<T>(a * si));
        }
      }
    }
  });
}

template <typename T>
void silu_mul_rows(const torch::Tensor& x, torch::Tensor& out) {
  const int64_t two = x.size(-1), inter = two / 2, rows = x.numel() / std::max<int64_t>(two, 1);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, grain(two), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T *g = xp + r * two, *u = g + inter;
      T* o = op + r * inter;
      int64_t i = 0;
#ifdef ECOSERVE_SIMD
      if constexpr (explicit_simd<T>())
        for (; i + W <= inter; i += W) vstore(o + i, vmul(vround_bf16(vsilu(vload(g + i))), vload(u + i)));
#endif
#pragma omp simd
      for (int64_t j = i; j < inter; ++j) o[j] = from_float<T>(round_to<T>(silu(to_float(g[j]))) * to_float(u[j]));
    }
  });
}

// One row of router logits [E] -> its top-k experts and their softmax probabilities (renormalised over the k
// when asked), float32 throughout. The selection is torch's own CPU top-k loop (TopKImpl.h), so experts whose
// probabilities tie come out in torch's order: a bf16 router has many ties, and at the k-th place the order
// decides which expert runs.
template <typename T>
void route_row(const T* logits, int64_t E, int64_t k, bool normalize, float* probs, float* weights, int64_t* ids) {
  float mx = -INFINITY;
  for (int64_t e = 0; e < E; ++e) mx = std::max(mx, to_float(logits[e]));
  float sum = 0.f;
  for (int64_t e = 0; e < E; ++e) sum += (probs[e] = std::exp(to_float(logits[e]) - mx));
  const float inv = 1.f / sum;  // torch's softmax multiplies by the reciprocal of the sum
  for (int64_t e = 0; e < E; ++e) probs[e] *= inv;
  char* data[3] = {reinterpret_cast<char*>(weights), reinterpret_cast<char*>(ids), reinterpret_cast<char*>(probs)};
  const int64_t strides[3] = {0, 0, 0};
  at::native::topk_impl_loop<float, float>(1, 1, 1, k, E, /*largest=*/true, /*sorted=*/true, data, strides, 1);
  if (normalize) {
    float total = 0.f;
    for (int64_t j = 0; j < k; ++j) total += weights[j];
    for (int64_t j = 0; j < k; ++j) weights[j] /= total;
  }
}

template <typename T, typename W>
void route_rows(const torch::Tensor& logits, int64_t k, bool normalize, torch::Tensor& weights, torch::Tensor& ids) {
  const int64_t rows = logits.size(0), E = logits.size(1);
  const T* lp = logits.data_ptr<T>();
  W* wp = weights.data_ptr<W>();
  int64_t* ip = ids.data_ptr<int64_t>();
  at::parallel_for(0, rows, grain(E * 8), [&](int64_t b, int64_t e) {
    std::vector<float> probs(E), top(k);
    for (int64_t r = b; r < e; ++r) {
      route_row(lp + r * E, E, k, normalize, probs.data(), top.data(), ip + r * k);
      for (int64_t j = 0; j < k; ++j) wp[r * k + j] = static_cast<W>(top[j]);
    }
  });
}

}  // namespace

// weight * (x * rsqrt(mean(x^2) + eps)) over the last dim.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, weight, "rms_norm");
  auto out = torch::empty_like(x);
  if (x.dtype() == torch::kBFloat16) rms_rows<c10::BFloat16>(x, weight, out, static_cast<float>(eps));
  else rms_rows<float>(x, weight, out, static_cast<float>(eps));
  return out;
}

// In place on x [T, H, D] (rows may be strided, e.g. q or k inside the fused qkv output): each head
// normalised as rms_norm normalises a row, with one weight [D] for all heads (Qwen3's q and k norms).
torch::Tensor head_rms_norm_(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(is_supported(x) && weight.dtype() == x.dtype(), "head_rms_norm_: float32 or bfloat16 x and weight "
              "alike, got ", x.dtype(), " and ", weight.dtype());
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "head_rms_norm_: x must be [T, H, D] "
              "with contiguous heads");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(2), "head_rms_norm_: the weight must be [D]");
  if (x.dtype() == torch::kBFloat16) rms_heads<c10::BFloat16>(x, weight, static_cast<float>(eps));
  else rms_heads<float>(x, weight, static_cast<float>(eps));
  return x;
}

// In place on x [T, H, D] (rows may be strided, e.g. q or k inside the fused qkv output): the
// half-split rotation (x1 cos - x2 sin, x2 cos + x1 sin) with cos, sin [T, D/2] (or [T, 1, D/2]), all
// float32 or all bfloat16.
torch::Tensor rotary_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(is_supported(x) && cos.dtype() == x.dtype() && sin.dtype() == x.dtype(),
              "rotary_: x, cos and sin must be float32 or bfloat16 alike, got ", x.dtype(), ", ", cos.dtype(), " and ",
              sin.dtype());
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "rotary_: x must be [T, H, D] with "
              "contiguous heads");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous(), "rotary_: contiguous cos/sin only");
  const int64_t T = x.size(0), D = x.size(2), half = D / 2;
  TORCH_CHECK(cos.numel() == T * half && sin.numel() == T * half, "rotary_: cos/sin must be [T, D/2]");
  if (x.dtype() == torch::kBFloat16) rotate_rows<c10::BFloat16>(x, cos, sin);
  else rotate_rows<float>(x, cos, sin);
  return x;
}

// x [T, 2I] = [gate | up] -> silu(gate) * up [T, I].
torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(is_supported(x) && x.is_contiguous(), "silu_and_mul: contiguous float32 or bfloat16 only, got ",
              x.dtype());
  auto sizes = x.sizes().vec();
  sizes.back() = x.size(-1) / 2;
  auto out = torch::empty(sizes, x.options());
  if (x.dtype() == torch::kBFloat16) silu_mul_rows<c10::BFloat16>(x, out);
  else silu_mul_rows<float>(x, out);
  return out;
}

// A mixture-of-experts router's decision from its logits [T, E] (float32 or bfloat16): (weights [T, k], expert
// ids [T, k] int64), transformers' rule in one pass per row: softmax in float32, the top k, optionally
// renormalised over them, the weights cast to bfloat16 when `bf16_weights` (Qwen's routers) or kept float32.
std::vector<torch::Tensor> moe_route(torch::Tensor logits, int64_t top_k, bool normalize, bool bf16_weights) {
  TORCH_CHECK(is_supported(logits) && logits.dim() == 2 && logits.is_contiguous(), "moe_route: contiguous float32 "
              "or bfloat16 logits [T, E], got ", logits.dtype(), " ", logits.sizes());
  TORCH_CHECK(top_k >= 1 && top_k <= logits.size(1), "moe_route: top_k ", top_k, " must be in [1, ",
              logits.size(1), "]");
  auto weights = torch::empty({logits.size(0), top_k}, logits.options().dtype(bf16_weights ? torch::kBFloat16
                                                                                            : torch::kFloat32));
  auto ids = torch::empty({logits.size(0), top_k}, logits.options().dtype(torch::kInt64));
  const bool bf16_logits = logits.dtype() == torch::kBFloat16;
  if (bf16_logits && bf16_weights) route_rows<c10::BFloat16, c10::BFloat16>(logits, top_k, normalize, weights, ids);
  else if (bf16_logits) route_rows<c10::BFloat16, float>(logits, top_k, normalize, weights, ids);
  else if (bf16_weights) route_rows<float, c10::BFloat16>(logits, top_k, normalize, weights, ids);
  else route_rows<float, float>(logits, top_k, normalize, weights, ids);
  return {weights, ids};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm);
  m.def("head_rms_norm_", &head_rms_norm_, "each head of x [T, H, D] RMS-normalised in place");
  m.def("rotary_", &rotary_);
  m.def("silu_and_mul", &silu_and_mul);
  m.def("moe_route", &moe_route, "a router's top-k weights and expert ids from its logits");
}
