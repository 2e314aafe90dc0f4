// Q8_0 activation quantisation and the matmul kernels (decode GEMV and prefill GEMM are
// one kernel family: a warp per weight row and a tile of MT activation rows).
//
// Quantised weights (Q4_0, Q8_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K): lane i of the warp takes blocks i, i+32, ... of
// the weight row, so the warp reads the row's blocks contiguously (16-byte loads of the
// repacked 4-bit data, 32-byte loads of the Q8_0 activations), computes each block's exact
// integer dot with dp4a (block_math.cuh), forms the block's f32 contribution p_b as the CPU
// does (docs/arithmetic.md: (fp16(d_w) * fp16(d_x)) * S_b, plus the offset / min terms, the
// K-quants' sub-block scales) and
// accumulates in f32; the 32 lane sums are then added with a shuffle tree. Every index is
// bounds-checked: any m, any n, and any number of blocks per row (field case B09: no
// assumption that k is a multiple of 64 or 128).
//
// Prefill with m >= kGemmTensorCoreMinRows activation rows takes the Tensor Core kernel
// (gemm_quant_tc_kernel below) instead: the exact integer block dots come from int8 WMMA
// (16x16x16 mma_sync, int32 accumulators), and the float side repeats the dp4a kernel's
// operations in its order, so every output is bit-identical to gemm_quant_kernel's.
#include <cuda_runtime.h>
#include <mma.h>

#include <type_traits>

#include "block_math.cuh"
#include "cuda_kernels.hpp"
#include "q8_warp.cuh"

namespace tandem::kernels::cuda {

namespace {

constexpr int kWarp = 32;
constexpr int kRowsPerBlock = 4;  // warps per thread block, one weight row each

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
}

// One warp per Q8_0 block of 32 values: lane j quantises value j.
__global__ void quantize_q8_0_kernel(const float* __restrict__ x, int64_t n_blocks, int8_t* __restrict__ xq,
                                     uint16_t* __restrict__ xd) {
  const int64_t blk = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (blk >= n_blocks) return;  // whole warps exit together (blockDim is a multiple of 32)
  warp_quantize_q8_0(x[blk * kQK + lane], lane, xq + blk * kQK, xd + blk);
}

// One quantised weight matrix's device arrays (DevWeight's q, d, m, qh).
struct QuantW {
  const void* q;
  const uint16_t* d;   // per 32-element block; K-quants: per 256-element block (index blk / 8)
  const uint16_t* m;   // Q4_1 / Q5_1 offsets, Q4_K / Q5_K dmin (per 256)
  const uint32_t* qh;  // Q5_0 / Q5_1 / Q5_K fifth bits, Q6_K top two bits (2 words a block)
  const uint16_t* sc;  // K-quants' sub-block scales (and mins)
};

__device__ __forceinline__ void load_q4_words(const void* q, int64_t blk, uint32_t v[4]) {
  const uint4 w = reinterpret_cast<const uint4*>(q)[blk];
  v[0] = w.x, v[1] = w.y, v[2] = w.z, v[3] = w.w;
}

// A weight block (its words and scales), loaded once per block and reused for every
// activation row; contribution() is the block's p_b (docs/arithmetic.md) with one Q8_0
// activation block (scale dx, 8 words x).
template <WType W>
struct WeightWords;
template <>
struct WeightWords<WType::kQ4_0> {
  uint32_t v[4];
  uint16_t d;
  __device__ __forceinline__ void load(const QuantW& w, int64_t blk) {
    load_q4_words(w.q, blk, v);
    d = w.d[blk];
  }
  __device__ __forceinline__ float contribution(uint16_t dx, const int32_t x[8]) const {
    return block_contribution(d, dx, dot_q4_0_q8_0_words(v, x));
  }
};
template <>
struct WeightWords<WType::kQ8_0> {
  int32_t v[8];
  uint16_t d;
  __device__ __forceinline__ void load(const QuantW& w, int64_t blk) {
    const int4* p = reinterpret_cast<const int4*>(static_cast<const int8_t*>(w.q) + blk * kQK);
    const int4 w0 = p[0], w1 = p[1];
    v[0] = w0.x, v[1] = w0.y, v[2] = w0.z, v[3] = w0.w, v[4] = w1.x, v[5] = w1.y, v[6] = w1.z, v[7] = w1.w;
    d = w.d[blk];
  }
  __device__ __forceinline__ float contribution(uint16_t dx, const int32_t x[8]) const {
    return block_contribution(d, dx, dot_q8_0_q8_0_words(v, x));
  }
};
template <>
struct WeightWords<WType::kQ4_1> {
  uint32_t v[4];
  uint16_t d, m;
  __device__ __forceinline__ void load(const QuantW& w, int64_t blk) {
    load_q4_words(w.q, blk, v);
    d = w.d[blk];
    m = w.m[blk];
  }
  __device__ __forceinline__ float contribution(uint16_t dx, const int32_t x[8]) const {
    return block_contribution_q4_1(d, m, dx, dot_q4_1_q8_0_words(v, x), sum_q8_words(x, 8));
  }
};
template <>
struct WeightWords<WType::kQ5_0> {
  uint32_t v[4];
  uint32_t qh;
  uint16_t d;
  __device__ __forceinline__ void load(const QuantW& w, int64_t blk) {
    load_q4_words(w.q, blk, v);
    qh = w.qh[blk];
    d = w.d[blk];
  }
  __device__ __forceinline__ float contribution(uint16_t dx, const int32_t x[8]) const {
    return block_contribution(d, dx, dot_q5_0_q8_0_words(v, qh, x));
  }
};

template <>
struct WeightWords<WType::kQ5_1> {
  uint32_t v[4];
  uint32_t qh;
  uint16_t d, m;
  __device__ __forceinline__ void load(const QuantW& w, int64_t blk) {
    load_q4_words(w.q, blk, v);
    qh = w.qh[blk];
    d = w.d[blk];
    m = w.m[blk];
  }
  __device__ __forceinline__ float contribution(uint16_t dx, const int32_t x[8]) const {
    return block_contribution_q4_1(d, m, dx, dot_q5_u_q8_0_words(v, qh, x), sum_q8_words(x, 8));
  }
};
// K-quants: block blk is a sub-block of 256-element block blk / 8 (nb % 8 == 0).
template <>
struct WeightWords<WType::kQ4_K> {
  uint32_t v[4];
  uint16_t d, dmin, sc;
  __device__ __forceinline__ void load(const QuantW& w, int64_t blk) {
    load_q4_words(w.q, blk, v);
    d = w.d[blk / 8];
    dmin = w.m[blk / 8];
    sc = w.sc[blk];
  }
  __device__ __forceinline__ float contribution(uint16_t dx, const int32_t x[8]) const {
    return block_contribution_k_min(d, dmin, dx, sc & 0xFF, sc >> 8, dot_q4_1_q8_0_words(v, x), sum_q8_words(x, 8));
  }
};
template <>
struct WeightWords<WType::kQ5_K> {
  uint32_t v[4];
  uint32_t qh;
  uint16_t d, dmin, sc;
  __device__ __forceinline__ void load(const QuantW& w, int64_t blk) {
    load_q4_words(w.q, blk, v);
    qh = w.qh[blk];
    d = w.d[blk / 8];
    dmin = w.m[blk / 8];
    sc = w.sc[blk];
  }
  __device__ __forceinline__ float contribution(uint16_t dx, const int32_t x[8]) const {
    return block_contribution_k_min(d, dmin, dx, sc & 0xFF, sc >> 8, dot_q5_u_q8_0_words(v, qh, x), sum_q8_words(x, 8));
  }
};
template <>
struct WeightWords<WType::kQ6_K> {
  uint32_t v[4];
  uint32_t top[2];
  uint16_t d, sc;
  __device__ __forceinline__ void load(const QuantW& w, int64_t blk) {
    load_q4_words(w.q, blk, v);
    const uint2 t = reinterpret_cast<const uint2*>(w.qh)[blk];
    top[0] = t.x, top[1] = t.y;
    d = w.d[blk / 8];
    sc = w.sc[blk];
  }
  __device__ __forceinline__ float contribution(uint16_t dx, const int32_t x[8]) const {
    return block_contribution_q6_k(d, dx, sc, dot_q6_k_half_words(v, top[0], x, false),
                                   dot_q6_k_half_words(v, top[1], x + 4, true));
  }
};

// The weight matrices of one launch of the dp4a kernels: up to kGemmMaxParts matrices of
// one type and k that multiply the same activations (Q, K and V; gate and up), part p
// owning the thread blocks [first[p], first[p + 1]) along grid.x and writing its own
// output (row stride ldy[p]). Merging them makes one launch of the few-row matrices (K
// and V) and fills the device with more blocks; each part's rows are computed exactly as
// alone (the part only picks the pointers).
struct QuantParts {
  QuantW w[kGemmMaxParts];
  int64_t n[kGemmMaxParts];
  float* y[kGemmMaxParts];
  int64_t ldy[kGemmMaxParts];
  const float* bias[kGemmMaxParts];  // null, or [n] added to each output row (add_bias's y + b)
  unsigned first[kGemmMaxParts + 1];
  int count;
};

// The value stored at output row r: s, or *out + s with `accumulate`, then + bias[r].
__device__ __forceinline__ float epilogue(const float* out, float s, bool accumulate, const float* bias, int64_t r) {
  const float v = accumulate ? *out + s : s;
  return bias != nullptr ? v + bias[r] : v;
}

// The part that owns thread block `bx` along grid.x.
__device__ __forceinline__ int part_of(const QuantParts& P, unsigned bx) {
  int p = 0;
#pragma unroll
  for (int i = 1; i < kGemmMaxParts; ++i) p = (i < P.count && bx >= P.first[i]) ? i : p;
  return p;
}

// grid: (sum over parts of ceil(n / kRowsPerBlock), ceil(m / MT)); block: kRowsPerBlock warps.
template <WType W, int MT>
__global__ void gemm_quant_kernel(QuantParts P, int64_t nb, const int8_t* __restrict__ xq,
                                  const uint16_t* __restrict__ xd, int64_t m, bool accumulate) {
  const int part = part_of(P, blockIdx.x);
  const QuantW w = P.w[part];
  const int64_t n = P.n[part], ldy = P.ldy[part];
  float* __restrict__ y = P.y[part];
  const float* __restrict__ bias = P.bias[part];
  const int64_t r = int64_t(blockIdx.x - P.first[part]) * kRowsPerBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  const int64_t c0 = int64_t(blockIdx.y) * MT;
  if (r >= n) return;  // a whole warp leaves together
  float acc[MT];
#pragma unroll
  for (int c = 0; c < MT; ++c) acc[c] = 0.0f;
  for (int64_t b = lane; b < nb; b += kWarp) {
    WeightWords<W> ww;
    ww.load(w, r * nb + b);
#pragma unroll
    for (int c = 0; c < MT; ++c) {
      if (c0 + c < m) {
        const int64_t xblk = (c0 + c) * nb + b;
        const int4* xp = reinterpret_cast<const int4*>(xq + xblk * kQK);
        const int4 x0 = xp[0], x1 = xp[1];
        const int32_t xv[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
        acc[c] += ww.contribution(xd[xblk], xv);
      }
    }
  }
#pragma unroll
  for (int c = 0; c < MT; ++c) {
    const float s = warp_sum(acc[c]);
    if (lane == 0 && c0 + c < m) {
      float* out = y + (c0 + c) * ldy + r;
      *out = epilogue(out, s, accumulate, bias, r);
    }
  }
}

// Decode GEMV (m == 1) of quantised weights: each warp takes R consecutive weight rows, and
// each lane the blocks lane, lane + 32, ... of all R rows, kU blocks per row at a time: the
// activation block is read once for the R rows, and R * kU weight blocks (16-byte loads for
// 4-bit weights) are loaded before any of them is used, so more bytes are in flight per warp than with
// gemm_quant_kernel's one row. Every row still adds its lane's blocks in the same order
// (ascending), starting from the same 0.0f, with the same block_contribution, then the same
// shuffle tree: each output is bit-identical to gemm_quant_kernel<W, MT>'s for that row.
// grid: sum over parts of ceil(n / (kRowsPerBlock * R)); block: kRowsPerBlock warps.
template <WType W, int R>
__global__ void gemv_quant_kernel(QuantParts P, int64_t nb, const int8_t* __restrict__ xq,
                                  const uint16_t* __restrict__ xd, bool accumulate) {
  constexpr int kU = 2;  // blocks per row loaded ahead
  const int part = part_of(P, blockIdx.x);
  const QuantW w = P.w[part];
  const int64_t n = P.n[part];
  float* __restrict__ y = P.y[part];
  const float* __restrict__ bias = P.bias[part];
  const int64_t r0 = (int64_t(blockIdx.x - P.first[part]) * kRowsPerBlock + threadIdx.x / kWarp) * R;
  const int lane = threadIdx.x % kWarp;
  if (r0 >= n) return;  // a whole warp leaves together
  float acc[R];
#pragma unroll
  for (int j = 0; j < R; ++j) acc[j] = 0.0f;
  for (int64_t b0 = lane; b0 < nb; b0 += kU * kWarp) {
    int32_t xv[kU][8] = {};
    uint16_t dx[kU] = {};
    WeightWords<W> ww[kU][R] = {};
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int64_t b = b0 + int64_t(u) * kWarp;
      if (b < nb) {
        const int4* xp = reinterpret_cast<const int4*>(xq + b * kQK);
        const int4 x0 = xp[0], x1 = xp[1];
        xv[u][0] = x0.x, xv[u][1] = x0.y, xv[u][2] = x0.z, xv[u][3] = x0.w;
        xv[u][4] = x1.x, xv[u][5] = x1.y, xv[u][6] = x1.z, xv[u][7] = x1.w;
        dx[u] = xd[b];
#pragma unroll
        for (int j = 0; j < R; ++j) {
          if (r0 + j < n) ww[u][j].load(w, (r0 + j) * nb + b);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      if (b0 + int64_t(u) * kWarp < nb) {
#pragma unroll
        for (int j = 0; j < R; ++j) {
          if (r0 + j < n) acc[j] += ww[u][j].contribution(dx[u], xv[u]);
        }
      }
    }
  }
#pragma unroll
  for (int j = 0; j < R; ++j) {
    const float s = warp_sum(acc[j]);  // every lane takes part, also for rows past n
    if (lane == 0 && r0 + j < n) {
      float* out = y + r0 + j;
      *out = epilogue(out, s, accumulate, bias, r0 + j);
    }
  }
}

// ---- Tensor Core prefill GEMM (int8 WMMA) -------------------------------------------------
//
// Technique: per 32-value block, the weight tile's values are unpacked to int8 (Q4_0: q - 8,
// Q5_0: q - 16, Q6_K: q - 32, Q4_1 / Q5_1 / Q4_K / Q5_K: the unsigned value) in shared memory
// next to the Q8_0 activation tile, and two 16x16x16 int8 mma_sync (the block's values 0..15,
// then 16..31) give the exact int32 block dot of every (weight row, activation row) pair of a
// 16 x 16 output tile (Q6_K: the two halves' dots apart, for its two scales); each dot is
// then scaled as the dp4a kernels' contribution() does and added in f32 (T, the activation
// block's sum for the offset / min terms, from the staging threads). Sources: the WMMA API of the
// CUDA C++ Programming Guide (section "Warp Matrix Functions": fragments, load/store/mma_sync,
// int8 inputs with int accumulators from sm_72); llama.cpp's mmq kernels use the same idea
// (integer MMA per quant block, float scaling per block).
//
// Bit-identity with gemm_quant_kernel: there, output (r, c) is the shuffle-tree sum of 32
// lane sums, lane l adding block_contribution() of blocks l, l + 32, l + 64, ... in that
// order, starting from 0.0f. Here thread (r, c) of the tile keeps those 32 lane sums itself
// (acc[l]: block b goes to acc[b % 32], blocks ascending), with the same block_contribution
// of the same exact integer dot, then adds them in the tree's pairs (level o: acc[l] +=
// acc[l + o], o = 16, 8, 4, 2, 1; float addition is commutative, so lane l's v + shfl(v, o)
// is the same value). No FMA contraction (--fmad=false), as the rest of the kernels. So the
// executor stays batch-invariant: a token's logits do not depend on whether its rows went
// through this kernel (prefill) or the dp4a GEMV/GEMM (decode, small batches).
//
// Tile: kTcTile weight rows x kTcTile activation rows per thread block of 256 threads (one
// output each); kTcStage blocks of the row are staged at a time, warp w multiplying block w.
// Shared memory (static): 4 + 4 KiB int8 tiles, 8 KiB int32 dots (16 KiB for Q6_K), 1 KiB
// scales and 1 KiB activation half sums (T). Every global index is bounds-checked (rows past n,
// activation rows past m and blocks past nb are staged as zeros and never written), so any n,
// m >= 1 and nb >= 1 are taken.
constexpr int kTcTile = 16;
constexpr int kTcStage = 8;
constexpr int kTcThreads = kTcStage * kWarp;
static_assert(kTcThreads == kTcTile * kTcTile, "one output per thread");
static_assert(kWarp % kTcStage == 0, "a stage's blocks map to consecutive lane sums");

// What a type's block contribution takes besides d_w and the dot: an offset / min (in m) and
// the activation sum T; K-quants: sub-block scales (sc) and d, m per 256-element block.
template <WType W>
constexpr bool kTcHasMin = W == WType::kQ4_1 || W == WType::kQ5_1 || W == WType::kQ4_K || W == WType::kQ5_K;
template <WType W>
constexpr bool kTcKQuant = W == WType::kQ4_K || W == WType::kQ5_K || W == WType::kQ6_K;

// Half h (values 16h .. 16h + 15) of weight block `blk` as 16 int8 (Q4_0: nibble - 8,
// Q4_1 / Q4_K: the nibble, Q5_0: 5-bit value - 16, Q5_1 / Q5_K: the 5-bit value, Q6_K: 6-bit
// value - 32, Q8_0: as stored).
template <WType W>
__device__ __forceinline__ uint4 tc_weight_half(const QuantW& w, int64_t blk, int h) {
  if constexpr (W == WType::kQ8_0) {
    return reinterpret_cast<const uint4*>(static_cast<const int8_t*>(w.q) + blk * kQK)[h];
  } else {
    uint32_t v[4];
    load_q4_words(w.q, blk, v);
    uint32_t o[4];
    if constexpr (W == WType::kQ5_0) {
      const uint32_t qh = w.qh[blk];
#pragma unroll
      for (int i = 0; i < 4; ++i) o[i] = static_cast<uint32_t>(q5_values_minus16(v[i], qh, i, h != 0));
    } else if constexpr (W == WType::kQ5_1 || W == WType::kQ5_K) {
      const uint32_t qh = w.qh[blk];
#pragma unroll
      for (int i = 0; i < 4; ++i) o[i] = q5_values(v[i], qh, i, h != 0);
    } else if constexpr (W == WType::kQ6_K) {
      const uint32_t top = w.qh[2 * blk + h];
#pragma unroll
      for (int i = 0; i < 4; ++i) o[i] = static_cast<uint32_t>(q6_values_minus32(v[i], top, i, h != 0));
    } else if constexpr (W == WType::kQ4_1 || W == WType::kQ4_K) {
#pragma unroll
      for (int i = 0; i < 4; ++i) o[i] = q4_nibbles(v[i], h != 0);
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) o[i] = static_cast<uint32_t>(q4_nibbles_minus8(v[i], h != 0));
    }
    return make_uint4(o[0], o[1], o[2], o[3]);
  }
}

// warp_sum's shuffle tree on 32 lane sums held by one thread: at level O (16, 8, 4, 2, 1)
// v[l] = v[l] + v[l + O] for l < O (lane l's v + shfl_xor(v, O)); v[0] ends as lane 0's sum.
// Compile-time indices, so v stays in registers.
template <int O>
__device__ __forceinline__ void lane_sum_tree(float (&v)[kWarp]) {
#pragma unroll
  for (int l = 0; l < O; ++l) v[l] = v[l] + v[l + O];
  if constexpr (O > 1) lane_sum_tree<O / 2>(v);
}

// grid: (ceil(n / kTcTile), ceil(m / kTcTile)); block: kTcThreads.
template <WType W>
__global__ void __launch_bounds__(kTcThreads)
    gemm_quant_tc_kernel(QuantW w, int64_t n, int64_t nb, const int8_t* __restrict__ xq,
                         const uint16_t* __restrict__ xd, int64_t m, float* __restrict__ y, int64_t ldy,
                         bool accumulate) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 720
  __trap();  // int8 WMMA needs sm_72+; the build targets sm_89/sm_90
#else
  namespace wmma = nvcuda::wmma;
  // [stage block][half: values 0..15 | 16..31][tile row (weights) or column (activations)][16]
  __shared__ __align__(256) signed char sw[kTcStage][2][kTcTile][16];
  __shared__ __align__(256) signed char sx[kTcStage][2][kTcTile][16];
  constexpr int kDots = W == WType::kQ6_K ? 2 : 1;                            // Q6_K: the halves' dots apart
  __shared__ __align__(256) int32_t sdot[kTcStage][kDots][kTcTile][kTcTile];  // [block][half][column][row]
  __shared__ uint16_t sdw[kTcStage][kTcTile], sdx[kTcStage][kTcTile];
  __shared__ uint16_t sdm[kTcStage][kTcTile];    // the weight rows' offsets / dmin (kTcHasMin)
  __shared__ uint16_t ssc[kTcStage][kTcTile];    // K-quants: the weight rows' sub-block scales
  __shared__ int32_t sxt[kTcStage][2][kTcTile];  // kTcHasMin: each activation half's sum of q_x
  const int t = threadIdx.x, warp = t / kWarp;
  const int64_t r0 = int64_t(blockIdx.x) * kTcTile, c0 = int64_t(blockIdx.y) * kTcTile;
  const int rl = t % kTcTile, cl = t / kTcTile;  // this thread's output (r0 + rl, c0 + cl)
  // Staging: thread t fills half h of stage block bl of tile row/column i; the 16 threads of
  // one row read its kTcStage consecutive blocks (coalesced).
  const int h = t % 2, bl = (t / 2) % kTcStage, i = (t / 2) / kTcStage;
  const bool w_in = r0 + i < n, x_in = c0 + i < m;
  float acc[kWarp];
#pragma unroll
  for (int l = 0; l < kWarp; ++l) acc[l] = 0.0f;
  for (int64_t g = 0; g < nb; g += kWarp) {
#pragma unroll
    for (int s = 0; s < kWarp / kTcStage; ++s) {
      const int64_t b0 = g + s * kTcStage;
      if (b0 >= nb) continue;  // the same for every thread of the block
      {
        const int64_t b = b0 + bl;
        uint4 wv = make_uint4(0, 0, 0, 0), xv = make_uint4(0, 0, 0, 0);
        uint16_t dv = 0;
        const int64_t wblk = (r0 + i) * nb + b, sblk = kTcKQuant<W> ? wblk / 8 : wblk;
        if (b < nb && w_in) wv = tc_weight_half<W>(w, wblk, h);
        if (b < nb && x_in) xv = reinterpret_cast<const uint4*>(xq + ((c0 + i) * nb + b) * kQK)[h];
        if (h == 0 && b < nb && w_in) dv = w.d[sblk];
        if (h == 1 && b < nb && x_in) dv = xd[(c0 + i) * nb + b];
        *reinterpret_cast<uint4*>(sw[bl][h][i]) = wv;
        *reinterpret_cast<uint4*>(sx[bl][h][i]) = xv;
        (h == 0 ? sdw : sdx)[bl][i] = dv;
        if constexpr (kTcKQuant<W>) {
          if (h == 0) ssc[bl][i] = b < nb && w_in ? w.sc[wblk] : uint16_t{0};
        }
        if constexpr (kTcHasMin<W>) {
          if (h == 0) sdm[bl][i] = b < nb && w_in ? w.m[sblk] : uint16_t{0};
          const int32_t xw[4] = {static_cast<int32_t>(xv.x), static_cast<int32_t>(xv.y), static_cast<int32_t>(xv.z),
                                 static_cast<int32_t>(xv.w)};
          sxt[bl][h][i] = sum_q8_words(xw, 4);
        }
      }
      __syncthreads();
      if (b0 + warp < nb) {  // whole warps: warp w multiplies stage block w
        wmma::fragment<wmma::matrix_a, 16, 16, 16, signed char, wmma::row_major> fa;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, signed char, wmma::col_major> fb;
        wmma::fragment<wmma::accumulator, 16, 16, 16, int> fd;
        wmma::fill_fragment(fd, 0);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          wmma::load_matrix_sync(fa, &sw[warp][hh][0][0], 16);  // A[row][k], row-major
          wmma::load_matrix_sync(fb, &sx[warp][hh][0][0], 16);  // B[k][column], column-major
          wmma::mma_sync(fd, fa, fb, fd);
          if constexpr (kDots == 2) {
            wmma::store_matrix_sync(&sdot[warp][hh][0][0], fd, kTcTile, wmma::mem_col_major);
            wmma::fill_fragment(fd, 0);
          }
        }
        if constexpr (kDots == 1) wmma::store_matrix_sync(&sdot[warp][0][0][0], fd, kTcTile, wmma::mem_col_major);
      }
      __syncthreads();
#pragma unroll
      for (int l = 0; l < kTcStage; ++l) {
        if (b0 + l < nb) {
          float p;
          if constexpr (W == WType::kQ6_K) {
            p = block_contribution_q6_k(sdw[l][rl], sdx[l][cl], ssc[l][rl], sdot[l][0][cl][rl], sdot[l][1][cl][rl]);
          } else if constexpr (kTcKQuant<W>) {
            p = block_contribution_k_min(sdw[l][rl], sdm[l][rl], sdx[l][cl], ssc[l][rl] & 0xFF, ssc[l][rl] >> 8,
                                         sdot[l][0][cl][rl], sxt[l][0][cl] + sxt[l][1][cl]);
          } else if constexpr (kTcHasMin<W>) {
            p = block_contribution_q4_1(sdw[l][rl], sdm[l][rl], sdx[l][cl], sdot[l][0][cl][rl],
                                        sxt[l][0][cl] + sxt[l][1][cl]);
          } else {
            p = block_contribution(sdw[l][rl], sdx[l][cl], sdot[l][0][cl][rl]);
          }
          acc[s * kTcStage + l] += p;
        }
      }
      __syncthreads();  // the stage buffers are refilled next
    }
  }
  // gemm_quant_kernel's warp_sum tree, on the 32 lane sums held here.
  lane_sum_tree<kWarp / 2>(acc);
  if (r0 + rl < n && c0 + cl < m) {
    float* out = y + (c0 + cl) * ldy + r0 + rl;
    *out = accumulate ? *out + acc[0] : acc[0];
  }
#endif
}

// Calls f(std::integral_constant<WType, t>{}) for a quantised type t (the kernels'
// template argument); float types take the float kernels instead.
template <class F>
void with_quant_type(WType t, F&& f) {
  switch (t) {
    case WType::kQ4_0:
      f(std::integral_constant<WType, WType::kQ4_0>{});
      break;
    case WType::kQ8_0:
      f(std::integral_constant<WType, WType::kQ8_0>{});
      break;
    case WType::kQ4_1:
      f(std::integral_constant<WType, WType::kQ4_1>{});
      break;
    case WType::kQ5_0:
      f(std::integral_constant<WType, WType::kQ5_0>{});
      break;
    case WType::kQ5_1:
      f(std::integral_constant<WType, WType::kQ5_1>{});
      break;
    case WType::kQ4_K:
      f(std::integral_constant<WType, WType::kQ4_K>{});
      break;
    case WType::kQ5_K:
      f(std::integral_constant<WType, WType::kQ5_K>{});
      break;
    case WType::kQ6_K:
      f(std::integral_constant<WType, WType::kQ6_K>{});
      break;
    case WType::kF32:
    case WType::kF16:
    case WType::kBF16:
      break;
  }
}

QuantW quant_w(const DevWeight& w) {
  return QuantW{w.q, w.d, w.m, w.qh, w.sc};
}

void launch_gemm_tc(const DevWeight& w, const int8_t* xq, const uint16_t* xd, int64_t m, float* y, int64_t ldy,
                    bool accumulate, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((w.n + kTcTile - 1) / kTcTile),
                  static_cast<unsigned>((m + kTcTile - 1) / kTcTile));
  const dim3 block(kTcThreads);
  const int64_t nb = w.k / kQK;
  with_quant_type(w.type, [&](auto type) {
    constexpr WType W = decltype(type)::value;
    gemm_quant_tc_kernel<W><<<grid, block, 0, stream>>>(quant_w(w), w.n, nb, xq, xd, m, y, ldy, accumulate);
  });
}

template <WType W>
__device__ __forceinline__ float load_w(const void* w, int64_t i) {
  if constexpr (W == WType::kF32) return static_cast<const float*>(w)[i];
  if constexpr (W == WType::kF16) return h2f(static_cast<const uint16_t*>(w)[i]);
  if constexpr (W == WType::kBF16) return bf16_bits_to_fp32(static_cast<const uint16_t*>(w)[i]);
  return 0.0f;
}

// Float weights (F32, F16 with f16-rounded activations, BF16): lanes stride over k.
template <WType W, int MT>
__global__ void gemm_float_kernel(const void* __restrict__ w, int64_t n, int64_t k, const float* __restrict__ x,
                                  int64_t m, float* __restrict__ y, int64_t ldy, bool accumulate) {
  const int64_t r = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  const int64_t c0 = int64_t(blockIdx.y) * MT;
  if (r >= n) return;
  float acc[MT];
#pragma unroll
  for (int c = 0; c < MT; ++c) acc[c] = 0.0f;
  for (int64_t i = lane; i < k; i += kWarp) {
    const float wv = load_w<W>(w, r * k + i);
#pragma unroll
    for (int c = 0; c < MT; ++c) {
      if (c0 + c < m) {
        float xv = x[(c0 + c) * k + i];
        if constexpr (W == WType::kF16) xv = round_f16(xv);
        acc[c] += wv * xv;
      }
    }
  }
#pragma unroll
  for (int c = 0; c < MT; ++c) {
    const float s = warp_sum(acc[c]);
    if (lane == 0 && c0 + c < m) {
      float* out = y + (c0 + c) * ldy + r;
      *out = accumulate ? *out + s : s;
    }
  }
}

// Weight rows per warp of the decode GEMV.
constexpr int kGemvRows = 2;

// The launch's parts: ws[i] (all quantised, of one type and k) into ys[i] rows strided by
// ldys[i], rows_per_block weight rows per thread block. Returns the blocks along grid.x.
unsigned make_parts(const DevWeight* const* ws, float* const* ys, const int64_t* ldys, const float* const* bias,
                    int count, int64_t rows_per_block, QuantParts& P) {
  P = QuantParts{};
  P.count = count;
  unsigned blocks = 0;
  for (int i = 0; i < count; ++i) {
    P.w[i] = quant_w(*ws[i]);
    P.n[i] = ws[i]->n;
    P.y[i] = ys[i];
    P.ldy[i] = ldys[i];
    P.bias[i] = bias != nullptr ? bias[i] : nullptr;
    P.first[i] = blocks;
    blocks += static_cast<unsigned>((ws[i]->n + rows_per_block - 1) / rows_per_block);
  }
  P.first[count] = blocks;
  return blocks;
}

void launch_gemv_quant(const DevWeight* const* ws, float* const* ys, const float* const* bias, int count,
                       const int8_t* xq, const uint16_t* xd, bool accumulate, cudaStream_t stream) {
  QuantParts P;
  const int64_t ldys[kGemmMaxParts] = {};
  const dim3 grid(make_parts(ws, ys, ldys, bias, count, int64_t{kRowsPerBlock} * kGemvRows, P));
  const dim3 block(kRowsPerBlock * kWarp);
  const int64_t nb = ws[0]->k / kQK;
  with_quant_type(ws[0]->type, [&](auto type) {
    constexpr WType W = decltype(type)::value;
    gemv_quant_kernel<W, kGemvRows><<<grid, block, 0, stream>>>(P, nb, xq, xd, accumulate);
  });
}

// The dp4a GEMM of quantised parts over activation rows [0, m) (8 per block along grid.y).
void launch_gemm_quant(const DevWeight* const* ws, float* const* ys, const int64_t* ldys, const float* const* bias,
                       int count, const int8_t* xq, const uint16_t* xd, int64_t m, bool accumulate,
                       cudaStream_t stream) {
  constexpr int MT = 8;
  QuantParts P;
  const dim3 grid(make_parts(ws, ys, ldys, bias, count, kRowsPerBlock, P), static_cast<unsigned>((m + MT - 1) / MT));
  const dim3 block(kRowsPerBlock * kWarp);
  const int64_t nb = ws[0]->k / kQK;
  with_quant_type(ws[0]->type, [&](auto type) {
    constexpr WType W = decltype(type)::value;
    gemm_quant_kernel<W, MT><<<grid, block, 0, stream>>>(P, nb, xq, xd, m, accumulate);
  });
}

// Float weights (F32, F16, BF16): the 8-row float GEMM (MT == 8) or its m == 1 form.
template <int MT>
void launch_gemm_float(const DevWeight& w, const float* x, int64_t m, float* y, int64_t ldy, bool accumulate,
                       cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((w.n + kRowsPerBlock - 1) / kRowsPerBlock),
                  static_cast<unsigned>((m + MT - 1) / MT));
  const dim3 block(kRowsPerBlock * kWarp);
  switch (w.type) {
    case WType::kF32:
      gemm_float_kernel<WType::kF32, MT><<<grid, block, 0, stream>>>(w.q, w.n, w.k, x, m, y, ldy, accumulate);
      break;
    case WType::kF16:
      gemm_float_kernel<WType::kF16, MT><<<grid, block, 0, stream>>>(w.q, w.n, w.k, x, m, y, ldy, accumulate);
      break;
    case WType::kBF16:
      gemm_float_kernel<WType::kBF16, MT><<<grid, block, 0, stream>>>(w.q, w.n, w.k, x, m, y, ldy, accumulate);
      break;
    case WType::kQ4_0:
    case WType::kQ8_0:
    case WType::kQ4_1:
    case WType::kQ5_0:
    case WType::kQ5_1:
    case WType::kQ4_K:
    case WType::kQ5_K:
    case WType::kQ6_K:
      break;  // quantised weights take launch_gemv_quant / launch_gemm_quant
  }
}

}  // namespace

void quantize_q8_0(const float* x, int64_t m, int64_t k, int8_t* xq, uint16_t* xd, cudaStream_t stream) {
  const int64_t n_blocks = m * (k / kQK);
  if (n_blocks <= 0) return;
  constexpr int kThreads = 256;
  const int64_t grid = (n_blocks * kWarp + kThreads - 1) / kThreads;
  quantize_q8_0_kernel<<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(x, n_blocks, xq, xd);
}

void gemm_parts(const DevWeight* const* w, float* const* y, const float* const* bias, int count, const float* x,
                const int8_t* xq, const uint16_t* xd, int64_t m, bool accumulate, cudaStream_t stream,
                bool tensor_cores) {
  if (m <= 0 || count <= 0) return;
  bool merged = count <= kGemmMaxParts;
  for (int i = 0; i < count && merged; ++i) {
    merged = w[i]->quantized() && w[i]->type == w[0]->type && w[i]->k == w[0]->k && w[i]->n > 0;
  }
  if (!merged || (tensor_cores && m >= kGemmTensorCoreMinRows && w[0]->k >= kQK)) {
    for (int i = 0; i < count; ++i) {
      gemm(*w[i], x, xq, xd, m, y[i], w[i]->n, accumulate, stream, tensor_cores);
      if (bias != nullptr && bias[i] != nullptr) add_bias(y[i], bias[i], m, w[i]->n, stream);
    }
    return;
  }
  if (m == 1) {
    launch_gemv_quant(w, y, bias, count, xq, xd, accumulate, stream);
    return;
  }
  // grid.y is limited to 65535 tiles: very tall activations go in slices.
  constexpr int64_t kSlice = int64_t{65535} * 8;
  const int64_t nb = w[0]->k / kQK;
  int64_t ldys[kGemmMaxParts] = {};
  for (int i = 0; i < count; ++i) ldys[i] = w[i]->n;
  for (int64_t c = 0; c < m; c += kSlice) {
    const int64_t mc = m - c < kSlice ? m - c : kSlice;
    float* ys[kGemmMaxParts] = {};
    for (int i = 0; i < count; ++i) ys[i] = y[i] + c * ldys[i];
    launch_gemm_quant(w, ys, ldys, bias, count, xq + c * w[0]->k, xd + c * nb, mc, accumulate, stream);
  }
}

void gemm(const DevWeight& w, const float* x, const int8_t* xq, const uint16_t* xd, int64_t m, float* y, int64_t ldy,
          bool accumulate, cudaStream_t stream, bool tensor_cores) {
  if (m <= 0 || w.n <= 0) return;
  if (tensor_cores && w.quantized() && m >= kGemmTensorCoreMinRows && w.k >= kQK) {
    // grid.y is limited to 65535 tiles: very tall activations go in slices.
    constexpr int64_t kSlice = int64_t{65535} * kTcTile;
    const int64_t nb = w.k / kQK;
    for (int64_t c = 0; c < m; c += kSlice) {
      const int64_t mc = m - c < kSlice ? m - c : kSlice;
      launch_gemm_tc(w, xq + c * w.k, xd + c * nb, mc, y + c * ldy, ldy, accumulate, stream);
    }
    return;
  }
  const DevWeight* ws[1] = {&w};
  if (m == 1) {
    if (w.quantized()) {
      float* ys[1] = {y};
      launch_gemv_quant(ws, ys, nullptr, 1, xq, xd, accumulate, stream);
    } else {
      launch_gemm_float<1>(w, x, m, y, ldy, accumulate, stream);
    }
    return;
  }
  // grid.y is limited to 65535 tiles: very tall activations go in slices.
  constexpr int64_t kSlice = int64_t{65535} * 8;
  const int64_t nb = w.k / kQK;
  for (int64_t c = 0; c < m; c += kSlice) {
    const int64_t mc = m - c < kSlice ? m - c : kSlice;
    if (w.quantized()) {
      float* ys[1] = {y + c * ldy};
      const int64_t ldys[1] = {ldy};
      launch_gemm_quant(ws, ys, ldys, nullptr, 1, xq + c * w.k, xd + c * nb, mc, accumulate, stream);
    } else {
      launch_gemm_float<8>(w, x + c * w.k, mc, y + c * ldy, ldy, accumulate, stream);
    }
  }
}

}  // namespace tandem::kernels::cuda
