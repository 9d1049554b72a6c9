// Linears over int8 weights with per-output-channel scales on AMX tiles (Intel Sapphire
// Rapids on), for the 2 to a few hundred activation rows of decode and prefill steps.
//
// Why next to the VNNI kernel (linear_int8.cpp): VPDPBUSD does 64 multiply-adds per cycle,
// so from about 8 rows its arithmetic, not the weight bytes, sets a decode step's time. One
// TDPBSSD multiplies a 16 x 64 int8 tile by a 64 x 16 one (16K multiply-adds) in ~16 cycles:
// at decode sizes the step is bound by reading the weight again. oneDNN's AMX int8 matmul
// (what took more rows before) needs the activations quantized and its sums scaled in two
// more passes and the weight in a second layout; here both are fused around the tiles and
// the weight is the VNNI kernel's packed form (its panels are AMX's VNNI B tiles).
//
// Activations: the P int8 planes per row of linear_int8.cpp (signed, no offset: TDPBSSD
// multiplies signed by signed), rows padded with zeros to whole 64-byte tile rows. Rows go
// in blocks of 16 (15 for P = 3, so a token's planes share a block), outputs in units of
// two panels (32): per (unit, row block) two accumulator tiles walk the K chunks of 64, then
// the exact int32 sums leave through a small buffer and the epilogue computes
// y = sum_p (sum_p * s_p) * w_scale[n] + bias in float32, rounded once: the same float
// operations in the same order as the VNNI kernel, so both give identical bits.
// Units are split over torch's OpenMP threads dynamically; each thread loads the tile
// configuration and releases the tiles when done. The process asks Linux for the AMX
// state once (arch_prctl ARCH_REQ_XCOMP_PERM, as oneDNN does); where the CPU or the OS
// refuses, pdserve_int8_amx_supported() is 0 and the callers run the VNNI kernel.
// Built and loaded by kernels/cpu/native.py; wrapped by kernels/cpu/int8_native.py.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include <omp.h>

#include "int8_rows.h"

#if PDSERVE_HAVE_INT8 && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define PDSERVE_HAVE_AMX_INT8 1
#else
#define PDSERVE_HAVE_AMX_INT8 0
#endif

// The epilogue's products and sums round one by one (no fused multiply-add), as the
// reference and the VNNI kernel do.
#pragma GCC optimize("fp-contract=off")

namespace {

using namespace pdserve::int8;

constexpr int64_t kChunk = 64;  // int8 inputs per tile row

inline int64_t amx_row_bytes(int64_t K) { return (K + kChunk - 1) / kChunk * kChunk; }

#if PDSERVE_HAVE_AMX_INT8

constexpr long kArchReqXcompPerm = 0x1023;  // arch_prctl: request an XSAVE feature
constexpr long kXfeatureXtiledata = 18;     // the AMX tile data

bool amx_ready() {
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = (d >> 24) & 1u, tile_int8 = (d >> 25) & 1u;
    return tile && tile_int8 && syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0, 1 sums and 2 activations of a full row block; 3, 4 the unit's two weight panels;
// 5, 6 sums and 7 activations of the last, shorter block (if any).
TileConfig tile_config(int64_t block, int64_t tail) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    const int64_t rows = t < 3 ? block : t < 5 ? kChunk / 4 : tail;
    cfg.rows[t] = static_cast<uint8_t>(rows);
    cfg.colsb[t] = static_cast<uint16_t>(rows > 0 ? kChunk : 0);
  }
  return cfg;
}

struct Epilogue {
  const float* row_scale;  // [R]: each plane row's scale
  const float* col_scale;  // [N]
  const float* bias;       // [N] or null
  int64_t planes;
};

// The sums of `rows` plane rows (whole tokens) x one unit's columns -> y.
template <typename T>
void finish_block(const int32_t (*sums)[kUnit], int64_t r0, int64_t rows, int64_t c0,
                  int64_t cols, const Epilogue& e, T* y, int64_t ldy) {
  const int64_t P = e.planes;
  for (int64_t half = 0; half < 2; ++half) {
    const int64_t c = c0 + half * kPanel, n = cols - half * kPanel;
    if (n <= 0) break;
    const __mmask16 m = lanes(n);
    const __m512 cs = _mm512_maskz_loadu_ps(m, e.col_scale + c);
    const __m512 bias = e.bias != nullptr ? _mm512_maskz_loadu_ps(m, e.bias + c) : __m512{};
    for (int64_t r = 0; r < rows; r += P) {
      __m512 v = _mm512_setzero_ps();
      for (int64_t p = 0; p < P; ++p) {
        const __m512 s = _mm512_cvtepi32_ps(_mm512_load_si512(sums[r + p] + half * kPanel));
        const __m512 t = _mm512_mul_ps(_mm512_mul_ps(s, _mm512_set1_ps(e.row_scale[r0 + r + p])), cs);
        v = p == 0 ? t : _mm512_add_ps(v, t);
      }
      if (e.bias != nullptr) v = _mm512_add_ps(v, bias);
      store16(y + (r0 + r) / P * ldy + c, v, n);
    }
  }
}

// The int32 sums of one row block (activation tile A, rows from a) x one unit's two panels
// (p0, p1) into accumulator tiles C0, C1, then into sums. A macro, not a template: GCC's
// tile intrinsics paste their tile numbers into the assembly as written.
#define PDSERVE_BLOCK_SUMS(name, C0, C1, A)                                              \
  inline void name(const uint8_t* a, int64_t ldq, int64_t chunks, const int8_t* p0,      \
                   const int8_t* p1, int32_t(*sums)[kUnit]) {                           \
    constexpr int64_t tile_bytes = kChunk * kPanel;                                      \
    _tile_zero(C0);                                                                      \
    _tile_zero(C1);                                                                      \
    for (int64_t k = 0; k < chunks; ++k) {                                               \
      _tile_loadd(A, a + k * kChunk, ldq);                                               \
      _tile_loadd(3, p0 + k * tile_bytes, 4 * kPanel);                                   \
      _tile_loadd(4, p1 + k * tile_bytes, 4 * kPanel);                                   \
      _tile_dpbssd(C0, A, 3);                                                            \
      _tile_dpbssd(C1, A, 4);                                                            \
    }                                                                                    \
    _tile_stored(C0, sums[0], sizeof sums[0]);                                           \
    _tile_stored(C1, sums[0] + kPanel, sizeof sums[0]);                                  \
  }
PDSERVE_BLOCK_SUMS(full_block_sums, 0, 1, 2)
PDSERVE_BLOCK_SUMS(tail_block_sums, 5, 6, 7)
#undef PDSERVE_BLOCK_SUMS

// y [R / P, N] from the R plane rows of xq (row stride ldq, a multiple of 64).
template <typename T>
void gemm(const uint8_t* xq, int64_t ldq, int64_t R, const int8_t* packed, int64_t N,
          int64_t quads, const Epilogue& e, T* y, int64_t ldy) {
  const int64_t block = kPanel - kPanel % e.planes, blocks = R / block, tail = R % block;
  const int64_t chunks = ldq / kChunk, units = panels_of(N) / 2;
  const int64_t panel_bytes = quads * 4 * kPanel;
  const TileConfig cfg = tile_config(blocks > 0 ? block : 0, tail);
#pragma omp parallel if (units > 1)
  {
    _tile_loadconfig(&cfg);
    alignas(64) int32_t sums[kPanel][kUnit];
#pragma omp for schedule(dynamic, 2)
    for (int64_t u = 0; u < units; ++u) {
      const int8_t* p0 = packed + 2 * u * panel_bytes;
      const int64_t c0 = u * kUnit, cols = std::min(kUnit, N - c0);
      for (int64_t b = 0; b < blocks; ++b) {
        full_block_sums(xq + b * block * ldq, ldq, chunks, p0, p0 + panel_bytes, sums);
        finish_block(sums, b * block, block, c0, cols, e, y, ldy);
      }
      if (tail > 0) {
        tail_block_sums(xq + blocks * block * ldq, ldq, chunks, p0, p0 + panel_bytes, sums);
        finish_block(sums, blocks * block, tail, c0, cols, e, y, ldy);
      }
    }
    _tile_release();
  }
}

template <typename T>
void linear(const T* x, int64_t ldx, int64_t M, int64_t K, int64_t P, const int8_t* packed,
            int64_t N, const float* wscale, const float* bias, T* y, int64_t ldy, uint8_t* xq,
            float* xs) {
  const int64_t ldq = amx_row_bytes(K);
#pragma omp parallel for schedule(static) if (M > 1)
  for (int64_t r = 0; r < M; ++r) {
    quantize_row(x + r * ldx, K, P, 0, xq + r * P * ldq, ldq, xs + r * P);
  }
  gemm(xq, ldq, M * P, packed, N, quads_of(K), Epilogue{xs, wscale, bias, P}, y, ldy);
}

#endif  // PDSERVE_HAVE_AMX_INT8

template <typename T>
void linear_entry(const T* x, int64_t ldx, int64_t M, int64_t K, int64_t P, const int8_t* packed,
                  int64_t N, const float* wscale, const float* bias, T* y, int64_t ldy,
                  uint8_t* xq, float* xs) {
#if PDSERVE_HAVE_AMX_INT8
  if (P >= 1 && P <= kMaxPlanes && amx_ready()) {
    linear(x, ldx, M, K, P, packed, N, wscale, bias, y, ldy, xq, xs);
  }
#else
  (void)x, (void)ldx, (void)M, (void)K, (void)P, (void)packed, (void)N, (void)wscale;
  (void)bias, (void)y, (void)ldy, (void)xq, (void)xs;
#endif
}

}  // namespace

// 1 where this build has the AMX kernel and the CPU and the OS let the process use the tiles.
extern "C" int pdserve_int8_amx_supported() {
#if PDSERVE_HAVE_AMX_INT8
  return amx_ready() ? 1 : 0;
#else
  return 0;
#endif
}

// Bytes of one plane row of quantized activations (K padded to whole tile rows).
extern "C" int64_t pdserve_int8_amx_row_bytes(int64_t K) { return amx_row_bytes(K); }

// x: [M, K] float32 or bf16 (row stride ldx) -> y: [M, N] of the same dtype (row stride ldy)
// through P (1..3) activation planes; packed from pdserve_pack_int8, wscale [N] and bias [N]
// (or null) float32. Scratch: xq M * P * pdserve_int8_amx_row_bytes(K) bytes, xs M * P floats.
extern "C" void pdserve_linear_int8_amx_f32(const float* x, int64_t ldx, int64_t M, int64_t K,
                                            int64_t P, const int8_t* packed, int64_t N,
                                            const float* wscale, const float* bias, float* y,
                                            int64_t ldy, uint8_t* xq, float* xs) {
  linear_entry(x, ldx, M, K, P, packed, N, wscale, bias, y, ldy, xq, xs);
}
extern "C" void pdserve_linear_int8_amx_bf16(const uint16_t* x, int64_t ldx, int64_t M,
                                             int64_t K, int64_t P, const int8_t* packed,
                                             int64_t N, const float* wscale, const float* bias,
                                             uint16_t* y, int64_t ldy, uint8_t* xq, float* xs) {
  linear_entry(x, ldx, M, K, P, packed, N, wscale, bias, y, ldy, xq, xs);
}
