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
// Exported as plain C functions for ctypes: no Python or torch headers, so it builds in
// about a second with the system compiler. Built and loaded by kernels/native.py.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <omp.h>

namespace {

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
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN stays NaN
    *out = static_cast<uint16_t>((u >> 16) | 0x40u);
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  *out = static_cast<uint16_t>(u >> 16);
}

// exp for x <= 0 in a form the compiler vectorizes (std::exp is a scalar libm call, and
// the softmax of every (sequence, head) calls it once per key): x = n ln2 + r with
// |r| <= ln2/2, exp(r) by its degree-6 Taylor polynomial (relative error ~1e-7, float32's
// rounding), times 2^n built in the exponent bits. Below -80 it returns 0: weights that
// small would make the value sums denormal, which x86 computes 100x slower.
inline float exp_nonpositive(float x_in) {
  const float x = std::max(x_in, -80.0f);
  const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
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

struct Scratch {
  std::vector<float> q, row, scores, acc, inv;
};

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

extern "C" int pdserve_native_abi_version() { return 1; }
