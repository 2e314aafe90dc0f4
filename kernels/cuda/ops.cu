// Element-wise and row kernels (RMSNorm, bias, RoPE, SwiGLU, GEGLU, soft-cap), the KV row store and paged
// attention. Numerics follow lib/exec/cpu/cpu_q4_executor.cpp; the library is compiled with
// --fmad=false so a * b - c * d and friends round exactly as the CPU's (uncontracted)
// arithmetic does.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
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

struct MaxF {
  __device__ float operator()(float a, float b) const { return b > a ? b : a; }
};

// Threads per block of the RMSNorm kernels (the scale is one thread's; the row's elements
// are spread over all of them).
constexpr int kRmsThreads = 256;

// 1 / sqrt(mean(x^2) + eps) of the row xr [n] as the CPU's rms_norm_row computes it: the
// squares summed in double in index order (by thread 0), mean = f32(sum / n); every thread
// gets the result (after a barrier, so the row may be overwritten afterwards).
__device__ __forceinline__ float rms_inv_scale(const float* xr, int64_t n, float eps, float* scale_sh) {
  if (threadIdx.x == 0) {
    double sum = 0.0;
    for (int64_t i = 0; i < n; ++i) sum = sum + double(xr[i]) * double(xr[i]);
    const float mean = static_cast<float>(sum / double(n));
    *scale_sh = 1.0f / sqrtf(mean + eps);
  }
  __syncthreads();
  return *scale_sh;
}

__global__ void rms_norm_kernel(const float* x, const float* __restrict__ w, float* y, int64_t n, float eps,
                                const int32_t* __restrict__ rows) {
  __shared__ float scale_sh;
  const int64_t row = blockIdx.x;
  const float* xr = x + (rows ? int64_t(rows[row]) : row) * n;
  float* yr = y + row * n;
  const float scale = rms_inv_scale(xr, n, eps, &scale_sh);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) yr[i] = (xr[i] * scale) * w[i];
}

// rms_norm_kernel's row (the same scale, the same products), then its Q8_0 blocks: warp j of
// the block takes blocks j, j + n_warps, ... (n % 32 == 0); lane i computes element i of the
// block, stores it and quantises it with the warp (q8_warp.cuh, as quantize_q8_0_kernel).
__global__ void rms_norm_q8_0_kernel(const float* x, const float* __restrict__ w, float* y, int8_t* __restrict__ yq,
                                     uint16_t* __restrict__ yd, int64_t n, float eps,
                                     const int32_t* __restrict__ rows) {
  __shared__ float scale_sh;
  const int64_t row = blockIdx.x;
  const float* xr = x + (rows ? int64_t(rows[row]) : row) * n;
  float* yr = y + row * n;
  const float scale = rms_inv_scale(xr, n, eps, &scale_sh);
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

// SwiGLU with the written SiLU (softmax_exp.hpp): the CPU executor's bits.
__device__ __forceinline__ float swiglu_value(float g, float u) {
  return silu(g) * u;
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

// ---- attention: docs/arithmetic.md "Attention", steps 1-4, bit for bit -------------------
// Every kernel below computes, for a query row at position pos, exactly the CPU's attn_tiled
// (kernels/cpu): the positions p0 .. pos with p0 = attn_first(); scores by warp_score (the
// 32-lane dot and its butterfly); the max; e_p = softmax_exp(s_p - max); the sum in double
// over 8 lanes, their tree, then the tail (softmax_lane_sums / softmax_sum_tail); w_p =
// e_p * f32(1 / sum), rounded to f16 with f16 KV; the output per element over chunks of
// kAttentionChunk positions counted from p0 (fma within a chunk, chunk partials added in
// chunk order from 0). They differ only in how the work is spread over threads.

// The first position a row at `pos` attends to: 0, or pos + 1 - window with a window.
__device__ __forceinline__ int32_t attn_first(const KvArgs& kv, int32_t pos) {
  return kv.window > 0 && pos + 1 > kv.window ? pos + 1 - kv.window : 0;
}

// dot(q, k) of one head by a whole warp (every lane calls it, `kf(d)` gives K element d as a
// float): with n32 = hd rounded down to 32 and n8 to 8, lane l takes elements l, l + 32, ...
// < n32, then lanes l < 8 the elements n32 + l, n32 + l + 8, ... < n8, each `a = fma(q, k, a)`
// from +0; the butterfly adds lanes 8, 16, 4, 2, 1 apart; lane 0's sum (which every lane
// gets) then takes the last hd % 8 elements by fma in order. Unscaled.
template <class K>
__device__ __forceinline__ float warp_score(const float* qs, K kf, int32_t hd, int lane) {
  const int32_t n32 = hd / kWarp * kWarp, n8 = hd / 8 * 8;
  float a = 0.0f;
  for (int32_t e = lane; e < n32; e += kWarp) a = __fmaf_rn(qs[e], kf(e), a);
  if (lane < 8) {
    for (int32_t e = n32 + lane; e < n8; e += 8) a = __fmaf_rn(qs[e], kf(e), a);
  }
  for (const int o : {8, 16, 4, 2, 1}) a = __fadd_rn(a, __shfl_xor_sync(0xFFFFFFFFu, a, o));
  float s = __shfl_sync(0xFFFFFFFFu, a, 0);
  for (int32_t e = n8; e < hd; ++e) s = __fmaf_rn(qs[e], kf(e), s);
  return s;
}

// The softmax sum's tree over its 8 double lanes: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)).
__device__ __forceinline__ double tree8(const double* l) {
  return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

// The probability of a row from its e_p and 1 / sum: e * inv, rounded to f16 with f16 KV.
template <bool F16>
__device__ __forceinline__ float attn_weight(float e, float inv) {
  const float w = __fmul_rn(e, inv);
  return F16 ? round_f16(w) : w;
}

// K or V element d of head hk at position p of token t's sequence, as a float.
template <bool F16>
__device__ __forceinline__ const char* kv_head_row(const KvArgs& kv, int64_t t, int32_t p, int kind, int32_t hk) {
  return kv_row(kv, t, p, kind) + int64_t(hk) * kv.head_dim * (F16 ? 2 : 4);
}

// warp_score of K[p] (head hk) against qs, times the scale: the value attn_tiled stores.
template <bool F16>
__device__ __forceinline__ float attn_score(const KvArgs& kv, int64_t t, int32_t p, int32_t hk, const float* qs,
                                            float scale, int lane) {
  const char* row = kv_head_row<F16>(kv, t, p, 0, hk);
  return __fmul_rn(warp_score(
                       qs, [row](int32_t d) { return kv_load<F16>(row, d); }, kv.head_dim, lane),
                   scale);
}

// One thread block per (token, head); blockDim = attention_threads(head_dim) (>= head_dim,
// a multiple of 32). Shared memory: q [head_dim] | scores [cap]. Warps score positions p0 +
// w, p0 + w + n_warps, ...; warp 0 takes the sum; thread d < head_dim takes output element
// d over the chunks. Positions from p0 + cap on recompute their score (by the whole warp:
// every loop that calls attn_score is uniform over the warp) instead of storing it.
template <bool F16>
__global__ void attention_kernel(KvArgs kv, const float* __restrict__ q, float* __restrict__ out, int32_t n_head,
                                 int32_t group, float scale, int32_t cap, const int32_t* __restrict__ tokens) {
  extern __shared__ float sh[];
  __shared__ float red_f[32];
  __shared__ float inv_sh;
  __shared__ double lanes_sh[8];
  const int32_t hd = kv.head_dim;
  float* qs = sh;
  float* sc = sh + hd;
  const int64_t t = tokens ? int64_t(tokens[blockIdx.x / n_head]) : int64_t(blockIdx.x / n_head);
  const int32_t h = blockIdx.x % n_head;
  const int32_t hk = h / group;
  const int32_t n = kv.pos[t] + 1;
  const int32_t p0 = attn_first(kv, kv.pos[t]);
  const int lane = static_cast<int>(threadIdx.x) % kWarp, warp = static_cast<int>(threadIdx.x) / kWarp;
  const int n_warps = static_cast<int>(blockDim.x) / kWarp;
  const float* qh = q + (t * n_head + h) * hd;
  for (int32_t d = threadIdx.x; d < hd; d += blockDim.x) qs[d] = F16 ? round_f16(qh[d]) : qh[d];
  __syncthreads();

  float mx = -INFINITY;
  for (int32_t p = p0 + warp; p < n; p += n_warps) {
    const float s = attn_score<F16>(kv, t, p, hk, qs, scale, lane);
    if (lane == 0 && p - p0 < cap) sc[p - p0] = s;
    mx = s > mx ? s : mx;
  }
  mx = block_reduce(mx, red_f, MaxF{});  // ends with a barrier: every stored score is visible
  for (int32_t p = p0 + static_cast<int32_t>(threadIdx.x); p < n && p - p0 < cap; p += blockDim.x) {
    sc[p - p0] = softmax_exp(__fsub_rn(sc[p - p0], mx));
  }
  __syncthreads();
  // e_p, warp-uniform: stored, or recomputed past the capacity.
  auto e_at = [&](int32_t p) {
    return p - p0 < cap ? sc[p - p0] : softmax_exp(__fsub_rn(attn_score<F16>(kv, t, p, hk, qs, scale, lane), mx));
  };
  if (warp == 0) {
    // Lane l < 8 adds the e_p with (p - p0) % 8 == l over the full groups of 8; the warp
    // walks the groups together, so every attn_score call in e_at is warp-uniform.
    const int32_t n8 = p0 + (n - p0) / 8 * 8;
    double l = 0.0;
    for (int32_t g = p0; g < n8; g += 8) {
      float mine = 0.0f;
      for (int32_t j = 0; j < 8; ++j) {
        const float e = e_at(g + j);
        if (j == lane) mine = e;
      }
      if (lane < 8) l = l + double(mine);
    }
    if (lane < 8) lanes_sh[lane] = l;
    __syncwarp();
    double sum = tree8(lanes_sh);
    for (int32_t p = n8; p < n; ++p) sum = sum + double(e_at(p));
    if (lane == 0) inv_sh = static_cast<float>(1.0 / sum);
  }
  __syncthreads();
  const float inv = inv_sh;
  for (int32_t p = p0 + static_cast<int32_t>(threadIdx.x); p < n && p - p0 < cap; p += blockDim.x) {
    sc[p - p0] = attn_weight<F16>(sc[p - p0], inv);
  }
  __syncthreads();
  const int32_t d = static_cast<int32_t>(threadIdx.x);  // blockDim >= hd: every thread runs the loop
  float y = 0.0f, part = 0.0f;
  for (int32_t p = p0; p < n; ++p) {
    const float w = p - p0 < cap ? sc[p - p0] : attn_weight<F16>(e_at(p), inv);
    if (d < hd) part = __fmaf_rn(w, kv_load<F16>(kv_head_row<F16>(kv, t, p, 1, hk), d), part);
    if ((p + 1 - p0) % kAttentionChunk == 0 || p + 1 == n) {
      y = __fadd_rn(y, part);
      part = 0.0f;
    }
  }
  if (d < hd) out[(t * n_head + h) * hd + d] = y;
}

// ---- flash-decoding (split-KV) attention -------------------------------------------------
// A token's positions p0 .. pos are split into partitions of `part` positions (a multiple of
// kAttentionChunk) counted from p0, so a token's result does not depend on the batch.
// Kernels 1 and 3 take one (token, KV head, partition) with every query head of the GQA
// group, so each K and V row is fetched by one block only; kernel 2 one (token, head).
// Scratch slots: score (i * n_head + h) * max_pos + (p - p0); max (i * n_head + h) *
// max_parts + c; acc ((i * n_head + h) * max_chunks + chunk) * hd.

// Kernel 1: the scores s_p (warp_score times the scale) to `score`, and per head the
// partition's max. Shared memory: q [group][hd] | s [group][part].
template <bool F16>
__global__ void attention_split_scores_kernel(KvArgs kv, const float* __restrict__ q, int32_t n_head, int32_t group,
                                              float scale, int32_t part, int32_t max_parts, int32_t max_pos,
                                              const int32_t* __restrict__ tokens, float* __restrict__ score,
                                              float* __restrict__ p_max) {
  extern __shared__ float sh[];
  __shared__ float red_f[32];
  const int32_t hd = kv.head_dim;
  const int32_t i = static_cast<int32_t>(blockIdx.x) / kv.n_head_kv;  // index into tokens
  const int32_t hk = static_cast<int32_t>(blockIdx.x) % kv.n_head_kv;
  const int32_t c = static_cast<int32_t>(blockIdx.y);
  const int64_t t = tokens[i];
  const int32_t n = kv.pos[t] + 1;
  const int32_t p0 = attn_first(kv, kv.pos[t]);
  const int32_t pa = p0 + c * part;  // the partition's first position
  if (pa >= n) return;               // the whole block: no barrier is skipped by part of it
  const int32_t np = (pa + part < n ? pa + part : n) - pa;
  const int lane = static_cast<int>(threadIdx.x) % kWarp, warp = static_cast<int>(threadIdx.x) / kWarp;
  const int n_warps = static_cast<int>(blockDim.x) / kWarp;
  float* qs = sh;
  float* ss = qs + group * hd;
  for (int32_t e = threadIdx.x; e < group * hd; e += blockDim.x) {
    const float x = q[(t * n_head + hk * group) * hd + e];
    qs[e] = F16 ? round_f16(x) : x;
  }
  __syncthreads();
  const int64_t head0 = int64_t(i) * n_head + hk * group;
  for (int32_t j = warp; j < np; j += n_warps) {  // the K row once for all heads
    const char* row = kv_head_row<F16>(kv, t, pa + j, 0, hk);
    for (int32_t h = 0; h < group; ++h) {
      const float s = __fmul_rn(warp_score(
                                    qs + h * hd, [row](int32_t d) { return kv_load<F16>(row, d); }, hd, lane),
                                scale);
      if (lane == 0) {
        ss[h * part + j] = s;
        score[(head0 + h) * max_pos + (pa - p0) + j] = s;
      }
    }
  }
  __syncthreads();
  for (int32_t h = 0; h < group; ++h) {
    float mx = -INFINITY;
    for (int32_t j = threadIdx.x; j < np; j += blockDim.x) mx = ss[h * part + j] > mx ? ss[h * part + j] : mx;
    mx = block_reduce(mx, red_f, MaxF{});
    if (threadIdx.x == 0) p_max[(head0 + h) * max_parts + c] = mx;
  }
}

// Kernel 2, one block per (token, head): the max over the partitions' maxima, e_p in place
// of the scores, warp 0's sum (warp_softmax_sum), then the probabilities w_p in place.
template <bool F16>
__global__ void attention_split_softmax_kernel(const int32_t* __restrict__ pos, int32_t window,
                                               const int32_t* __restrict__ tokens, int32_t n_head, int32_t part,
                                               int32_t max_parts, int32_t max_pos, float* __restrict__ score,
                                               const float* __restrict__ p_max) {
  __shared__ float inv_sh;
  __shared__ double lanes_sh[8];
  const int32_t i = static_cast<int32_t>(blockIdx.x) / n_head;
  const int32_t h = static_cast<int32_t>(blockIdx.x) % n_head;
  const int64_t t = tokens[i];
  KvArgs w;
  w.window = window;
  const int32_t p0 = attn_first(w, pos[t]);
  const int32_t cnt = pos[t] + 1 - p0;
  const int32_t n_parts = (cnt + part - 1) / part;
  const int64_t slot = int64_t(i) * n_head + h;
  float* e = score + slot * max_pos;  // e[k]: position p0 + k
  float mx = -INFINITY;
  for (int32_t c = 0; c < n_parts; ++c) mx = p_max[slot * max_parts + c] > mx ? p_max[slot * max_parts + c] : mx;
  for (int32_t k = threadIdx.x; k < cnt; k += blockDim.x) e[k] = softmax_exp(__fsub_rn(e[k], mx));
  __syncthreads();
  const int32_t n8 = cnt / 8 * 8;
  if (threadIdx.x < 8) {
    double l = 0.0;
    for (int32_t k = threadIdx.x; k < n8; k += 8) l = l + double(e[k]);
    lanes_sh[threadIdx.x] = l;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double sum = tree8(lanes_sh);
    for (int32_t k = n8; k < cnt; ++k) sum = sum + double(e[k]);
    inv_sh = static_cast<float>(1.0 / sum);
  }
  __syncthreads();
  const float inv = inv_sh;
  for (int32_t k = threadIdx.x; k < cnt; k += blockDim.x) e[k] = attn_weight<F16>(e[k], inv);
}

// Kernel 3: per query head of the group and chunk of the partition, a thread per (head,
// element d): part = fma(w_p, V[p][d], part) over the chunk's positions in order, to acc.
template <bool F16>
__global__ void attention_split_values_kernel(KvArgs kv, int32_t n_head, int32_t group, int32_t part,
                                              int32_t max_chunks, int32_t max_pos, const int32_t* __restrict__ tokens,
                                              const float* __restrict__ score, float* __restrict__ p_acc) {
  const int32_t hd = kv.head_dim;
  const int32_t i = static_cast<int32_t>(blockIdx.x) / kv.n_head_kv;
  const int32_t hk = static_cast<int32_t>(blockIdx.x) % kv.n_head_kv;
  const int32_t c = static_cast<int32_t>(blockIdx.y);
  const int64_t t = tokens[i];
  const int32_t n = kv.pos[t] + 1;
  const int32_t p0 = attn_first(kv, kv.pos[t]);
  const int32_t pa = p0 + c * part;
  if (pa >= n) return;
  const int32_t pe = pa + part < n ? pa + part : n;
  const int64_t head0 = int64_t(i) * n_head + hk * group;
  for (int32_t e = threadIdx.x; e < group * hd; e += blockDim.x) {
    const int32_t h = e / hd, d = e % hd;
    const float* w = score + (head0 + h) * max_pos - p0;  // w[p]
    for (int32_t cs = pa; cs < pe; cs += kAttentionChunk) {
      const int32_t ce = cs + kAttentionChunk < pe ? cs + kAttentionChunk : pe;
      float acc = 0.0f;
      for (int32_t p = cs; p < ce; ++p) acc = __fmaf_rn(w[p], kv_load<F16>(kv_head_row<F16>(kv, t, p, 1, hk), d), acc);
      p_acc[((head0 + h) * max_chunks + (cs - p0) / kAttentionChunk) * hd + d] = acc;
    }
  }
}

// Kernel 4, one block per (token, head), a thread per dim: out[d] = 0 + acc_0[d] + acc_1[d]
// + ..., in chunk order. With oq/od (head_dim % 32 == 0, blockDim == head_dim): each warp
// also quantises its 32 outputs, one Q8_0 block of the row, as quantize_q8_0_kernel does
// (warp_quantize_q8_0).
__global__ void attention_combine_kernel(const int32_t* __restrict__ pos, int32_t window,
                                         const int32_t* __restrict__ tokens, int32_t n_head, int32_t head_dim,
                                         int32_t max_chunks, const float* __restrict__ p_acc, float* __restrict__ out,
                                         int8_t* __restrict__ oq, uint16_t* __restrict__ od) {
  const int32_t i = static_cast<int32_t>(blockIdx.x) / n_head;
  const int32_t h = static_cast<int32_t>(blockIdx.x) % n_head;
  const int32_t d = static_cast<int32_t>(threadIdx.x);
  if (d >= head_dim) return;  // never a partial warp when quantising (head_dim % 32 == 0)
  const int64_t t = tokens[i];
  KvArgs w;
  w.window = window;
  const int32_t cnt = pos[t] + 1 - attn_first(w, pos[t]);
  const int32_t n_chunks = (cnt + kAttentionChunk - 1) / kAttentionChunk;
  const int64_t s0 = (int64_t(i) * n_head + h) * max_chunks;
  float r = 0.0f;
  for (int32_t c = 0; c < n_chunks; ++c) r = __fadd_rn(r, p_acc[(s0 + c) * head_dim + d]);
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
// of bk positions are staged in shared memory. Shared memory: lane sums [R][8] doubles | q
// [R][hd] | out [R][hd] | chunk part [R][hd] | K [bk][hd + 1] | V [bk][hd] | scores [R][bk] |
// max [R] | inv [R] | tail e [R][8] floats, R = bq * group. K rows are padded by one float.

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

// Scores of the staged K tile (positions kb .. kb + n - 1) for every row, by warps
// (warp_score times the scale): positions outside a row's [p0, pos] are not written.
__device__ __forceinline__ void prefill_scores(const KvArgs& kv, int64_t t0, int32_t group, int32_t R, int32_t bk,
                                               int32_t kb, int32_t n, float scale, const float* qs, const float* ks,
                                               float* ss) {
  const int32_t hd = kv.head_dim;
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  for (int32_t e = static_cast<int32_t>(threadIdx.x) / kWarp; e < R * bk;
       e += static_cast<int32_t>(blockDim.x) / kWarp) {
    const int32_t r = e / bk, j = e % bk;
    const int32_t pos = kv.pos[t0 + r / group];
    if (j >= n || kb + j > pos || kb + j < attn_first(kv, pos)) continue;  // uniform over the warp
    const float* kj = ks + j * (hd + 1);
    const float s = __fmul_rn(warp_score(
                                  qs + r * hd, [kj](int32_t d) { return kj[d]; }, hd, lane),
                              scale);
    if (lane == 0) ss[e] = s;
  }
}

// Three passes over the K (and in the last, V) tiles from the rows' first p0: (1) each row's
// max; (2) e_p and the sum's 8 double lanes, a thread per (row, lane) adding its positions
// in order across the tiles (the last (pos + 1 - p0) % 8 e_p, the tail, kept apart), then
// per row the tree and the tail; (3) w_p, and a thread per (row, element d) keeping the
// running chunk part and output in shared memory across tiles, a chunk closed every
// kAttentionChunk positions from the row's p0 and at its last position.
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
  double* ls = reinterpret_cast<double*>(sh);
  float* qs = sh + 16 * R_cap;
  float* os = qs + R_cap * hd;
  float* ps = os + R_cap * hd;
  float* ks = ps + R_cap * hd;
  float* vs = ks + bk * (hd + 1);
  float* ss = vs + bk * hd;
  float* ms = ss + R_cap * bk;
  float* inv = ms + R_cap;
  float* et = inv + R_cap;
  for (int32_t e = threadIdx.x; e < R * hd; e += blockDim.x) {
    const int32_t r = e / hd, d = e % hd;
    const float x = q[((t0 + r / group) * n_head + hk * group + r % group) * hd + d];
    qs[e] = F16 ? round_f16(x) : x;
    os[e] = 0.0f;
    ps[e] = 0.0f;
  }
  for (int32_t r = threadIdx.x; r < R; r += blockDim.x) ms[r] = -INFINITY;
  for (int32_t e = threadIdx.x; e < 8 * R; e += blockDim.x) ls[e] = 0.0;
  int32_t first = INT32_MAX, last = 0;  // the K/V rows any row reads: [first, last]
  for (int32_t i = 0; i < nq; ++i) {
    const int32_t p = kv.pos[t0 + i];
    last = p > last ? p : last;
    const int32_t f = attn_first(kv, p);
    first = f < first ? f : first;
  }
  auto tile_len = [&](int32_t kb) { return kb + bk <= last + 1 ? bk : last + 1 - kb; };
  // Row r's positions within the tile at kb: j in [lo, hi).
  auto row_span = [&](int32_t r, int32_t kb, int32_t n, int32_t* lo, int32_t* hi) {
    const int32_t pos = kv.pos[t0 + r / group];
    const int32_t p0 = attn_first(kv, pos);
    *lo = p0 > kb ? p0 - kb : 0;
    *hi = pos + 1 - kb < n ? pos + 1 - kb : n;
    return p0;
  };

  for (int32_t kb = first; kb <= last; kb += bk) {  // pass 1: max
    const int32_t n = tile_len(kb);
    __syncthreads();  // the previous tile's K and scores are no longer read
    prefill_stage<F16>(kv, t0, hk, kb, n, false, ks, vs);
    __syncthreads();
    prefill_scores(kv, t0, group, R, bk, kb, n, scale, qs, ks, ss);
    __syncthreads();
    for (int32_t r = threadIdx.x; r < R; r += blockDim.x) {
      int32_t lo, hi;
      row_span(r, kb, n, &lo, &hi);
      float mx = ms[r];
      for (int32_t j = lo; j < hi; ++j) mx = ss[r * bk + j] > mx ? ss[r * bk + j] : mx;
      ms[r] = mx;
    }
  }
  for (int32_t kb = first; kb <= last; kb += bk) {  // pass 2: the sum's lanes and tail
    const int32_t n = tile_len(kb);
    __syncthreads();
    prefill_stage<F16>(kv, t0, hk, kb, n, false, ks, vs);
    __syncthreads();
    prefill_scores(kv, t0, group, R, bk, kb, n, scale, qs, ks, ss);
    __syncthreads();
    for (int32_t e = threadIdx.x; e < 8 * R; e += blockDim.x) {
      const int32_t r = e / 8, l = e % 8;
      int32_t lo, hi;
      const int32_t p0 = row_span(r, kb, n, &lo, &hi);
      const int32_t n8 = p0 + (kv.pos[t0 + r / group] + 1 - p0) / 8 * 8;
      double acc = ls[e];
      for (int32_t j = lo; j < hi; ++j) {
        const int32_t p = kb + j;
        if ((p - p0) % 8 != l) continue;
        const float x = softmax_exp(__fsub_rn(ss[r * bk + j], ms[r]));
        if (p < n8) {
          acc = acc + double(x);
        } else {
          et[e] = x;  // tail term p - n8 == l
        }
      }
      ls[e] = acc;
    }
  }
  __syncthreads();
  for (int32_t r = threadIdx.x; r < R; r += blockDim.x) {
    const int32_t pos = kv.pos[t0 + r / group];
    const int32_t cnt = pos + 1 - attn_first(kv, pos);
    double sum = tree8(ls + 8 * r);
    for (int32_t l = 0; l < cnt % 8; ++l) sum = sum + double(et[8 * r + l]);
    inv[r] = static_cast<float>(1.0 / sum);
  }

  for (int32_t kb = first; kb <= last; kb += bk) {  // pass 3: probabilities times V
    const int32_t n = tile_len(kb);
    __syncthreads();  // the previous tile's K, V and probabilities are no longer read
    prefill_stage<F16>(kv, t0, hk, kb, n, true, ks, vs);
    __syncthreads();
    prefill_scores(kv, t0, group, R, bk, kb, n, scale, qs, ks, ss);
    __syncthreads();
    for (int32_t e = threadIdx.x; e < R * bk; e += blockDim.x) {
      const int32_t r = e / bk, j = e % bk;
      int32_t lo, hi;
      row_span(r, kb, n, &lo, &hi);
      if (j >= lo && j < hi) ss[e] = attn_weight<F16>(softmax_exp(__fsub_rn(ss[e], ms[r])), inv[r]);
    }
    __syncthreads();
    for (int32_t e = threadIdx.x; e < R * hd; e += blockDim.x) {
      const int32_t r = e / hd, d = e % hd;
      int32_t lo, hi;
      const int32_t p0 = row_span(r, kb, n, &lo, &hi);
      const int32_t pos = kv.pos[t0 + r / group];
      float y = os[e], part = ps[e];
      for (int32_t j = lo; j < hi; ++j) {
        const int32_t p = kb + j;
        part = __fmaf_rn(ss[r * bk + j], vs[j * hd + d], part);
        if ((p + 1 - p0) % kAttentionChunk == 0 || p == pos) {
          y = __fadd_rn(y, part);
          part = 0.0f;
        }
      }
      os[e] = y;
      ps[e] = part;
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
  return (size_t(group) * size_t(head_dim) + size_t(group) * size_t(part)) * sizeof(float);
}

void attention_split(const KvArgs& kv, const float* q, float* out, const int32_t* tokens, int64_t n_tokens,
                     int32_t n_head, float scale, int32_t max_pos, const AttentionSplitScratch& scratch,
                     cudaStream_t stream, int8_t* out_q, uint16_t* out_d) {
  if (n_tokens <= 0) return;
  const int threads = attention_threads(kv.head_dim);
  const int32_t group = n_head / kv.n_head_kv;
  const int32_t part = scratch.part;
  const int32_t max_parts = (max_pos + part - 1) / part;
  const int32_t max_chunks = (max_pos + kAttentionChunk - 1) / kAttentionChunk;
  const size_t shmem = attention_split_shmem(kv.head_dim, group, part);
  const dim3 grid(static_cast<unsigned>(n_tokens * kv.n_head_kv), static_cast<unsigned>(max_parts));
  const unsigned heads = static_cast<unsigned>(n_tokens * n_head);
  if (kv.f16) {
    attention_split_scores_kernel<true><<<grid, threads, shmem, stream>>>(kv, q, n_head, group, scale, part, max_parts,
                                                                          max_pos, tokens, scratch.score, scratch.max);
    attention_split_softmax_kernel<true><<<heads, 128, 0, stream>>>(kv.pos, kv.window, tokens, n_head, part, max_parts,
                                                                    max_pos, scratch.score, scratch.max);
    attention_split_values_kernel<true><<<grid, threads, 0, stream>>>(kv, n_head, group, part, max_chunks, max_pos,
                                                                      tokens, scratch.score, scratch.acc);
  } else {
    attention_split_scores_kernel<false><<<grid, threads, shmem, stream>>>(kv, q, n_head, group, scale, part, max_parts,
                                                                           max_pos, tokens, scratch.score, scratch.max);
    attention_split_softmax_kernel<false><<<heads, 128, 0, stream>>>(kv.pos, kv.window, tokens, n_head, part, max_parts,
                                                                     max_pos, scratch.score, scratch.max);
    attention_split_values_kernel<false><<<grid, threads, 0, stream>>>(kv, n_head, group, part, max_chunks, max_pos,
                                                                       tokens, scratch.score, scratch.acc);
  }
  const int combine_threads = ((kv.head_dim + kWarp - 1) / kWarp) * kWarp;
  const bool quantise = out_q != nullptr && out_d != nullptr && kv.head_dim % kQK == 0;
  attention_combine_kernel<<<heads, combine_threads, 0, stream>>>(
      kv.pos, kv.window, tokens, n_head, kv.head_dim, max_chunks, scratch.acc, out, quantise ? out_q : nullptr,
      quantise ? out_d : nullptr);
}

AttentionPrefillPlan attention_prefill_plan(int32_t head_dim, int32_t group) {
  AttentionPrefillPlan plan;
  if (head_dim <= 0 || group <= 0) return plan;
  const int32_t bk = 16;
  const int64_t budget = 48 * 1024 / 4;                             // floats of the default dynamic limit
  const int64_t fixed = int64_t(bk) * (2 * int64_t(head_dim) + 1);  // K (rows padded) and V tiles
  // q, out, chunk part, scores, max, inv, tail [8], lane sums [8] (doubles)
  const int64_t per_row = 3 * int64_t(head_dim) + bk + 2 + 8 + 16;
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
  // kernel's static reductions and scalars (under 256 bytes).
  const int dynamic_max = optin - 1024;
  for (const void* k : {reinterpret_cast<const void*>(attention_kernel<true>),
                        reinterpret_cast<const void*>(attention_kernel<false>)}) {
    if (const cudaError_t e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, dynamic_max);
        e != cudaSuccess) {
      return e;
    }
  }
  // Room for q (at most 1024 floats).
  const int64_t avail = int64_t(dynamic_max) - int64_t(1024) * 4;
  *score_capacity = static_cast<int32_t>(avail > 0 ? avail / 4 : 0);
  return cudaSuccess;
}

void attention(const KvArgs& kv, const float* q, float* out, int64_t T, int32_t n_head, float scale, int32_t max_pos,
               int32_t score_capacity, cudaStream_t stream, const int32_t* tokens) {
  if (T <= 0) return;
  const int threads = attention_threads(kv.head_dim);
  const int32_t cap = max_pos < score_capacity ? max_pos : score_capacity;
  const size_t shmem = (size_t(kv.head_dim) + size_t(cap)) * sizeof(float);
  const int32_t group = n_head / kv.n_head_kv;
  const unsigned grid = static_cast<unsigned>(T * n_head);
  if (kv.f16) {
    attention_kernel<true><<<grid, threads, shmem, stream>>>(kv, q, out, n_head, group, scale, cap, tokens);
  } else {
    attention_kernel<false><<<grid, threads, shmem, stream>>>(kv, q, out, n_head, group, scale, cap, tokens);
  }
}

}  // namespace tandem::kernels::cuda
