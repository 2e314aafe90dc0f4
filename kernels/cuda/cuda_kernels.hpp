// Host-callable launchers of the CUDA kernels (kernels/cuda/*.cu). Plain C++: included by
// the GPU executor's host code (lib/exec/gpu/), compiled by the host compiler.
//
// Conventions as kernels/cpu: a weight matrix has n rows of k elements; activations X are
// m rows of k floats; outputs Y[c * ldy + r] = dot(W row r, X row c). All pointers are
// device pointers; every launcher enqueues on `stream` and returns at once.
// Numerics mirror lib/exec/cpu/cpu_q4_executor.cpp (see block_math.cuh and each kernel's comment).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace tandem::kernels::cuda {

enum class WType : int32_t { kQ4_0, kQ8_0, kQ4_1, kQ5_0, kQ5_1, kQ4_K, kQ5_K, kQ6_K, kF32, kF16, kBF16 };

/// A weight matrix in VRAM (nb = k / 32 blocks per row). Q4_0: q = [n][nb][16] packed bytes,
/// d = [n][nb] fp16 scales; Q8_0: q = [n][nb][32] int8, d = [n][nb]; Q4_1: q and d as Q4_0,
/// m = [n][nb] fp16 offsets; Q5_0: q and d as Q4_0 (low four bits), qh = [n][nb] uint32
/// fifth bits; Q5_1: q, d, qh as Q5_0, m as Q4_1; Q4_K, Q5_K, Q6_K (k % 256 == 0): q as
/// Q4_0 per 32-element block, d (and Q4_K/Q5_K's dmin in m) = [n][nb / 8], sc = [n][nb]
/// sub-block scales, qh = Q5_K [n][nb], Q6_K [n][nb][2] (block_math.cuh); F32: q = [n][k]
/// float; F16/BF16: q = [n][k] 16-bit values. Pointers a type does not use are null.
/// (block_math.cuh: the rearrangement is a pure repacking.)
struct DevWeight {
  WType type = WType::kF32;
  int64_t n = 0, k = 0;
  const void* q = nullptr;
  const uint16_t* d = nullptr;
  const uint16_t* m = nullptr;
  const uint32_t* qh = nullptr;
  const uint16_t* sc = nullptr;
  bool quantized() const noexcept { return type != WType::kF32 && type != WType::kF16 && type != WType::kBF16; }
};

/// X [m][k] floats -> Q8_0: xq [m][k] int8, xd [m][k/32] fp16 scales (k % 32 == 0),
/// bit-identical to kernels/cpu quantize_row_q8_0 on the same floats.
void quantize_q8_0(const float* x, int64_t m, int64_t k, int8_t* xq, uint16_t* xd, cudaStream_t stream);

/// Activation rows from which gemm() multiplies quantised weights on the Tensor Cores.
inline constexpr int64_t kGemmTensorCoreMinRows = 16;

/// Y[c * ldy + r] (= or, with `accumulate`, +=) W[r] . X[c] for r < w.n, c < m.
/// Quantised weights read xq/xd (from quantize_q8_0 of X); float weights read x (rounded to
/// f16 first for F16 weights, as the CPU does). Any m >= 1 and any n; k % 32 == 0 for
/// quantised weights (any number of blocks, field case B09). Kernels for quantised weights:
/// m == 1 the decode GEMV (two weight rows per warp), m < kGemmTensorCoreMinRows or
/// !tensor_cores the dp4a GEMM (a warp per weight row, 8 activation rows), else the Tensor
/// Core GEMM (int8 WMMA block dots in 16 x 16 output tiles, sm_72+). All three give every
/// output bit for bit the same value (same exact integer block dots, same f32 operations in
/// the same order; tests/gpu/test_gpu_gemv.cpp, test_gpu_tensor_core.cpp), so results do not
/// depend on the batch a row is in. Errors surface as launch errors (cudaGetLastError).
/// Thread-safe: no state beyond what is enqueued on `stream`.
void gemm(const DevWeight& w, const float* x, const int8_t* xq, const uint16_t* xd, int64_t m, float* y, int64_t ldy,
          bool accumulate, cudaStream_t stream, bool tensor_cores = true);

/// The most weight matrices gemm_parts() merges into one launch.
inline constexpr int kGemmMaxParts = 3;

/// Y_i = (or, with `accumulate`, +=) W_i X, then + b_i per row when bias && bias[i] (the
/// result of add_bias(Y_i, b_i) after the matmul, bit for bit), for i < count, Y_i
/// [m][w[i]->n] (row stride w[i]->n): matrices that share their input (Q, K and V with
/// their biases; gate and up). When the matrices are quantised, of one type and k,
/// count <= kGemmMaxParts and the step takes the dp4a kernels (m < kGemmTensorCoreMinRows or
/// !tensor_cores), one launch computes them all, biases included: its thread blocks are
/// split between the matrices, so the small ones (K, V under GQA) no longer run as launches
/// of a few blocks. Otherwise gemm() then add_bias() per matrix. Each Y_i is bit for bit
/// what gemm(*w[i], ...) and add_bias write (the same kernels; a block only picks its
/// matrix's pointers; tests/gpu/test_gpu_merged_matmuls.cpp). Inputs and errors as gemm().
void gemm_parts(const DevWeight* const* w, float* const* y, const float* const* bias, int count, const float* x,
                const int8_t* xq, const uint16_t* xd, int64_t m, bool accumulate, cudaStream_t stream,
                bool tensor_cores = true);

/// y row i = RMSNorm(x row src_i) * w, src_i = rows ? rows[i] : i; n elements per row,
/// x and y rows strided by n. Sum of squares in double in index order, the CPU's rms_norm_row bit for bit. In place
/// allowed (y == x, rows null).
void rms_norm(const float* x, const float* w, float* y, int64_t n_rows, int64_t n, float eps, const int32_t* rows,
              cudaStream_t stream);

/// rms_norm() then quantize_q8_0() of its output in one launch (n % 32 == 0): y as
/// rms_norm() writes it, yq [n_rows][n] and yd [n_rows][n/32] as quantize_q8_0(y, n_rows, n)
/// writes them, bit for bit (the same float operations in the same order; tested in
/// tests/gpu/test_gpu_fused.cpp). Not in place (y != x).
void rms_norm_q8_0(const float* x, const float* w, float* y, int8_t* yq, uint16_t* yd, int64_t n_rows, int64_t n,
                   float eps, const int32_t* rows, cudaStream_t stream);

/// y[r][i] += b[i] for r < n_rows, i < n.
void add_bias(float* y, const float* b, int64_t n_rows, int64_t n, cudaStream_t stream);

/// RoPE in place on x [T][n_heads][head_dim]: the first n_rot dims of each head rotated
/// by cs [T][n_rot] (cos of the n_rot/2 angles, then their sin). neox: pairs (i, i+n_rot/2),
/// else (2i, 2i+1).
void rope(float* x, const float* cs, int64_t T, int32_t n_heads, int32_t head_dim, int32_t n_rot, bool neox,
          cudaStream_t stream);

/// gate[i] = silu(gate[i]) * up[i].
void swiglu(float* gate, const float* up, int64_t n, cudaStream_t stream);

/// Entries of the GELU table geglu() reads: one per f16 bit pattern.
inline constexpr int64_t kGeluTableSize = int64_t{1} << 16;

/// gate[i] = gelu(gate[i]) * up[i] with the CPU executor's arithmetic (GELU tanh form through
/// an f16 table, ggml_geglu_split's): 0 where gate <= -10, gate * up where gate >= 10, else
/// f32(table[f16(gate)]) * up. `table`: kGeluTableSize f16 values in device memory, the
/// CPU's kernels::gelu_f16_table() uploaded as it is. Same bits as the CPU.
void geglu(float* gate, const float* up, int64_t n, const uint16_t* table, cudaStream_t stream);

/// geglu() then quantize_q8_0() of gate in one launch, as swiglu_q8_0() for SwiGLU.
void geglu_q8_0(float* gate, const float* up, int64_t n, const uint16_t* table, int8_t* hq, uint16_t* hd,
                cudaStream_t stream);

/// y[i] += x[i], i < n (the CPU's residual add of a separately computed term).
void add(float* y, const float* x, int64_t n, cudaStream_t stream);

/// x[i] *= s, i < n.
void scale(float* x, float s, int64_t n, cudaStream_t stream);

/// Final-logit soft-capping in place, x[i] = tanhf(x[i] * (1 / c)) * c (c > 0), the CPU's
/// order of operations (tanhf: the device's, within its ulp bound of the host's).
void softcap(float* x, int64_t n, float c, cudaStream_t stream);

/// swiglu() then quantize_q8_0() of gate in one launch (n % 32 == 0; for m rows of k
/// values, n = m * k with k % 32 == 0): gate, hq [n] and hd [n/32] bit for bit as the two
/// launches write them.
void swiglu_q8_0(float* gate, const float* up, int64_t n, int8_t* hq, uint16_t* hd, cudaStream_t stream);

/// Where a step's tokens read and write KV: token t's sequence has its page pointers at
/// pages[page_off[t]...] (one per page_size positions), t is at position pos[t] and
/// attends to positions [p0, pos[t]]: p0 = 0, or with a sliding window (window > 0, the
/// layer's; Gemma 3's local layers) p0 = max(0, pos[t] + 1 - window), as the CPU's
/// FlashAttnArgs::window.
struct KvArgs {
  void* const* pages = nullptr;
  const int32_t* page_off = nullptr;
  const int32_t* pos = nullptr;
  int32_t page_size = 16;
  int32_t n_head_kv = 0;
  int32_t head_dim = 0;
  int32_t layer = 0;   ///< page-local layer
  int32_t window = 0;  ///< sliding window in positions; 0: full causal attention
  bool f16 = true;
};

/// Write K and V rows ([T][n_head_kv * head_dim] floats) of layer kv.layer at each token's
/// position (f16 round-to-nearest-even, or f32).
void kv_store_rows(const KvArgs& kv, const float* k, const float* v, int64_t T, cudaStream_t stream);

/// rope(q, cs, T, n_head, kv.head_dim, n_rot, neox), rope(k, cs, T, kv.n_head_kv, ...) and
/// kv_store_rows(kv, k, v, T) in one launch (one thread block per token): q, k and the KV
/// rows bit for bit as the three launches leave them.
void rope_kv_store(const KvArgs& kv, float* q, float* k, const float* v, const float* cs, int64_t T, int32_t n_head,
                   int32_t n_rot, bool neox, cudaStream_t stream);

/// Once per device, before any attention launch on it (the current device must be
/// `device`): raises the attention kernels' dynamic shared-memory limit to the device's
/// opt-in maximum (cudaFuncSetAttribute is global per function and device) and returns in
/// *score_capacity the largest score count attention() keeps in shared memory there.
/// Returns the first CUDA error (nothing else is left pending).
cudaError_t attention_setup(int device, int32_t* score_capacity);

/// The attention kernels below (attention, attention_split, attention_prefill) all compute
/// docs/arithmetic.md's "Attention" steps 1-4 bit for bit, the CPU's attn_tiled on the same
/// q and KV: q rounded to f16 with f16 KV; each score by a warp (32 lanes of fma, the
/// butterfly 8, 16, 4, 2, 1, then the hd % 8 tail) times `scale`; the max; e =
/// softmax_exp(s - max); the sum in double over 8 lanes, their tree and the tail; w = e *
/// f32(1 / sum), rounded to f16 with f16 KV; the output per element over chunks of
/// kAttentionChunk positions from p0 (fma within a chunk, chunk partials added in order).
/// So the three give the same bits as each other and as the CPU, for any batch
/// (tests/gpu/test_gpu_attention.cpp).
inline constexpr int32_t kAttentionChunk = 64;

/// Causal GQA attention: out [T][n_head][head_dim] from q [T][n_head][head_dim] and the KV
/// pages. One thread block per (token, head). `max_pos` bounds pos[t] + 1 over the step
/// (sizes the shared score buffer); `score_capacity` is attention_setup()'s (positions past
/// it recompute their score). With `tokens` (device, T entries) only the rows t =
/// tokens[0..T) of q/out are computed (T then counts the list, not the step).
void attention(const KvArgs& kv, const float* q, float* out, int64_t T, int32_t n_head, float scale, int32_t max_pos,
               int32_t score_capacity, cudaStream_t stream, const int32_t* tokens = nullptr);

/// Partition size (positions, a multiple of kAttentionChunk) of attention_split() in the
/// executor. Partitions are counted from each token's p0, so a token's result does not
/// depend on the batch.
inline constexpr int32_t kAttentionPartition = 128;

/// Device scratch of attention_split(): for n_tokens tokens, n_head heads, max_parts =
/// ceil(max_pos / part) partitions and max_chunks = ceil(max_pos / kAttentionChunk) chunks,
/// `acc` holds n_tokens * n_head * max_chunks * head_dim floats, `max` n_tokens * n_head *
/// max_parts floats and `score` n_tokens * n_head * max_pos floats.
struct AttentionSplitScratch {
  float* acc = nullptr;
  float* max = nullptr;
  float* score = nullptr;
  int32_t part = kAttentionPartition;
};

/// Dynamic shared memory (bytes) of attention_split()'s score kernel: per tile, not per
/// sequence: group * (head_dim + part) floats. The caller uses attention() instead when
/// this exceeds 48 KiB.
size_t attention_split_shmem(int32_t head_dim, int32_t group, int32_t part);

/// Split-KV (flash-decoding) attention of the tokens t = tokens[0..n_tokens) (a device
/// list), same inputs and output rows as attention() and the same bits. Each token's
/// positions [p0, pos[t]] are split into partitions of scratch.part positions (a multiple
/// of kAttentionChunk) from p0. Four kernels: per (token, KV head, partition) the scores of
/// all n_head / n_head_kv query heads of the GQA group (each K row read once per group) and
/// the partition's max; per (token, head) the max, the exps, the sum and the probabilities;
/// per (token, KV head, partition) each chunk's V partial; per (token, head) the chunks
/// added in order. Sources: FlashDecoding (Dao, Haziza, Massa, Sizov, 2023) for the split.
/// `max_pos` bounds pos[t] + 1.
/// out_q/out_d (both non-null, head_dim % 32 == 0; otherwise ignored): the combining kernel
/// also writes the Q8_0 quantisation of each written output row, xq [T][n_head * head_dim]
/// int8 and xd [T][n_head * head_dim / 32] fp16 as quantize_q8_0(out, T, n_head * head_dim)
/// writes those rows, bit for bit (one launch less before Wo when every token of the step
/// decodes; tests/gpu/test_gpu_fused.cpp).
void attention_split(const KvArgs& kv, const float* q, float* out, const int32_t* tokens, int64_t n_tokens,
                     int32_t n_head, float scale, int32_t max_pos, const AttentionSplitScratch& scratch,
                     cudaStream_t stream, int8_t* out_q = nullptr, uint16_t* out_d = nullptr);

/// Most query tokens per tile of attention_prefill().
inline constexpr int32_t kAttentionPrefillMaxTile = 16;

/// Tile shape of attention_prefill() for a head_dim and GQA group: bq query tokens (times
/// `group` query heads) per block, bk K/V positions per shared-memory tile, and the block's
/// dynamic shared memory in bytes, (bk * (2 * head_dim + 1) + bq * group * (3 * head_dim +
/// bk + 26)) floats, at most 48 KiB (the default limit: no attribute needed). bq is the
/// largest that fits, capped at kAttentionPrefillMaxTile; bq == 0 when not even one token
/// fits (the caller then uses attention()). Pure function of its arguments; thread-safe.
struct AttentionPrefillPlan {
  int32_t bq = 0;
  int32_t bk = 0;
  size_t shmem = 0;
};
AttentionPrefillPlan attention_prefill_plan(int32_t head_dim, int32_t group);

/// Tiled prefill attention: for each tile i of `tiles` (device, n_tiles pairs (t0, nq), 1 <=
/// nq <= attention_prefill_plan(kv.head_dim, n_head / kv.n_head_kv).bq), the rows t0 .. t0 +
/// nq - 1 of q/out ([step tokens][n_head][head_dim] floats), which must be tokens of one
/// sequence (same page_off), at increasing positions; token t attends to [p0, pos[t]] of
/// its sequence's pages. One thread block per (tile, KV head) with all query heads of its
/// GQA group, so each K/V row is read from memory by one block per tile and group instead
/// of once per (token, head) as in attention(). K/V tiles of bk positions are staged in
/// shared memory as floats; three passes over them (the max; the sum's lanes; the
/// probabilities times V, each row's chunk partial kept across tiles) give attention()'s
/// bits. Source: FlashAttention-2 (Dao, 2023) for the tiling of queries and K/V.
/// Asynchronous on `stream`; no host state.
void attention_prefill(const KvArgs& kv, const float* q, float* out, const int32_t* tiles, int64_t n_tiles,
                       int32_t n_head, float scale, cudaStream_t stream);

/// Fill n floats with quiet NaN (tests).
void fill_nan(float* y, int64_t n, cudaStream_t stream);

}  // namespace tandem::kernels::cuda
