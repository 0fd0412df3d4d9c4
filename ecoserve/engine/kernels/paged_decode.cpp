#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

// Paged decode attention on CPU: one query token per sequence, reading K/V straight from the
// paged cache (no gather copy). q: [B, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D];
// tables: [B, max_blocks] int64 block ids; lens: [B] int64 context lengths. float32 only.
// Each (sequence, kv head) pair is one task: scores for its G = Hq / Hkv query heads, softmax,
// then the weighted sum of V, reading each K and V row once.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables,
                           torch::Tensor lens, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k_cache.dtype() == torch::kFloat32 && v_cache.dtype() == torch::kFloat32,
              "paged_decode: float32 only");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() && tables.is_contiguous() &&
              lens.is_contiguous(), "paged_decode: contiguous tensors only");
  TORCH_CHECK(tables.dtype() == torch::kInt64 && lens.dtype() == torch::kInt64, "paged_decode: int64 tables/lens");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2);
  const int64_t G = Hq / Hkv, nblk = tables.size(1);
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const int64_t row = Hkv * D;  // floats between consecutive tokens of a block
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(G * D);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t b = idx / Hkv, h = idx % Hkv, L = lp[b];
      scores.resize(G * L);
      const float* qb = qp + (b * Hq + h * G) * D;
      const int64_t* table = tp + b * nblk;
      // pass 1: scores, walking each block's tokens with a fixed stride
      for (int64_t t0 = 0; t0 < L; t0 += bs) {
        const int64_t n = std::min(bs, L - t0);
        const float* kt = kp + (table[t0 / bs] * bs * Hkv + h) * D;
        for (int64_t i = 0; i < n; ++i, kt += row) {
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qb + g * D;
            float s = 0.f;
#pragma omp simd reduction(+:s)
            for (int64_t d = 0; d < D; ++d) s += qg[d] * kt[d];
            scores[g * L + t0 + i] = s * sc;
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * L;
        float m = -INFINITY;
        for (int64_t t = 0; t < L; ++t) m = std::max(m, sg[t]);
        float z = 0.f;
#pragma omp simd reduction(+:z)
        for (int64_t t = 0; t < L; ++t) { sg[t] = std::exp(sg[t] - m); z += sg[t]; }
        const float inv = 1.f / z;
        for (int64_t t = 0; t < L; ++t) sg[t] *= inv;
      }
      // pass 2: weighted sum of V
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = 0; t0 < L; t0 += bs) {
        const int64_t n = std::min(bs, L - t0);
        const float* vt = vp + (table[t0 / bs] * bs * Hkv + h) * D;
        for (int64_t i = 0; i < n; ++i, vt += row) {
          for (int64_t g = 0; g < G; ++g) {
            const float p = scores[g * L + t0 + i];
            float* ag = acc.data() + g * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ag[d] += p * vt[d];
          }
        }
      }
      for (int64_t g = 0; g < G; ++g)
        std::copy(acc.begin() + g * D, acc.begin() + (g + 1) * D, op + (b * Hq + h * G + g) * D);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_decode", &paged_decode); }
