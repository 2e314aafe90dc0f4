// The one definition of the quantisation blocks shared by kernels/cpu and kernels/cuda.
//
// Layout as ggml (ggml-common.h) and the GGUF files it writes:
//   Q4_0: 32 weights = fp16 scale d + 16 bytes; byte j holds weight j in its low nibble
//         and weight j+16 in its high nibble; w = d * (q - 8).
//   Q8_0: 32 values  = fp16 scale d + 32 int8;  x = d * q.
// Everything here is plain arithmetic usable from host and device code.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define TANDEM_HD __host__ __device__
#else
#define TANDEM_HD
#endif

namespace tandem::kernels {

inline constexpr int kQK = 32;  ///< elements per Q4_0 / Q8_0 block

struct BlockQ4_0 {
  uint16_t d;        ///< IEEE fp16 bits of the scale
  uint8_t qs[kQK / 2];
};
static_assert(sizeof(BlockQ4_0) == 18, "Q4_0 block must be 18 bytes");

struct BlockQ8_0 {
  uint16_t d;        ///< IEEE fp16 bits of the scale
  int8_t qs[kQK];
};
static_assert(sizeof(BlockQ8_0) == 34, "Q8_0 block must be 34 bytes");

}  // namespace tandem::kernels
