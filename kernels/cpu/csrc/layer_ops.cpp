// The row-wise ops of every decoder layer, one pass over memory each, for CPUs:
//
// - RMSNorm with the residual add fused in. The residual stream may be float32 while the
//   layer outputs are bfloat16 (what the model does): the sum is then exact to float32 and
//   stored in the residual's dtype, never rounded to bfloat16. The statistics are float32;
//   the output ``weight * x / rms`` is computed in float32 and rounded once to its dtype
//   (float32 for the final norm that feeds the logits).
// - neox-style rotary embedding of q and k (float32 math, rounded once per element);
// - SiLU-and-mul of the fused gate/up projection (float32 math, rounded once).
//
// In torch each of these is several kernels, each a full pass over a [T, H] tensor with a
// temporary in between, a noticeable share of a bf16 prefill step (docs/cpu.md). Rows
// are split over the OpenMP threads of the calling process (torch's runtime) when there is
// enough work; decode-sized inputs run on the calling thread. Plain C ABI, loaded by
// kernels/cpu/native.py; the inner loops are portable code that the compiler vectorizes.

#include <cmath>
#include <cstdint>

#include <omp.h>

#include "cpu_math.h"

// No fused multiply-adds in this file: each product and sum is rounded as torch rounds
// its separate kernels, so the rotary embedding is bitwise the reference's.
#pragma GCC optimize("fp-contract=off")

namespace {

using pdserve::exp_nonpositive;
using pdserve::from_f32;
using pdserve::round_to;
using pdserve::to_f32;

constexpr int64_t kParallelElems = 1 << 16;  // below this, one thread: waking others costs more

template <typename TX, typename TR, typename TW, typename TO>
void rms_norm(const TX* x, int64_t x_stride, const TR* res, int64_t res_stride, TR* sum_out,
              const TW* weight, TO* out, int64_t rows, int64_t h, float eps) {
#pragma omp parallel for schedule(static) if (rows * h >= kParallelElems)
  for (int64_t r = 0; r < rows; ++r) {
    const TX* xr = x + r * x_stride;
    TO* o = out + r * h;
    float ss = 0.0f;
    if (res != nullptr) {
      const TR* rr = res + r * res_stride;
      TR* s = sum_out + r * h;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < h; ++i) {
        const float v = round_to<TR>(to_f32(xr[i]) + to_f32(rr[i]));
        from_f32(v, &s[i]);
        ss += v * v;
      }
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(h) + eps);
#pragma omp simd
      for (int64_t i = 0; i < h; ++i) from_f32(to_f32(weight[i]) * (to_f32(s[i]) * inv), &o[i]);
    } else {
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < h; ++i) {
        const float v = to_f32(xr[i]);
        ss += v * v;
      }
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(h) + eps);
#pragma omp simd
      for (int64_t i = 0; i < h; ++i) from_f32(to_f32(weight[i]) * (to_f32(xr[i]) * inv), &o[i]);
    }
  }
}

// One instantiation per dtype combination (1 = bfloat16, 0 = float32 for each of x, the
// residual, the weight and the output).
template <typename TX, typename TR, typename TW>
void rms_norm_out(int out_bf16, const void* x, int64_t xs, const void* res, int64_t rs,
                  void* sum, const void* w, void* out, int64_t rows, int64_t h, float eps) {
  const auto* xp = static_cast<const TX*>(x);
  const auto* rp = static_cast<const TR*>(res);
  const auto* wp = static_cast<const TW*>(w);
  if (out_bf16)
    rms_norm(xp, xs, rp, rs, static_cast<TR*>(sum), wp, static_cast<uint16_t*>(out), rows, h, eps);
  else
    rms_norm(xp, xs, rp, rs, static_cast<TR*>(sum), wp, static_cast<float*>(out), rows, h, eps);
}

template <typename TX, typename TR>
void rms_norm_w(int w_bf16, int out_bf16, const void* x, int64_t xs, const void* res,
                int64_t rs, void* sum, const void* w, void* out, int64_t rows, int64_t h,
                float eps) {
  if (w_bf16)
    rms_norm_out<TX, TR, uint16_t>(out_bf16, x, xs, res, rs, sum, w, out, rows, h, eps);
  else
    rms_norm_out<TX, TR, float>(out_bf16, x, xs, res, rs, sum, w, out, rows, h, eps);
}

template <typename T>
inline void rotate_head(const T* x, const float* cos, const float* sin, int half, T* o) {
#pragma omp simd
  for (int i = 0; i < half; ++i) {
    const float x1 = to_f32(x[i]), x2 = to_f32(x[i + half]);
    from_f32(x1 * cos[i] - x2 * sin[i], &o[i]);
    from_f32(x2 * cos[i] + x1 * sin[i], &o[i + half]);
  }
}

template <typename T>
void rotary(const float* rows, const T* q, int64_t q_tok, int64_t q_head, int hq, const T* k,
            int64_t k_tok, int64_t k_head, int hk, int d, T* q_out, T* k_out, int64_t tokens) {
  const int half = d / 2;
#pragma omp parallel for schedule(static) if (tokens * (hq + hk) * d >= kParallelElems)
  for (int64_t t = 0; t < tokens; ++t) {
    const float* cos = rows + t * d;
    const float* sin = cos + half;
    for (int h = 0; h < hq; ++h)
      rotate_head(q + t * q_tok + h * q_head, cos, sin, half, q_out + (t * hq + h) * d);
    for (int h = 0; h < hk; ++h)
      rotate_head(k + t * k_tok + h * k_head, cos, sin, half, k_out + (t * hk + h) * d);
  }
}

template <typename T>
inline void silu_and_mul_row(const T* gate, const T* up, int64_t n, T* out) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float g = to_f32(gate[i]);
    const float e = exp_nonpositive(-std::fabs(g));  // sigmoid without overflow
    const float sigmoid = (g >= 0.0f ? 1.0f : e) / (1.0f + e);
    from_f32(g * sigmoid * to_f32(up[i]), &out[i]);
  }
}

template <typename T>
void silu_and_mul(const T* x, int64_t x_stride, int64_t rows, int64_t inter, T* out) {
#pragma omp parallel for schedule(static) if (rows * inter >= kParallelElems)
  for (int64_t r = 0; r < rows; ++r)
    silu_and_mul_row(x + r * x_stride, x + r * x_stride + inter, inter, out + r * inter);
}

}  // namespace

// x, residual, weight and output dtypes: 1 = bfloat16, 0 = float32 (the residual's is
// ignored without one). sum_out has the residual's dtype.
extern "C" void pdserve_rms_norm(int x_bf16, int res_bf16, int w_bf16, int out_bf16,
                                 const void* x, int64_t x_stride, const void* res,
                                 int64_t res_stride, void* sum_out, const void* weight,
                                 void* out, int64_t rows, int64_t h, float eps) {
  if (x_bf16 && res_bf16)
    rms_norm_w<uint16_t, uint16_t>(w_bf16, out_bf16, x, x_stride, res, res_stride, sum_out,
                                   weight, out, rows, h, eps);
  else if (x_bf16)
    rms_norm_w<uint16_t, float>(w_bf16, out_bf16, x, x_stride, res, res_stride, sum_out,
                                weight, out, rows, h, eps);
  else if (res_bf16)
    rms_norm_w<float, uint16_t>(w_bf16, out_bf16, x, x_stride, res, res_stride, sum_out,
                                weight, out, rows, h, eps);
  else
    rms_norm_w<float, float>(w_bf16, out_bf16, x, x_stride, res, res_stride, sum_out, weight,
                             out, rows, h, eps);
}

#define PDSERVE_LAYER_OPS(SUFFIX, T)                                                          \
  extern "C" void pdserve_rotary_##SUFFIX(const float* rows, const T* q, int64_t q_tok,       \
                                          int64_t q_head, int hq, const T* k, int64_t k_tok,  \
                                          int64_t k_head, int hk, int d, T* q_out, T* k_out,  \
                                          int64_t tokens) {                                   \
    rotary<T>(rows, q, q_tok, q_head, hq, k, k_tok, k_head, hk, d, q_out, k_out, tokens);     \
  }                                                                                           \
  extern "C" void pdserve_silu_and_mul_##SUFFIX(const T* x, int64_t x_stride, int64_t rows,   \
                                                int64_t inter, T* out) {                      \
    silu_and_mul<T>(x, x_stride, rows, inter, out);                                           \
  }

PDSERVE_LAYER_OPS(f32, float)
PDSERVE_LAYER_OPS(bf16, uint16_t)
