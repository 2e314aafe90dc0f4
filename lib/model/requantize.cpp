// Requantisation to Q4_0 / Q8_0. See include/tandem/model/requantize.hpp for the rule.
#include "tandem/model/requantize.hpp"

#include <fmt/format.h>

#include <cstring>
#include <vector>

#include "tandem/gguf/ggml_dequant.hpp"
#include "tandem/gguf/gguf_writer.hpp"

namespace tandem {

namespace {

// ggml_n_dims: dimensions up to the last one that is not 1 (at least 1).
size_t n_dims(const GgufTensorInfo& t) {
  size_t n = t.ne.size();
  while (n > 1 && t.ne[n - 1] == 1) --n;
  return n;
}

bool ends_with(std::string_view s, std::string_view tail) {
  return s.size() >= tail.size() && s.substr(s.size() - tail.size()) == tail;
}

uint64_t row_bytes_as(const GgufTensorInfo& t, GgmlType type) {
  return static_cast<uint64_t>(t.ne[0] / ggml_block_elements(type) * ggml_block_bytes(type));
}

void check_type(const GgufTensorInfo& t, GgmlType type) {
  if (type != t.type && type != GgmlType::kQ4_0 && type != GgmlType::kQ8_0) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("requantize: tensor '{}' cannot be converted to {} (Q4_0, Q8_0 or a copy)", t.name,
                            ggml_type_name(type)));
  }
  if (t.ne.empty() || t.ne[0] % ggml_block_elements(type) != 0) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("requantize: tensor '{}' row length {} is not a multiple of the {} block size {}", t.name,
                            t.ne.empty() ? 0 : t.ne[0], ggml_type_name(type), ggml_block_elements(type)));
  }
}

}  // namespace

GgmlType requantized_type(const GgufTensorInfo& t, bool has_output, GgmlType target, bool pure) {
  if (target != GgmlType::kQ4_0 && target != GgmlType::kQ8_0) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("requantize: target {} is not Q4_0 or Q8_0", ggml_type_name(target)));
  }
  const bool convert =
      ends_with(t.name, "weight") && n_dims(t) >= 2 && t.name.find("_norm.weight") == std::string::npos;
  if (!convert || t.ne[0] % 32 != 0) return t.type;
  if (!pure && (t.name == "output.weight" || (!has_output && t.name == "token_embd.weight"))) {
    return GgmlType::kQ8_0;
  }
  return target;
}

uint64_t requantized_bytes(const GgufTensorInfo& t, GgmlType type) {
  return static_cast<uint64_t>(t.n_rows()) * row_bytes_as(t, type);
}

void requantize_rows(const GgufTensorInfo& t, GgmlType type, int64_t row_begin, int64_t row_end, std::byte* out,
                     float* scratch) noexcept {
  const auto in_row = static_cast<uint64_t>(t.row_bytes());
  const uint64_t out_row = row_bytes_as(t, type);
  for (int64_t r = row_begin; r < row_end; ++r) {
    const std::byte* src = t.data + static_cast<uint64_t>(r) * in_row;
    std::byte* dst = out + static_cast<uint64_t>(r - row_begin) * out_row;
    if (type == t.type) {
      std::memcpy(dst, src, in_row);
      continue;
    }
    dequantize_row(t.type, src, scratch, t.ne[0]);  // cannot throw: the reader checked the type and row
    if (type == GgmlType::kQ4_0) {
      quantize_row_q4_0_ref(scratch, dst, t.ne[0]);
    } else {
      quantize_row_q8_0_ref(scratch, dst, t.ne[0]);
    }
  }
}

void requantize_tensor(const GgufTensorInfo& t, GgmlType type, std::byte* out, ThreadPool& pool) {
  check_type(t, type);
  std::vector<std::vector<float>> scratch(static_cast<size_t>(pool.size()),
                                          std::vector<float>(static_cast<size_t>(t.ne[0])));
  const uint64_t out_row = row_bytes_as(t, type);
  pool.parallel_for(t.n_rows(), 16, [&](int64_t b, int64_t e, int thread) {
    requantize_rows(t, type, b, e, out + static_cast<uint64_t>(b) * out_row,
                    scratch[static_cast<size_t>(thread)].data());
  });
}

QuantizeFileResult quantize_file(const std::filesystem::path& in, const std::filesystem::path& out,
                                 const QuantizeFileOptions& options) {
  if (options.target != GgmlType::kQ4_0 && options.target != GgmlType::kQ8_0) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("quantize: target {} is not Q4_0 or Q8_0", ggml_type_name(options.target)));
  }
  const auto file = GgufFile::open(in);
  GgufWriter w;
  for (const GgufKv& kv : file->metadata()) {
    if (kv.key == "general.alignment" || kv.key == "general.file_type" || kv.key == "general.quantization_version") {
      continue;
    }
    w.add_value(kv.key, kv.value);
  }
  constexpr uint32_t kGgmlQuantizationVersion = 2;                // GGML_QNT_VERSION
  constexpr uint32_t kFtypeMostlyQ4_0 = 2, kFtypeMostlyQ8_0 = 7;  // llama_ftype
  w.add_u32("general.quantization_version", kGgmlQuantizationVersion);
  w.add_u32("general.file_type", options.target == GgmlType::kQ4_0 ? kFtypeMostlyQ4_0 : kFtypeMostlyQ8_0);

  const bool has_output = file->find_tensor("output.weight") != nullptr;
  ThreadPool pool(options.n_threads);
  QuantizeFileResult result;
  result.n_tensors = file->tensors().size();
  size_t done = 0;
  for (const GgufTensorInfo& t : file->tensors()) {
    const GgmlType type = requantized_type(t, has_output, options.target, options.pure);
    result.bytes_in += t.n_bytes;
    result.bytes_out += requantized_bytes(t, type);
    if (type != t.type) ++result.n_converted;
    w.add_tensor(t.name, t.ne, type, [&, type](std::span<std::byte> dst) {
      requantize_tensor(t, type, dst.data(), pool);
      if (options.on_tensor) options.on_tensor(++done, result.n_tensors, t.name, type);
    });
  }
  w.write(out);
  return result;
}

}  // namespace tandem
