// AVX2 + FMA + F16C kernels (compiled with -mavx2 -mfma -mf16c; see kernels_simd.hpp).
#define TANDEM_ISA_NS avx2
#define TANDEM_ISA_AVX512 0
#define TANDEM_ISA_NAME "avx2"
#include "kernels_simd.hpp"

namespace tandem::kernels::detail {
const KernelTable& table_avx2() noexcept {
  return avx2::table();
}
}  // namespace tandem::kernels::detail
