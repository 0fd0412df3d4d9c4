#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

// Weight-only quantized linear layers on CPU, reading GGUF blocks as stored (no float copy).
// A weight is [N, K / 32 * block_bytes] uint8: each row holds K / 32 blocks of 32 weights.
//   Q4_0 (type 2, 18 bytes): fp16 d, 16 bytes of nibbles; w = d * (q - 8)
//   Q4_1 (type 3, 20 bytes): fp16 d, fp16 m, 16 bytes of nibbles; w = d * q + m
//   Q8_0 (type 8, 34 bytes): fp16 d, 32 int8; w = d * q
// Nibble j of a block holds weight j (low half) and weight j + 16 (high half).
// The activations are quantized per 32-block to int8 (scale max|x| / 127) so each block is one
// integer dot product. Nibbles are centred (q - 8) so the activation rounding error is not
// multiplied by a positive mean; Q4_1's remaining offset (m + 8d) uses the exact float sum of x.

namespace {

constexpr int64_t QK = 32;

int64_t block_bytes(int64_t qtype) {
  switch (qtype) {
    case 2: return 18;
    case 3: return 20;
    case 8: return 34;
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
  std::vector<int8_t> q;      // [M, K]
  std::vector<float> scale;   // [M, K / 32]
  std::vector<float> sum;     // [M, K / 32] float sum of the block (Q4_1 offsets)
  std::vector<int32_t> qsum;  // [M, K / 32] integer sum of the block (Q4_0's -8)
};

QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K) {
  const int64_t nb = K / QK;
  QuantizedRows r{std::vector<int8_t>(M * K), std::vector<float>(M * nb), std::vector<float>(M * nb),
                  std::vector<int32_t>(M * nb)};
  for (int64_t i = 0; i < M * nb; ++i) {
    const float* xb = x + i * QK;
    float amax = 0.f, s = 0.f;
    for (int64_t j = 0; j < QK; ++j) { amax = std::max(amax, std::fabs(xb[j])); s += xb[j]; }
    const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    int32_t qs = 0;
    int8_t* qb = r.q.data() + i * QK;
    for (int64_t j = 0; j < QK; ++j) { qb[j] = static_cast<int8_t>(std::nearbyint(xb[j] * id)); qs += qb[j]; }
    r.scale[i] = d; r.sum[i] = s; r.qsum[i] = qs;
  }
  return r;
}

#if defined(__AVX2__)
inline __m256i unpack_nibbles(const uint8_t* qs) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
  return _mm256_set_m128i(hi, lo);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// One output row against M activation rows; out[m * N] receives row m's value.
void dot_row(const uint8_t* w, int64_t qtype, int64_t nb, const QuantizedRows& xr, int64_t M, int64_t K,
             float* out, int64_t N) {
  const int64_t bb = block_bytes(qtype);
#if defined(__AVX2__)
  std::vector<__m256> acc(M, _mm256_setzero_ps());
  std::vector<float> offset(M, 0.f);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * bb;
    const float d = half_to_float(blk);
    __m256i wv;
    float m_off = 0.f;
    if (qtype == 8) wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
    else if (qtype == 3) { m_off = half_to_float(blk + 2); wv = unpack_nibbles(blk + 4); }
    else wv = unpack_nibbles(blk + 2);
    const __m256i wabs = qtype == 8 ? _mm256_sign_epi8(wv, wv) : wv;
    for (int64_t m = 0; m < M; ++m) {
      const int64_t i = m * nb + b;
      __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr.q.data() + m * K + b * QK));
      if (qtype == 8) xv = _mm256_sign_epi8(xv, wv);  // |w| * sign(w) x keeps maddubs' first operand unsigned
      const __m256i prod = _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, xv), ones);
      const float s = d * xr.scale[i];
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(prod), _mm256_set1_ps(s), acc[m]);
      if (qtype != 8) offset[m] -= 8.f * s * static_cast<float>(xr.qsum[i]);
      if (qtype == 3) offset[m] += (m_off + 8.f * d) * xr.sum[i];
    }
  }
  for (int64_t m = 0; m < M; ++m) out[m * N] = hsum(acc[m]) + offset[m];
#else
  std::vector<float> acc(M, 0.f);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * bb;
    const float d = half_to_float(blk);
    int8_t wq[QK];
    float m_off = 0.f;
    if (qtype == 8) std::memcpy(wq, blk + 2, QK);
    else {
      const uint8_t* qs = blk + (qtype == 3 ? 4 : 2);
      if (qtype == 3) m_off = half_to_float(blk + 2);
      for (int j = 0; j < 16; ++j) { wq[j] = qs[j] & 0x0F; wq[j + 16] = qs[j] >> 4; }
    }
    for (int64_t m = 0; m < M; ++m) {
      const int64_t i = m * nb + b;
      const int8_t* xq = xr.q.data() + m * K + b * QK;
      int32_t s = 0;
      for (int j = 0; j < QK; ++j) s += static_cast<int32_t>(wq[j]) * xq[j];
      const float sc = d * xr.scale[i];
      acc[m] += sc * s + (qtype == 8 ? 0.f : -8.f * sc * xr.qsum[i]) + (qtype == 3 ? (m_off + 8.f * d) * xr.sum[i] : 0.f);
    }
  }
  for (int64_t m = 0; m < M; ++m) out[m * N] = acc[m];
#endif
}

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
  const int64_t row_bytes = w.size(1);
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) dot_row(wp + n * row_bytes, qtype, nb, xr, M, K, op + n, N);
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
