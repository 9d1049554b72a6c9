// What the int8 linears (linear_int8.cpp: VNNI; linear_int8_amx.cpp: AMX tiles) share: the
// CPU features they need, and the per-token activation quantization into int8 planes
// (see linear_int8.cpp's header for the planes and their scales).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define PDSERVE_HAVE_INT8 1
#else
#define PDSERVE_HAVE_INT8 0
#endif

namespace pdserve::int8 {

// The packed weight (pdserve_pack_int8): the N outputs in panels of kPanel, their count
// rounded up to a pair (kUnit outputs); panel p holds, for every quad of inputs 4j .. 4j+3,
// 16 int32 lanes, lane i = W[16p+i][4j .. 4j+3] (VPDPBUSD's operand and AMX's VNNI B tile).
// kPackSlack zero bytes follow: an AMX tile load of the last 64 inputs of a panel may read
// that far past it (against zero activations).
constexpr int64_t kPanel = 16;
constexpr int64_t kUnit = 2 * kPanel;
constexpr int64_t kPackSlack = 16 * 4 * kPanel;
constexpr float kTiny = 1e-12f;        // quant_reference._TINY: the smallest scale
constexpr int64_t kMaxPlanes = 3;

inline int64_t quads_of(int64_t K) { return (K + 3) / 4; }
inline int64_t panels_of(int64_t N) { return (N + kUnit - 1) / kUnit * 2; }

#if PDSERVE_HAVE_INT8

inline __mmask16 lanes(int64_t n) {
  return static_cast<__mmask16>(n >= 16 ? 0xffff : (1u << std::max<int64_t>(n, 0)) - 1);
}

inline void store16(uint16_t* out, __m512 v, int64_t cols) {
  _mm256_mask_storeu_epi16(out, lanes(cols), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}
inline void store16(float* out, __m512 v, int64_t cols) {
  _mm512_mask_storeu_ps(out, lanes(cols), v);
}

inline __m512 load16(const float* x, int64_t n) { return _mm512_maskz_loadu_ps(lanes(n), x); }
inline __m512 load16(const uint16_t* x, int64_t n) {
  const __m256i h = _mm256_maskz_loadu_epi16(lanes(n), x);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Row x -> P plane rows of xq (row stride ldq >= K, the padding = offset) and their scales.
template <typename TX>
inline void quantize_row(const TX* x, int64_t K, int64_t P, int32_t offset, uint8_t* xq, int64_t ldq,
                  float* scale) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    amax = _mm512_max_ps(amax, _mm512_abs_ps(load16(x + k, K - k)));
  }
  float s[kMaxPlanes];
  s[0] = std::max(_mm512_reduce_max_ps(amax) / 127.0f, kTiny);
  for (int64_t p = 1; p < P; ++p) s[p] = s[p - 1] / 254.0f;
  const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  const __m512i off = _mm512_set1_epi32(offset);
  for (int64_t k = 0; k < K; k += 16) {
    __m512 v = load16(x + k, K - k);
    for (int64_t p = 0; p < P; ++p) {
      const __m512 vs = _mm512_set1_ps(s[p]);
      __m512 q = _mm512_roundscale_ps(_mm512_div_ps(v, vs),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      q = _mm512_min_ps(_mm512_max_ps(q, lo), hi);
      v = _mm512_fnmadd_ps(q, vs, v);  // the residual, exact (one rounding)
      const __m512i u = _mm512_add_epi32(_mm512_cvtps_epi32(q), off);
      _mm_mask_storeu_epi8(xq + p * ldq + k, lanes(K - k), _mm512_cvtepi32_epi8(u));
    }
  }
  for (int64_t p = 0; p < P; ++p) {
    for (int64_t k = K; k < ldq; ++k) xq[p * ldq + k] = static_cast<uint8_t>(offset);
    scale[p] = s[p];
  }
}

#endif  // PDSERVE_HAVE_INT8

}  // namespace pdserve::int8
