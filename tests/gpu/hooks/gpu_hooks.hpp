// Test-only harnesses of the GPU executor's kernels (the tandem_gpu_test_hooks target, CUDA
// builds only): each uploads host data, runs kernels/cuda launches as the executor does and
// copies the results back, so tests/gpu can compare them with CPU references.
#pragma once

#include <cstdint>
#include <vector>

#include "tandem/gguf/gguf.hpp"

namespace tandem::gpu_testing {

/// Field case B09 harness: y[m][n] = W x^T on the device, W [n][k] Q4_0 blocks, x [m][k]
/// floats quantised to Q8_0 on the device; the device output is filled with NaN first.
/// Throws Error(kInvalidArgument) without a device.
void gemm_q4_0(const void* w_blocks, int64_t n, int64_t k, const float* x, int64_t m, float* y, int device = 0);
/// Quantised GEMM on given blocks: W [n rows of k] GGUF blocks of `wtype` (Q4_0, Q8_0, Q4_1,
/// Q5_0, Q5_1, Q4_K, Q5_K or Q6_K, uploaded as the executor does), X [m][k/32] GGUF Q8_0 blocks taken as they are (any
/// int8, -128 included); y [m][n] floats from kernels/cuda gemm() with `tensor_cores` as
/// passed (the Tensor Core kernel for m >= 16 when true, the dp4a kernels otherwise). The
/// device output is NaN-filled first. Throws Error(kInvalidArgument) without a device, for
/// k % 32 != 0 (a K-quant: k % 256 != 0) or another weight type.
void gemm_q8_blocks(GgmlType wtype, const void* w_blocks, int64_t n, int64_t k, const void* x_blocks, int64_t m,
                    bool tensor_cores, float* y, int device = 0);
/// Several weight matrices times the same activations, as gemm_q8_blocks: w_blocks[i] with
/// n[i] rows (all of `wtype`), y[i] resized to [m][n[i]], plus
/// bias[i] ([n[i]] floats; none when `bias` or bias[i] is empty) on every row. merged: one
/// kernels/cuda gemm_parts() call; else gemm() then add_bias() per matrix. Device outputs
/// NaN-filled first. Throws Error(kInvalidArgument) without a device, for k % 32 != 0,
/// n[i] < 1, m < 1, w_blocks and n of different sizes, or biases of the wrong counts.
void gemm_parts_q8_blocks(GgmlType wtype, const std::vector<const void*>& w_blocks, const std::vector<int64_t>& n,
                          int64_t k, const void* x_blocks, int64_t m, bool merged, bool tensor_cores,
                          std::vector<std::vector<float>>& y, const std::vector<std::vector<float>>& bias = {},
                          int device = 0);
/// The calling thread's current CUDA device (cudaGetDevice), and setting it.
int current_device();
void set_current_device(int device);
/// Q8_0 quantisation of x [m][k] on the device, returned as GGUF Q8_0 blocks (34 bytes each).
void quantize_q8_0(const float* x, int64_t m, int64_t k, void* blocks_out, int device = 0);
/// Decode attention harness: lens.size() sequences, sequence s holding positions
/// [0, lens[s]) and querying at position lens[s] - 1. k, v: the sequences' rows one after
/// another, [sum lens][n_head_kv * head_dim] floats (stored to the pages as f16 when `f16`);
/// q, out: [lens.size()][n_head][head_dim]. Pages of page_size positions, two layers, rows in
/// layer 1, page pointers in reverse allocation order. part > 0: flash-decoding
/// (attention_split) with partitions of `part` positions (a multiple of
/// kAttentionChunk); part == 0: attention(). window: KvArgs::window (0: full attention).
/// page_shift: bytes every page starts past a 16-byte aligned address (a multiple of the
/// KV element size, below 16; non-zero exercises the kernels' element-wise loads).
/// q8_blocks_out (part > 0, head_dim % 32 == 0): also the Q8_0 blocks the split kernels'
/// fused quantisation writes for `out` ([lens.size()][n_head * head_dim / 32] GGUF blocks).
/// Output filled with NaN first. Throws Error(kInvalidArgument) without a device, for a
/// bad page_shift or a q8_blocks_out the shape does not allow.
void attention_decode(int32_t n_head, int32_t n_head_kv, int32_t head_dim, int32_t page_size, bool f16,
                      const std::vector<int32_t>& lens, const float* q, const float* k, const float* v, float* out,
                      int32_t part, int32_t page_shift = 0, void* q8_blocks_out = nullptr, int device = 0,
                      int32_t window = 0);
/// Prefill attention harness: sequence s holds positions [0, lens[s]) (k, v as in
/// attention_decode) and queries with its last chunks[s] positions, [lens[s] - chunks[s],
/// lens[s]) (a later chunk of a prompt when chunks[s] < lens[s]); q, out: [sum chunks][n_head]
/// [head_dim], sequence by sequence, all in one launch. tiled: the tiled flash-attention
/// kernel (attention_prefill, tiles of its plan's bq tokens, the last one partial); else
/// attention(). Pages (and page_shift, window) as in attention_decode. Output NaN-filled first.
/// Throws Error(kInvalidArgument) without a device, for chunks outside [1, lens[s]], a bad
/// page_shift, or (tiled) when no tile fits the shape.
void attention_prefill(int32_t n_head, int32_t n_head_kv, int32_t head_dim, int32_t page_size, bool f16,
                       const std::vector<int32_t>& lens, const std::vector<int32_t>& chunks, const float* q,
                       const float* k, const float* v, float* out, bool tiled, int32_t page_shift = 0, int device = 0,
                       int32_t window = 0);
/// Fused-kernel harnesses (tests/gpu/test_gpu_fused.cpp): with `fused` the one-launch
/// kernel, else the separate launches it replaces; device outputs are NaN- or 0x5A-filled
/// first. Throw Error(kInvalidArgument) without a device.
/// RMSNorm of rows of x ([n_x_rows][n]; row i of the output is x row rows[i], or i when
/// `rows` is empty) times w [n], then Q8_0 of the result (n % 32 == 0): y [m][n] floats,
/// blocks_out [m][n/32] GGUF Q8_0 blocks, m = rows.empty() ? n_x_rows : rows.size().
void rms_norm_q8_0(const float* x, const float* w, int64_t n_x_rows, int64_t n, float eps,
                   const std::vector<int32_t>& rows, bool fused, float* y, void* blocks_out, int device = 0);
/// h = silu(gate) * up over n values (n % 32 == 0), then Q8_0: h [n], blocks_out [n/32].
void swiglu_q8_0(const float* gate, const float* up, int64_t n, bool fused, float* h, void* blocks_out, int device = 0);
/// h = gelu(gate) * up over n values (n % 32 == 0) with kernels::gelu_f16_table() uploaded
/// (cuda geglu / geglu_q8_0), then Q8_0: h [n], blocks_out [n/32].
void geglu_q8_0(const float* gate, const float* up, int64_t n, bool fused, float* h, void* blocks_out, int device = 0);
/// RoPE of q [T][n_head][head_dim] and k [T][n_head_kv][head_dim] (in place, by cs [T][n_rot]:
/// cos of the n_rot/2 angles then their sin) and the K/V rows stored at each token's slot:
/// token t is position pos[t] of sequence seq[t] (seq non-decreasing from 0); sequence s owns
/// ceil((max pos of s + 1) / page_size) pages of two layers, rows written to layer 1.
/// pages_out: every page's bytes (pages 0x5A-filled first), sequence by sequence.
void rope_kv_store(int32_t n_head, int32_t n_head_kv, int32_t head_dim, int32_t n_rot, bool neox, int32_t page_size,
                   bool f16, const std::vector<int32_t>& seq, const std::vector<int32_t>& pos, float* q, float* k,
                   const float* v, const float* cs, std::vector<uint8_t>& pages_out, bool fused, int device = 0);

}  // namespace tandem::gpu_testing
