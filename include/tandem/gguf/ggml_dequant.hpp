// Dequantisation of every GGUF weight type Tandem reads, and ggml's reference Q4_0 / Q8_0
// quantisers.
//
// Source of the formulas: ggml's block layouts (ggml-common.h) and its scalar reference
// routines (ggml-quants.c: dequantize_row_*, quantize_row_q4_0_ref, quantize_row_q8_0_ref).
// The arithmetic here is the same sequence of f32 operations, so a row dequantised here
// equals ggml's bit for bit (the translation unit is built with -ffp-contract=off so that
// no multiply-add is fused), and a row quantised here equals the bytes llama-quantize
// writes.
//
// Shapes: a row of `k` elements, k a multiple of ggml_block_elements(type); `src` holds
// k / block_elements blocks of ggml_block_bytes(type) bytes (no alignment required).
//
// Thread-safety: pure functions of their arguments.
#pragma once

#include <cstddef>
#include <cstdint>

#include "tandem/gguf/gguf.hpp"

namespace tandem {

/// dst[0..k) = the values the k elements of `src` (type `type`) stand for. Inf/NaN scales
/// propagate as ggml propagates them (Inf * 0 = NaN). Throws Error(kInvalidArgument) for a
/// type Tandem does not read or k not a multiple of the block size.
void dequantize_row(GgmlType type, const std::byte* src, float* dst, int64_t k);

/// ggml's quantize_row_q4_0_ref: per block of 32, `max` = the element of largest
/// magnitude (the first one on ties, sign kept), d = max / -8, id = d != 0 ? 1/d : 0,
/// q = min(15, (int8_t)(x * id + 8.5f)), d stored as fp16 (round to nearest even);
/// element j in the low nibble of byte j, element j + 16 in its high nibble.
/// `dst` receives k / 32 blocks of 18 bytes. k must be a multiple of 32.
void quantize_row_q4_0_ref(const float* x, std::byte* dst, int64_t k);

/// ggml's quantize_row_q8_0_ref: per block of 32, d = max|x| / 127, id = d != 0 ? 1/d : 0,
/// q = roundf(x * id) (half away from zero), d stored as fp16. `dst` receives k / 32
/// blocks of 34 bytes. k must be a multiple of 32.
void quantize_row_q8_0_ref(const float* x, std::byte* dst, int64_t k);

}  // namespace tandem
