// Scalar helpers shared by the native CPU kernels, written so that the compiler vectorizes
// the loops that call them (no libm calls, no early returns).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace pdserve {

inline float to_f32(float x) { return x; }
inline float to_f32(uint16_t x) {  // bfloat16 is the high half of a float32
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline void from_f32(float x, float* out) { *out = x; }
inline void from_f32(float x, uint16_t* out) {  // round to nearest even, as torch does
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (u >> 16) | 0x40u;  // NaN stays NaN
  *out = static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

// x rounded to T and widened back: what a tensor of dtype T holds after storing x.
template <typename T>
inline float round_to(float x) {
  T t;
  from_f32(x, &t);
  return to_f32(t);
}

// exp for x <= 0 in a form the compiler vectorizes (std::exp is a scalar libm call):
// x = n ln2 + r with |r| <= ln2/2, exp(r) by its degree-6 Taylor polynomial (relative error
// ~1e-7, float32's rounding), times 2^n built in the exponent bits. Below -80 it returns 0:
// weights that small would make sums denormal, which x86 computes 100x slower. n is
// rounded with the 1.5 * 2^23 trick (floorf does not vectorize without -fno-trapping-math).
inline float exp_nonpositive(float x_in) {
  const float x = std::max(x_in, -80.0f);
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float n = (x * 1.44269504088896341f + kRound) - kRound;
  const float r = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x_in < -80.0f ? 0.0f : p * scale;
}

}  // namespace pdserve
