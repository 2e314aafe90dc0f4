// AVX-512 (F/BW/DQ/CD/VL) + VNNI + FMA + F16C kernels (see kernels_simd.hpp): the same
// code as kernels_avx512.cpp with the integer block dots done by vpdpbusd.
#define TANDEM_ISA_NS avx512vnni
#define TANDEM_ISA_AVX512 1
#define TANDEM_ISA_VNNI 1
#define TANDEM_ISA_NAME "avx512vnni"
#include "kernels_simd.hpp"

namespace tandem::kernels::detail {
const KernelTable& table_avx512vnni() noexcept {
  return avx512vnni::table();
}
}  // namespace tandem::kernels::detail
