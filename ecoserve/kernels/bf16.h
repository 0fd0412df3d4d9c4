// bfloat16 rows for the native kernels: conversions to and from float32, scalar and on the vector
// layer of simd.h, so that one kernel template serves float32 and bfloat16 (c10::BFloat16) elements.
// A load widens bf16 to fp32 exactly (a 16-bit shift); a store rounds to nearest even with NaN kept
// quiet, bit for bit as torch's conversion does. Plain AVX2 and AVX-512F suffice: a CPU without the
// bf16 instructions runs the same code. Arithmetic stays float32; only the memory is 16-bit.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

#include "simd.h"

namespace ecoserve_simd {

inline float bf16_bits_to_float(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even; NaN becomes torch's quiet NaN. Integer tests only, so that -ffast-math
// (which assumes no NaN) cannot drop the check, and a loop of them vectorizes.
inline uint16_t float_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
}

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return bf16_bits_to_float(x.x); }

template <typename T>
inline T from_float(float x);
template <>
inline float from_float<float>(float x) { return x; }
template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float x) { return c10::BFloat16(float_to_bf16_bits(x), c10::BFloat16::from_bits()); }

// x rounded to T: the result of a torch op in T (identity for float)
template <typename T>
inline float round_to(float x) { return to_float(from_float<T>(x)); }

#ifdef ECOSERVE_SIMD
#if defined(__AVX512F__)
inline vec vload(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
// Each lane's bf16 bits (float_to_bf16_bits) in its low 16 bits.
inline __m512i bf16_bits(vec x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                                _mm512_set1_epi32(0x7F800000));
  return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
}
inline void vstore(c10::BFloat16* p, vec x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(x)));
}
// x rounded to the nearest bf16, as a float
inline vec vround_bf16(vec x) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(x), 16)); }
#else  // AVX2 + FMA
inline vec vload(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256i bf16_bits(vec x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  // signed compare is safe: both sides have the sign bit clear
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)),
                                         _mm256_set1_epi32(0x7F800000));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
}
inline void vstore(c10::BFloat16* p, vec x) {
  // 8 int32 lanes below 2^16 -> 8 uint16: pack within 128-bit halves, then gather the halves
  const __m256i r = bf16_bits(x);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
inline vec vround_bf16(vec x) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(x), 16)); }
#endif
#endif

// out[i] = in[i] converted, for rows of either element type (explicit vector loads and stores: the
// compiler's loops do not vectorize c10::BFloat16; the stores round as the scalar conversion does).
template <typename To, typename From>
inline void convert_row(To* __restrict out, const From* __restrict in, int64_t n) {
  int64_t i = 0;
#ifdef ECOSERVE_SIMD
  for (; i + W <= n; i += W) vstore(out + i, vload(in + i));
#endif
#pragma omp simd
  for (int64_t j = i; j < n; ++j) out[j] = from_float<To>(to_float(in[j]));
}

}  // namespace ecoserve_simd
