#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "simd.h"

// Fused elementwise chains of the decoder layer on CPU, float32: each replaces 4-9 torch ops (and
// their Python calls and temporaries) by one pass over the rows. The float operations are HF
// Llama's, per element in the same order (built without -ffast-math and with -ffp-contract=off: no
// fused multiply-adds where torch has none), except the RMS sum of squares, accumulated in another
// order, and SiLU's exponential, a vectorizable polynomial within 2e-7 of expf (a call to expf
// does not vectorize without -ffast-math, and a 2048-token prompt chunk needs millions).

namespace {

// rows per task: small tensors (a batch-1 decode) stay on the calling thread
inline int64_t grain(int64_t row_floats) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_floats, 1)); }

using namespace ecoserve_simd;

// silu(g) = g * sigmoid(g), sigmoid from exp(-|g|) so that no exponential overflows.
inline float silu(float g) {
  const float z = exp_nonpositive(g < 0.f ? g : -g);
  return g * ((g < 0.f ? z : 1.f) / (1.f + z));
}

inline void rms_row(const float* x, const float* w, float* out, int64_t n, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+:ss)
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * inv);
}

void check_rows(const torch::Tensor& x, const torch::Tensor& w, const char* what) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && w.dtype() == torch::kFloat32, what, ": float32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), what, ": contiguous tensors only");
  TORCH_CHECK(x.size(-1) == w.numel(), what, ": the weight must have the rows' length");
}

}  // namespace

// weight * (x * rsqrt(mean(x^2) + eps)) over the last dim.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, weight, "rms_norm");
  auto out = torch::empty_like(x);
  const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, grain(n), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) rms_row(xp + r * n, wp, op + r * n, n, static_cast<float>(eps));
  });
  return out;
}

// In place on x [T, H, D] (rows may be strided, e.g. q or k inside the fused qkv output): the
// half-split rotation (x1 cos - x2 sin, x2 cos + x1 sin) with cos, sin [T, D/2] (or [T, 1, D/2]).
torch::Tensor rotary_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && cos.dtype() == torch::kFloat32 && sin.dtype() == torch::kFloat32,
              "rotary_: float32 only");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "rotary_: x must be [T, H, D] with "
              "contiguous heads");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous(), "rotary_: contiguous cos/sin only");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2, row = x.stride(0);
  TORCH_CHECK(cos.numel() == T * half && sin.numel() == T * half, "rotary_: cos/sin must be [T, D/2]");
  float* xp = x.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  at::parallel_for(0, T, grain(H * D), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float *c = cp + t * half, *s = sp + t * half;
      for (int64_t h = 0; h < H; ++h) {
        float* x1 = xp + t * row + h * D;
        float* x2 = x1 + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = x1[i], b2 = x2[i];
          x1[i] = a * c[i] - b2 * s[i];
          x2[i] = b2 * c[i] + a * s[i];
        }
      }
    }
  });
  return x;
}

// x [T, 2I] = [gate | up] -> silu(gate) * up [T, I].
torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous(), "silu_and_mul: contiguous float32 only");
  const int64_t two = x.size(-1), inter = two / 2, rows = x.numel() / std::max<int64_t>(two, 1);
  auto sizes = x.sizes().vec();
  sizes.back() = inter;
  auto out = torch::empty(sizes, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, grain(two), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float *g = xp + r * two, *u = g + inter;
      float* o = op + r * inter;
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) o[i] = silu(g[i]) * u[i];
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm);
  m.def("rotary_", &rotary_);
  m.def("silu_and_mul", &silu_and_mul);
}
