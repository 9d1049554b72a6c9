// Linears over int8 weights with per-output-channel scales on CPUs with AVX512-VNNI (Intel
// Sapphire Rapids on, AMD Zen 4/5), for the few rows of a decode step.
//
// Why not oneDNN / torch: a decode step streams every weight from memory once, so an int8
// weight should cost half the time of a bf16 one; torch._int_mm and _weight_int8pack_mm read
// int8 weights at decode sizes no faster than oneDNN's packed bf16 matmul reads twice the
// bytes (measurements in docs/quantization.md). This kernel makes one pass over the packed
// bytes. Where the CPU has AMX-INT8, linear_int8_amx.cpp runs the same product on tiles
// (from about 8 rows VPDPBUSD's arithmetic, not the bytes, sets this kernel's time);
// without AMX, from 16 plane rows on oneDNN's int8 matmul computes faster and the callers
// (kernels/cpu/quant_linear.py) use it instead.
//
// Activations: each row of x is split into P int8 planes with their own scales,
// x ~ sum_p s_p q_p: s_0 = absmax / 127 and q_0 = round(x / s_0) (half to even, clamped to
// +-127) is the per-token quantization of kernels/quant_reference.py (P = 1: W8A8); each
// further plane quantizes what is left, |x - s_0 q_0| <= s_0 / 2, with s_p = s_(p-1) / 254,
// so P = 2 leaves an error of at most absmax / 64516 per element and P = 3 about float32
// rounding of the residuals, absmax * 2^-23 (the weight-only linears: far below the
// rounding of a bf16 activation or of the output).
//
// VPDPBUSD multiplies unsigned by signed bytes, so the planes are stored as uint8 = q + 128
// and the int32 sums lose 128 * sum_k W[n][k] again (pdserve_pack_int8 precomputes it).
// Weight layout: the N outputs in panels of 16 (their count rounded up to even, zero-padded);
// panel p holds for every quad of inputs (4j .. 4j+3) the 16 int32 lanes
// lane i = W[16p+i][4j .. 4j+3], which VPDPBUSD takes against a quad of x broadcast.
// An MR x 32 register tile (MR <= 12 plane rows, two panels) walks the quads; rows go in
// blocks, (block, panel pair) units are split over torch's OpenMP threads dynamically (a
// preempted helper thread delays a step by one unit). The exact int32 sums become
// t = sum * s_p * w_scale[n] in float32, and y = sum_p t_p + bias is rounded once.
// Built and loaded by kernels/cpu/native.py; wrapped by kernels/cpu/int8_native.py.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <omp.h>

#include "int8_rows.h"

namespace {

using namespace pdserve::int8;

#if PDSERVE_HAVE_INT8

inline int32_t load_i32(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Accumulators are named variables, not an array: GCC keeps an array tile in memory.
#define PDSERVE_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)

struct Epilogue {  // t = (sum - 128 * wsum[n]) * row_scale[r] * col_scale[n]
  const int32_t* wsum;
  const float* row_scale;
  const float* col_scale;
};

template <int MR>
inline void tile(const uint8_t* xq, int64_t ldq, int64_t quads, const int32_t* p0,
                 const int32_t* p1, const Epilogue& e, int64_t r0, int64_t c0, float* t,
                 int64_t ldt, int64_t cols) {
#define PDSERVE_DECL(r) __m512i lo##r = _mm512_setzero_si512(), hi##r = _mm512_setzero_si512();
  PDSERVE_ROWS(PDSERVE_DECL)
#undef PDSERVE_DECL
  for (int64_t j = 0; j < quads; ++j) {
    const __m512i w0 = _mm512_loadu_si512(p0 + j * kPanel);
    const __m512i w1 = _mm512_loadu_si512(p1 + j * kPanel);
#define PDSERVE_STEP(r)                                                  \
  if constexpr (r < MR) {                                                \
    const __m512i xv = _mm512_set1_epi32(load_i32(xq + r * ldq + 4 * j)); \
    lo##r = _mm512_dpbusd_epi32(lo##r, xv, w0);                          \
    hi##r = _mm512_dpbusd_epi32(hi##r, xv, w1);                          \
  }
    PDSERVE_ROWS(PDSERVE_STEP)
#undef PDSERVE_STEP
  }
  const __m512i shift = _mm512_set1_epi32(128);
  const __m512i ws0 = _mm512_mullo_epi32(_mm512_loadu_si512(e.wsum + c0), shift);
  const __m512i ws1 = _mm512_mullo_epi32(_mm512_loadu_si512(e.wsum + c0 + kPanel), shift);
  const __m512 cs0 = _mm512_maskz_loadu_ps(lanes(cols), e.col_scale + c0);
  const __m512 cs1 = _mm512_maskz_loadu_ps(lanes(cols - kPanel), e.col_scale + c0 + kPanel);
  // (sum * row scale) * column scale: the reference's order of the float32 products.
#define PDSERVE_STORE(r)                                                                     \
  if constexpr (r < MR) {                                                                    \
    const __m512 xs = _mm512_set1_ps(e.row_scale[r0 + r]);                                   \
    const __m512 s0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(lo##r, ws0)), xs);  \
    const __m512 s1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(hi##r, ws1)), xs);  \
    store16(t + r * ldt, _mm512_mul_ps(s0, cs0), cols);                                      \
    store16(t + r * ldt + kPanel, _mm512_mul_ps(s1, cs1), cols - kPanel);                    \
  }
  PDSERVE_ROWS(PDSERVE_STORE)
#undef PDSERVE_STORE
}

// Runs tile<mr>(row offset, mr) over `rows` rows in tiles of at most 12, split evenly (the
// weights are widened once per tile, so a tile of a few rows costs nearly a full one).
template <typename F>
inline void over_row_tiles(int64_t rows, F&& tile) {
  const int64_t tiles = (rows + 11) / 12;
  int64_t r = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t mr = (rows - r) / (tiles - t);
    switch (mr) {
#define PDSERVE_CASE(n) \
  case n: tile(std::integral_constant<int, n>{}, r); break;
      PDSERVE_CASE(12) PDSERVE_CASE(11) PDSERVE_CASE(10) PDSERVE_CASE(9) PDSERVE_CASE(8)
      PDSERVE_CASE(7) PDSERVE_CASE(6) PDSERVE_CASE(5) PDSERVE_CASE(4) PDSERVE_CASE(3)
      PDSERVE_CASE(2)
#undef PDSERVE_CASE
      default: tile(std::integral_constant<int, 1>{}, r); break;
    }
    r += mr;
  }
}

// The (row block, panel pair) units of an M x N product, split over the OpenMP team.
template <typename F>
inline void over_units(int64_t M, int64_t N, int64_t row_bytes, F&& unit) {
  const int64_t units = panels_of(N) / 2;
  // Rows per block: the block's x slice within ~256 KiB of L2, whole tiles.
  int64_t block = std::max<int64_t>(12, (256 * 1024) / std::max<int64_t>(row_bytes, 1) / 12 * 12);
  block = std::min(block, M);
  const int64_t row_blocks = (M + block - 1) / block;
#pragma omp parallel for collapse(2) schedule(dynamic, 2)
  for (int64_t rb = 0; rb < row_blocks; ++rb) {
    for (int64_t u = 0; u < units; ++u) {
      const int64_t r0 = rb * block;
      unit(r0, std::min(block, M - r0), u, u * kUnit, std::min(kUnit, N - u * kUnit));
    }
  }
}

// t [R, N] float32 (row stride ldt) = the scaled sums of the R plane rows of xq.
void gemm(const uint8_t* xq, int64_t ldq, int64_t R, int64_t K, const int32_t* packed,
          int64_t N, const Epilogue& e, float* t, int64_t ldt) {
  const int64_t quads = quads_of(K), panel_words = quads * kPanel;
  over_units(R, N, ldq, [&](int64_t r0, int64_t rows, int64_t u, int64_t c0, int64_t cols) {
    const int32_t* p0 = packed + 2 * u * panel_words;
    over_row_tiles(rows, [&](auto mr, int64_t r) {
      tile<decltype(mr)::value>(xq + (r0 + r) * ldq, ldq, quads, p0, p0 + panel_words, e, r0 + r,
                                c0, t + (r0 + r) * ldt + c0, ldt, cols);
    });
  });
}

template <typename T>
void linear(const T* x, int64_t ldx, int64_t M, int64_t K, int64_t P, const int32_t* packed,
            int64_t N, const int32_t* wsum, const float* wscale, const float* bias, T* y,
            int64_t ldy, uint8_t* xq, float* xs, float* t) {
  const int64_t ldq = 4 * quads_of(K);
#pragma omp parallel for schedule(static) if (M > 1)
  for (int64_t r = 0; r < M; ++r) {
    quantize_row(x + r * ldx, K, P, 128, xq + r * P * ldq, ldq, xs + r * P);
  }
  gemm(xq, ldq, M * P, K, packed, N, Epilogue{wsum, xs, wscale}, t, N);
#pragma omp parallel for schedule(static) if (M > 1)
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t c = 0; c < N; c += 16) {
      const __mmask16 m = lanes(N - c);
      __m512 v = _mm512_maskz_loadu_ps(m, t + r * P * N + c);
      for (int64_t p = 1; p < P; ++p) {
        v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, t + (r * P + p) * N + c));
      }
      if (bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, bias + c));
      store16(y + r * ldy + c, v, N - c);
    }
  }
}

// y [M, N] = sum_p (acc[r P + p] * xs[r P + p]) * wscale + bias, rounded once: the
// epilogue of sums computed elsewhere (oneDNN), in one pass over them.
template <typename T>
void finish_rows(const float* acc, int64_t M, int64_t N, int64_t P, const float* xs,
                 const float* wscale, const float* bias, T* y, int64_t ldy) {
#pragma omp parallel for schedule(static) if (M * N > 65536)
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t c = 0; c < N; c += 16) {
      const __mmask16 m = lanes(N - c);
      const __m512 ws = _mm512_maskz_loadu_ps(m, wscale + c);
      __m512 v = _mm512_setzero_ps();
      for (int64_t p = 0; p < P; ++p) {
        const __m512 a = _mm512_maskz_loadu_ps(m, acc + (r * P + p) * N + c);
        const __m512 scaled = _mm512_mul_ps(_mm512_mul_ps(a, _mm512_set1_ps(xs[r * P + p])), ws);
        v = p == 0 ? scaled : _mm512_add_ps(v, scaled);
      }
      if (bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, bias + c));
      store16(y + r * ldy + c, v, N - c);
    }
  }
}

#endif  // PDSERVE_HAVE_INT8

}  // namespace

extern "C" int pdserve_linear_int8_supported() { return PDSERVE_HAVE_INT8; }

// Bytes of the packed form of an [N, K] int8 weight, ints of its weight sums, and bytes of
// one plane row of quantized activations.
extern "C" int64_t pdserve_int8_packed_bytes(int64_t N, int64_t K) {
  return panels_of(N) * quads_of(K) * 4 * kPanel + kPackSlack;
}
extern "C" int64_t pdserve_int8_wsum_len(int64_t N) { return panels_of(N) * kPanel; }
extern "C" int64_t pdserve_int8_row_bytes(int64_t K) { return quads_of(K) * 4; }

// q: [N, K] int8 (row stride ldq) -> packed (pdserve_int8_packed_bytes) and wsum
// (pdserve_int8_wsum_len) int32, the sum of each output's weights (zero past N).
extern "C" void pdserve_pack_int8(const int8_t* q, int64_t ldq, int64_t N, int64_t K,
                                  int8_t* packed, int32_t* wsum) {
  const int64_t panels = panels_of(N), quads = quads_of(K);
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    int8_t* dst = packed + p * quads * 4 * kPanel;
    for (int64_t i = 0; i < kPanel; ++i) {
      const int64_t n = p * kPanel + i;
      int32_t sum = 0;
      for (int64_t k = 0; k < quads * 4; ++k) {
        const int8_t w = n < N && k < K ? q[n * ldq + k] : 0;
        dst[(k / 4) * 4 * kPanel + i * 4 + k % 4] = w;
        sum += w;
      }
      wsum[n] = sum;
    }
  }
  std::memset(packed + panels * quads * 4 * kPanel, 0, kPackSlack);
}

template <typename T>
static void linear_entry(const T* x, int64_t ldx, int64_t M, int64_t K, int64_t P,
                         const int32_t* packed, int64_t N, const int32_t* wsum,
                         const float* wscale, const float* bias, T* y, int64_t ldy, uint8_t* xq,
                         float* xs, float* t) {
#if PDSERVE_HAVE_INT8
  if (P >= 1 && P <= kMaxPlanes) {
    linear(x, ldx, M, K, P, packed, N, wsum, wscale, bias, y, ldy, xq, xs, t);
  }
#else
  (void)x, (void)ldx, (void)M, (void)K, (void)P, (void)packed, (void)N, (void)wsum;
  (void)wscale, (void)bias, (void)y, (void)ldy, (void)xq, (void)xs, (void)t;
#endif
}

template <typename T>
static void quantize_entry(const T* x, int64_t ldx, int64_t M, int64_t K, int64_t P, int8_t* xq,
                           int64_t ldq, float* xs) {
#if PDSERVE_HAVE_INT8
  if (P < 1 || P > kMaxPlanes) return;
  uint8_t* out = reinterpret_cast<uint8_t*>(xq);
#pragma omp parallel for schedule(static) if (M > 1)
  for (int64_t r = 0; r < M; ++r) quantize_row(x + r * ldx, K, P, 0, out + r * P * ldq, ldq, xs + r * P);
#else
  (void)x, (void)ldx, (void)M, (void)K, (void)P, (void)xq, (void)ldq, (void)xs;
#endif
}

// x: [M, K] float32 or bf16 (row stride ldx) -> y: [M, N] of the same dtype (row stride ldy)
// through P (1..3) activation planes; wscale [N] and bias [N] (or null) float32. Scratch:
// xq M * P * pdserve_int8_row_bytes(K) bytes, xs M * P floats, t M * P * N floats.
extern "C" void pdserve_linear_int8_f32(const float* x, int64_t ldx, int64_t M, int64_t K,
                                        int64_t P, const int32_t* packed, int64_t N,
                                        const int32_t* wsum, const float* wscale,
                                        const float* bias, float* y, int64_t ldy, uint8_t* xq,
                                        float* xs, float* t) {
  linear_entry(x, ldx, M, K, P, packed, N, wsum, wscale, bias, y, ldy, xq, xs, t);
}
extern "C" void pdserve_linear_int8_bf16(const uint16_t* x, int64_t ldx, int64_t M, int64_t K,
                                         int64_t P, const int32_t* packed, int64_t N,
                                         const int32_t* wsum, const float* wscale,
                                         const float* bias, uint16_t* y, int64_t ldy,
                                         uint8_t* xq, float* xs, float* t) {
  linear_entry(x, ldx, M, K, P, packed, N, wsum, wscale, bias, y, ldy, xq, xs, t);
}

// The planes alone, as signed int8, for a GEMM elsewhere (torch._int_mm):
// xq [M * P, ldq >= K] (padding zero), xs [M * P].
extern "C" void pdserve_int8_quantize_f32(const float* x, int64_t ldx, int64_t M, int64_t K,
                                          int64_t P, int8_t* xq, int64_t ldq, float* xs) {
  quantize_entry(x, ldx, M, K, P, xq, ldq, xs);
}
extern "C" void pdserve_int8_quantize_bf16(const uint16_t* x, int64_t ldx, int64_t M,
                                           int64_t K, int64_t P, int8_t* xq, int64_t ldq,
                                           float* xs) {
  quantize_entry(x, ldx, M, K, P, xq, ldq, xs);
}

template <typename T>
static void finish_entry(const float* acc, int64_t M, int64_t N, int64_t P, const float* xs,
                         const float* wscale, const float* bias, T* y, int64_t ldy) {
#if PDSERVE_HAVE_INT8
  finish_rows(acc, M, N, P, xs, wscale, bias, y, ldy);
#else
  (void)acc, (void)M, (void)N, (void)P, (void)xs, (void)wscale, (void)bias, (void)y, (void)ldy;
#endif
}

// acc [M * P, N] float32 (contiguous), xs [M * P]: y [M, N] (row stride ldy), see finish_rows.
extern "C" void pdserve_int8_finish_f32(const float* acc, int64_t M, int64_t N, int64_t P,
                                        const float* xs, const float* wscale, const float* bias,
                                        float* y, int64_t ldy) {
  finish_entry(acc, M, N, P, xs, wscale, bias, y, ldy);
}
extern "C" void pdserve_int8_finish_bf16(const float* acc, int64_t M, int64_t N, int64_t P,
                                         const float* xs, const float* wscale, const float* bias,
                                         uint16_t* y, int64_t ldy) {
  finish_entry(acc, M, N, P, xs, wscale, bias, y, ldy);
}
