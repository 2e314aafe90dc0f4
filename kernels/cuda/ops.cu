// Element-wise and row kernels (RMSNorm, bias, RoPE, SwiGLU, GEGLU, soft-cap), the KV row store and paged
// attention. Numerics follow lib/exec/cpu/cpu_q4_executor.cpp; the library is compiled with
// --fmad=false so a * b - c * d and friends round exactly as the CPU's (uncontracted)
// arithmetic does.
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>

#include "block_math.cuh"
#include "cuda_kernels.hpp"
#include "q8_warp.cuh"
#include "softmax_exp.hpp"

namespace tandem::kernels::cuda {

namespace {

constexpr int kWarp = 32;

unsigned blocks_for(int64_t n, int threads) {
  return static_cast<unsigned>((n + threads - 1) / threads);
}

// Block-wide reductions (blockDim.x a multiple of 32, at most 1024). `red` holds 32
// values; every thread gets the result. Ends with a barrier, so `red` may be reused.
template <class T, class Op>
__device__ T block_reduce(T v, T* red, Op op) {
  for (int o = kWarp / 2; o > 0; o /= 2) v = op(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int n_warps = blockDim.x / kWarp;
  __syncthreads();  // `red` may still be read from a previous reduction
  if (lane == 0) red[warp] = v;
  __syncthreads();
  T r = red[0];
  for (int w = 1; w < n_warps; ++w) r = op(r, red[w]);
  __syncthreads();
  return r;
}

struct SumD {
  __device__ double operator()(double a, double b) const { return a + b; }
};
struct MaxF {
  __device__ float operator()(float a, float b) const { return b > a ? b : a; }
};

// Threads per block of the RMSNorm kernels: the sum of squares is split over this many
// threads, so the plain and the fused kernel must use the same count to agree bit for bit.
constexpr int kRmsThreads = 256;

// 1 / sqrt(mean(x^2) + eps) of the row xr [n], every thread of the block striding over it,
// squares summed in double; every thread gets the result (block_reduce ends with a barrier,
// so the row may be overwritten afterwards).
__device__ __forceinline__ float rms_inv_scale(const float* xr, int64_t n, float eps, double* red) {
  double sum = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) sum += double(xr[i]) * double(xr[i]);
  sum = block_reduce(sum, red, SumD{});
  const float mean = static_cast<float>(sum / double(n));
  return 1.0f / sqrtf(mean + eps);
}

__global__ void rms_norm_kernel(const float* x, const float* __restrict__ w, float* y, int64_t n, float eps,
                                const int32_t* __restrict__ rows) {
  __shared__ double red[32];
  const int64_t row = blockIdx.x;
  const float* xr = x + (rows ? int64_t(rows[row]) : row) * n;
  float* yr = y + row * n;
  const float scale = rms_inv_scale(xr, n, eps, red);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) yr[i] = (xr[i] * scale) * w[i];
}

// rms_norm_kernel's row (the same scale, the same products), then its Q8_0 blocks: warp j of
// the block takes blocks j, j + n_warps, ... (n % 32 == 0); lane i computes element i of the
// block, stores it and quantises it with the warp (q8_warp.cuh, as quantize_q8_0_kernel).
__global__ void rms_norm_q8_0_kernel(const float* x, const float* __restrict__ w, float* y, int8_t* __restrict__ yq,
                                     uint16_t* __restrict__ yd, int64_t n, float eps,
                                     const int32_t* __restrict__ rows) {
  __shared__ double red[32];
  const int64_t row = blockIdx.x;
  const float* xr = x + (rows ? int64_t(rows[row]) : row) * n;
  float* yr = y + row * n;
  const float scale = rms_inv_scale(xr, n, eps, red);
  const int64_t nb = n / kQK;
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  for (int64_t b = threadIdx.x / kWarp; b < nb; b += blockDim.x / kWarp) {  // whole warps iterate together
    const int64_t i = b * kQK + lane;
    const float v = (xr[i] * scale) * w[i];
    yr[i] = v;
    warp_quantize_q8_0(v, lane, yq + row * n + b * kQK, yd + row * nb + b);
  }
}

__global__ void add_bias_kernel(float* y, const float* __restrict__ b, int64_t total, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < total) y[i] += b[i % n];
}

// Pair i (< n_rot / 2) of one head rotated in place by the token's cos/sin row cs_t
// [n_rot]: neox pairs (i, i + n_rot/2), else (2i, 2i+1). Returns the two element indices.
struct RopePair {
  int32_t i0, i1;
};
__device__ __forceinline__ RopePair rope_pair(float* head, const float* cs_t, int32_t i, int32_t n_rot, bool neox) {
  const int32_t half = n_rot / 2;
  const float c = cs_t[i];
  const float s = cs_t[half + i];
  const RopePair p{neox ? i : 2 * i, neox ? i + half : 2 * i + 1};
  const float x0 = head[p.i0], x1 = head[p.i1];
  head[p.i0] = x0 * c - x1 * s;
  head[p.i1] = x0 * s + x1 * c;
  return p;
}

// One thread per rotated pair.
__global__ void rope_kernel(float* x, const float* __restrict__ cs, int64_t total_pairs, int32_t n_heads,
                            int32_t head_dim, int32_t n_rot, bool neox) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= total_pairs) return;
  const int32_t half = n_rot / 2;
  const int64_t th = idx / half;  // token * n_heads + head
  const int64_t t = th / n_heads;
  rope_pair(x + th * head_dim, cs + t * n_rot, static_cast<int32_t>(idx % half), n_rot, neox);
}

__device__ __forceinline__ float swiglu_value(float g, float u) {
  return g / (1.0f + expf(-g)) * u;
}

// The CPU executor's GEGLU value (its geglu(): the f16 GELU table between -10 and 10).
__device__ __forceinline__ float geglu_value(float g, float u, const uint16_t* __restrict__ table) {
  if (g <= -10.0f) return 0.0f;
  if (g >= 10.0f) return g * u;
  return h2f(table[fp32_to_fp16_bits(g)]) * u;
}

// The gated value: GEGLU through `table`, SwiGLU without one.
__device__ __forceinline__ float glu_value(float g, float u, const uint16_t* __restrict__ table) {
  return table != nullptr ? geglu_value(g, u, table) : swiglu_value(g, u);
}

__global__ void glu_kernel(float* gate, const float* __restrict__ up, int64_t n, const uint16_t* __restrict__ table) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  gate[i] = glu_value(gate[i], up[i], table);
}

// glu_kernel's values, quantised as they are made: one warp per Q8_0 block of 32
// consecutive values (the blocks of quantize_q8_0 over rows of a multiple of 32).
__global__ void glu_q8_0_kernel(float* gate, const float* __restrict__ up, int64_t n_blocks,
                                const uint16_t* __restrict__ table, int8_t* __restrict__ hq,
                                uint16_t* __restrict__ hd) {
  const int64_t blk = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  if (blk >= n_blocks) return;  // whole warps exit together (blockDim is a multiple of 32)
  const int64_t i = blk * kQK + lane;
  const float h = glu_value(gate[i], up[i], table);
  gate[i] = h;
  warp_quantize_q8_0(h, lane, hq + blk * kQK, hd + blk);
}

__global__ void add_kernel(float* y, const float* __restrict__ x, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) y[i] += x[i];
}

__global__ void scale_kernel(float* x, float s, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) x[i] *= s;
}

__global__ void softcap_kernel(float* x, int64_t n, float c) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) x[i] = tanhf(x[i] * (1.0f / c)) * c;
}

__global__ void fill_nan_kernel(float* y, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) y[i] = __int_as_float(0x7FC00000);
}

__device__ __forceinline__ char* kv_row(const KvArgs& kv, int64_t t, int32_t p, int kind) {
  const int32_t row_elems = kv.n_head_kv * kv.head_dim;
  char* page = static_cast<char*>(kv.pages[kv.page_off[t] + p / kv.page_size]);
  const int64_t off = kv_row_elem_offset(kv.layer, kind, p % kv.page_size, kv.page_size, row_elems);
  return page + off * (kv.f16 ? 2 : 4);
}

// Element e of a KV row: f16 (round to nearest even) or f32.
__device__ __forceinline__ void kv_put(bool f16, char* row, int32_t e, float x) {
  if (f16) {
    reinterpret_cast<uint16_t*>(row)[e] = fp32_to_fp16_bits(x);
  } else {
    reinterpret_cast<float*>(row)[e] = x;
  }
}

// grid: T tokens; threads over the row's elements.
__global__ void kv_store_kernel(KvArgs kv, const float* __restrict__ k, const float* __restrict__ v) {
  const int64_t t = blockIdx.x;
  const int32_t row_elems = kv.n_head_kv * kv.head_dim;
  const int32_t p = kv.pos[t];
  char* krow = kv_row(kv, t, p, 0);
  char* vrow = kv_row(kv, t, p, 1);
  for (int32_t e = threadIdx.x; e < row_elems; e += blockDim.x) {
    kv_put(kv.f16, krow, e, k[t * row_elems + e]);
    kv_put(kv.f16, vrow, e, v[t * row_elems + e]);
  }
}

// rope_kernel on q and on k, then kv_store_kernel, for one token per block: Q pairs rotated
// in place; each K pair rotated in place (rope_pair, the same operations) and its two
// values stored to the token's K row by the thread that made them; then the K dims past
// the rotated ones (partial rotary) and the V row stored as they are. Nothing is read that
// another thread writes, so no barrier is needed.
__global__ void rope_kv_store_kernel(KvArgs kv, float* __restrict__ q, float* __restrict__ k,
                                     const float* __restrict__ v, const float* __restrict__ cs, int32_t n_head,
                                     int32_t n_rot, bool neox) {
  const int64_t t = blockIdx.x;
  const int32_t hd = kv.head_dim;
  const int32_t half = n_rot / 2;
  const int32_t row_elems = kv.n_head_kv * hd;
  const float* cs_t = cs + t * n_rot;
  for (int32_t idx = threadIdx.x; idx < n_head * half; idx += blockDim.x) {
    rope_pair(q + (t * n_head + idx / half) * hd, cs_t, idx % half, n_rot, neox);
  }
  const int32_t p = kv.pos[t];
  char* krow = kv_row(kv, t, p, 0);
  char* vrow = kv_row(kv, t, p, 1);
  float* kt = k + t * row_elems;
  for (int32_t idx = threadIdx.x; idx < kv.n_head_kv * half; idx += blockDim.x) {
    const int32_t h0 = (idx / half) * hd;
    const RopePair r = rope_pair(kt + h0, cs_t, idx % half, n_rot, neox);
    kv_put(kv.f16, krow, h0 + r.i0, kt[h0 + r.i0]);
    kv_put(kv.f16, krow, h0 + r.i1, kt[h0 + r.i1]);
  }
  const int32_t tail = hd - 2 * half;  // K dims left unrotated
  for (int32_t idx = threadIdx.x; idx < kv.n_head_kv * tail; idx += blockDim.x) {
    const int32_t e = (idx / tail) * hd + 2 * half + idx % tail;
    kv_put(kv.f16, krow, e, kt[e]);
  }
  for (int32_t e = threadIdx.x; e < row_elems; e += blockDim.x) kv_put(kv.f16, vrow, e, v[t * row_elems + e]);
}

template <bool F16>
__device__ __forceinline__ float kv_load(const char* row, int32_t d) {
  if constexpr (F16) return h2f(reinterpret_cast<const uint16_t*>(row)[d]);
  return reinterpret_cast<const float*>(row)[d];
}

// KV values per 16-byte load: 8 f16 or 4 f32.
template <bool F16>
constexpr int32_t kKvPerVec = F16 ? 8 : 4;

// Whether values [d, d + kKvPerVec) of `row` can be read with one 16-byte load: the head
// holds whole 16-byte chunks and the address is 16-byte aligned (page bases from
// cudaMalloc are; the harness tests shift them to exercise the element-wise path).
template <bool F16>
__device__ __forceinline__ bool kv_vec_ok(const char* row, int32_t head_dim) {
  return head_dim % kKvPerVec<F16> == 0 && (reinterpret_cast<uintptr_t>(row) & 15u) == 0;
}

// Values [c * kKvPerVec, (c + 1) * kKvPerVec) of a 16-byte aligned row as floats.
template <bool F16>
__device__ __forceinline__ void kv_load_vec(const char* row, int32_t c, float* x) {
  const uint4 w = reinterpret_cast<const uint4*>(row)[c];
  if constexpr (F16) {
    const uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      x[2 * i] = h2f(static_cast<uint16_t>(u[i] & 0xFFFFu));  // little-endian: the lower half first
      x[2 * i + 1] = h2f(static_cast<uint16_t>(u[i] >> 16));
    }
  } else {
    x[0] = __uint_as_float(w.x);
    x[1] = __uint_as_float(w.y);
    x[2] = __uint_as_float(w.z);
    x[3] = __uint_as_float(w.w);
  }
}

// q . K row of one head: sum_d q[d] * K[d], added in order over d (the CPU's scalar order).
// The K row is read 16 bytes at a time where kv_vec_ok, else one value at a time; the
// products and their order are the same, so is the result.
template <bool F16>
__device__ __forceinline__ float k_row_dot(const char* row, const float* qs, int32_t head_dim) {
  float s = 0.0f;
  if (kv_vec_ok<F16>(row, head_dim)) {
    constexpr int32_t kV = kKvPerVec<F16>;
    for (int32_t c = 0; c < head_dim / kV; ++c) {
      float x[kV];
      kv_load_vec<F16>(row, c, x);
#pragma unroll
      for (int32_t i = 0; i < kV; ++i) s += qs[c * kV + i] * x[i];
    }
    return s;
  }
  for (int32_t d = 0; d < head_dim; ++d) s += qs[d] * kv_load<F16>(row, d);
  return s;
}

// The first position token t attends to: its sliding window's start, 0 without a window
// (KvArgs::window). Each attention kernel below starts its position loops here.
__device__ __forceinline__ int32_t attn_first(const KvArgs& kv, int64_t t) {
  return kv.window > 0 && kv.pos[t] + 1 > kv.window ? kv.pos[t] + 1 - kv.window : 0;
}

// q . K[p] of one head (k_row_dot) times the scale. The same function serves every pass,
// so a recomputed score equals the stored one.
template <bool F16>
__device__ __forceinline__ float attn_score(const KvArgs& kv, int64_t t, int32_t p, int32_t hk, const float* qs,
                                            float scale) {
  const char* row = kv_row(kv, t, p, 0) + int64_t(hk) * kv.head_dim * (F16 ? 2 : 4);
  return k_row_dot<F16>(row, qs, kv.head_dim) * scale;
}

// One thread block per (token, head); blockDim >= head_dim (a multiple of 32).
// Shared memory: q [head_dim] | scores [cap] | partial outputs [G][head_dim].
// Pass 1: scores (thread per position), max. Pass 2: e = softmax_exp(s - max) (the CPU's
// written exp, softmax_exp.hpp), sum in double.
// Pass 3: out[d] = sum_p prob_p * V[p][d], prob rounded to f16 with an f16 cache, the
// positions split over G = blockDim / head_dim groups, group partials added in order.
// Positions beyond the shared capacity recompute their score instead of storing it.
template <bool F16>
__global__ void attention_kernel(KvArgs kv, const float* __restrict__ q, float* __restrict__ out, int32_t n_head,
                                 int32_t group, float scale, int32_t cap, const int32_t* __restrict__ tokens) {
  extern __shared__ float sh[];
  __shared__ double red_d[32];
  __shared__ float red_f[32];
  const int32_t hd = kv.head_dim;
  float* qs = sh;
  float* sc = sh + hd;
  float* part = sc + cap;
  const int64_t t = tokens ? int64_t(tokens[blockIdx.x / n_head]) : int64_t(blockIdx.x / n_head);
  const int32_t h = blockIdx.x % n_head;
  const int32_t hk = h / group;
  const int32_t n_pos = kv.pos[t] + 1;
  const int32_t first = attn_first(kv, t);
  const float* qh = q + (t * n_head + h) * hd;
  for (int32_t d = threadIdx.x; d < hd; d += blockDim.x) qs[d] = F16 ? round_f16(qh[d]) : qh[d];
  __syncthreads();

  float mx = -FLT_MAX;
  for (int32_t p = first + threadIdx.x; p < n_pos; p += blockDim.x) {
    const float s = attn_score<F16>(kv, t, p, hk, qs, scale);
    if (p < cap) sc[p] = s;
    mx = s > mx ? s : mx;
  }
  mx = block_reduce(mx, red_f, MaxF{});

  double sum = 0.0;
  for (int32_t p = first + threadIdx.x; p < n_pos; p += blockDim.x) {  // same p -> thread map as pass 1
    const float s = p < cap ? sc[p] : attn_score<F16>(kv, t, p, hk, qs, scale);
    const float e = softmax_exp(s - mx);
    if (p < cap) sc[p] = e;
    sum += e;
  }
  sum = block_reduce(sum, red_d, SumD{});  // ends with a barrier: every sc[p] is visible
  const float inv = static_cast<float>(1.0 / sum);

  const int32_t G = static_cast<int32_t>(blockDim.x) / hd;
  const int32_t g = static_cast<int32_t>(threadIdx.x) / hd;
  const int32_t d = static_cast<int32_t>(threadIdx.x) % hd;
  if (g < G) {
    float acc = 0.0f;
    for (int32_t p = first + g; p < n_pos; p += G) {
      const float e = p < cap ? sc[p] : softmax_exp(attn_score<F16>(kv, t, p, hk, qs, scale) - mx);
      const float prob = F16 ? round_f16(e * inv) : e * inv;
      const char* vrow = kv_row(kv, t, p, 1) + int64_t(hk) * hd * (F16 ? 2 : 4);
      acc += prob * kv_load<F16>(vrow, d);
    }
    part[g * hd + d] = acc;
  }
  __syncthreads();
  if (static_cast<int32_t>(threadIdx.x) < hd) {
    float r = 0.0f;
    for (int32_t j = 0; j < G; ++j) r += part[j * hd + threadIdx.x];
    out[(t * n_head + h) * hd + threadIdx.x] = r;
  }
}

// ---- flash-decoding (split-KV) attention -------------------------------------------------
// The positions [0, pos[t]] of a token are split into partitions of `part` absolute
// positions (independent of the batch). Blocks of the first two kernels each take one
// (token, KV head, partition) and every query head of the GQA group, so each K and V row is
// fetched from memory by one block only. Shared memory is sized per tile:
// q [group][hd] | e [group][part] | slice partials [G][hd], G = blockDim / hd.
// Slot of (list index i, head h, partition c): (i * n_head + h) * max_parts + c.

// Kernel 1: scores s_p = q . K[p] * scale (the CPU's order over d) to `score`
// [i][h][max_pos], and per head the partition's max m_c and sum of exp(s - m_c) (double).
template <bool F16>
__global__ void attention_split_scores_kernel(KvArgs kv, const float* __restrict__ q, int32_t n_head, int32_t group,
                                              float scale, int32_t part, int32_t max_parts, int32_t max_pos,
                                              const int32_t* __restrict__ tokens, float* __restrict__ score,
                                              float* __restrict__ p_max, double* __restrict__ p_sum) {
  extern __shared__ float sh[];
  __shared__ double red_d[32];
  __shared__ float red_f[32];
  const int32_t hd = kv.head_dim;
  const int32_t i = static_cast<int32_t>(blockIdx.x) / kv.n_head_kv;  // index into tokens
  const int32_t hk = static_cast<int32_t>(blockIdx.x) % kv.n_head_kv;
  const int32_t c = static_cast<int32_t>(blockIdx.y);
  const int64_t t = tokens[i];
  const int32_t n_pos = kv.pos[t] + 1;
  const int32_t first = attn_first(kv, t);
  if (c * part >= n_pos || (c + 1) * part <= first) return;  // the whole block: no barrier is skipped by part of it
  const int32_t p0 = c * part > first ? c * part : first;    // the partition's positions in the window
  const int32_t n = ((c + 1) * part < n_pos ? (c + 1) * part : n_pos) - p0;
  float* qs = sh;
  float* es = qs + group * hd;
  for (int32_t e = threadIdx.x; e < group * hd; e += blockDim.x) {
    const float x = q[(t * n_head + hk * group) * hd + e];
    qs[e] = F16 ? round_f16(x) : x;
  }
  __syncthreads();
  const int64_t head0 = int64_t(i) * n_head + hk * group;
  for (int32_t j = threadIdx.x; j < n; j += blockDim.x) {  // the K row once for all heads
    const char* row = kv_row(kv, t, p0 + j, 0) + int64_t(hk) * hd * (F16 ? 2 : 4);
    for (int32_t h = 0; h < group; ++h) {
      const float sc = k_row_dot<F16>(row, qs + h * hd, hd) * scale;
      es[h * part + j] = sc;
      score[(head0 + h) * max_pos + p0 + j] = sc;
    }
  }
  __syncthreads();
  for (int32_t h = 0; h < group; ++h) {
    const float* eh = es + h * part;
    float mx = -FLT_MAX;
    for (int32_t j = threadIdx.x; j < n; j += blockDim.x) mx = eh[j] > mx ? eh[j] : mx;
    mx = block_reduce(mx, red_f, MaxF{});
    double sum = 0.0;
    for (int32_t j = threadIdx.x; j < n; j += blockDim.x) sum += softmax_exp(eh[j] - mx);
    sum = block_reduce(sum, red_d, SumD{});
    if (threadIdx.x == 0) {
      p_max[(head0 + h) * max_parts + c] = mx;
      p_sum[(head0 + h) * max_parts + c] = sum;
    }
  }
}

// Kernel 2: per head, the global max M = max_c m_c and sum S = sum_c e^(m_c - M) sum_c
// (log-sum-exp, in double) from every partition, then the CPU's probabilities
// prob_p = e^(s_p - M) / S (rounded to f16 with f16 KV) and the partition's share of the
// output, acc_c[d] = sum_p prob_p V[p][d] (positions split over G slices, added in order).
template <bool F16>
__global__ void attention_split_values_kernel(KvArgs kv, int32_t n_head, int32_t group, int32_t part, int32_t max_parts,
                                              int32_t max_pos, const int32_t* __restrict__ tokens,
                                              const float* __restrict__ score, const float* __restrict__ p_max,
                                              const double* __restrict__ p_sum, float* __restrict__ p_acc) {
  extern __shared__ float sh[];
  const int32_t hd = kv.head_dim;
  const int32_t i = static_cast<int32_t>(blockIdx.x) / kv.n_head_kv;
  const int32_t hk = static_cast<int32_t>(blockIdx.x) % kv.n_head_kv;
  const int32_t c = static_cast<int32_t>(blockIdx.y);
  const int64_t t = tokens[i];
  const int32_t n_pos = kv.pos[t] + 1;
  const int32_t first = attn_first(kv, t);
  if (c * part >= n_pos || (c + 1) * part <= first) return;
  const int32_t p0 = c * part > first ? c * part : first;
  const int32_t n = ((c + 1) * part < n_pos ? (c + 1) * part : n_pos) - p0;
  const int32_t c_first = first / part;  // the partitions kernel 1 wrote: c_first .. n_parts - 1
  const int32_t n_parts = (n_pos + part - 1) / part;
  float* es = sh + group * hd;  // same layout as kernel 1 (the q area is unused here)
  float* slice = es + group * part;
  const int64_t head0 = int64_t(i) * n_head + hk * group;
  for (int32_t h = 0; h < group; ++h) {
    const int64_t s0 = (head0 + h) * max_parts;
    float mx = -FLT_MAX;
    for (int32_t k = c_first; k < n_parts; ++k) mx = p_max[s0 + k] > mx ? p_max[s0 + k] : mx;
    double sum = 0.0;
    for (int32_t k = c_first; k < n_parts; ++k) sum += double(softmax_exp(p_max[s0 + k] - mx)) * p_sum[s0 + k];
    const float inv = static_cast<float>(1.0 / sum);
    for (int32_t j = threadIdx.x; j < n; j += blockDim.x) {
      const float e = softmax_exp(score[(head0 + h) * max_pos + p0 + j] - mx);
      es[h * part + j] = F16 ? round_f16(e * inv) : e * inv;
    }
  }
  __syncthreads();
  const int32_t G = static_cast<int32_t>(blockDim.x) / hd;
  const int32_t g = static_cast<int32_t>(threadIdx.x) / hd;
  const int32_t d = static_cast<int32_t>(threadIdx.x) % hd;
  for (int32_t h = 0; h < group; ++h) {
    if (g < G) {
      float acc = 0.0f;
      for (int32_t j = g; j < n; j += G) {
        const char* vrow = kv_row(kv, t, p0 + j, 1) + int64_t(hk) * hd * (F16 ? 2 : 4);
        acc += es[h * part + j] * kv_load<F16>(vrow, d);
      }
      slice[g * hd + d] = acc;
    }
    __syncthreads();
    if (static_cast<int32_t>(threadIdx.x) < hd) {
      float r = 0.0f;
      for (int32_t k = 0; k < G; ++k) r += slice[k * hd + threadIdx.x];
      p_acc[((head0 + h) * max_parts + c) * hd + threadIdx.x] = r;
    }
    __syncthreads();  // `slice` is rewritten for the next head
  }
}

// Kernel 3, one block per (token, head), a thread per dim: out[d] = sum_c acc_c[d], in order.
// With oq/od (head_dim % 32 == 0, blockDim == head_dim): each warp also quantises its 32
// outputs, one Q8_0 block of the row, as quantize_q8_0_kernel does (warp_quantize_q8_0).
__global__ void attention_combine_kernel(KvArgs kv, const int32_t* __restrict__ tokens, int32_t n_head,
                                         int32_t head_dim, int32_t part, int32_t max_parts,
                                         const float* __restrict__ p_acc, float* __restrict__ out,
                                         int8_t* __restrict__ oq, uint16_t* __restrict__ od) {
  const int32_t i = static_cast<int32_t>(blockIdx.x) / n_head;
  const int32_t h = static_cast<int32_t>(blockIdx.x) % n_head;
  const int32_t d = static_cast<int32_t>(threadIdx.x);
  if (d >= head_dim) return;  // never a partial warp when quantising (head_dim % 32 == 0)
  const int64_t t = tokens[i];
  const int32_t n_parts = (kv.pos[t] + 1 + part - 1) / part;
  const int64_t s0 = (int64_t(i) * n_head + h) * max_parts;
  float r = 0.0f;
  for (int32_t c = attn_first(kv, t) / part; c < n_parts; ++c) r += p_acc[(s0 + c) * head_dim + d];
  const int64_t e = (t * n_head + h) * head_dim + d;
  out[e] = r;
  if (oq != nullptr) {
    const int64_t blk = e / kQK;
    warp_quantize_q8_0(r, d % kWarp, oq + blk * kQK, od + blk);
  }
}

// ---- tiled flash-attention prefill ---------------------------------------------------------
// One block per (tile of bq consecutive query tokens of one sequence, KV head), with the
// group's query heads: rows r = i * group + g (token t0 + i, head hk * group + g). K/V tiles
// of bk positions are staged in shared memory. Shared memory: S [R] doubles | q [R][hd] |
// O [R][hd] | K [bk][hd + 1] | V [bk][hd] | scores [R][bk] | m [R] | inv [R] floats,
// R = bq * group. K rows are padded by one float so the threads of a warp, each scoring
// another position against the same q row, read distinct banks.

// Stage rows [kb, kb + n) of the K (and with `with_v` the V) cache of head hk as floats,
// 16 bytes per load where the head holds whole 16-byte chunks (kv_vec_ok).
template <bool F16>
__device__ __forceinline__ void prefill_stage(const KvArgs& kv, int64_t t0, int32_t hk, int32_t kb, int32_t n,
                                              bool with_v, float* ks, float* vs) {
  const int32_t hd = kv.head_dim;
  const int64_t head_off = int64_t(hk) * hd * (F16 ? 2 : 4);
  if (hd % kKvPerVec<F16> == 0) {  // a thread per 16-byte chunk of a row
    constexpr int32_t kV = kKvPerVec<F16>;
    const int32_t chunks = hd / kV;
    for (int32_t e = threadIdx.x; e < n * chunks; e += blockDim.x) {
      const int32_t j = e / chunks, d0 = (e % chunks) * kV;
      for (int kind = 0; kind < (with_v ? 2 : 1); ++kind) {
        const char* row = kv_row(kv, t0, kb + j, kind) + head_off;
        float* dst = kind == 0 ? ks + j * (hd + 1) + d0 : vs + j * hd + d0;
        if (kv_vec_ok<F16>(row, hd)) {
          float x[kV];
          kv_load_vec<F16>(row, d0 / kV, x);
#pragma unroll
          for (int32_t i = 0; i < kV; ++i) dst[i] = x[i];
        } else {
          for (int32_t i = 0; i < kV; ++i) dst[i] = kv_load<F16>(row, d0 + i);
        }
      }
    }
    return;
  }
  for (int32_t e = threadIdx.x; e < n * hd; e += blockDim.x) {
    const int32_t j = e / hd, d = e % hd;
    ks[j * (hd + 1) + d] = kv_load<F16>(kv_row(kv, t0, kb + j, 0) + head_off, d);
    if (with_v) vs[e] = kv_load<F16>(kv_row(kv, t0, kb + j, 1) + head_off, d);
  }
}

// Scores of the staged K tile for every row, the CPU's order over d, times the scale;
// positions past the row's own (the causal mask) or before its window are not written.
__device__ __forceinline__ void prefill_scores(const KvArgs& kv, int64_t t0, int32_t group, int32_t R, int32_t bk,
                                               int32_t kb, int32_t n, float scale, const float* qs, const float* ks,
                                               float* ss) {
  const int32_t hd = kv.head_dim;
  for (int32_t e = threadIdx.x; e < R * bk; e += blockDim.x) {
    const int32_t r = e / bk, j = e % bk;
    if (j >= n || kb + j > kv.pos[t0 + r / group] || kb + j < attn_first(kv, t0 + r / group)) continue;
    const float* qr = qs + r * hd;
    const float* kj = ks + j * (hd + 1);
    float s = 0.0f;
    for (int32_t d = 0; d < hd; ++d) s += qr[d] * kj[d];
    ss[e] = s * scale;
  }
}

// Pass 1 over K tiles: per row the running max m and sum S = sum_p exp(s_p - m) (double),
// each tile's partial sum taken against the tile's own max and the running sum rescaled by
// exp(m_old - m_new) when the max grows (online softmax). Pass 2 over K/V tiles: the CPU's
// probabilities e * (1 / S) (f16-rounded with f16 KV) times V, accumulated in f32 in
// position order; no rescaling is left to do as the max is final.
template <bool F16>
__global__ void attention_prefill_kernel(KvArgs kv, const float* __restrict__ q, float* __restrict__ out,
                                         int32_t n_head, int32_t group, float scale, int32_t bq, int32_t bk,
                                         const int32_t* __restrict__ tiles) {
  extern __shared__ float sh[];
  const int32_t hd = kv.head_dim;
  const int32_t tile = static_cast<int32_t>(blockIdx.x) / kv.n_head_kv;
  const int32_t hk = static_cast<int32_t>(blockIdx.x) % kv.n_head_kv;
  const int64_t t0 = tiles[2 * tile];
  const int32_t nq = tiles[2 * tile + 1];
  const int32_t R = nq * group;  // rows in use (<= bq * group)
  const int32_t R_cap = bq * group;
  double* sd = reinterpret_cast<double*>(sh);
  float* qs = sh + 2 * R_cap;
  float* os = qs + R_cap * hd;
  float* ks = os + R_cap * hd;
  float* vs = ks + bk * (hd + 1);
  float* ss = vs + bk * hd;
  float* ms = ss + R_cap * bk;
  float* inv = ms + R_cap;
  for (int32_t e = threadIdx.x; e < R * hd; e += blockDim.x) {
    const int32_t r = e / hd, d = e % hd;
    const float x = q[((t0 + r / group) * n_head + hk * group + r % group) * hd + d];
    qs[e] = F16 ? round_f16(x) : x;
    os[e] = 0.0f;
  }
  for (int32_t r = threadIdx.x; r < R; r += blockDim.x) {
    ms[r] = -FLT_MAX;
    sd[r] = 0.0;
  }
  int32_t last = 0;         // the tile's largest position: its K/V rows are [kb0, last]
  int32_t kb0 = INT32_MAX;  // the first position of the K/V tile holding the tile's earliest window start
  for (int32_t i = 0; i < nq; ++i) {
    last = kv.pos[t0 + i] > last ? kv.pos[t0 + i] : last;
    const int32_t f = attn_first(kv, t0 + i) / bk * bk;
    kb0 = f < kb0 ? f : kb0;
  }

  for (int32_t kb = kb0; kb <= last; kb += bk) {  // pass 1: max and sum
    const int32_t n = (kb + bk <= last + 1 ? bk : last + 1 - kb);
    __syncthreads();  // the previous tile's K and scores are no longer read
    prefill_stage<F16>(kv, t0, hk, kb, n, false, ks, vs);
    __syncthreads();
    prefill_scores(kv, t0, group, R, bk, kb, n, scale, qs, ks, ss);
    __syncthreads();
    for (int32_t r = threadIdx.x; r < R; r += blockDim.x) {
      const int32_t nr = kv.pos[t0 + r / group] - kb + 1;  // valid positions of the row here
      const int32_t nv = nr < n ? nr : n;
      const int32_t j0 = attn_first(kv, t0 + r / group) - kb;  // the row's window start here (<= 0: none)
      const int32_t jf = j0 > 0 ? j0 : 0;
      if (nv <= jf) continue;
      const float* sr = ss + r * bk;
      float mt = -FLT_MAX;
      for (int32_t j = jf; j < nv; ++j) mt = sr[j] > mt ? sr[j] : mt;
      double st = 0.0;
      for (int32_t j = jf; j < nv; ++j) st += softmax_exp(sr[j] - mt);
      if (mt > ms[r]) {
        sd[r] = sd[r] * exp(double(ms[r]) - double(mt)) + st;
        ms[r] = mt;
      } else {
        sd[r] += exp(double(mt) - double(ms[r])) * st;
      }
    }
  }
  for (int32_t r = threadIdx.x; r < R; r += blockDim.x) inv[r] = static_cast<float>(1.0 / sd[r]);

  for (int32_t kb = kb0; kb <= last; kb += bk) {  // pass 2: probabilities times V
    const int32_t n = (kb + bk <= last + 1 ? bk : last + 1 - kb);
    __syncthreads();  // the previous tile's K, V and probabilities are no longer read
    prefill_stage<F16>(kv, t0, hk, kb, n, true, ks, vs);
    __syncthreads();
    prefill_scores(kv, t0, group, R, bk, kb, n, scale, qs, ks, ss);
    __syncthreads();
    for (int32_t e = threadIdx.x; e < R * bk; e += blockDim.x) {
      const int32_t r = e / bk, j = e % bk;
      if (j >= n) continue;
      if (kb + j > kv.pos[t0 + r / group] || kb + j < attn_first(kv, t0 + r / group)) {
        ss[e] = 0.0f;
        continue;
      }
      const float prob = softmax_exp(ss[e] - ms[r]) * inv[r];
      ss[e] = F16 ? round_f16(prob) : prob;
    }
    __syncthreads();
    for (int32_t e = threadIdx.x; e < R * hd; e += blockDim.x) {
      const int32_t r = e / hd, d = e % hd;
      const float* pr = ss + r * bk;
      float acc = os[e];
      for (int32_t j = 0; j < n; ++j) acc += pr[j] * vs[j * hd + d];
      os[e] = acc;
    }
  }
  __syncthreads();
  for (int32_t e = threadIdx.x; e < R * hd; e += blockDim.x) {
    const int32_t r = e / hd, d = e % hd;
    out[((t0 + r / group) * n_head + hk * group + r % group) * hd + d] = os[e];
  }
}

int attention_threads(int32_t head_dim) {
  const int need = ((head_dim + kWarp - 1) / kWarp) * kWarp;
  return need > 128 ? need : 128;
}

}  // namespace

void rms_norm(const float* x, const float* w, float* y, int64_t n_rows, int64_t n, float eps, const int32_t* rows,
              cudaStream_t stream) {
  if (n_rows <= 0) return;
  rms_norm_kernel<<<static_cast<unsigned>(n_rows), kRmsThreads, 0, stream>>>(x, w, y, n, eps, rows);
}

void rms_norm_q8_0(const float* x, const float* w, float* y, int8_t* yq, uint16_t* yd, int64_t n_rows, int64_t n,
                   float eps, const int32_t* rows, cudaStream_t stream) {
  if (n_rows <= 0) return;
  rms_norm_q8_0_kernel<<<static_cast<unsigned>(n_rows), kRmsThreads, 0, stream>>>(x, w, y, yq, yd, n, eps, rows);
}

void add_bias(float* y, const float* b, int64_t n_rows, int64_t n, cudaStream_t stream) {
  const int64_t total = n_rows * n;
  if (total <= 0) return;
  add_bias_kernel<<<blocks_for(total, 256), 256, 0, stream>>>(y, b, total, n);
}

void rope(float* x, const float* cs, int64_t T, int32_t n_heads, int32_t head_dim, int32_t n_rot, bool neox,
          cudaStream_t stream) {
  const int64_t pairs = T * n_heads * (n_rot / 2);
  if (pairs <= 0) return;
  rope_kernel<<<blocks_for(pairs, 256), 256, 0, stream>>>(x, cs, pairs, n_heads, head_dim, n_rot, neox);
}

void swiglu(float* gate, const float* up, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  glu_kernel<<<blocks_for(n, 256), 256, 0, stream>>>(gate, up, n, nullptr);
}

void swiglu_q8_0(float* gate, const float* up, int64_t n, int8_t* hq, uint16_t* hd, cudaStream_t stream) {
  const int64_t n_blocks = n / kQK;
  if (n_blocks <= 0) return;
  glu_q8_0_kernel<<<blocks_for(n_blocks * kWarp, 256), 256, 0, stream>>>(gate, up, n_blocks, nullptr, hq, hd);
}

void geglu(float* gate, const float* up, int64_t n, const uint16_t* table, cudaStream_t stream) {
  if (n <= 0) return;
  glu_kernel<<<blocks_for(n, 256), 256, 0, stream>>>(gate, up, n, table);
}

void geglu_q8_0(float* gate, const float* up, int64_t n, const uint16_t* table, int8_t* hq, uint16_t* hd,
                cudaStream_t stream) {
  const int64_t n_blocks = n / kQK;
  if (n_blocks <= 0) return;
  glu_q8_0_kernel<<<blocks_for(n_blocks * kWarp, 256), 256, 0, stream>>>(gate, up, n_blocks, table, hq, hd);
}

void add(float* y, const float* x, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  add_kernel<<<blocks_for(n, 256), 256, 0, stream>>>(y, x, n);
}

void scale(float* x, float s, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  scale_kernel<<<blocks_for(n, 256), 256, 0, stream>>>(x, s, n);
}

void softcap(float* x, int64_t n, float c, cudaStream_t stream) {
  if (n <= 0) return;
  softcap_kernel<<<blocks_for(n, 256), 256, 0, stream>>>(x, n, c);
}

size_t attention_split_shmem(int32_t head_dim, int32_t group, int32_t part) {
  const int threads = attention_threads(head_dim);
  const size_t G = size_t(threads / head_dim);
  return (size_t(group) * size_t(head_dim) + size_t(group) * size_t(part) + G * size_t(head_dim)) * sizeof(float);
}

void attention_split(const KvArgs& kv, const float* q, float* out, const int32_t* tokens, int64_t n_tokens,
                     int32_t n_head, float scale, int32_t max_pos, const AttentionSplitScratch& scratch,
                     cudaStream_t stream, int8_t* out_q, uint16_t* out_d) {
  if (n_tokens <= 0) return;
  const int threads = attention_threads(kv.head_dim);
  const int32_t group = n_head / kv.n_head_kv;
  const int32_t part = scratch.part;
  const int32_t max_parts = (max_pos + part - 1) / part;
  const size_t shmem = attention_split_shmem(kv.head_dim, group, part);
  const dim3 grid(static_cast<unsigned>(n_tokens * kv.n_head_kv), static_cast<unsigned>(max_parts));
  if (kv.f16) {
    attention_split_scores_kernel<true><<<grid, threads, shmem, stream>>>(
        kv, q, n_head, group, scale, part, max_parts, max_pos, tokens, scratch.score, scratch.max, scratch.sum);
    attention_split_values_kernel<true><<<grid, threads, shmem, stream>>>(
        kv, n_head, group, part, max_parts, max_pos, tokens, scratch.score, scratch.max, scratch.sum, scratch.acc);
  } else {
    attention_split_scores_kernel<false><<<grid, threads, shmem, stream>>>(
        kv, q, n_head, group, scale, part, max_parts, max_pos, tokens, scratch.score, scratch.max, scratch.sum);
    attention_split_values_kernel<false><<<grid, threads, shmem, stream>>>(
        kv, n_head, group, part, max_parts, max_pos, tokens, scratch.score, scratch.max, scratch.sum, scratch.acc);
  }
  const int combine_threads = ((kv.head_dim + kWarp - 1) / kWarp) * kWarp;
  const bool quantise = out_q != nullptr && out_d != nullptr && kv.head_dim % kQK == 0;
  attention_combine_kernel<<<static_cast<unsigned>(n_tokens * n_head), combine_threads, 0, stream>>>(
      kv, tokens, n_head, kv.head_dim, part, max_parts, scratch.acc, out, quantise ? out_q : nullptr,
      quantise ? out_d : nullptr);
}

AttentionPrefillPlan attention_prefill_plan(int32_t head_dim, int32_t group) {
  AttentionPrefillPlan plan;
  if (head_dim <= 0 || group <= 0) return plan;
  const int32_t bk = 16;
  const int64_t budget = 48 * 1024 / 4;                             // floats of the default dynamic limit
  const int64_t fixed = int64_t(bk) * (2 * int64_t(head_dim) + 1);  // K (rows padded) and V tiles
  const int64_t per_row = 2 * int64_t(head_dim) + bk + 4;           // q, O, scores, m, inv, S (a double)
  const int64_t rows = budget > fixed ? (budget - fixed) / per_row : 0;
  const int64_t bq = std::min<int64_t>(kAttentionPrefillMaxTile, rows / group);
  if (bq < 1) return plan;
  plan.bq = static_cast<int32_t>(bq);
  plan.bk = bk;
  plan.shmem = size_t(fixed + per_row * bq * group) * sizeof(float);
  return plan;
}

void attention_prefill(const KvArgs& kv, const float* q, float* out, const int32_t* tiles, int64_t n_tiles,
                       int32_t n_head, float scale, cudaStream_t stream) {
  if (n_tiles <= 0) return;
  const int32_t group = n_head / kv.n_head_kv;
  const AttentionPrefillPlan plan = attention_prefill_plan(kv.head_dim, group);
  const int threads = attention_threads(kv.head_dim);
  const unsigned grid = static_cast<unsigned>(n_tiles * kv.n_head_kv);
  const auto kernel = kv.f16 ? attention_prefill_kernel<true> : attention_prefill_kernel<false>;
  kernel<<<grid, threads, plan.shmem, stream>>>(kv, q, out, n_head, group, scale, plan.bq, plan.bk, tiles);
}

void fill_nan(float* y, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  fill_nan_kernel<<<blocks_for(n, 256), 256, 0, stream>>>(y, n);
}

void kv_store_rows(const KvArgs& kv, const float* k, const float* v, int64_t T, cudaStream_t stream) {
  if (T <= 0) return;
  kv_store_kernel<<<static_cast<unsigned>(T), 128, 0, stream>>>(kv, k, v);
}

void rope_kv_store(const KvArgs& kv, float* q, float* k, const float* v, const float* cs, int64_t T, int32_t n_head,
                   int32_t n_rot, bool neox, cudaStream_t stream) {
  if (T <= 0) return;
  rope_kv_store_kernel<<<static_cast<unsigned>(T), 256, 0, stream>>>(kv, q, k, v, cs, n_head, n_rot, neox);
}

cudaError_t attention_setup(int device, int32_t* score_capacity) {
  int optin = 0;
  if (const cudaError_t e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
      e != cudaSuccess) {
    return e;
  }
  // Dynamic + static shared memory must fit the opt-in limit: 1 KiB is left for the
  // kernel's static reductions (384 bytes).
  const int dynamic_max = optin - 1024;
  for (const void* k : {reinterpret_cast<const void*>(attention_kernel<true>),
                        reinterpret_cast<const void*>(attention_kernel<false>)}) {
    if (const cudaError_t e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, dynamic_max);
        e != cudaSuccess) {
      return e;
    }
  }
  // Room for q and the group partials (at most 1024 + 1024 floats).
  const int64_t avail = int64_t(dynamic_max) - int64_t(2048) * 4;
  *score_capacity = static_cast<int32_t>(avail > 0 ? avail / 4 : 0);
  return cudaSuccess;
}

void attention(const KvArgs& kv, const float* q, float* out, int64_t T, int32_t n_head, float scale, int32_t max_pos,
               int32_t score_capacity, cudaStream_t stream, const int32_t* tokens) {
  if (T <= 0) return;
  const int threads = attention_threads(kv.head_dim);
  const int32_t cap = max_pos < score_capacity ? max_pos : score_capacity;
  const int32_t G = threads / kv.head_dim;
  const size_t shmem = (size_t(kv.head_dim) + size_t(cap) + size_t(G) * size_t(kv.head_dim)) * sizeof(float);
  const int32_t group = n_head / kv.n_head_kv;
  const unsigned grid = static_cast<unsigned>(T * n_head);
  if (kv.f16) {
    attention_kernel<true><<<grid, threads, shmem, stream>>>(kv, q, out, n_head, group, scale, cap, tokens);
  } else {
    attention_kernel<false><<<grid, threads, shmem, stream>>>(kv, q, out, n_head, group, scale, cap, tokens);
  }
}

}  // namespace tandem::kernels::cuda
