#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "simd.h"

// Weight-only quantized linear layers on CPU, reading GGUF blocks as stored (no float copy).
// A weight is [N, K / 32 * block_bytes] uint8: each row holds K / 32 blocks of 32 weights.
//   Q4_0 (type 2, 18 bytes): fp16 d, 16 bytes of nibbles; w = d * (q - 8)
//   Q4_1 (type 3, 20 bytes): fp16 d, fp16 m, 16 bytes of nibbles; w = d * q + m
//   Q8_0 (type 8, 34 bytes): fp16 d, 32 int8; w = d * q
// Nibble j of a block holds weight j (low half) and weight j + 16 (high half).
// The activations are quantized per 32-block to int8 (scale max|x| / 127), so each block is one
// integer dot product and one float FMA. Nibbles are centred (q - 8) so the activations' rounding
// error is not multiplied by a positive mean: Q4_1's w = d (q - 8) + (m + 8 d), whose offset
// multiplies the exact float sum of x's block.
// Each weight row is read from memory once for all activation rows; rows split across threads.

namespace {

constexpr int64_t QK = 32;

template <int64_t QT>
constexpr int64_t kBlockBytes = QT == 2 ? 18 : QT == 3 ? 20 : 34;

int64_t block_bytes(int64_t qtype) {
  switch (qtype) {
    case 2: return kBlockBytes<2>;
    case 3: return kBlockBytes<3>;
    case 8: return kBlockBytes<8>;
  }
  TORCH_CHECK(false, "quant_matmul: unsupported GGML type ", qtype, " (supported: 2 Q4_0, 3 Q4_1, 8 Q8_0)");
}

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

struct QuantizedRows {  // activations as int8 blocks
  std::vector<int8_t> q;     // [M, K]
  std::vector<float> scale;  // [M, K / 32]
  std::vector<float> sum;    // [M, K / 32] float sum of the block (Q4_1 offsets)
};

QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K) {
  const int64_t nb = K / QK;
  QuantizedRows r{std::vector<int8_t>(M * K), std::vector<float>(M * nb), std::vector<float>(M * nb)};
  for (int64_t i = 0; i < M * nb; ++i) {
    const float* xb = x + i * QK;
    float amax = 0.f, s = 0.f;
    for (int64_t j = 0; j < QK; ++j) { amax = std::max(amax, std::fabs(xb[j])); s += xb[j]; }
    const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    int8_t* qb = r.q.data() + i * QK;
    for (int64_t j = 0; j < QK; ++j) qb[j] = static_cast<int8_t>(std::nearbyint(xb[j] * id));
    r.scale[i] = d; r.sum[i] = s;
  }
  return r;
}

#ifdef ECOSERVE_SIMD_INT8
using ecoserve_simd::dot_u8s8;
using ecoserve_simd::hsum8;

// 32 weights of a block as signed bytes: q - 8 (Q4_0, Q4_1) or q (Q8_0).
template <int64_t QT>
inline __m256i load_weights(const uint8_t* blk) {
  if constexpr (QT == 8) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  } else {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (QT == 3 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
    return _mm256_sub_epi8(q, _mm256_set1_epi8(8));
  }
}

// Output row n against activation rows [m0, m0 + MR): out[m * N + n]. MR is a compile-time tile so
// the accumulators stay in registers; two per row (even and odd blocks) hide the FMA latency.
template <int64_t QT, int64_t MR>
inline void dot_tile(const uint8_t* row, int64_t nb, const QuantizedRows& xr, int64_t m0, int64_t K, float* out,
                     int64_t N, int64_t n) {
  constexpr int64_t bb = kBlockBytes<QT>;
  __m256 acc[2][MR];
  float offset[MR];
  for (int64_t m = 0; m < MR; ++m) { acc[0][m] = acc[1][m] = _mm256_setzero_ps(); offset[m] = 0.f; }
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * bb;
    const float d = half_to_float(blk);
    const __m256i wv = load_weights<QT>(blk);
    // maddubs/dpbusd take unsigned x signed: pass |w| and move w's sign onto x
    const __m256i u = _mm256_sign_epi8(wv, wv);
    const float offset_w = QT == 3 ? half_to_float(blk + 2) + 8.f * d : 0.f;
    for (int64_t m = 0; m < MR; ++m) {
      const int64_t i = (m0 + m) * (K / QK) + b;
      __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr.q.data() + (m0 + m) * K + b * QK));
      xv = _mm256_sign_epi8(xv, wv);
      acc[b & 1][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(u, xv)), _mm256_set1_ps(d * xr.scale[i]),
                                      acc[b & 1][m]);
      if constexpr (QT == 3) offset[m] += offset_w * xr.sum[i];
    }
  }
  for (int64_t m = 0; m < MR; ++m) out[(m0 + m) * N + n] = hsum8(_mm256_add_ps(acc[0][m], acc[1][m])) + offset[m];
}

// Output rows [n0, n1) against M activation rows: out[m * N + n]; each weight row is loaded from
// memory once and reused from L1 by every tile of activation rows.
template <int64_t QT>
void dot_rows(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t nb, const QuantizedRows& xr,
              int64_t M, int64_t K, float* out, int64_t N) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) dot_tile<QT, 4>(row, nb, xr, m, K, out, N, n);
    switch (M - m) {
      case 3: dot_tile<QT, 3>(row, nb, xr, m, K, out, N, n); break;
      case 2: dot_tile<QT, 2>(row, nb, xr, m, K, out, N, n); break;
      case 1: dot_tile<QT, 1>(row, nb, xr, m, K, out, N, n); break;
    }
  }
}
#else
template <int64_t QT>
void dot_rows(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t nb, const QuantizedRows& xr,
              int64_t M, int64_t K, float* out, int64_t N) {
  constexpr int64_t bb = kBlockBytes<QT>;
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t m = 0; m < M; ++m) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = w + n * row_bytes + b * bb;
        const float d = half_to_float(blk);
        const int8_t* xq = xr.q.data() + m * K + b * QK;
        int32_t s = 0;
        if constexpr (QT == 8) {
          for (int j = 0; j < QK; ++j) s += reinterpret_cast<const int8_t*>(blk + 2)[j] * xq[j];
        } else {
          const uint8_t* qs = blk + (QT == 3 ? 4 : 2);
          for (int j = 0; j < 16; ++j) s += ((qs[j] & 0x0F) - 8) * xq[j] + ((qs[j] >> 4) - 8) * xq[j + 16];
        }
        const int64_t i = m * nb + b;
        acc += d * xr.scale[i] * s + (QT == 3 ? (half_to_float(blk + 2) + 8.f * d) * xr.sum[i] : 0.f);
      }
      out[m * N + n] = acc;
    }
  }
}
#endif

void check_weight(const torch::Tensor& w, int64_t qtype, int64_t K) {
  TORCH_CHECK(w.dtype() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous(),
              "quant_matmul: weight must be a contiguous 2-D uint8 tensor");
  TORCH_CHECK(K % QK == 0 && w.size(1) == K / QK * block_bytes(qtype),
              "quant_matmul: weight row of ", w.size(1), " bytes does not hold ", K, " weights of type ", qtype);
}

}  // namespace

// x [M, K] float32 @ dequant(w)^T -> [M, N] float32.
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor w, int64_t qtype) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "quant_linear: x must be 2-D float32");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), nb = K / QK;
  check_weight(w, qtype, K);
  const QuantizedRows xr = quantize_rows(x.data_ptr<float>(), M, K);
  auto out = torch::empty({M, N}, x.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t rb = w.size(1);
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    if (qtype == 2) dot_rows<2>(wp, rb, begin, end, nb, xr, M, K, op, N);
    else if (qtype == 3) dot_rows<3>(wp, rb, begin, end, nb, xr, M, K, op, N);
    else dot_rows<8>(wp, rb, begin, end, nb, xr, M, K, op, N);
  });
  return out;
}

// w [N, K / 32 * block_bytes] -> float32 [N, K].
torch::Tensor dequantize(torch::Tensor w, int64_t qtype, int64_t K) {
  check_weight(w, qtype, K);
  const int64_t N = w.size(0), nb = K / QK, bb = block_bytes(qtype), row_bytes = w.size(1);
  auto out = torch::empty({N, K}, torch::dtype(torch::kFloat32));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = wp + n * row_bytes + b * bb;
        float* o = op + n * K + b * QK;
        const float d = half_to_float(blk);
        if (qtype == 8) {
          const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
          for (int j = 0; j < QK; ++j) o[j] = d * q[j];
        } else {
          const float m = qtype == 3 ? half_to_float(blk + 2) : -8.f * d;
          const uint8_t* qs = blk + (qtype == 3 ? 4 : 2);
          for (int j = 0; j < 16; ++j) { o[j] = d * (qs[j] & 0x0F) + m; o[j + 16] = d * (qs[j] >> 4) + m; }
        }
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_linear", &quant_linear);
  m.def("dequantize", &dequantize);
}
