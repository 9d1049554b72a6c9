// Paged decode attention for CPUs: one query token per sequence against its paged context,
// read in place from the KV pool (no gather into a padded copy), float32 math.
//
// Layout (kernels/ops.py): q [S, Hq, D]; k_cache, v_cache [N, B, Hkv, D] with the last dim
// contiguous; block_tables [S, M] int32; seq_lens [S] int32; out [S, Hq, D]. Query head
// h*G + g attends with KV head h (G = Hq / Hkv), so each K/V row is converted once and
// used by its G query heads. Work items are (sequence, KV head) pairs, split over the
// OpenMP threads of the calling process (torch's own runtime: this library is loaded after
// torch, so it shares torch's libgomp and its thread count).
//
// Where the compiler targets AVX-512 (-march=native) and the head dim is 64 or 128, both
// passes take 16 tokens of a block at a time in intrinsics (scores16, values16): partial
// dot products are summed 16 at once, and the value sums stay in registers over a block.
// Elsewhere the portable loops below run (the compiler vectorizes them with `omp simd`).
//
// Exported as plain C functions for ctypes: no Python or torch headers, so it builds in
// about a second with the system compiler. Built and loaded by kernels/cpu/native.py.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <omp.h>

#include "cpu_math.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using pdserve::exp_nonpositive;
using pdserve::from_f32;
using pdserve::to_f32;

struct Scratch {
  std::vector<float> q, row, scores, acc, inv, part;
};

#if defined(__AVX512F__)
// Scores with AVX-512: each (token, query head) dot product stays a 16-lane partial
// vector, and 16 of them are summed at once by a transpose-and-add tree (45 instructions
// for 16 sums, where a horizontal sum per dot costs ~8 each: the dot products of a 64-dim
// head are only 4 FMAs).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {  // 16 bfloat16 -> float32 (the high halves)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// out lane i = the sum of the 16 floats at p + 16 i, for i < 16.
inline __m512 sum16x16(const float* p) {
  __m512 t[8], u[4], w[2];
  for (int k = 0; k < 8; ++k) {
    const __m512 a = _mm512_loadu_ps(p + 32 * k), b = _mm512_loadu_ps(p + 32 * k + 16);
    t[k] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  for (int k = 0; k < 4; ++k)
    u[k] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * k], t[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * k], t[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int k = 0; k < 2; ++k)
    w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// Scores of tokens [l0, l0 + n) (n <= 16, consecutive rows from `kb` on) for the G query
// rows of KV head h: sc[r * len + l] for r = (h - h0) * G + g.
template <typename T, int kD>
inline void scores16(const T* kb, int64_t tok_stride, const float* qf, int G, int r0, int n,
                     int l0, int len, float* sc, float* part) {
  constexpr int C = kD / 16;
  for (int t = 0; t < 16; ++t) {  // part: [G][16 tokens][16 lanes] partial sums
    if (t >= n) {  // unused rows of a short block sum to nothing
      for (int g = 0; g < G; ++g) _mm512_storeu_ps(part + (g * 16 + t) * 16, _mm512_setzero_ps());
      continue;
    }
    __m512 k[C];
    for (int c = 0; c < C; ++c) k[c] = load16(kb + t * tok_stride + 16 * c);
    for (int g = 0; g < G; ++g) {
      const float* qr = qf + (r0 + g) * kD;
      __m512 acc = _mm512_mul_ps(load16(qr), k[0]);
      for (int c = 1; c < C; ++c) acc = _mm512_fmadd_ps(load16(qr + 16 * c), k[c], acc);
      _mm512_storeu_ps(part + (g * 16 + t) * 16, acc);
    }
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1u);
  for (int g = 0; g < G; ++g)
    _mm512_mask_storeu_ps(sc + (r0 + g) * len + l0, mask, sum16x16(part + g * 256));
}

// acc[r][d0, d0 + 64) += sum over the n tokens from `vr` on of p[r][t] * v[t][d0, d0 + 64),
// for GN query rows r = r0 + g: the 16 partial sums stay in registers over the block and
// go to memory once per block instead of once per token.
template <typename T, int GN>
inline void values_tile(const T* vr, int64_t tok_stride, int n, const float* sc, int len,
                        int l0, int r0, int D, int d0, float* acc) {
  __m512 a[GN][4];
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < 4; ++c) a[g][c] = _mm512_setzero_ps();
  for (int t = 0; t < n; ++t) {
    __m512 v[4];
    for (int c = 0; c < 4; ++c) v[c] = load16(vr + t * tok_stride + d0 + 16 * c);
    for (int g = 0; g < GN; ++g) {
      const __m512 p = _mm512_set1_ps(sc[(r0 + g) * len + l0 + t]);
      for (int c = 0; c < 4; ++c) a[g][c] = _mm512_fmadd_ps(p, v[c], a[g][c]);
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < 4; ++c) {
      float* dst = acc + (r0 + g) * D + d0 + 16 * c;
      _mm512_storeu_ps(dst, _mm512_add_ps(_mm512_loadu_ps(dst), a[g][c]));
    }
}

template <typename T, int kD>
inline void values16(const T* vr, int64_t tok_stride, int n, const float* sc, int len, int l0,
                     int r0, int G, float* acc) {
  for (int d0 = 0; d0 < kD; d0 += 64)
    for (int g0 = 0; g0 < G; g0 += 4) {
      const int r = r0 + g0;
      switch (std::min(4, G - g0)) {
        case 4: values_tile<T, 4>(vr, tok_stride, n, sc, len, l0, r, kD, d0, acc); break;
        case 3: values_tile<T, 3>(vr, tok_stride, n, sc, len, l0, r, kD, d0, acc); break;
        case 2: values_tile<T, 2>(vr, tok_stride, n, sc, len, l0, r, kD, d0, acc); break;
        default: values_tile<T, 1>(vr, tok_stride, n, sc, len, l0, r, kD, d0, acc); break;
      }
    }
}
#endif

// The blocks of one sequence, and the cache layout they live in.
template <typename T>
struct Context {
  const T* k_cache;
  const T* v_cache;
  int64_t blk_stride, tok_stride, head_stride;  // elements
  const int32_t* table;
  int num_blocks;  // of the table that hold the context
  int pool_blocks;  // of the cache: out-of-range ids are clamped, never read past
  int block_size;
  int len;
};

// Ask for the next block's rows of heads [h0, h1) ahead of use: the blocks of a sequence
// are scattered over the pool, so the hardware prefetcher cannot see them coming.
template <typename T>
inline void prefetch_block(const T* base, const Context<T>& c, int h0, int h1, int n, int D) {
  const int lines = static_cast<int>((D * sizeof(T) + 63) / 64);
  for (int t = 0; t < n; ++t)
    for (int h = h0; h < h1; ++h)
      for (int i = 0; i < lines; ++i)
        __builtin_prefetch(reinterpret_cast<const char*>(base + t * c.tok_stride +
                                                         h * c.head_stride) + 64 * i);
}

template <typename T>
inline int64_t block_id(const Context<T>& c, int b) {
  return std::clamp<int64_t>(c.table[b], 0, c.pool_blocks - 1);
}

// Query heads h*G .. h*G+G-1 for KV heads h in [h0, h1) of one sequence. kD is the head
// dim when known at compile time (the inner loops then unroll), else 0 and D is used.
template <typename T, int kD>
void attend(const T* q, int64_t q_head_stride, const Context<T>& c, int h0, int h1, int G,
            int head_dim, float scale, T* out, int64_t out_head_stride, Scratch& s) {
  const int D = kD ? kD : head_dim;
  const int H = h1 - h0, R = H * G;  // R query rows, row r = (h - h0) * G + g
  const int len = c.len;
  if (len <= 0) {  // nothing to attend to: zeros, as the reference
    for (int r = 0; r < R; ++r)
      for (int d = 0; d < D; ++d) from_f32(0.0f, out + (h0 * G + r) * out_head_stride + d);
    return;
  }
  s.q.resize(static_cast<size_t>(R) * D);
  s.row.resize(D);
  s.scores.resize(static_cast<size_t>(R) * len);
  s.acc.assign(static_cast<size_t>(R) * D, 0.0f);
  s.inv.resize(R);
  s.part.resize(static_cast<size_t>(G) * 16 * 16);  // see scores16
  float* qf = s.q.data();
  float* row = s.row.data();
  float* sc = s.scores.data();
  float* acc = s.acc.data();
  for (int r = 0; r < R; ++r)
    for (int d = 0; d < D; ++d) qf[r * D + d] = to_f32(q[(h0 * G + r) * q_head_stride + d]) * scale;

  // Pass 1: the score of every key for every query row.
  for (int b = 0; b < c.num_blocks; ++b) {
    const int n = std::min(c.block_size, len - b * c.block_size);
    if (b + 1 < c.num_blocks)
      prefetch_block(c.k_cache + block_id(c, b + 1) * c.blk_stride, c, h0, h1,
                     std::min(c.block_size, len - (b + 1) * c.block_size), D);
    const T* kb = c.k_cache + block_id(c, b) * c.blk_stride;
#if defined(__AVX512F__)
    if constexpr (kD == 64 || kD == 128) {
      for (int h = h0; h < h1; ++h)
        for (int t0 = 0; t0 < n; t0 += 16)
          scores16<T, kD>(kb + t0 * c.tok_stride + h * c.head_stride, c.tok_stride, qf, G,
                          (h - h0) * G, std::min(16, n - t0), b * c.block_size + t0, len, sc,
                          s.part.data());
      continue;
    }
#endif
    for (int t = 0; t < n; ++t) {
      const int l = b * c.block_size + t;
      for (int h = h0; h < h1; ++h) {
        const T* kr = kb + t * c.tok_stride + h * c.head_stride;
#pragma omp simd
        for (int d = 0; d < D; ++d) row[d] = to_f32(kr[d]);
        for (int g = 0; g < G; ++g) {
          const int r = (h - h0) * G + g;
          const float* qr = qf + r * D;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int d = 0; d < D; ++d) dot += qr[d] * row[d];
          sc[r * len + l] = dot;
        }
      }
    }
  }
  // Softmax per query row (float32, max-subtracted).
  for (int r = 0; r < R; ++r) {
    float* sr = sc + r * len;
    float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
    for (int l = 0; l < len; ++l) m = std::max(m, sr[l]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int l = 0; l < len; ++l) {
      sr[l] = exp_nonpositive(sr[l] - m);
      sum += sr[l];
    }
    s.inv[r] = 1.0f / sum;
  }
  // Pass 2: the probability-weighted sum of the values.
  for (int b = 0; b < c.num_blocks; ++b) {
    const int n = std::min(c.block_size, len - b * c.block_size);
    if (b + 1 < c.num_blocks)
      prefetch_block(c.v_cache + block_id(c, b + 1) * c.blk_stride, c, h0, h1,
                     std::min(c.block_size, len - (b + 1) * c.block_size), D);
    const T* vb = c.v_cache + block_id(c, b) * c.blk_stride;
#if defined(__AVX512F__)
    if constexpr (kD == 64 || kD == 128) {
      for (int h = h0; h < h1; ++h)
        values16<T, kD>(vb + h * c.head_stride, c.tok_stride, n, sc, len, b * c.block_size,
                        (h - h0) * G, G, acc);
      continue;
    }
#endif
    for (int t = 0; t < n; ++t) {
      const int l = b * c.block_size + t;
      for (int h = h0; h < h1; ++h) {
        const T* vr = vb + t * c.tok_stride + h * c.head_stride;
#pragma omp simd
        for (int d = 0; d < D; ++d) row[d] = to_f32(vr[d]);
        for (int g = 0; g < G; ++g) {
          const int r = (h - h0) * G + g;
          const float p = sc[r * len + l];
          float* ar = acc + r * D;
#pragma omp simd
          for (int d = 0; d < D; ++d) ar[d] += p * row[d];
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int d = 0; d < D; ++d)
      from_f32(acc[r * D + d] * s.inv[r], out + (h0 * G + r) * out_head_stride + d);
}

template <typename T>
void paged_decode(const T* q, int64_t q_seq_stride, int64_t q_head_stride, const T* k_cache,
                  const T* v_cache, int64_t blk_stride, int64_t tok_stride, int64_t head_stride,
                  int pool_blocks, const int32_t* block_tables, int64_t table_stride,
                  int table_width, const int32_t* seq_lens, T* out, int64_t out_seq_stride,
                  int64_t out_head_stride, int num_seqs, int num_heads, int num_kv_heads,
                  int head_dim, int block_size, float scale) {
  const int G = num_heads / num_kv_heads;
  // A work item is a sequence's KV heads, all of them (its blocks are then read front to
  // back) unless there are fewer sequences than threads to share them.
  const int threads = omp_get_max_threads();
  const int splits = num_seqs >= threads ? 1 : std::min(num_kv_heads, threads);
  const int per_split = (num_kv_heads + splits - 1) / splits;
  const int64_t items = static_cast<int64_t>(num_seqs) * splits;
#pragma omp parallel
  {
    Scratch s;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < items; ++i) {
      const int64_t seq = i / splits;
      const int h0 = static_cast<int>(i % splits) * per_split;
      const int h1 = std::min(num_kv_heads, h0 + per_split);
      if (h0 >= h1) continue;
      Context<T> c{k_cache, v_cache, blk_stride, tok_stride, head_stride,
                   block_tables + seq * table_stride, 0, pool_blocks, block_size, 0};
      // A table shorter than the length bounds what is read (kernels.ops checks lengths).
      const int len = std::max(seq_lens[seq], 0);
      c.num_blocks = std::min((len + block_size - 1) / block_size, table_width);
      c.len = std::min(len, c.num_blocks * block_size);
      const T* qs = q + seq * q_seq_stride;
      T* os = out + seq * out_seq_stride;
      if (head_dim == 64)
        attend<T, 64>(qs, q_head_stride, c, h0, h1, G, 64, scale, os, out_head_stride, s);
      else if (head_dim == 128)
        attend<T, 128>(qs, q_head_stride, c, h0, h1, G, 128, scale, os, out_head_stride, s);
      else
        attend<T, 0>(qs, q_head_stride, c, h0, h1, G, head_dim, scale, os, out_head_stride, s);
    }
  }
}

}  // namespace

#define PDSERVE_DECODE_ENTRY(NAME, T)                                                         \
  extern "C" void NAME(const T* q, int64_t q_seq_stride, int64_t q_head_stride,              \
                       const T* k_cache, const T* v_cache, int64_t blk_stride,               \
                       int64_t tok_stride, int64_t head_stride, int num_blocks,              \
                       const int32_t* block_tables, int64_t table_stride,                    \
                       int num_table_blocks, const int32_t* seq_lens, T* out,                \
                       int64_t out_seq_stride, int64_t out_head_stride, int num_seqs,        \
                       int num_heads, int num_kv_heads, int head_dim, int block_size,        \
                       float scale) {                                                         \
    paged_decode<T>(q, q_seq_stride, q_head_stride, k_cache, v_cache, blk_stride, tok_stride, \
                    head_stride, num_blocks, block_tables, table_stride, num_table_blocks,    \
                    seq_lens, out, out_seq_stride, out_head_stride, num_seqs, num_heads,      \
                    num_kv_heads, head_dim, block_size, scale);                               \
  }

PDSERVE_DECODE_ENTRY(pdserve_paged_decode_f32, float)
PDSERVE_DECODE_ENTRY(pdserve_paged_decode_bf16, uint16_t)

extern "C" int pdserve_native_abi_version() { return 2; }
