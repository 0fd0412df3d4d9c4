// The native kernels' vector layer: one set of names over AVX-512 (W = 16 floats) or AVX2 + FMA
// (W = 8), with ECOSERVE_SIMD defined where either is compiled in, and the exponentials they share;
// then the 32-byte integer dot products of the quantized matmul (ECOSERVE_SIMD_INT8: AVX2 + FMA, with
// VNNI where the compiler targets it), which AVX-512 builds use too since a GGUF block is 32 bytes.
// Included by one translation unit per extension; ninja's depfile rebuilds each on a change here.
#pragma once

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstdint>
#include <cstring>

namespace ecoserve_simd {

#if defined(__AVX2__) && defined(__FMA__)
#define ECOSERVE_SIMD_INT8 1
// the sum of an 8-float register's lanes
inline float hsum8(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Sum over the 32 lanes of u * s (u unsigned bytes, s signed bytes) as 8 int32 lanes.
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
#endif

// exp(x) for x <= 0 (a softmax after subtracting the max, a sigmoid from exp(-|x|)): Cody-Waite
// reduction and a degree-6 polynomial (relative error ~2e-7), branch-free, so that a loop calling it
// vectorizes (expf does not without -ffast-math).
inline float exp_nonpositive(float x) {
  x = x < -87.f ? -87.f : x;
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

// silu(g) = g * sigmoid(g), sigmoid from exp(-|g|) so that no exponential overflows.
inline float silu(float g) {
  const float z = exp_nonpositive(g < 0.f ? g : -g);
  return g * ((g < 0.f ? z : 1.f) / (1.f + z));
}

#if defined(__AVX512F__)
#define ECOSERVE_SIMD 1
using vec = __m512;
using vmask = __mmask16;
constexpr int W = 16;
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vec x) { _mm512_storeu_ps(p, x); }
inline vec vset1(float x) { return _mm512_set1_ps(x); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec vdiv(vec a, vec b) { return _mm512_div_ps(a, b); }
inline float vsum(vec x) { return _mm512_reduce_add_ps(x); }
inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec vfnma(vec a, vec b, vec c) { return _mm512_fnmadd_ps(a, b, c); }
inline vmask vle(vec a, vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_LE_OQ); }
inline vec vselect(vmask m, vec yes, vec no) { return _mm512_mask_blend_ps(m, no, yes); }
inline vec vround(vec x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vec vpow2i(vec n) {  // 2^n for integral n in [-127, 127]
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_castsi512_ps(bits);
}
// r[i] = row i of a W x W block -> r[j] = its column j (unpacks, in-lane shuffles, then 128-bit lanes)
inline void transpose_block(vec* r) {
  vec t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
#define ECOSERVE_SIMD 1
using vec = __m256;
using vmask = __m256;
constexpr int W = 8;
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vec x) { _mm256_storeu_ps(p, x); }
inline vec vset1(float x) { return _mm256_set1_ps(x); }
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec vdiv(vec a, vec b) { return _mm256_div_ps(a, b); }
inline float vsum(vec x) { return hsum8(x); }
inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec vfnma(vec a, vec b, vec c) { return _mm256_fnmadd_ps(a, b, c); }
inline vmask vle(vec a, vec b) { return _mm256_cmp_ps(a, b, _CMP_LE_OQ); }
inline vec vselect(vmask m, vec yes, vec no) { return _mm256_blendv_ps(no, yes, m); }
inline vec vround(vec x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vec vpow2i(vec n) {
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_castsi256_ps(bits);
}
inline void transpose_block(vec* r) {
  vec t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}
#endif

#ifdef ECOSERVE_SIMD
// exp(x) for x <= 0, exactly 0 below -87 (so masked scores of -inf weigh nothing): Cody-Waite
// reduction and a degree-6 polynomial, relative error ~2e-7.
inline vec vexp_nonpositive(vec x) {
  const vec lo = vset1(-87.f);
  const vec xc = vmax(x, lo);
  const vec n = vround(vmul(xc, vset1(1.44269504088896341f)));
  const vec r = vfma(n, vset1(2.12194440e-4f), vfnma(n, vset1(0.693359375f), xc));
  vec p = vset1(1.f / 720.f);
  p = vfma(p, r, vset1(1.f / 120.f));
  p = vfma(p, r, vset1(1.f / 24.f));
  p = vfma(p, r, vset1(1.f / 6.f));
  p = vfma(p, r, vset1(0.5f));
  p = vfma(p, r, vset1(1.f));
  p = vfma(p, r, vset1(1.f));
  return vselect(vle(lo, x), vmul(p, vpow2i(n)), vset1(0.f));
}

// silu on a vector, for bf16 rows: the exponential's fused multiply-adds may move the float32 value by
// an ulp from the scalar loop's, which rounding to bf16 hides but on a rounding boundary.
inline vec vsilu(vec g) {
  const vec zero = vset1(0.f);
  const vec z = vexp_nonpositive(vsub(zero, vmax(g, vsub(zero, g))));  // exp(-|g|)
  const vec one = vset1(1.f);
  return vmul(g, vdiv(vselect(vle(g, zero), z, one), vadd(one, z)));
}
#endif

}  // namespace ecoserve_simd

#ifdef ECOSERVE_SIMD
namespace ecoserve_simd {
// r[0..W) -> one vector whose lane i is the sum of r[i]'s lanes: a transpose-and-add tree (30 shuffles
// and 15 adds for 16 rows on AVX-512, against 16 full reductions of ~8 dependent steps each).
#if defined(__AVX512F__)
__attribute__((always_inline)) inline vec vsum_rows(const vec* r) {
  vec a[8], b[4], c[2];
  // pairs of rows: lanes (2i, 2i+1) of a 128-bit lane hold the pair's partial sums
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]), _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]));
  // quads: a 128-bit lane holds its four rows' sums over that lane
  for (int i = 0; i < 4; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
  // then add the 128-bit lanes: b[i]'s four lanes into one, two steps
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}
#else  // AVX2
__attribute__((always_inline)) inline vec vsum_rows(const vec* r) {
  vec a[4], b[2];
  for (int i = 0; i < 4; ++i)
    a[i] = _mm256_add_ps(_mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]), _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]));
  for (int i = 0; i < 2; ++i)
    b[i] = _mm256_add_ps(_mm256_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44),
                         _mm256_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
  return _mm256_add_ps(_mm256_permute2f128_ps(b[0], b[1], 0x20), _mm256_permute2f128_ps(b[0], b[1], 0x31));
}
#endif
}  // namespace ecoserve_simd
#endif
