// AVX-512 (F/BW/DQ/CD/VL) + FMA + F16C kernels (see kernels_simd.hpp).
#define TANDEM_ISA_NS avx512
#define TANDEM_ISA_AVX512 1
#define TANDEM_ISA_NAME "avx512"
#include "kernels_simd.hpp"

namespace tandem::kernels::detail {
const KernelTable& table_avx512() noexcept {
  return avx512::table();
}
}  // namespace tandem::kernels::detail
