// y = x W^T + b for bfloat16 x, W and y with float32 accumulation, on CPUs with AVX512-BF16
// (AMD Zen 4/5, Intel Cooper Lake; not used where AMX is, oneDNN's AMX kernels win there).
//
// Why not oneDNN: for the few rows of a decode step the weights stream from memory once per
// step, and oneDNN's packed bf16 matmul reads them well below the memory bandwidth; this
// kernel's one pass reads them faster and is on par with oneDNN from 32 rows up to prefill
// sizes (measurements in docs/cpu.md).
//
// Layout (pdserve_pack_bf16): the N outputs in panels of 16 (their count rounded up to even,
// zero-padded past N); panel p holds for every pair of inputs (2j, 2j+1) the 16 uint32 lanes
// lane i = W[16p+i][2j] | W[16p+i][2j+1] << 16, which is what VDPBF16PS takes: one 512-bit
// load gives 16 outputs times 2 inputs, against the pair x[r][2j..2j+1] broadcast. An odd K
// is padded with a zero weight; the matching x element is never read past the row.
//
// Kernel: an MR x 32 register tile (MR <= 12 rows, two panels, 24 fp32 accumulators) walks
// the input pairs: two weight loads, then one broadcast and two dot products per row. Rows
// go in blocks whose x slice stays in L2 while every panel pair streams past it once; the
// (block, panel pair) units are split over the OpenMP threads (torch's pool). The sums are
// rounded to bf16 once, after the bias is added in float32, as oneDNN does.
//
// pdserve_linear_bf16_f32out is the logits' variant: the same sums stored as float32, never
// rounded to bf16 (a near-tie between two tokens is the model's, not bf16's).
// Built and loaded by kernels/cpu/native.py.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include <omp.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__)
#include <immintrin.h>
#define PDSERVE_HAVE_AVX512BF16 1
#else
#define PDSERVE_HAVE_AVX512BF16 0
#endif

namespace {

constexpr int64_t kPanel = 16;
constexpr int64_t kUnit = 2 * kPanel;  // output columns of one register tile

inline int64_t pairs_of(int64_t K) { return (K + 1) / 2; }
inline int64_t panels_of(int64_t N) { return (N + kUnit - 1) / kUnit * 2; }

#if PDSERVE_HAVE_AVX512BF16

inline uint32_t load_pair(const uint16_t* x) {
  uint32_t v;
  std::memcpy(&v, x, sizeof v);
  return v;
}

inline void store_row(uint16_t* out, __m512 lo, __m512 hi, int64_t cols) {
  const __m256i a = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(lo));
  const __m256i b = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(hi));
  if (cols >= kUnit) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), a);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + kPanel), b);
    return;
  }
  const auto mask = [](int64_t n) {
    return static_cast<__mmask16>(n >= 16 ? 0xffff : (1u << std::max<int64_t>(n, 0)) - 1);
  };
  _mm256_mask_storeu_epi16(out, mask(cols), a);
  _mm256_mask_storeu_epi16(out + kPanel, mask(cols - kPanel), b);
}

inline void store_row(float* out, __m512 lo, __m512 hi, int64_t cols) {
  const auto mask = [](int64_t n) {
    return static_cast<__mmask16>(n >= 16 ? 0xffff : (1u << std::max<int64_t>(n, 0)) - 1);
  };
  _mm512_mask_storeu_ps(out, mask(cols), lo);
  _mm512_mask_storeu_ps(out + kPanel, mask(cols - kPanel), hi);
}

// Accumulators are named variables, not an array: GCC keeps an array tile in memory.
#define PDSERVE_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)

template <int MR, typename TY>
inline void tile(const uint16_t* x, int64_t ldx, int64_t K, const uint32_t* p0,
                 const uint32_t* p1, const float* bias, TY* y, int64_t ldy, int64_t cols) {
#define PDSERVE_DECL(r) __m512 lo##r = _mm512_setzero_ps(), hi##r = _mm512_setzero_ps();
  PDSERVE_ROWS(PDSERVE_DECL)
#undef PDSERVE_DECL
  const int64_t full = K / 2;
#define PDSERVE_DOT(r, PAIR)                                                  \
  if constexpr (r < MR) {                                                     \
    const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(PAIR)); \
    lo##r = _mm512_dpbf16_ps(lo##r, xv, w0);                                  \
    hi##r = _mm512_dpbf16_ps(hi##r, xv, w1);                                  \
  }
  for (int64_t j = 0; j < full; ++j) {
    const __m512bh w0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(p0 + j * kPanel));
    const __m512bh w1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(p1 + j * kPanel));
#define PDSERVE_STEP(r) PDSERVE_DOT(r, static_cast<int>(load_pair(x + r * ldx + 2 * j)))
    PDSERVE_ROWS(PDSERVE_STEP)
#undef PDSERVE_STEP
  }
  if (K % 2) {  // the last input alone: its pair's upper weight is zero, so is its x half
    const __m512bh w0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(p0 + full * kPanel));
    const __m512bh w1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(p1 + full * kPanel));
#define PDSERVE_TAIL(r) PDSERVE_DOT(r, static_cast<int>(x[r * ldx + K - 1]))
    PDSERVE_ROWS(PDSERVE_TAIL)
#undef PDSERVE_TAIL
  }
#undef PDSERVE_DOT
  alignas(64) float padded_bias[kUnit] = {0};
  if (bias != nullptr) std::memcpy(padded_bias, bias, sizeof(float) * std::min(cols, kUnit));
  const __m512 b0 = _mm512_load_ps(padded_bias), b1 = _mm512_load_ps(padded_bias + kPanel);
#define PDSERVE_STORE(r)                                                                    \
  if constexpr (r < MR) {                                                                   \
    store_row(y + r * ldy, _mm512_add_ps(lo##r, b0), _mm512_add_ps(hi##r, b1), cols);     \
  }
  PDSERVE_ROWS(PDSERVE_STORE)
#undef PDSERVE_STORE
}

// Rows in tiles of at most 12, split evenly (the weights are loaded once per tile, so a
// tile of a few rows costs nearly as much as a full one).
template <typename TY>
void unit_rows(const uint16_t* x, int64_t ldx, int64_t rows, int64_t K, const uint32_t* p0,
               const uint32_t* p1, const float* bias, TY* y, int64_t ldy, int64_t cols) {
  const int64_t tiles = (rows + 11) / 12;
  int64_t r = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t mr = (rows - r) / (tiles - t);
    const uint16_t* xr = x + r * ldx;
    TY* yr = y + r * ldy;
    switch (mr) {
#define PDSERVE_CASE(n) \
  case n: tile<n>(xr, ldx, K, p0, p1, bias, yr, ldy, cols); break;
      PDSERVE_CASE(12) PDSERVE_CASE(11) PDSERVE_CASE(10) PDSERVE_CASE(9) PDSERVE_CASE(8)
      PDSERVE_CASE(7) PDSERVE_CASE(6) PDSERVE_CASE(5) PDSERVE_CASE(4) PDSERVE_CASE(3)
      PDSERVE_CASE(2)
#undef PDSERVE_CASE
      default: tile<1>(xr, ldx, K, p0, p1, bias, yr, ldy, cols); break;
    }
    r += mr;
  }
}

template <typename TY>
void linear(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const uint32_t* packed,
            int64_t N, const float* bias, TY* y, int64_t ldy) {
  const int64_t units = panels_of(N) / 2, panel_words = pairs_of(K) * kPanel;
  // Rows per block: the block's x slice (rows * K bf16) within ~256 KiB of L2, whole tiles.
  int64_t block = std::max<int64_t>(12, (256 * 1024 / 2) / std::max<int64_t>(K, 1) / 12 * 12);
  block = std::min(block, M);
  const int64_t row_blocks = (M + block - 1) / block;
  // Dynamic: a thread that is preempted (a helper on a shared CPU, kernels/cpu/runtime.py)
  // holds up the step by its current chunk of panel pairs, not by a static share.
#pragma omp parallel for collapse(2) schedule(dynamic, 2)
  for (int64_t rb = 0; rb < row_blocks; ++rb) {
    for (int64_t u = 0; u < units; ++u) {
      const int64_t r0 = rb * block, rows = std::min(block, M - r0);
      const int64_t c0 = u * kUnit, cols = std::min(kUnit, N - c0);
      const uint32_t* p0 = packed + 2 * u * panel_words;
      unit_rows(x + r0 * ldx, ldx, rows, K, p0, p0 + panel_words,
                bias == nullptr ? nullptr : bias + c0, y + r0 * ldy + c0, ldy, cols);
    }
  }
}

#endif  // PDSERVE_HAVE_AVX512BF16

}  // namespace

extern "C" int pdserve_linear_bf16_supported() { return PDSERVE_HAVE_AVX512BF16; }

// uint32 words of the packed form of an [N, K] weight.
extern "C" int64_t pdserve_bf16_packed_words(int64_t N, int64_t K) {
  return panels_of(N) * pairs_of(K) * kPanel;
}

// w: [N, K] bf16 bits (row-major, row stride ldw) -> packed (pdserve_bf16_packed_words).
extern "C" void pdserve_pack_bf16(const uint16_t* w, int64_t ldw, int64_t N, int64_t K,
                                  uint32_t* packed) {
  const int64_t panels = panels_of(N), pairs = pairs_of(K);
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    uint32_t* dst = packed + p * pairs * kPanel;
    for (int64_t j = 0; j < pairs; ++j) {
      for (int64_t i = 0; i < kPanel; ++i) {
        const int64_t n = p * kPanel + i, k = 2 * j;
        const uint32_t lo = n < N ? w[n * ldw + k] : 0;
        const uint32_t hi = n < N && k + 1 < K ? w[n * ldw + k + 1] : 0;
        dst[j * kPanel + i] = lo | (hi << 16);
      }
    }
  }
}

// x: [M, K] bf16 (row stride ldx); y: [M, N] bf16 (row stride ldy); bias: [N] fp32 or null.
extern "C" void pdserve_linear_bf16(const uint16_t* x, int64_t ldx, int64_t M, int64_t K,
                                    const uint32_t* packed, int64_t N, const float* bias,
                                    uint16_t* y, int64_t ldy) {
#if PDSERVE_HAVE_AVX512BF16
  linear(x, ldx, M, K, packed, N, bias, y, ldy);
#else
  (void)x, (void)ldx, (void)M, (void)K, (void)packed, (void)N, (void)bias, (void)y, (void)ldy;
#endif
}

// The same with y: [M, N] float32, the sums never rounded to bf16 (the logits).
extern "C" void pdserve_linear_bf16_f32out(const uint16_t* x, int64_t ldx, int64_t M, int64_t K,
                                           const uint32_t* packed, int64_t N, const float* bias,
                                           float* y, int64_t ldy) {
#if PDSERVE_HAVE_AVX512BF16
  linear(x, ldx, M, K, packed, N, bias, y, ldy);
#else
  (void)x, (void)ldx, (void)M, (void)K, (void)packed, (void)N, (void)bias, (void)y, (void)ldy;
#endif
}
