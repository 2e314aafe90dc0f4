// CPU compute kernels (xsimd; AVX-512 / AVX2+FMA / scalar chosen once at run time).
//
// Conventions: matrices are row-major. A weight matrix W has n rows of k elements
// (ggml's ne = [k, n]); activations X have m rows of k elements; the output Y has m rows
// of `ldy` floats and receives Y[i, r] = dot(W[r, :], X[i, :]) for r in [r0, r1).
// Row ranges let a thread pool split the work; kernels never allocate and never lock.
// k must be a multiple of 32 for the quantised paths.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "quant_blocks.hpp"

namespace tandem::kernels {

/// Name of the instruction set the dispatcher selected ("avx512vnni", "avx512", "avx2",
/// "scalar"). The SIMD ones compute the same bits (one 256-bit arithmetic, kernels_simd.hpp).
std::string_view cpu_isa_name() noexcept;
/// Force the scalar implementation (tests compare it with the SIMD one). Not thread-safe:
/// call before any kernel runs.
void cpu_force_scalar(bool on) noexcept;
/// Select one ISA ("avx512", "avx2", "scalar") if this CPU supports it; false otherwise
/// (selection unchanged). For tests and benchmarks; same thread-safety caveat as above.
/// The environment variable TANDEM_CPU_ISA caps the automatic choice the same way.
bool cpu_set_isa(std::string_view isa) noexcept;
bool cpu_isa_supported(std::string_view isa) noexcept;

/// Give the calling thread the scratch the kernels need (once per thread; later calls are
/// cheap). After it, no kernel call on this thread allocates for any shape whose packed
/// activations fit 1 MiB. Returns false when that memory cannot be had.
bool cpu_thread_prepare() noexcept;

float fp16_to_fp32(uint16_t h) noexcept;
uint16_t fp32_to_fp16(float f) noexcept;  ///< round to nearest even, as F16C
float bf16_to_fp32(uint16_t h) noexcept;

/// ggml's GELU (tanh form) as its CPU backend computes it in a GEGLU (GGML_GELU_FP16): 65536
/// entries, entry h = f16(gelu(x)) for the f16 value x of bit pattern h, the formula in f32
/// (docs/arithmetic.md). Built once, on first use (thread-safe static; std::bad_alloc if
/// there is no memory for it); the CPU executor reads it and the GPU executor uploads it.
const uint16_t* gelu_f16_table();
/// GEGLU in place with that table (ggml_geglu_split's arithmetic): gate[i] = 0 for gate[i]
/// <= -10, gate[i] * up[i] for gate[i] >= 10, else f32(table[f16(gate[i])]) * up[i], for
/// i < n. The same bits on every ISA (the f16 conversions are exact or round to nearest
/// even, as F16C).
void geglu(const uint16_t* table, float* gate, const float* up, int64_t n) noexcept;

void fp16_to_fp32_row(const uint16_t* x, float* y, int64_t n) noexcept;
void fp32_to_fp16_row(const float* x, uint16_t* y, int64_t n) noexcept;

/// Quantise `k` floats (k % 32 == 0) to Q8_0 exactly as ggml's x86 path does:
/// amax = max|x|, d = amax / 127 stored as fp16, q = round-half-even(x * (127 / amax)),
/// all-zero block -> d = 0, q = 0.
void quantize_row_q8_0(const float* x, BlockQ8_0* y, int64_t k) noexcept;

void dequantize_row_q4_0(const BlockQ4_0* x, float* y, int64_t k) noexcept;
void dequantize_row_q8_0(const BlockQ8_0* x, float* y, int64_t k) noexcept;

/// Edge blocks (identical on every ISA): a block with scale d = 0 contributes exactly 0
/// for any finite partner; subnormal and max (0x7BFF = 65504) fp16 scales are used exactly
/// as the arithmetic says. Inf/NaN scales are NOT filtered here: they propagate per IEEE
/// into every output the block touches. Dequantisation gives +-Inf (NaN where q == 8) or
/// NaN exactly; a dot product is the same non-finite value on every ISA and the GPU
/// (a block's whole integer dot is scaled: an Inf scale gives +-Inf, Inf * 0 = NaN). The
/// GGUF loader refuses non-finite scales up front (field case B07,
/// TANDEM_E_TENSOR_NONFINITE), so models never reach this.
///
/// The quantised dot arithmetic (docs/arithmetic.md; every Q4_0/Q8_0 kernel below, on every
/// ISA, repacked or not, and the GPU's dp4a and Tensor Core kernels): for block b,
///   p_b = (f32(d_w) * f32(d_x)) * f32(S_b),  S_b = sum_j q_w[j] * q_x[j] exact in i32
/// (Q4_0: q_w = nibble - 8); lane i < 32 sums a_i = (((0 + p_i) + p_{i+32}) + ...) in
/// block order; then a_l = a_l + a_{l+o} for o = 16, 8, 4, 2, 1 and l < o; the dot is a_0.
/// Every product and sum is rounded to f32 (no FMA). Results are bit-identical across
/// ISAs, tile shapes, row ranges and threads, and batch-invariant (column i of a GEMM
/// equals the m == 1 call on it).
/// Dot product of one Q4_0 row and one Q8_0 row of k elements (the arithmetic above).
float vec_dot_q4_0_q8_0(const BlockQ4_0* w, const BlockQ8_0* x, int64_t k) noexcept;
float vec_dot_q8_0_q8_0(const BlockQ8_0* w, const BlockQ8_0* x, int64_t k) noexcept;
/// Q4_1 weights (the file's own blocks, not converted) x Q8_0 activations: the same lanes
/// and tree, with block b's term p_b = ((d_w * d_x) * f32(S_b)) + ((m_w * d_x) * f32(T_b)),
/// S_b = sum_j q_w[j] * q_x[j] (q_w = the nibble, 0..15) and T_b = sum_j q_x[j], both exact
/// in i32 (docs/arithmetic.md).
float vec_dot_q4_1_q8_0(const BlockQ4_1* w, const BlockQ8_0* x, int64_t k) noexcept;
/// Q5_0 weights (the file's own blocks) x Q8_0 activations: the arithmetic above with
/// q_w = the 5-bit value - 16.
float vec_dot_q5_0_q8_0(const BlockQ5_0* w, const BlockQ8_0* x, int64_t k) noexcept;
/// Q4_K weights (the file's own 256-element blocks; k a multiple of 256) x Q8_0
/// activations: Q8_0 block b meets sub-block j = b % 8 of weight block b / 8, with its
/// 6-bit scale sc_j and min m_j, and p_b = ((d * d_x) * f32(sc_j * S_b)) - ((dmin * d_x) *
/// f32(m_j * T_b)), S_b over the nibbles (0..15), T_b = sum_j q_x[j]; the integer products
/// are exact in i32 and f32 (< 2^24). Lanes and tree as above (docs/arithmetic.md).
float vec_dot_q4_k_q8_0(const BlockQ4_K* w, const BlockQ8_0* x, int64_t k) noexcept;
/// Q6_K weights (256-element blocks; k a multiple of 256) x Q8_0 activations: Q8_0 block b
/// covers the 16-element sub-blocks 2j, 2j + 1 (j = b % 8) of weight block b / 8, with int8
/// scales s0, s1, and p_b = (d * d_x) * f32(s0 * S_lo + s1 * S_hi), S_lo / S_hi the exact
/// dots of elements 0-15 / 16-31 (q = the 6-bit value - 32); the integer is exact and
/// below 2^24 in magnitude. Lanes and tree as above.
float vec_dot_q6_k_q8_0(const BlockQ6_K* w, const BlockQ8_0* x, int64_t k) noexcept;
/// Q5_1: the Q4_1 arithmetic with q_w = the 5-bit value (0..31).
float vec_dot_q5_1_q8_0(const BlockQ5_1* w, const BlockQ8_0* x, int64_t k) noexcept;
/// Q5_K: the Q4_K arithmetic with q_w = the 5-bit value (0..31): |sc_j * S_b| <= 63 * 32 *
/// 31 * 127 = 7936992 < 2^24, still exact.
float vec_dot_q5_k_q8_0(const BlockQ5_K* w, const BlockQ8_0* x, int64_t k) noexcept;
float vec_dot_f32(const float* a, const float* b, int64_t n) noexcept;
float vec_dot_f16(const uint16_t* a, const uint16_t* b, int64_t n) noexcept;  ///< f32 accumulate
float vec_dot_bf16_f32(const uint16_t* a, const float* b, int64_t n) noexcept;

/// Y[i, r] for i < m, r0 <= r < r1. W: n x k Q4_0 (k/32 blocks per row, row-major).
/// X: m x k, already quantised to Q8_0. Tiled over rows and columns so each weight block
/// is loaded once per column tile (the prefill path); m == 1 is the decode GEMV.
void gemm_q4_0_q8_0(const BlockQ4_0* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                    int64_t r1) noexcept;
void gemm_q8_0_q8_0(const BlockQ8_0* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                    int64_t r1) noexcept;
void gemm_q4_1_q8_0(const BlockQ4_1* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                    int64_t r1) noexcept;
void gemm_q5_0_q8_0(const BlockQ5_0* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                    int64_t r1) noexcept;
/// W: n x k Q4_K / Q6_K (k / 256 blocks per row), k a multiple of 256; otherwise as above.
void gemm_q4_k_q8_0(const BlockQ4_K* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                    int64_t r1) noexcept;
void gemm_q6_k_q8_0(const BlockQ6_K* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                    int64_t r1) noexcept;
/// W: n x k Q5_1 (k / 32 blocks per row) or Q5_K (k / 256, k a multiple of 256).
void gemm_q5_1_q8_0(const BlockQ5_1* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                    int64_t r1) noexcept;
void gemm_q5_k_q8_0(const BlockQ5_K* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                    int64_t r1) noexcept;
/// Q4_0 weights repacked 8 rows at a time for the SIMD kernel below (the interleaving
/// idea of ggml's q4_0_8x8 repack; this layout is Tandem's own). A matrix of n rows and
/// nb = k / 32 blocks per row becomes ceil(n / 8) groups of nb records, group g's record b
/// at index g * nb + b, holding block b of rows 8g .. 8g + 7:
///   d[r]              fp16 scale of row 8g + r;
///   qs[32j + 4r + i]  Q4_0 byte qs[4j + i] of row 8g + r (j, i < 4): 32-bit lane r of
///                     32-byte chunk j holds row r's weights 4j..4j+3 (low nibbles) and
///                     16+4j..16+4j+3 (high nibbles).
/// Rows past n (the last group's padding) have d = 0 and all weights 0 (q = 8).
struct BlockQ4_0x8 {
  uint16_t d[8];
  uint8_t qs[128];
};
static_assert(sizeof(BlockQ4_0x8) == 144, "8 Q4_0 blocks: 8 scales + 128 bytes");

/// Q4_1 weights repacked as BlockQ4_0x8 is, each row's fp16 min beside its scale:
///   d[r], m[r]  fp16 scale and min of row 8g + r;
///   qs          as BlockQ4_0x8's (here the nibbles are q itself, 0..15).
/// Rows past n have d = m = 0 and all nibbles 0.
struct BlockQ4_1x8 {
  uint16_t d[8];
  uint16_t m[8];
  uint8_t qs[128];
};
static_assert(sizeof(BlockQ4_1x8) == 160, "8 Q4_1 blocks: 8 scales + 8 mins + 128 bytes");

/// Q5_0 weights repacked as BlockQ4_0x8 is (qs: each weight's low four bits), with the
/// fifth bits beside the bytes of qs they complete:
///   qh[4r + i]  bit 2j: the fifth bit of row 8g + r's weight 4j + i, bit 2j + 1: of its
///               weight 16 + 4j + i (j < 4: the weights of qs[32j + 4r + i]).
/// Rows past n have d = 0 and every weight q = 16 (value 0). As many bytes as the GGUF blocks.
struct BlockQ5_0x8 {
  uint16_t d[8];
  uint8_t qh[32];
  uint8_t qs[128];
};
static_assert(sizeof(BlockQ5_0x8) == 176, "8 Q5_0 blocks: 8 scales + 32 fifth-bit bytes + 128 bytes");

/// Q4_K weights repacked 8 rows and one 32-element sub-block at a time (record b of group g
/// holds sub-block b % 8 of super-block b / 8 of rows 8g .. 8g + 7):
///   d[r], dmin[r]  fp16 super-block scale and min scale of row 8g + r;
///   sc[r], m[r]    its 6-bit sub-block scale and min (k4_scale_min);
///   qs             as BlockQ4_0x8's, the sub-block's 32 nibbles q (0..15) laid out as a
///                  Q4_0 block's (weight l < 16: low nibble of byte l, l >= 16: high of l - 16).
/// Rows past n have d = dmin = 0, sc = m = 0 and all nibbles 0. 22 bytes per row and 32
/// weights (the GGUF blocks: 18).
struct BlockQ4_Kx8 {
  uint16_t d[8];
  uint16_t dmin[8];
  uint8_t sc[8];
  uint8_t m[8];
  uint8_t qs[128];
};
static_assert(sizeof(BlockQ4_Kx8) == 176, "8 Q4_K sub-blocks: 8 scales, mins, sub-scales, sub-mins + 128 bytes");

/// Q6_K weights repacked 8 rows and one 32-element sub-block at a time (record b of group g
/// holds elements 32 (b % 8) .. + 31 of super-block b / 8 of rows 8g .. 8g + 7), each
/// weight as u = q + 32 (0..63):
///   d[r]              fp16 super-block scale of row 8g + r;
///   s[r], s[8 + r]    its int8 scales of the sub-block's elements 0-15 and 16-31;
///   qs                as BlockQ4_0x8's, the low four bits of u;
///   qh[32p + 4r + i]  u's top two bits of row r's weights 4c + i (bits 0-1), 16 + 4c + i
///                     (bits 2-3) for chunk c = 2p, and the same for c = 2p + 1 (bits 4-7).
/// Rows past n have d = 0, scales 0 and every u = 32 (value 0). 28 bytes per row and 32
/// weights (the GGUF blocks: 26.25).
struct BlockQ6_Kx8 {
  uint16_t d[8];
  int8_t s[16];
  uint8_t qs[128];
  uint8_t qh[64];
};
static_assert(sizeof(BlockQ6_Kx8) == 224, "8 Q6_K sub-blocks: 8 scales, 16 sub-scales, 128 + 64 bytes");

/// Number of records repack_q4_0x8 (or any x8 repack) writes for n rows of k elements.
inline int64_t q4_0x8_records(int64_t n, int64_t k) noexcept {
  return (n + 7) / 8 * (k / kQK);
}
/// Repacks groups [g0, g1) of the n x k Q4_0 matrix w (row-major GGUF blocks) into out
/// (q4_0x8_records(n, k) records in all; a pool splits the groups). k % 32 == 0.
void repack_q4_0x8(const BlockQ4_0* w, int64_t n, int64_t k, BlockQ4_0x8* out, int64_t g0, int64_t g1) noexcept;
/// Y[i, r] for i < m, r0 <= r < r1 over repacked weights (w: all groups of the matrix).
/// The quantised dot arithmetic above: the same bits as gemm_q4_0_q8_0 on the GGUF
/// blocks, on every ISA. Any r0 works; r0 % 8 == 0 avoids recomputing a shared group. Does not allocate once
/// cpu_thread_prepare() ran (for k up to 2^20). Thread-safe for disjoint outputs.
void gemm_q4_0x8_q8_0(const BlockQ4_0x8* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                      int64_t r1) noexcept;
/// repack_q4_0x8 and gemm_q4_0x8_q8_0 for Q4_1 weights: the same bits as gemm_q4_1_q8_0
/// on the GGUF blocks (its p_b, T_b = corr / 8 of the activations' 8 * sum(x)).
void repack_q4_1x8(const BlockQ4_1* w, int64_t n, int64_t k, BlockQ4_1x8* out, int64_t g0, int64_t g1) noexcept;
void gemm_q4_1x8_q8_0(const BlockQ4_1x8* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                      int64_t r1) noexcept;
/// The same for Q5_0 weights: the bits of gemm_q5_0_q8_0 on the GGUF blocks.
void repack_q5_0x8(const BlockQ5_0* w, int64_t n, int64_t k, BlockQ5_0x8* out, int64_t g0, int64_t g1) noexcept;
void gemm_q5_0x8_q8_0(const BlockQ5_0x8* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                      int64_t r1) noexcept;
/// The same for Q4_K weights (k a multiple of 256): the bits of gemm_q4_k_q8_0 on the
/// GGUF blocks (its p_b, T_b = corr / 8 of the activations' 8 * sum(x)).
void repack_q4_kx8(const BlockQ4_K* w, int64_t n, int64_t k, BlockQ4_Kx8* out, int64_t g0, int64_t g1) noexcept;
void gemm_q4_kx8_q8_0(const BlockQ4_Kx8* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                      int64_t r1) noexcept;
/// The same for Q6_K weights (k a multiple of 256): the bits of gemm_q6_k_q8_0 on the
/// GGUF blocks.
void repack_q6_kx8(const BlockQ6_K* w, int64_t n, int64_t k, BlockQ6_Kx8* out, int64_t g0, int64_t g1) noexcept;
void gemm_q6_kx8_q8_0(const BlockQ6_Kx8* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                      int64_t r1) noexcept;
/// F32 weights x F32 activations.
void gemm_f32_f32(const float* w, const float* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                  int64_t r1) noexcept;
/// F16 weights x activations already rounded to F16 (as ggml does), f32 accumulate.
void gemm_f16_f16(const uint16_t* w, const uint16_t* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                  int64_t r1) noexcept;
/// BF16 weights x F32 activations.
void gemm_bf16_f32(const uint16_t* w, const float* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                   int64_t r1) noexcept;

/// y += a * x over n elements, x in fp16 (attention's V accumulation).
void axpy_f16(float a, const uint16_t* x, float* y, int64_t n) noexcept;

/// SwiGLU (Shazeer 2020, arXiv:2002.05202) in place: gate[i] = silu(gate[i]) * up[i] for i < n,
/// silu the written one of softmax_exp.hpp (the same bits on every ISA and the GPU; the
/// ISA paths run its steps with the hardware's fma, 8 lanes at a time).
void swiglu(float* gate, const float* up, int64_t n) noexcept;

/// Attention over one KV page: out[r] = vec_dot_f16(k + r * stride, q, n) for r < n_rows
/// (rows `stride` elements apart), and y += sum over r of a[r] * x[r * stride .. + n] in
/// row order. Bit-identical to the per-row calls, without a dispatch per row.
void vec_dot_f16_rows(const uint16_t* k, int64_t stride, int64_t n_rows, const uint16_t* q, int64_t n,
                      float* out) noexcept;
void axpy_f16_rows(const float* a, const uint16_t* x, int64_t stride, int64_t n_rows, float* y, int64_t n) noexcept;

/// Tiled ("flash") causal attention of one sequence's query rows that share one KV head,
/// over a paged KV cache (FlashAttention-2's online softmax: Dao, arXiv:2307.08691).
///
/// KV: the K row of absolute position p for this KV head is
///   k_pages[p / page_size] + (p % page_size) * row_stride + head_offset
/// (elements: uint16_t f16 bits when kv_f16, else float), V likewise with v_pages.
/// Queries: n_pos consecutive positions pos0 .. pos0 + n_pos - 1, each with `group` heads;
/// the query of (position i, head g) is q + i * q_stride + g * head_dim (f32; rounded to
/// f16 first when kv_f16, as ggml does), its output goes to out with the same indexing.
/// Position p attends to KV positions 0..p, which must all be written.
///
/// Numerics (f32 throughout, scores s = dot(q, k) * scale): the KV positions are taken in
/// tiles of kFlashAttnTile aligned to absolute position 0; per tile and query row the
/// running max m, the sum l and the output O are updated: m' = max(m, tile max),
/// c = exp(m - m'), l' = l * c + sum exp(s - m'), O' = O * c + sum exp(s - m') * v (in
/// position order), out = O / l at the end. Every query row's result depends only on its
/// own position, q and the KV — not on pos0, n_pos, group, page_size or the thread — so
/// batching and prompt chunking leave it bit-identical (batch invariance). ISAs differ in
/// the last bits (vectorised exp; FMA vs separate multiply-add).
///
/// Each K and V row of the range is read once per call for all n_pos * group query rows.
/// `scratch` must hold flash_attn_scratch_floats(head_dim, n_pos * group) floats; the call
/// does not allocate. Thread-safe for distinct scratch and outputs.
inline constexpr int64_t kFlashAttnTile = 64;
struct FlashAttnArgs {
  const void* const* k_pages = nullptr;
  const void* const* v_pages = nullptr;
  int64_t page_size = 0;
  int64_t row_stride = 0;   ///< elements between consecutive positions' rows in a page
  int64_t head_offset = 0;  ///< elements from a row's start to this KV head
  bool kv_f16 = true;
  /// K/V are Q8_0 blocks (kv_f16 is then ignored): element e of a page (the same element
  /// indexing as above; row_stride must be a multiple of 32) is qs[e % 32] of the page's
  /// block e / 32, value fp16(d) * q. attn_tiled only; flash_attn does not take it.
  bool kv_q8_0 = false;
  int64_t head_dim = 0;
  const float* q = nullptr;
  float* out = nullptr;
  int64_t q_stride = 0;  ///< floats between consecutive positions' query (and output) rows
  int32_t pos0 = 0;
  int32_t n_pos = 0;
  int32_t group = 1;
  float scale = 1.0f;
  /// Sliding window (attn_tiled only; flash_attn ignores it): > 0, position p attends to
  /// KV positions max(0, p - window + 1) .. p only (llama.cpp's LLAMA_SWA_TYPE_STANDARD:
  /// key p0 is masked for query p1 when p1 - p0 >= window); 0: to every position 0 .. p.
  /// A windowed row's result is the full-attention result over its window's positions
  /// (the same arithmetic, starting at the window's first position), so it stays batch-
  /// and chunk-invariant; positions before the window are never read (their pages may be
  /// null).
  int32_t window = 0;
};
size_t flash_attn_scratch_floats(int64_t head_dim, int64_t rows) noexcept;
void flash_attn(const FlashAttnArgs& args, float* scratch) noexcept;

/// The same tiled causal attention (same arguments, one read of each K and V row per call
/// for all n_pos * group query rows) with the written attention arithmetic
/// (docs/arithmetic.md, "Attention"): per row, every score s[p] = dot(k[p], f16(q)) * scale
/// first (the dot: 32 lanes and their fixed tree, the keys as vector lanes), then m = max s,
/// e = softmax_exp(s - m), the sum in double, w = f16(e * float(1 / sum)), and per output
/// element an fma chain over each chunk of kFlashAttnTile positions counted from the row's
/// first position, the chunks added in order. The f16 rounding of w is what llama.cpp's
/// reference logits (tests/test_golden.cpp) contain, so this is the executor's kernel
/// (args.window limits each row to its last `window` positions: the max, the sum and the
/// chunks start there); flash_attn's online softmax keeps w in f32 and lands outside those
/// tolerances. f32 and q8_0 KV: q and w stay f32 (q8_0 rows are dequantised exactly to f32
/// in the tile scratch, so q8_0 KV is the f32 path on the dequantised values). Every ISA
/// gives the same bits. Batch-invariant in the same sense as flash_attn. `scratch`:
/// attn_tiled_scratch_floats(head_dim, n_pos * group, pos0 + n_pos) floats.
size_t attn_tiled_scratch_floats(int64_t head_dim, int64_t rows, int64_t n_ctx) noexcept;
void attn_tiled(const FlashAttnArgs& args, float* scratch) noexcept;

/// A decode step's attn_tiled split over its keys, so that several threads share one long
/// sequence (flash decoding: Dao, Haziza, Massa, Sizov, "Flash-Decoding for long-context
/// inference", 2023). Same arguments and the same bits as attn_tiled: the phases below run
/// its written arithmetic with the keys in ranges, and put the order-dependent steps (the
/// max's combination, the double sum, the chunks' sum) in one call each.
///
/// Applies (attn_split_applies) to one query position (n_pos 1) over an f16 cache with
/// head_dim a multiple of 32, at most 512. Its R = group rows see the positions
/// p0 .. pos0 (p0 = pos0 + 1 - window with a window, else 0); chunk c is positions
/// p0 + c * kFlashAttnTile .. (attn_split_chunks chunks, the last one partial). Scores and
/// weights live in s, row r at s + r * ld (ld >= pos0 + 1); parts hold one chunk's partial
/// outputs, chunk c at parts + c * group * head_dim, row r head_dim floats at r * head_dim.
///  1. attn_split_scores(a, c0, c1, s, ld, row_max): s[r * ld + p] = dot(k[p], f16(q_r)) *
///     scale for the positions of chunks [c0, c1); row_max[r] = their max (-inf: none).
///  2. attn_split_softmax(a, s, ld, range_max, n_ranges): per row, m = the max of
///     range_max[i * group + r] over i < n_ranges (phase 1's row_max of every range), then
///     the written softmax; s holds the f16-rounded weights after it.
///  3. attn_split_wv(a, c0, c1, s, ld, parts): chunk c's partial outputs (an fma chain over
///     its positions in order, from 0) for every c in [c0, c1).
///  4. attn_split_combine(a, parts): out = ((0 + part_0) + part_1) + ... in chunk order.
/// Phases 1 and 3 may run concurrently over disjoint chunk ranges; each phase needs the
/// previous one finished. No allocation, no scratch beyond s, row_max and parts.
bool attn_split_applies(const FlashAttnArgs& args) noexcept;
int64_t attn_split_chunks(const FlashAttnArgs& args) noexcept;
void attn_split_scores(const FlashAttnArgs& args, int64_t c0, int64_t c1, float* s, int64_t ld,
                       float* row_max) noexcept;
void attn_split_softmax(const FlashAttnArgs& args, float* s, int64_t ld, const float* range_max,
                        int64_t n_ranges) noexcept;
void attn_split_wv(const FlashAttnArgs& args, int64_t c0, int64_t c1, const float* s, int64_t ld,
                   float* parts) noexcept;
void attn_split_combine(const FlashAttnArgs& args, const float* parts) noexcept;

}  // namespace tandem::kernels
