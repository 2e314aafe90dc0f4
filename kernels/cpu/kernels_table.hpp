// Internal: one table of kernel entry points per instruction set. Each ISA-specific
// translation unit (kernels_scalar.cpp, kernels_avx2.cpp, kernels_avx512.cpp) fills one;
// cpu_dispatch.cpp picks a table once (cpuid) and forwards the public API to it.
#pragma once

#include <cstdint>

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
};

const KernelTable& table_scalar() noexcept;
#if defined(TANDEM_CPU_X86)
const KernelTable& table_avx2() noexcept;        ///< AVX2 + FMA + F16C
const KernelTable& table_avx512() noexcept;      ///< AVX-512 F/BW/DQ/CD/VL + FMA + F16C
const KernelTable& table_avx512vnni() noexcept;  ///< the same + AVX512-VNNI integer dots
#endif

}  // namespace tandem::kernels::detail
