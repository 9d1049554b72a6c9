// y = x W^T + b in float32 with W stored as bfloat16: weight-only bf16 for CPUs without
// native bf16 arithmetic (AVX2 + FMA, e.g. AMD Zen 2/3, Intel before Cooper Lake).
//
// A bfloat16 checkpoint served in float32 (engine dtype 'auto' on such a CPU) reads its
// linear weights from memory on every decode step; held as bf16 they are half the bytes,
// and widening bf16 to fp32 is exact (a 16-bit shift), so the result is the float32 model's
// (only the summation order differs from torch's). oneDNN and MKL have no bf16-weight /
// fp32-compute matmul on AVX2, which is why this one exists.
//
// Layout (pdserve_pack_bf16w): the N outputs in panels of 16; panel p holds for every k the
// 16 weights W[16p .. 16p+15][k] as 8 uint32 lanes, lane i = (col i) | (col i+8) << 16. One
// 256-bit load then gives cols 0-7 (lane << 16) and cols 8-15 (lane & 0xffff0000) as fp32.
// A panel is zero-padded past N.
//
// Kernel: an MR x 16 register tile (MR <= 6 rows of x, 12 accumulators) walks k, one
// broadcast of x per row and two FMAs per row per k (the BLIS-style outer product). Rows are
// taken in blocks whose x slice stays in L2 while every panel streams past it once; panels
// of a block are shared across OpenMP threads (torch's pool, as many as it runs).
// Built and loaded by kernels/cpu/native.py.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include <omp.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PDSERVE_HAVE_AVX2 1
#else
#define PDSERVE_HAVE_AVX2 0
#endif

namespace {

constexpr int64_t kPanel = 16;
// How far ahead of its loads a tile that streams from memory prefetches (2 KiB).
constexpr int64_t kAheadWords = 512;

#if PDSERVE_HAVE_AVX2

inline void store_row(float* out, __m256 lo, __m256 hi, int64_t cols) {
  if (cols == kPanel) {
    _mm256_storeu_ps(out, lo);
    _mm256_storeu_ps(out + 8, hi);
  } else {  // the last, partial panel
    alignas(32) float tmp[kPanel];
    _mm256_store_ps(tmp, lo);
    _mm256_store_ps(tmp + 8, hi);
    std::memcpy(out, tmp, sizeof(float) * cols);
  }
}

// Accumulators are named variables, not an array: GCC keeps an array tile in memory (a
// store per FMA), named ones stay in the 12 registers.
#define PDSERVE_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)

// While it walks k, the tile also prefetches ahead[k * 8] for k < ahead_k (into L1).
template <int MR>
inline void tile(const float* x, int64_t ldx, const uint32_t* panel, int64_t K,
                 const float* bias, float* y, int64_t ldy, int64_t cols,
                 const uint32_t* ahead, int64_t ahead_k) {
#define PDSERVE_DECL(r) __m256 lo##r = _mm256_setzero_ps(), hi##r = _mm256_setzero_ps();
  PDSERVE_ROWS(PDSERVE_DECL)
#undef PDSERVE_DECL
  const __m256i hi_mask = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t k = 0; k < K; ++k) {
    if (k < ahead_k) _mm_prefetch(reinterpret_cast<const char*>(ahead + k * 8), _MM_HINT_T0);
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + k * 8));
    const __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    const __m256 w1 = _mm256_castsi256_ps(_mm256_and_si256(w, hi_mask));
#define PDSERVE_FMA(r)                                       \
  if constexpr (r < MR) {                                    \
    const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k); \
    lo##r = _mm256_fmadd_ps(xv, w0, lo##r);                  \
    hi##r = _mm256_fmadd_ps(xv, w1, hi##r);                  \
  }
    PDSERVE_ROWS(PDSERVE_FMA)
#undef PDSERVE_FMA
  }
  alignas(32) float padded_bias[kPanel] = {0};
  if (bias != nullptr) std::memcpy(padded_bias, bias, sizeof(float) * cols);
  const __m256 b0 = _mm256_load_ps(padded_bias), b1 = _mm256_load_ps(padded_bias + 8);
#define PDSERVE_STORE(r)                                          \
  if constexpr (r < MR) {                                         \
    store_row(y + r * ldy, _mm256_add_ps(lo##r, b0), _mm256_add_ps(hi##r, b1), cols); \
  }
  PDSERVE_ROWS(PDSERVE_STORE)
#undef PDSERVE_STORE
}

// Rows in tiles of at most 6, split evenly (8 rows: 4 + 4, not 6 + 2: a 2-row tile spends
// as much on loading and widening the weights as on its 4 FMAs per k).
//
// The first tile streams the panel from memory and prefetches kAheadWords ahead of itself
// (on into the next panel, which follows in memory); the second one, computing from L1,
// prefetches the next panel, so that memory stays busy meanwhile (gain in docs/cpu.md).
void panel_rows(const float* x, int64_t ldx, int64_t rows, const uint32_t* panel, int64_t K,
                const float* bias, float* y, int64_t ldy, int64_t cols, bool has_next) {
  const int64_t tiles = (rows + 5) / 6;
  int64_t r = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t mr = (rows - r) / (tiles - t);  // the first tiles take the remainder last
    const float* xr = x + r * ldx;
    float* yr = y + r * ldy;
    const uint32_t* ahead = nullptr;
    int64_t ahead_k = 0;  // stays inside this panel and the next one, when there is one
    if (t == 0) {
      const int64_t words = (has_next ? 2 : 1) * K * 8;  // from this panel's start
      ahead_k = std::clamp<int64_t>((words - kAheadWords) / 8, 0, K);
      if (ahead_k > 0) ahead = panel + kAheadWords;
    } else if (t == 1 && has_next) {
      ahead = panel + K * 8;
      ahead_k = K;
    }
    switch (mr) {
      case 6: tile<6>(xr, ldx, panel, K, bias, yr, ldy, cols, ahead, ahead_k); break;
      case 5: tile<5>(xr, ldx, panel, K, bias, yr, ldy, cols, ahead, ahead_k); break;
      case 4: tile<4>(xr, ldx, panel, K, bias, yr, ldy, cols, ahead, ahead_k); break;
      case 3: tile<3>(xr, ldx, panel, K, bias, yr, ldy, cols, ahead, ahead_k); break;
      case 2: tile<2>(xr, ldx, panel, K, bias, yr, ldy, cols, ahead, ahead_k); break;
      default: tile<1>(xr, ldx, panel, K, bias, yr, ldy, cols, ahead, ahead_k); break;
    }
    r += mr;
  }
}

#endif  // PDSERVE_HAVE_AVX2

}  // namespace

extern "C" int pdserve_linear_bf16w_supported() { return PDSERVE_HAVE_AVX2; }

// w: [N, K] bf16 bits (row-major, row stride ldw); packed: ceil(N/16) * K * 8 uint32.
extern "C" void pdserve_pack_bf16w(const uint16_t* w, int64_t ldw, int64_t N, int64_t K,
                                   uint32_t* packed) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    uint32_t* dst = packed + p * K * 8;
    for (int64_t k = 0; k < K; ++k) {
      for (int64_t i = 0; i < 8; ++i) {
        const int64_t lo_col = p * kPanel + i, hi_col = lo_col + 8;
        const uint32_t lo = lo_col < N ? w[lo_col * ldw + k] : 0;
        const uint32_t hi = hi_col < N ? w[hi_col * ldw + k] : 0;
        dst[k * 8 + i] = lo | (hi << 16);
      }
    }
  }
}

// x: [M, K] fp32 (row stride ldx); y: [M, N] fp32 (row stride ldy); bias: [N] fp32 or null.
extern "C" void pdserve_linear_bf16w(const float* x, int64_t ldx, int64_t M, int64_t K,
                                     const uint32_t* packed, int64_t N, const float* bias,
                                     float* y, int64_t ldy) {
#if PDSERVE_HAVE_AVX2
  const int64_t panels = (N + kPanel - 1) / kPanel;
  // Rows per block: the block's x slice (rows * K floats) within ~192 KiB of L2, whole tiles.
  int64_t block = std::max<int64_t>(6, (192 * 1024 / 4) / std::max<int64_t>(K, 1) / 6 * 6);
  block = std::min(block, M);
  const int64_t row_blocks = (M + block - 1) / block;
  // Dynamic: a thread that is preempted (a helper on a shared CPU, kernels/cpu/runtime.py)
  // holds up the step by its current chunk of panels, not by a static share.
#pragma omp parallel for collapse(2) schedule(dynamic, 4)
  for (int64_t rb = 0; rb < row_blocks; ++rb) {
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t r0 = rb * block, rows = std::min(block, M - r0);
      const int64_t c0 = p * kPanel, cols = std::min(kPanel, N - c0);
      panel_rows(x + r0 * ldx, ldx, rows, packed + p * K * 8, K,
                 bias == nullptr ? nullptr : bias + c0, y + r0 * ldy + c0, ldy, cols,
                 p + 1 < panels);
    }
  }
#else
  (void)x, (void)ldx, (void)M, (void)K, (void)packed, (void)N, (void)bias, (void)y, (void)ldy;
#endif
}
