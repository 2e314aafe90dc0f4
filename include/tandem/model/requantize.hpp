// Requantisation of GGUF weights to the executors' formats (Q4_0, Q8_0), as
// llama-quantize does it.
//
// The type rule (llama.cpp's llama_model_quantize with allow_requantize, for the targets
// MOSTLY_Q4_0 and MOSTLY_Q8_0):
//   - only tensors whose name ends in "weight", with at least 2 dimensions (trailing
//     1-sized dimensions do not count) and whose name does not contain "_norm.weight" are
//     converted; every other tensor is copied as it is;
//   - unless `pure`: the output projection ("output.weight", or "token_embd.weight" when
//     the model has no "output.weight", i.e. a tied output) becomes Q8_0. llama.cpp picks
//     Q6_K there when the row length is a multiple of 256 and Q8_0 otherwise; Tandem has
//     no Q6_K kernels, so it is Q8_0 in both cases (identical to llama.cpp for rows that
//     are not multiples of 256, e.g. SmolLM2's 576);
//   - every other converted tensor becomes the target type (an untied token_embd too);
//   - a tensor already of its new type is copied byte for byte (never requantised);
//   - a float tensor whose row length is not a multiple of 32 is copied as it is
//     (llama.cpp refuses such a file).
// Conversion dequantises each row to f32 exactly as ggml does (ggml_dequant.hpp) and
// quantises it with ggml's reference quantiser, so the bytes equal llama-quantize's.
//
// Thread-safety: pure functions of their arguments; requantize_tensor() uses the pool.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>

#include "tandem/core/thread_pool.hpp"
#include "tandem/gguf/gguf.hpp"

namespace tandem {

/// The type `t` gets when a file is converted to `target` (kQ4_0 or kQ8_0) by the rule
/// above. `has_output` says whether the file has an "output.weight" tensor. Throws
/// Error(kInvalidArgument) for another target.
GgmlType requantized_type(const GgufTensorInfo& t, bool has_output, GgmlType target, bool pure);

/// Bytes `t` takes as `type` (its row count times the row size of `type`).
uint64_t requantized_bytes(const GgufTensorInfo& t, GgmlType type);

/// Rows [row_begin, row_end) of `t` converted to `type` (kQ4_0, kQ8_0, or t.type for a
/// copy), written to `out` (the rows' bytes, contiguous). `scratch` holds ne[0] floats.
/// No allocation, no exception for valid arguments.
void requantize_rows(const GgufTensorInfo& t, GgmlType type, int64_t row_begin, int64_t row_end, std::byte* out,
                     float* scratch) noexcept;

/// All of `t` converted to `type` into `out` (requantized_bytes(t, type) bytes), split by
/// rows over `pool`. Throws Error(kInvalidArgument) when `type` is neither kQ4_0, kQ8_0
/// nor t.type, or the row length is not a multiple of its block size.
void requantize_tensor(const GgufTensorInfo& t, GgmlType type, std::byte* out, ThreadPool& pool);

struct QuantizeFileOptions {
  GgmlType target = GgmlType::kQ4_0;  ///< kQ4_0 (llama.cpp ftype MOSTLY_Q4_0 = 2) or kQ8_0 (7)
  bool pure = false;                  ///< llama-quantize --pure: no Q8_0 output projection
  int n_threads = 0;                  ///< <= 0: physical_core_count()
  /// Called after each tensor is written: (tensors done, tensors in all, its name, its
  /// type in the output). May be empty.
  std::function<void(size_t, size_t, const std::string&, GgmlType)> on_tensor;
};

struct QuantizeFileResult {
  size_t n_tensors = 0;
  size_t n_converted = 0;  ///< tensors whose type changed
  uint64_t bytes_in = 0;   ///< tensor data bytes read
  uint64_t bytes_out = 0;  ///< tensor data bytes written
};

/// llama-quantize for Tandem's targets: reads `in` (validated as GgufFile::open does),
/// converts every tensor by the rule above, writes `out` (GGUF v3, alignment 32): the
/// metadata in the input's order without general.alignment, general.file_type and
/// general.quantization_version, then general.quantization_version = 2 and
/// general.file_type = the ftype (UINT32), as llama.cpp appends them; the tensors in the
/// input's order. `out` is written through a temporary file and renamed, so it is never
/// left half-written. Throws Error: the reader's codes for `in`, kIo for `out`,
/// kInvalidArgument for a bad target.
QuantizeFileResult quantize_file(const std::filesystem::path& in, const std::filesystem::path& out,
                                 const QuantizeFileOptions& options = {});

}  // namespace tandem
