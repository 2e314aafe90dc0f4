// Internal: one table of kernel entry points per instruction set. Each ISA-specific
// translation unit (kernels_scalar.cpp, kernels_avx2.cpp, kernels_avx512.cpp) fills one;
// cpu_dispatch.cpp picks a table once (cpuid) and forwards the public API to it.
#pragma once

#include <algorithm>
#include <cstdint>

#include "cpu_kernels.hpp"
#include "quant_blocks.hpp"

namespace tandem::kernels::detail {

struct KernelTable {
  const char* name;
  void (*fp16_to_fp32_row)(const uint16_t*, float*, int64_t) noexcept;
  void (*fp32_to_fp16_row)(const float*, uint16_t*, int64_t) noexcept;
  void (*quantize_row_q8_0)(const float*, BlockQ8_0*, int64_t) noexcept;
  void (*dequantize_row_q4_0)(const BlockQ4_0*, float*, int64_t) noexcept;
  void (*dequantize_row_q8_0)(const BlockQ8_0*, float*, int64_t) noexcept;
  float (*vec_dot_q4_0_q8_0)(const BlockQ4_0*, const BlockQ8_0*, int64_t) noexcept;
  float (*vec_dot_q8_0_q8_0)(const BlockQ8_0*, const BlockQ8_0*, int64_t) noexcept;
  float (*vec_dot_f32)(const float*, const float*, int64_t) noexcept;
  float (*vec_dot_f16)(const uint16_t*, const uint16_t*, int64_t) noexcept;
  float (*vec_dot_bf16_f32)(const uint16_t*, const float*, int64_t) noexcept;
  void (*gemm_q4_0_q8_0)(const BlockQ4_0*, const BlockQ8_0*, float*, int64_t, int64_t, int64_t, int64_t,
                         int64_t) noexcept;
  void (*gemm_q8_0_q8_0)(const BlockQ8_0*, const BlockQ8_0*, float*, int64_t, int64_t, int64_t, int64_t,
                         int64_t) noexcept;
  void (*gemm_f32_f32)(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t, int64_t) noexcept;
  void (*gemm_f16_f16)(const uint16_t*, const uint16_t*, float*, int64_t, int64_t, int64_t, int64_t, int64_t) noexcept;
  void (*gemm_bf16_f32)(const uint16_t*, const float*, float*, int64_t, int64_t, int64_t, int64_t, int64_t) noexcept;
  void (*axpy_f16)(float, const uint16_t*, float*, int64_t) noexcept;
  void (*vec_dot_f16_rows)(const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t, float*) noexcept;
  void (*axpy_f16_rows)(const float*, const uint16_t*, int64_t, int64_t, float*, int64_t) noexcept;
  bool (*thread_prepare)() noexcept;
  void (*flash_attn)(const FlashAttnArgs&, float*) noexcept;
  void (*attn_tiled)(const FlashAttnArgs&, float*) noexcept;
  void (*gemm_q4_0x8_q8_0)(const BlockQ4_0x8*, const BlockQ8_0*, float*, int64_t, int64_t, int64_t, int64_t,
                           int64_t) noexcept;
  float (*vec_dot_q4_1_q8_0)(const BlockQ4_1*, const BlockQ8_0*, int64_t) noexcept;
  void (*gemm_q4_1_q8_0)(const BlockQ4_1*, const BlockQ8_0*, float*, int64_t, int64_t, int64_t, int64_t,
                         int64_t) noexcept;
  float (*vec_dot_q5_0_q8_0)(const BlockQ5_0*, const BlockQ8_0*, int64_t) noexcept;
  void (*gemm_q5_0_q8_0)(const BlockQ5_0*, const BlockQ8_0*, float*, int64_t, int64_t, int64_t, int64_t,
                         int64_t) noexcept;
  void (*gemm_q4_1x8_q8_0)(const BlockQ4_1x8*, const BlockQ8_0*, float*, int64_t, int64_t, int64_t, int64_t,
                           int64_t) noexcept;
  void (*gemm_q5_0x8_q8_0)(const BlockQ5_0x8*, const BlockQ8_0*, float*, int64_t, int64_t, int64_t, int64_t,
                           int64_t) noexcept;
  float (*vec_dot_q4_k_q8_0)(const BlockQ4_K*, const BlockQ8_0*, int64_t) noexcept;
  void (*gemm_q4_k_q8_0)(const BlockQ4_K*, const BlockQ8_0*, float*, int64_t, int64_t, int64_t, int64_t,
                         int64_t) noexcept;
  float (*vec_dot_q6_k_q8_0)(const BlockQ6_K*, const BlockQ8_0*, int64_t) noexcept;
  void (*gemm_q6_k_q8_0)(const BlockQ6_K*, const BlockQ8_0*, float*, int64_t, int64_t, int64_t, int64_t,
                         int64_t) noexcept;
  float (*vec_dot_q5_1_q8_0)(const BlockQ5_1*, const BlockQ8_0*, int64_t) noexcept;
  void (*gemm_q5_1_q8_0)(const BlockQ5_1*, const BlockQ8_0*, float*, int64_t, int64_t, int64_t, int64_t,
                         int64_t) noexcept;
  float (*vec_dot_q5_k_q8_0)(const BlockQ5_K*, const BlockQ8_0*, int64_t) noexcept;
  void (*gemm_q5_k_q8_0)(const BlockQ5_K*, const BlockQ8_0*, float*, int64_t, int64_t, int64_t, int64_t,
                         int64_t) noexcept;
  void (*gemm_q4_kx8_q8_0)(const BlockQ4_Kx8*, const BlockQ8_0*, float*, int64_t, int64_t, int64_t, int64_t,
                           int64_t) noexcept;
  void (*gemm_q6_kx8_q8_0)(const BlockQ6_Kx8*, const BlockQ8_0*, float*, int64_t, int64_t, int64_t, int64_t,
                           int64_t) noexcept;
  void (*swiglu)(float*, const float*, int64_t) noexcept;
  void (*attn_split_scores)(const FlashAttnArgs&, int64_t, int64_t, float*, int64_t, float*) noexcept;
  void (*attn_split_softmax)(const FlashAttnArgs&, float*, int64_t, const float*, int64_t) noexcept;
  void (*attn_split_wv)(const FlashAttnArgs&, int64_t, int64_t, const float*, int64_t, float*) noexcept;
  void (*geglu)(const uint16_t*, float*, const float*, int64_t) noexcept;
};

/// Per (column, block) of the activations: fp16(d) as f32 and the Q4_0 correction
/// 8 * sum(qs), the two per-column scalars of the repacked kernel (gemm_q4_0x8_q8_0), and
/// 8 * the sum of qs[0..15] (Q6_K's correction of the first 16 elements).
struct XAux {
  float dx;
  int32_t corr;
  int32_t corr_lo;
};

/// Where flash_attn's scratch parts start (in floats) for head_dim and `rows` query rows;
/// rows are padded to 16 lanes (the widest vector) so every ISA shares one layout.
struct FlashAttnLayout {
  int64_t rp = 0;                          ///< rows, padded
  size_t qt = 0;                           ///< queries transposed: [head_dim][rp]
  size_t k = 0;                            ///< one tile of K rows as f32: [kFlashAttnTile][head_dim]
  size_t v = 0;                            ///< the same for V
  size_t s = 0;                            ///< scores, then weights, of one tile: [kFlashAttnTile][rp]
  size_t o = 0;                            ///< output accumulators: [rows][head_dim]
  size_t m = 0, l = 0, corr = 0, pos = 0;  ///< per row: running max, sum, rescale, position
  size_t total = 0;
};
inline FlashAttnLayout flash_attn_scratch_layout(int64_t hd, int64_t rows) noexcept {
  FlashAttnLayout L;
  L.rp = (rows + 15) / 16 * 16;
  size_t at = 0;
  auto take = [&](int64_t n) {
    const size_t here = at;
    at += static_cast<size_t>((n + 15) / 16 * 16);
    return here;
  };
  L.qt = take(hd * L.rp);
  L.k = take(kFlashAttnTile * hd);
  L.v = take(kFlashAttnTile * hd);
  L.s = take(kFlashAttnTile * L.rp);
  L.o = take(rows * hd);
  L.m = take(L.rp);
  L.l = take(L.rp);
  L.corr = take(L.rp);
  L.pos = take(L.rp);
  L.total = at;
  return L;
}

/// Elements [e0, e0 + n) of a run of Q8_0 blocks (element e is qs[e % 32] of block e / 32)
/// to f32: y = fp16(d) * q. Exact (an 11-bit by 8-bit product), so every ISA and
/// dequantize_row_q8_0 give the same bits. `static` for the multi-ISA ODR reason in
/// quant_blocks.hpp.
static inline void q8_0_span_to_f32(const BlockQ8_0* b, int64_t e0, int64_t n, float* y) noexcept {
  int64_t i = 0;
  while (i < n) {
    const int64_t e = e0 + i;
    const BlockQ8_0& blk = b[e / kQK];
    const float d = fp16_bits_to_fp32(blk.d);
    const int64_t j0 = e % kQK;
    const int64_t m = kQK - j0 < n - i ? kQK - j0 : n - i;
    for (int64_t j = 0; j < m; ++j) y[i + j] = d * static_cast<float>(blk.qs[j0 + j]);
    i += m;
  }
}

/// attn_tiled's scratch: q rows [rows][hp] (f32, f16-rounded for an f16 cache; hp = head_dim
/// rounded up to 16), one K or V tile [kFlashAttnTile][hp], the K tile transposed
/// [hp][kFlashAttnTile], scores [rows][n_ctx], outputs and the current chunk's partial
/// outputs [rows][hp] (docs/arithmetic.md, "Attention").
struct AttnTiledLayout {
  int64_t ld = 0;  ///< scores row stride (n_ctx rounded up to 16)
  int64_t hp = 0;  ///< q, tile, output row stride (head_dim rounded up to 16)
  size_t q = 0, kv = 0, kt = 0, s = 0, o = 0, part = 0, total = 0;
};
inline AttnTiledLayout attn_tiled_scratch_layout(int64_t hd, int64_t rows, int64_t n_ctx) noexcept {
  AttnTiledLayout L;
  L.ld = (n_ctx + 15) / 16 * 16;
  L.hp = (hd + 15) / 16 * 16;
  L.q = 0;
  L.kv = L.q + size_t(rows * L.hp);
  L.kt = L.kv + size_t(kFlashAttnTile * L.hp);
  L.s = L.kt + size_t(kFlashAttnTile * L.hp);
  L.o = L.s + size_t(rows * L.ld);
  L.part = L.o + size_t(rows * L.hp);
  L.total = L.part + size_t(rows * L.hp);
  return L;
}

/// The positions a split decode call's rows see (cpu_kernels.hpp, attn_split_*): p0 .. n - 1,
/// in n_chunks chunks of kFlashAttnTile from p0.
struct AttnSplitGeom {
  int64_t p0 = 0, n = 0, n_chunks = 0;
};
inline AttnSplitGeom attn_split_geom(const FlashAttnArgs& a) noexcept {
  AttnSplitGeom g;
  g.n = int64_t{a.pos0} + 1;
  g.p0 = a.window > 0 ? std::max<int64_t>(0, g.n - a.window) : 0;
  g.n_chunks = (g.n - g.p0 + kFlashAttnTile - 1) / kFlashAttnTile;
  return g;
}
/// Position p's K or V row of the call's KV head in an f16 cache.
inline const uint16_t* attn_kv_row_f16(const FlashAttnArgs& a, const void* const* pages, int64_t p) noexcept {
  return static_cast<const uint16_t*>(pages[static_cast<size_t>(p / a.page_size)]) + (p % a.page_size) * a.row_stride +
         a.head_offset;
}
/// rows[i] = attn_kv_row_f16(a, pages, p + i) for i < n, one division for the run.
inline void attn_kv_rows_f16(const FlashAttnArgs& a, const void* const* pages, int64_t p, int64_t n,
                             const uint16_t** rows) noexcept {
  int64_t pg = p / a.page_size, off = p % a.page_size;
  for (int64_t i = 0; i < n; ++i) {
    rows[i] = static_cast<const uint16_t*>(pages[static_cast<size_t>(pg)]) + off * a.row_stride + a.head_offset;
    if (++off == a.page_size) {
      off = 0;
      ++pg;
    }
  }
}
/// One GEGLU value (cpu_kernels.hpp's geglu): 0 for g <= -10, g * u for g >= 10, else
/// f32(table[f16(g)]) * u; the scalar table's loop and the AVX tables' tail.
inline float geglu_value(const uint16_t* table, float g, float u) noexcept {
  if (g <= -10.0f) return 0.0f;
  if (g >= 10.0f) return g * u;
  return fp16_bits_to_fp32(table[fp32_to_fp16_bits(g)]) * u;
}
inline constexpr int64_t kAttnSplitMaxDim = 512;
/// cpu_kernels.hpp's attn_split_applies.
inline bool attn_split_applies(const FlashAttnArgs& a) noexcept {
  return a.n_pos == 1 && a.group >= 1 && a.kv_f16 && !a.kv_q8_0 && a.head_dim > 0 && a.head_dim % 32 == 0 &&
         a.head_dim <= kAttnSplitMaxDim;
}

const KernelTable& table_scalar() noexcept;
#if defined(TANDEM_CPU_X86)
const KernelTable& table_avx2() noexcept;        ///< AVX2 + FMA + F16C
const KernelTable& table_avx512() noexcept;      ///< AVX-512 F/BW/DQ/CD/VL + FMA + F16C
const KernelTable& table_avx512vnni() noexcept;  ///< the same + AVX512-VNNI integer dots
#endif

}  // namespace tandem::kernels::detail
