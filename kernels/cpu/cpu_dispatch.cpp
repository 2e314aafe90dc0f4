// Run-time selection of the CPU kernel table (once, lock-free) and the public entry points.
//
// Order of preference: avx512vnni (avx512 + VNNI), avx512 (F/BW/DQ/CD/VL + FMA + F16C), avx2 (AVX2 + FMA + F16C),
// scalar. The environment variable TANDEM_CPU_ISA=avx512vnni|avx512|avx2|scalar caps the choice
// (a request for an ISA the CPU lacks falls back to the best supported one).
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cpu_kernels.hpp"
#include "kernels_table.hpp"

namespace tandem::kernels {
namespace {

using detail::KernelTable;

bool cpu_has(std::string_view isa) noexcept {
  if (isa == "scalar") return true;
#if defined(TANDEM_CPU_X86)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (isa == "avx2") return avx2;
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512cd") &&
                      __builtin_cpu_supports("avx512vl");
  if (isa == "avx512") return avx512;
  if (isa == "avx512vnni") return avx512 && __builtin_cpu_supports("avx512vnni");
#endif
  return false;
}

const KernelTable* table_for(std::string_view isa) noexcept {
  if (!cpu_has(isa)) return nullptr;
#if defined(TANDEM_CPU_X86)
  if (isa == "avx512vnni") return &detail::table_avx512vnni();
  if (isa == "avx512") return &detail::table_avx512();
  if (isa == "avx2") return &detail::table_avx2();
#endif
  return &detail::table_scalar();
}

const KernelTable* best_table() noexcept {
  static constexpr std::string_view kOrder[] = {"avx512vnni", "avx512", "avx2", "scalar"};
  size_t first = 0;
  if (const char* env = std::getenv("TANDEM_CPU_ISA"); env && *env) {
    for (size_t i = 0; i < std::size(kOrder); ++i)
      if (kOrder[i] == env) first = i;
  }
  for (size_t i = first; i < std::size(kOrder); ++i)
    if (const KernelTable* t = table_for(kOrder[i])) return t;
  return &detail::table_scalar();
}

std::atomic<const KernelTable*> g_active{nullptr};

inline const KernelTable& K() noexcept {
  const KernelTable* t = g_active.load(std::memory_order_acquire);
  if (t == nullptr) [[unlikely]] {
    const KernelTable* best = best_table();  // idempotent: racing callers agree
    const KernelTable* expected = nullptr;
    t = g_active.compare_exchange_strong(expected, best, std::memory_order_acq_rel) ? best : expected;
  }
  return *t;
}

}  // namespace

std::string_view cpu_isa_name() noexcept {
  return K().name;
}

void cpu_force_scalar(bool on) noexcept {
  g_active.store(on ? &detail::table_scalar() : best_table(), std::memory_order_release);
}

bool cpu_set_isa(std::string_view isa) noexcept {
  const KernelTable* t = table_for(isa);
  if (t == nullptr) return false;
  g_active.store(t, std::memory_order_release);
  return true;
}

bool cpu_isa_supported(std::string_view isa) noexcept {
  return table_for(isa) != nullptr;
}

float fp16_to_fp32(uint16_t h) noexcept {
  return fp16_bits_to_fp32(h);
}
uint16_t fp32_to_fp16(float f) noexcept {
  return fp32_to_fp16_bits(f);
}
float bf16_to_fp32(uint16_t h) noexcept {
  return bf16_bits_to_fp32(h);
}

const uint16_t* gelu_f16_table() {
  static const std::vector<uint16_t> table = [] {
    std::vector<uint16_t> t(size_t{1} << 16);
    constexpr float kCoefA = 0.044715f;
    constexpr float kSqrt2OverPi = 0.79788456080286535587989211986876f;
    for (uint32_t h = 0; h < t.size(); ++h) {
      const float x = fp16_bits_to_fp32(static_cast<uint16_t>(h));
      const float inner = kSqrt2OverPi * x * (1.0f + kCoefA * x * x);
      t[h] = fp32_to_fp16_bits(0.5f * x * (1.0f + std::tanh(inner)));
    }
    return t;
  }();
  return table.data();
}

void fp16_to_fp32_row(const uint16_t* x, float* y, int64_t n) noexcept {
  K().fp16_to_fp32_row(x, y, n);
}
void fp32_to_fp16_row(const float* x, uint16_t* y, int64_t n) noexcept {
  K().fp32_to_fp16_row(x, y, n);
}
void quantize_row_q8_0(const float* x, BlockQ8_0* y, int64_t k) noexcept {
  K().quantize_row_q8_0(x, y, k);
}
void dequantize_row_q4_0(const BlockQ4_0* x, float* y, int64_t k) noexcept {
  K().dequantize_row_q4_0(x, y, k);
}
void dequantize_row_q8_0(const BlockQ8_0* x, float* y, int64_t k) noexcept {
  K().dequantize_row_q8_0(x, y, k);
}

float vec_dot_q4_0_q8_0(const BlockQ4_0* w, const BlockQ8_0* x, int64_t k) noexcept {
  return K().vec_dot_q4_0_q8_0(w, x, k);
}
float vec_dot_q8_0_q8_0(const BlockQ8_0* w, const BlockQ8_0* x, int64_t k) noexcept {
  return K().vec_dot_q8_0_q8_0(w, x, k);
}
float vec_dot_q4_1_q8_0(const BlockQ4_1* w, const BlockQ8_0* x, int64_t k) noexcept {
  return K().vec_dot_q4_1_q8_0(w, x, k);
}
float vec_dot_q5_0_q8_0(const BlockQ5_0* w, const BlockQ8_0* x, int64_t k) noexcept {
  return K().vec_dot_q5_0_q8_0(w, x, k);
}
float vec_dot_q4_k_q8_0(const BlockQ4_K* w, const BlockQ8_0* x, int64_t k) noexcept {
  return K().vec_dot_q4_k_q8_0(w, x, k);
}
float vec_dot_q6_k_q8_0(const BlockQ6_K* w, const BlockQ8_0* x, int64_t k) noexcept {
  return K().vec_dot_q6_k_q8_0(w, x, k);
}
float vec_dot_q5_1_q8_0(const BlockQ5_1* w, const BlockQ8_0* x, int64_t k) noexcept {
  return K().vec_dot_q5_1_q8_0(w, x, k);
}
float vec_dot_q5_k_q8_0(const BlockQ5_K* w, const BlockQ8_0* x, int64_t k) noexcept {
  return K().vec_dot_q5_k_q8_0(w, x, k);
}
float vec_dot_f32(const float* a, const float* b, int64_t n) noexcept {
  return K().vec_dot_f32(a, b, n);
}
float vec_dot_f16(const uint16_t* a, const uint16_t* b, int64_t n) noexcept {
  return K().vec_dot_f16(a, b, n);
}
float vec_dot_bf16_f32(const uint16_t* a, const float* b, int64_t n) noexcept {
  return K().vec_dot_bf16_f32(a, b, n);
}

void gemm_q4_0_q8_0(const BlockQ4_0* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                    int64_t r1) noexcept {
  K().gemm_q4_0_q8_0(w, x, y, k, m, ldy, r0, r1);
}
void gemm_q8_0_q8_0(const BlockQ8_0* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                    int64_t r1) noexcept {
  K().gemm_q8_0_q8_0(w, x, y, k, m, ldy, r0, r1);
}
void gemm_f32_f32(const float* w, const float* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                  int64_t r1) noexcept {
  K().gemm_f32_f32(w, x, y, k, m, ldy, r0, r1);
}
void gemm_f16_f16(const uint16_t* w, const uint16_t* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                  int64_t r1) noexcept {
  K().gemm_f16_f16(w, x, y, k, m, ldy, r0, r1);
}
void gemm_bf16_f32(const uint16_t* w, const float* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                   int64_t r1) noexcept {
  K().gemm_bf16_f32(w, x, y, k, m, ldy, r0, r1);
}

namespace {

/// The 8-row repack loop shared by every x8 layout: record (g, b) of `out` gets 32-element
/// block b of rows 8g .. 8g + 7 through row(record, r, block), or pad(record, r) past row
/// n. K-quants (kSub = 8 sub-blocks per GGUF block): row(record, r, block, sub-block b % 8).
template <int kSub = 1, class TB, class TO, class Row, class Pad>
void repack_x8(const TB* w, int64_t n, int64_t k, TO* out, int64_t g0, int64_t g1, Row row, Pad pad) noexcept {
  const int64_t nb = k / kQK;
  const int64_t nbw = nb / kSub;  // GGUF blocks per row
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t b = 0; b < nb; ++b) {
      TO& o = out[g * nb + b];
      for (int r = 0; r < 8; ++r) {
        if (g * 8 + r < n) {
          if constexpr (kSub == 1) {
            row(o, r, w[(g * 8 + r) * nb + b]);
          } else {
            row(o, r, w[(g * 8 + r) * nbw + b / kSub], static_cast<int>(b % kSub));
          }
        } else {
          pad(o, r);
        }
      }
    }
  }
}

/// Chunk j's 32-bit lane r of the x8 layouts' qs: the block's bytes 4j .. 4j + 3.
template <class TO>
void put_nibbles(TO& o, int r, const uint8_t* qs) noexcept {
  for (int j = 0; j < 4; ++j) std::memcpy(o.qs + 32 * j + 4 * r, qs + 4 * j, 4);
}
template <class TO>
void fill_nibbles(TO& o, int r, int byte) noexcept {
  for (int j = 0; j < 4; ++j) std::memset(o.qs + 32 * j + 4 * r, byte, 4);
}

}  // namespace

void repack_q4_0x8(const BlockQ4_0* w, int64_t n, int64_t k, BlockQ4_0x8* out, int64_t g0, int64_t g1) noexcept {
  repack_x8(
      w, n, k, out, g0, g1,
      [](BlockQ4_0x8& o, int r, const BlockQ4_0& src) {
        o.d[r] = src.d;
        put_nibbles(o, r, src.qs);
      },
      [](BlockQ4_0x8& o, int r) {  // padding row: scale 0, every weight q = 8 (value 0)
        o.d[r] = 0;
        fill_nibbles(o, r, 0x88);
      });
}
void repack_q4_1x8(const BlockQ4_1* w, int64_t n, int64_t k, BlockQ4_1x8* out, int64_t g0, int64_t g1) noexcept {
  repack_x8(
      w, n, k, out, g0, g1,
      [](BlockQ4_1x8& o, int r, const BlockQ4_1& src) {
        o.d[r] = src.d;
        o.m[r] = src.m;
        put_nibbles(o, r, src.qs);
      },
      [](BlockQ4_1x8& o, int r) {  // padding row: scale and min 0, every nibble 0
        o.d[r] = 0;
        o.m[r] = 0;
        fill_nibbles(o, r, 0);
      });
}
void repack_q5_0x8(const BlockQ5_0* w, int64_t n, int64_t k, BlockQ5_0x8* out, int64_t g0, int64_t g1) noexcept {
  repack_x8(
      w, n, k, out, g0, g1,
      [](BlockQ5_0x8& o, int r, const BlockQ5_0& src) {
        uint32_t h;
        std::memcpy(&h, src.qh, sizeof h);
        o.d[r] = src.d;
        put_nibbles(o, r, src.qs);
        for (int i = 0; i < 4; ++i) {
          uint32_t v = 0;
          for (int j = 0; j < 4; ++j)
            v |= ((h >> (4 * j + i)) & 1u) << (2 * j) | ((h >> (16 + 4 * j + i)) & 1u) << (2 * j + 1);
          o.qh[4 * r + i] = static_cast<uint8_t>(v);
        }
      },
      [](BlockQ5_0x8& o, int r) {  // padding row: scale 0, every weight q = 16 (value 0)
        o.d[r] = 0;
        fill_nibbles(o, r, 0);
        std::memset(o.qh + 4 * r, 0xFF, 4);
      });
}
void repack_q4_kx8(const BlockQ4_K* w, int64_t n, int64_t k, BlockQ4_Kx8* out, int64_t g0, int64_t g1) noexcept {
  repack_x8<kQK_K / kQK>(
      w, n, k, out, g0, g1,
      [](BlockQ4_Kx8& o, int r, const BlockQ4_K& src, int j) {
        int sc = 0, mn = 0;
        k4_scale_min(src.scales, j, sc, mn);
        o.d[r] = src.d;
        o.dmin[r] = src.dmin;
        o.sc[r] = static_cast<uint8_t>(sc);
        o.m[r] = static_cast<uint8_t>(mn);
        uint8_t qs[kQK / 2];  // sub-block j's nibbles (the low or high ones of its 32 bytes) as a Q4_0 block's
        const uint8_t* q = src.qs + 32 * (j / 2);
        const int shift = 4 * (j % 2);
        for (int l = 0; l < kQK / 2; ++l)
          qs[l] = static_cast<uint8_t>(((q[l] >> shift) & 0x0F) | (((q[l + kQK / 2] >> shift) & 0x0F) << 4));
        put_nibbles(o, r, qs);
      },
      [](BlockQ4_Kx8& o, int r) {  // padding row: every scale 0, every nibble 0
        o.d[r] = 0;
        o.dmin[r] = 0;
        o.sc[r] = 0;
        o.m[r] = 0;
        fill_nibbles(o, r, 0);
      });
}
void repack_q6_kx8(const BlockQ6_K* w, int64_t n, int64_t k, BlockQ6_Kx8* out, int64_t g0, int64_t g1) noexcept {
  repack_x8<kQK_K / kQK>(
      w, n, k, out, g0, g1,
      [](BlockQ6_Kx8& o, int r, const BlockQ6_K& src, int j) {
        o.d[r] = src.d;
        o.s[r] = src.scales[2 * j];
        o.s[8 + r] = src.scales[2 * j + 1];
        int u[kQK];  // the sub-block's weights q + 32
        for (int e = 0; e < kQK; ++e) u[e] = q6k_at(src, kQK * j + e) + 32;
        uint8_t qs[kQK / 2];  // low four bits as a Q4_0 block's
        for (int l = 0; l < kQK / 2; ++l) qs[l] = static_cast<uint8_t>((u[l] & 0x0F) | ((u[l + kQK / 2] & 0x0F) << 4));
        put_nibbles(o, r, qs);
        for (int c = 0; c < 4; ++c)
          for (int i = 0; i < 4; ++i) {
            uint8_t& h = o.qh[32 * (c / 2) + 4 * r + i];
            if (c % 2 == 0) h = 0;
            h = static_cast<uint8_t>(h | (((u[4 * c + i] >> 4) | ((u[16 + 4 * c + i] >> 4) << 2)) << (4 * (c % 2))));
          }
      },
      [](BlockQ6_Kx8& o, int r) {  // padding row: scales 0, every u = 32 (top bits 10, value 0)
        o.d[r] = 0;
        o.s[r] = 0;
        o.s[8 + r] = 0;
        fill_nibbles(o, r, 0);
        for (int p = 0; p < 2; ++p) std::memset(o.qh + 32 * p + 4 * r, 0xAA, 4);
      });
}
void gemm_q4_1_q8_0(const BlockQ4_1* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                    int64_t r1) noexcept {
  K().gemm_q4_1_q8_0(w, x, y, k, m, ldy, r0, r1);
}
void gemm_q5_0_q8_0(const BlockQ5_0* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                    int64_t r1) noexcept {
  K().gemm_q5_0_q8_0(w, x, y, k, m, ldy, r0, r1);
}
void gemm_q4_k_q8_0(const BlockQ4_K* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                    int64_t r1) noexcept {
  K().gemm_q4_k_q8_0(w, x, y, k, m, ldy, r0, r1);
}
void gemm_q6_k_q8_0(const BlockQ6_K* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                    int64_t r1) noexcept {
  K().gemm_q6_k_q8_0(w, x, y, k, m, ldy, r0, r1);
}
void gemm_q5_1_q8_0(const BlockQ5_1* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                    int64_t r1) noexcept {
  K().gemm_q5_1_q8_0(w, x, y, k, m, ldy, r0, r1);
}
void gemm_q5_k_q8_0(const BlockQ5_K* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                    int64_t r1) noexcept {
  K().gemm_q5_k_q8_0(w, x, y, k, m, ldy, r0, r1);
}
void gemm_q4_0x8_q8_0(const BlockQ4_0x8* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                      int64_t r1) noexcept {
  K().gemm_q4_0x8_q8_0(w, x, y, k, m, ldy, r0, r1);
}
void gemm_q4_1x8_q8_0(const BlockQ4_1x8* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                      int64_t r1) noexcept {
  K().gemm_q4_1x8_q8_0(w, x, y, k, m, ldy, r0, r1);
}
void gemm_q5_0x8_q8_0(const BlockQ5_0x8* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                      int64_t r1) noexcept {
  K().gemm_q5_0x8_q8_0(w, x, y, k, m, ldy, r0, r1);
}
void gemm_q4_kx8_q8_0(const BlockQ4_Kx8* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                      int64_t r1) noexcept {
  K().gemm_q4_kx8_q8_0(w, x, y, k, m, ldy, r0, r1);
}
void gemm_q6_kx8_q8_0(const BlockQ6_Kx8* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                      int64_t r1) noexcept {
  K().gemm_q6_kx8_q8_0(w, x, y, k, m, ldy, r0, r1);
}

void axpy_f16(float a, const uint16_t* x, float* y, int64_t n) noexcept {
  K().axpy_f16(a, x, y, n);
}

void swiglu(float* gate, const float* up, int64_t n) noexcept {
  K().swiglu(gate, up, n);
}
void geglu(const uint16_t* table, float* gate, const float* up, int64_t n) noexcept {
  K().geglu(table, gate, up, n);
}
bool cpu_thread_prepare() noexcept {
  return K().thread_prepare();
}
void vec_dot_f16_rows(const uint16_t* k, int64_t stride, int64_t n_rows, const uint16_t* q, int64_t n,
                      float* out) noexcept {
  K().vec_dot_f16_rows(k, stride, n_rows, q, n, out);
}
void axpy_f16_rows(const float* a, const uint16_t* x, int64_t stride, int64_t n_rows, float* y, int64_t n) noexcept {
  K().axpy_f16_rows(a, x, stride, n_rows, y, n);
}

size_t flash_attn_scratch_floats(int64_t head_dim, int64_t rows) noexcept {
  return detail::flash_attn_scratch_layout(head_dim, rows).total;
}
void flash_attn(const FlashAttnArgs& args, float* scratch) noexcept {
  K().flash_attn(args, scratch);
}
size_t attn_tiled_scratch_floats(int64_t head_dim, int64_t rows, int64_t n_ctx) noexcept {
  return detail::attn_tiled_scratch_layout(head_dim, rows, n_ctx).total;
}
void attn_tiled(const FlashAttnArgs& args, float* scratch) noexcept {
  K().attn_tiled(args, scratch);
}
bool attn_split_applies(const FlashAttnArgs& a) noexcept {
  return detail::attn_split_applies(a);
}
int64_t attn_split_chunks(const FlashAttnArgs& a) noexcept {
  return detail::attn_split_geom(a).n_chunks;
}
void attn_split_scores(const FlashAttnArgs& a, int64_t c0, int64_t c1, float* s, int64_t ld, float* row_max) noexcept {
  K().attn_split_scores(a, c0, c1, s, ld, row_max);
}
void attn_split_softmax(const FlashAttnArgs& a, float* s, int64_t ld, const float* range_max,
                        int64_t n_ranges) noexcept {
  K().attn_split_softmax(a, s, ld, range_max, n_ranges);
}
void attn_split_wv(const FlashAttnArgs& a, int64_t c0, int64_t c1, const float* s, int64_t ld, float* parts) noexcept {
  K().attn_split_wv(a, c0, c1, s, ld, parts);
}
// f32 adds element by element: the bits of attn_tiled's vector flush on every ISA.
void attn_split_combine(const FlashAttnArgs& a, const float* parts) noexcept {
  const int64_t rows = int64_t{a.group} * a.head_dim, n_chunks = attn_split_chunks(a);
  for (int64_t i = 0; i < rows; ++i) {
    float y = 0.0f;
    for (int64_t c = 0; c < n_chunks; ++c) y = y + parts[c * rows + i];
    a.out[i] = y;  // n_pos 1: row r at out + r * head_dim
  }
}

}  // namespace tandem::kernels
