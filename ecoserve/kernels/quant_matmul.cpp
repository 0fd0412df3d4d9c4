#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "bf16.h"
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
  std::vector<int8_t> q;        // [M, K]
  std::vector<float> info;      // [M, K / 32, 2]: each block's scale max|x| / 127 and float sum (Q4_1 offsets)
  std::vector<int32_t> centre;  // [M, K / 4]: -8 x the sum of each 4 int8 values (Q4 nibbles' centring)
  float scale(int64_t block) const { return info[2 * block]; }
  float sum(int64_t block) const { return info[2 * block + 1]; }
};

QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K) {
  const int64_t nb = K / QK;
  QuantizedRows r{std::vector<int8_t>(M * K), std::vector<float>(M * nb * 2), std::vector<int32_t>(M * K / 4)};
  for (int64_t i = 0; i < M * nb; ++i) {
    const float* xb = x + i * QK;
    int8_t* qb = r.q.data() + i * QK;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    const __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float s = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
    const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    // cvtps rounds to nearest even, as nearbyint does in the default rounding mode
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qb), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(id)))));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16),
                     _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(id)))));
#else
    float amax = 0.f, s = 0.f;
    for (int64_t j = 0; j < QK; ++j) { amax = std::max(amax, std::fabs(xb[j])); s += xb[j]; }
    const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    for (int64_t j = 0; j < QK; ++j) qb[j] = static_cast<int8_t>(std::nearbyint(xb[j] * id));
#endif
    for (int64_t j = 0; j < QK / 4; ++j) r.centre[i * QK / 4 + j] = -8 * (qb[4 * j] + qb[4 * j + 1] + qb[4 * j + 2] + qb[4 * j + 3]);
    r.info[2 * i] = d; r.info[2 * i + 1] = s;
  }
  return r;
}

// Bytes of the weight stream to prefetch ahead of the row being read. A decode reads each layer
// once per token from L3 or memory; without prefetch the integer dots wait on the loads instead of
// overlapping them (measured on a 30-layer model: 17.9 ms of kernel per token streaming against
// 7.6 ms with the layers in L2).
constexpr int64_t kPrefetchBytes = 2048;

inline void prefetch_ahead(const uint8_t* row, int64_t row_bytes) {
#if defined(__x86_64__) || defined(_M_X64)
  for (int64_t o = 0; o < row_bytes; o += 64)
    _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetchBytes + o), _MM_HINT_T0);
#endif
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

// One block against activation row m's block b as a float: d * scale * dot + Q4_1's offset.
template <int64_t QT>
inline float block_dot(const uint8_t* blk, const QuantizedRows& xr, int64_t m, int64_t b, int64_t K) {
  const __m256i wv = load_weights<QT>(blk);
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr.q.data() + m * K + b * QK));
  const int64_t i = m * (K / QK) + b;
  const float dot = hsum8(_mm256_cvtepi32_ps(dot_u8s8(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv))));
  const float d = half_to_float(blk);
  return d * xr.scale(i) * dot + (QT == 3 ? (half_to_float(blk + 2) + 8.f * d) * xr.sum(i) : 0.f);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
// AVX512-VNNI: two blocks per 64-byte register, one vpdpbusd for both.
#define QUANT_MATMUL_512 1

// Blocks a and b's 64 weights, a's first: Q4 nibbles as unsigned bytes 0..15 (their centring by -8
// is the activations' `centre`, the accumulator's starting value); Q8_0 as stored (signed).
template <int64_t QT>
inline __m512i load_pair(const uint8_t* a, const uint8_t* b) {
  if constexpr (QT == 8) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 2))),
                              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)), 1);
  } else {
    constexpr int64_t off = QT == 3 ? 4 : 2;
    const __m256i raw = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + off))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + off)), 1);
    // 128-bit lanes a, b, a >> 4, b >> 4, reordered to a's weights 0-15, 16-31, then b's
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(raw), _mm256_srli_epi16(raw, 4), 1);
    return _mm512_and_si512(_mm512_shuffle_i64x2(both, both, _MM_SHUFFLE(3, 1, 2, 0)), _mm512_set1_epi8(0x0F));
  }
}

// [d_a, m_a, d_b, m_b] from the blocks' fp16 headers (m = 0 unless Q4_1).
template <int64_t QT>
inline __m128 pair_header(const uint8_t* a, const uint8_t* b) {
  uint32_t ha, hb;
  std::memcpy(&ha, a, 4);
  std::memcpy(&hb, b, 4);
  if constexpr (QT != 3) { ha &= 0xFFFFu; hb &= 0xFFFFu; }
  return _mm_cvtph_ps(_mm_set_epi32(0, 0, static_cast<int>(hb), static_cast<int>(ha)));
}

template <int64_t QT, int64_t MR>
inline void dot_tile(const uint8_t* row, int64_t nb, const QuantizedRows& xr, int64_t m0, int64_t K, float* out,
                     int64_t N, int64_t n) {
  constexpr int64_t bb = kBlockBytes<QT>;
  const __m512i lane_block = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m128 eight_at_m = _mm_set_ps(8.f, 0.f, 8.f, 0.f);
  __m512 acc[MR];
  __m128 offset[MR];
  for (int64_t m = 0; m < MR; ++m) { acc[m] = _mm512_setzero_ps(); offset[m] = _mm_setzero_ps(); }
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    const uint8_t* a = row + b * bb;
    __m128 header = pair_header<QT>(a, a + bb);
    // Q4_1: w = d (q - 8) + (m + 8 d); lanes [d_a, m_a + 8 d_a, d_b, m_b + 8 d_b]
    if constexpr (QT == 3) header = _mm_fmadd_ps(_mm_moveldup_ps(header), eight_at_m, header);
    __m512i wv = load_pair<QT>(a, a + bb);
    __mmask64 negative = 0;
    if constexpr (QT == 8) {  // vpdpbusd takes unsigned x signed: |w|, and w's sign moved onto x
      negative = _mm512_movepi8_mask(wv);
      wv = _mm512_abs_epi8(wv);
    }
    for (int64_t m = 0; m < MR; ++m) {
      const int64_t at = (m0 + m) * K + b * QK;
      __m512i xv = _mm512_loadu_si512(xr.q.data() + at);
      __m512i start;
      if constexpr (QT == 8) {
        xv = _mm512_mask_sub_epi8(xv, negative, _mm512_setzero_si512(), xv);
        start = _mm512_setzero_si512();
      } else {
        start = _mm512_loadu_si512(xr.centre.data() + at / 4);
      }
      const __m512i dot = _mm512_dpbusd_epi32(start, wv, xv);
      // [d_a s_a, (m_a + 8 d_a) sum_a, d_b s_b, ...] with the activations' scales s and sums
      const __m128 scaled = _mm_mul_ps(header, _mm_loadu_ps(xr.info.data() + 2 * ((m0 + m) * nb + b)));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(lane_block, _mm512_castps128_ps512(scaled)),
                               acc[m]);
      if constexpr (QT == 3) offset[m] = _mm_add_ps(offset[m], scaled);
    }
  }
  for (int64_t m = 0; m < MR; ++m) {
    float total = _mm512_reduce_add_ps(acc[m]);
    if constexpr (QT == 3) total += _mm_cvtss_f32(_mm_movehdup_ps(offset[m])) + _mm_cvtss_f32(_mm_shuffle_ps(offset[m], offset[m], 3));
    if (b < nb) total += block_dot<QT>(row + b * bb, xr, m0 + m, b, K);
    out[(m0 + m) * N + n] = total;
  }
}
#else
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
      acc[b & 1][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(u, xv)), _mm256_set1_ps(d * xr.scale(i)),
                                      acc[b & 1][m]);
      if constexpr (QT == 3) offset[m] += offset_w * xr.sum(i);
    }
  }
  for (int64_t m = 0; m < MR; ++m) out[(m0 + m) * N + n] = hsum8(_mm256_add_ps(acc[0][m], acc[1][m])) + offset[m];
}
#endif

// Output rows [n0, n1) against M activation rows: out[m * N + n]; each weight row is loaded from
// memory once and reused from L1 by every tile of activation rows.
template <int64_t QT>
void dot_rows(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t nb, const QuantizedRows& xr,
              int64_t M, int64_t K, float* out, int64_t N) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    prefetch_ahead(row, row_bytes);
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
        acc += d * xr.scale(i) * s + (QT == 3 ? (half_to_float(blk + 2) + 8.f * d) * xr.sum(i) : 0.f);
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

// W8A8 (per-token int8 activations, per-output-channel int8 weights). The int8 GEMM is oneDNN's where the
// CPU has int8 dot products (AMX-INT8 / VNNI), else `int8_gemm` below; `quantize_per_token` and
// `scale_rows_to` are the float passes around it, one read of each operand instead of torch's chain of
// elementwise ops.

namespace {

using namespace ecoserve_simd;

// Activation rows x [M, K] against weight rows w [N, K], into out [M, N] int32: MR rows of x by NR rows of w
// per tile, so each loaded vector feeds several products and the accumulators stay in registers.
#ifdef ECOSERVE_SIMD_INT8
inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
  return _mm_cvtsi128_si32(s);
}

// maddubs multiplies unsigned by signed bytes and sums each pair in int16, saturating: it gets |w| (<= 128)
// and x with w's sign (|x| <= 127, so the sign moves exactly), which bounds a pair by 2 * 128 * 127 = 32512,
// so nothing saturates (oneDNN's AVX2 kernels pass unsigned activations up to 255, and do); the pairs
// are then summed in int32 (VNNI builds: vpdpbusd, exact as well).
template <int64_t MR, int64_t NR>
inline void int8_tile(const int8_t* x, const int8_t* w, int64_t K, int32_t* out, int64_t N) {
  __m256i acc[MR][NR];
  for (int64_t m = 0; m < MR; ++m)
    for (int64_t n = 0; n < NR; ++n) acc[m][n] = _mm256_setzero_si256();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m256i wv[NR], u[NR];
    for (int64_t n = 0; n < NR; ++n) {
      wv[n] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + n * K + k));
      u[n] = _mm256_abs_epi8(wv[n]);
    }
    for (int64_t m = 0; m < MR; ++m) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + m * K + k));
      for (int64_t n = 0; n < NR; ++n)
        acc[m][n] = _mm256_add_epi32(acc[m][n], dot_u8s8(u[n], _mm256_sign_epi8(xv, wv[n])));
    }
  }
  for (int64_t m = 0; m < MR; ++m)
    for (int64_t n = 0; n < NR; ++n) {
      int32_t s = hsum_epi32(acc[m][n]);
      for (int64_t j = k; j < K; ++j) s += int32_t(x[m * K + j]) * w[n * K + j];
      out[m * N + n] = s;
    }
}
#else
template <int64_t MR, int64_t NR>
inline void int8_tile(const int8_t* x, const int8_t* w, int64_t K, int32_t* out, int64_t N) {
  for (int64_t m = 0; m < MR; ++m)
    for (int64_t n = 0; n < NR; ++n) {
      int32_t s = 0;
      for (int64_t j = 0; j < K; ++j) s += int32_t(x[m * K + j]) * w[n * K + j];
      out[m * N + n] = s;
    }
}
#endif

// Rows [m0, m1) of x against NR rows of w: tiles of 4 rows (4 x 2 measured fastest of 4x2, 2x4, 3x3, 2x3).
template <int64_t NR>
void int8_rows(const int8_t* x, const int8_t* w, int64_t K, int32_t* out, int64_t N, int64_t m0, int64_t m1) {
  int64_t m = m0;
  for (; m + 4 <= m1; m += 4) int8_tile<4, NR>(x + m * K, w, K, out + m * N, N);
  switch (m1 - m) {
    case 3: int8_tile<3, NR>(x + m * K, w, K, out + m * N, N); break;
    case 2: int8_tile<2, NR>(x + m * K, w, K, out + m * N, N); break;
    case 1: int8_tile<1, NR>(x + m * K, w, K, out + m * N, N); break;
  }
}

// max|x_row| / 127 divided as torch divides: this file's -ffast-math would otherwise multiply by a rounded 1/127,
// one float32 step off torch's scale for some rows
__attribute__((optimize("no-fast-math"), noinline)) float int8_scale(float amax) { return amax / 127.f; }

template <typename T>
void quantize_rows(const T* xp, int8_t* qp, float* sp, int64_t M, int64_t K) {
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const T* row = xp + m * K;
      int8_t* out = qp + m * K;
      float amax = 0.f;
      int64_t k = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
      __m512 vmax = _mm512_setzero_ps();
      for (; k + 16 <= K; k += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(vload(row + k)));
      amax = _mm512_reduce_max_ps(vmax);
#endif
      for (; k < K; ++k) amax = std::max(amax, std::fabs(to_float(row[k])));
      const float d = int8_scale(amax), id = d > 0.f ? 1.f / d : 0.f;
      k = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
      for (; k + 16 <= K; k += 16)  // cvtps rounds to nearest even, as nearbyint does
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k),
                         _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(vload(row + k), _mm512_set1_ps(id)))));
#endif
      for (; k < K; ++k) out[k] = static_cast<int8_t>(std::nearbyint(to_float(row[k]) * id));
      sp[m] = d;
    }
  });
}

// dst = out * w_scale[n] (if given) * x_scale[m] (+ bias[n]); out float32 or int32 (the exact int8 GEMM's sums)
template <typename Ti, typename To>
void scale_rows_into(const Ti* op, const float* xs, const float* ws, const float* bp, To* dp, int64_t M, int64_t N) {
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(N, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const Ti* o = op + m * N;
      To* d = dp + m * N;
      const float s = xs[m];
      for (int64_t n = 0; n < N; ++n) {
        float v = static_cast<float>(o[n]);
        if (ws != nullptr) v *= ws[n];
        v *= s;
        if (bp != nullptr) v += bp[n];
        d[n] = from_float<To>(v);
      }
    }
  });
}

template <typename Ti>
void scale_rows_into(const Ti* op, const float* xs, const float* ws, const float* bp, torch::Tensor& dst, int64_t M,
                     int64_t N) {
  if (dst.dtype() == torch::kBFloat16)
    scale_rows_into(op, xs, ws, bp, dst.data_ptr<c10::BFloat16>(), M, N);
  else
    scale_rows_into(op, xs, ws, bp, dst.data_ptr<float>(), M, N);
}

}  // namespace

// x [M, K] int8 @ w [N, K]^T int8 -> int32 [M, N], exact: W8A8's GEMM where oneDNN's would saturate. x must
// lie within +/-127 (as quantize_per_token writes it; -128 has no negation), w may be any int8.
torch::Tensor int8_gemm(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dtype() == torch::kInt8 && w.dtype() == torch::kInt8 && x.dim() == 2 && w.dim() == 2 &&
              x.size(1) == w.size(1), "int8_gemm: x [M, K] and w [N, K] must be 2-D int8 with the same K");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  // int32 holds K products of at most 128 * 127
  TORCH_CHECK(K <= 131072, "int8_gemm: K = ", K, " could overflow the int32 sums (at most 131072)");
  const int8_t* xp = x.data_ptr<int8_t>();
  TORCH_CHECK(std::find(xp, xp + M * K, int8_t(-128)) == xp + M * K, "int8_gemm: x must lie within +/-127");
  auto out = torch::empty({M, N}, x.options().dtype(torch::kInt32));
  const int8_t* wp = w.data_ptr<int8_t>();
  int32_t* op = out.data_ptr<int32_t>();
  constexpr int64_t NR = 2;
  // activation rows per pass over the weight: 128 KiB of them stay in L2 while each weight pair, read once
  // per pass, stays in L1
  const int64_t MC = std::max<int64_t>(4, (131072 / std::max<int64_t>(K, 1)) / 4 * 4);
  at::parallel_for(0, (N + NR - 1) / NR, 8, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += MC) {
      const int64_t m1 = std::min(M, m0 + MC);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t n0 = t * NR;
        if (n0 + NR <= N)
          int8_rows<NR>(xp, wp + n0 * K, K, op + n0, N, m0, m1);
        else
          int8_rows<1>(xp, wp + n0 * K, K, op + n0, N, m0, m1);
      }
    }
  });
  return out;
}

// x [M, K] float32 or bfloat16 -> (int8 [M, K], float32 [M]): each row rounded to int8 with scale
// max|x_row| / 127.
std::vector<torch::Tensor> quantize_per_token(torch::Tensor x) {
  TORCH_CHECK((x.dtype() == torch::kFloat32 || x.dtype() == torch::kBFloat16) && x.dim() == 2,
              "quantize_per_token: x must be 2-D float32 or bfloat16");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  auto q = torch::empty({M, K}, x.options().dtype(torch::kInt8));
  auto scale = torch::empty({M}, x.options().dtype(torch::kFloat32));
  if (x.dtype() == torch::kBFloat16)
    quantize_rows(x.data_ptr<c10::BFloat16>(), q.data_ptr<int8_t>(), scale.data_ptr<float>(), M, K);
  else
    quantize_rows(x.data_ptr<float>(), q.data_ptr<int8_t>(), scale.data_ptr<float>(), M, K);
  return {q, scale};
}

// out [M, N] -> dst [M, N] (float32, which may be out itself, or bfloat16, rounded once): out[m, n] (* w_scale[n])
// * x_scale[m] (+ bias[n]), the scales of an int8 GEMM: out is oneDNN's float32, its per-channel weight scales
// applied, or int8_gemm's int32 sums with w_scale.
void scale_rows_to(torch::Tensor out, torch::Tensor x_scale, c10::optional<torch::Tensor> bias, torch::Tensor dst,
                   c10::optional<torch::Tensor> w_scale) {
  TORCH_CHECK((out.dtype() == torch::kFloat32 || out.dtype() == torch::kInt32) && out.dim() == 2 &&
              out.is_contiguous(), "scale_rows_to: out must be a contiguous 2-D float32 or int32 tensor");
  const int64_t M = out.size(0), N = out.size(1);
  TORCH_CHECK(x_scale.dtype() == torch::kFloat32 && x_scale.numel() == M && x_scale.is_contiguous(),
              "scale_rows_to: x_scale must be contiguous float32 [M]");
  TORCH_CHECK((dst.dtype() == torch::kFloat32 || dst.dtype() == torch::kBFloat16) && dst.is_contiguous() &&
              dst.sizes() == out.sizes(), "scale_rows_to: dst must be a contiguous float32 or bfloat16 tensor shaped "
              "like out");
  const auto per_channel = [N](const c10::optional<torch::Tensor>& t, const char* name) -> const float* {
    if (!t.has_value() || !t->defined()) return nullptr;
    TORCH_CHECK(t->dtype() == torch::kFloat32 && t->numel() == N && t->is_contiguous(),
                "scale_rows_to: ", name, " must be contiguous float32 [N]");
    return t->data_ptr<float>();
  };
  const float* bp = per_channel(bias, "bias");
  const float* ws = per_channel(w_scale, "w_scale");
  if (out.dtype() == torch::kInt32)
    scale_rows_into(out.data_ptr<int32_t>(), x_scale.data_ptr<float>(), ws, bp, dst, M, N);
  else
    scale_rows_into(out.data_ptr<float>(), x_scale.data_ptr<float>(), ws, bp, dst, M, N);
}

// The integer dot path this build compiled: tests check each one, the engine logs it.
std::string isa() {
#if defined(QUANT_MATMUL_512)
  return "avx512-vnni";
#elif defined(ECOSERVE_SIMD_INT8) && (defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__)))
  return "avx2-vnni";
#elif defined(ECOSERVE_SIMD_INT8)
  return "avx2";
#else
  return "scalar";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa", &isa);
  m.def("quant_linear", &quant_linear);
  m.def("dequantize", &dequantize);
  m.def("quantize_per_token", &quantize_per_token);
  m.def("int8_gemm", &int8_gemm);
  m.def("scale_rows_to", &scale_rows_to, py::arg("out"), py::arg("x_scale"), py::arg("bias"), py::arg("dst"),
        py::arg("w_scale") = py::none());
}
