// GGUF reader: parses and validates a GGUF v2/v3 file and memory-maps its tensor data.
//
// Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (little-endian;
// header "GGUF" u32 version, u64 tensor_count, u64 kv_count; KV pairs; tensor infos;
// data section at the next multiple of general.alignment, default 32).
//
// Everything is validated before use: every length and count is checked against the
// bytes left in the file before anything is allocated, tensor extents are checked
// against the file size before the mapping is touched, and non-finite quantisation
// scales are refused. Failures throw tandem::Error with a code from error.hpp and a
// message naming the key or tensor and the byte offset.
//
// Thread-safety: a GgufFile is immutable after open(); all const members may be called
// from any number of threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "tandem/core/error.hpp"

namespace tandem {

/// Metadata value types, numbered as in the GGUF spec.
enum class GgufValueType : uint32_t {
  kUint8 = 0,
  kInt8 = 1,
  kUint16 = 2,
  kInt16 = 3,
  kUint32 = 4,
  kInt32 = 5,
  kFloat32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kUint64 = 10,
  kInt64 = 11,
  kFloat64 = 12,
};

/// Tensor element types, numbered as ggml's `enum ggml_type`. Only the ones Tandem reads
/// are named; others are refused at open with kGgufBadType. The executors compute with
/// F32, F16, BF16, Q4_0 and Q8_0; Model::load converts the other quantised types
/// (model.hpp). Block layouts: ggml's ggml-common.h, one struct per type.
enum class GgmlType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kBF16 = 30,
};

/// The type's name as ggml spells it ("Q4_K"), "unknown" for a value not named above.
std::string_view ggml_type_name(GgmlType t) noexcept;
/// Elements per block: 1 for F32/F16/BF16, 32 for Q4_0..Q8_0, 256 for the K-quants
/// (0 for an unnamed value).
int64_t ggml_block_elements(GgmlType t) noexcept;
/// Bytes per block: F32 4, F16/BF16 2, Q4_0 18, Q4_1 20, Q5_0 22, Q5_1 24, Q8_0 34,
/// Q2_K 84, Q3_K 110, Q4_K 144, Q5_K 176, Q6_K 210 (0 for an unnamed value).
int64_t ggml_block_bytes(GgmlType t) noexcept;
/// True for the block-quantised types (everything above except F32, F16, BF16).
bool ggml_is_quantized(GgmlType t) noexcept;

struct GgufValue;

/// A GGUF array: the element type and its items (arrays may nest), stored compactly: the
/// numeric and BOOL elements in one buffer at their encoded width (a 262k-entry FLOAT32
/// array is 1 MiB), STRING elements as one byte blob plus each element's end offset, and
/// nested arrays as a list of arrays. Built only by the reader (GgufFile); a copy owns its
/// storage and does not depend on the file.
///
/// Thread-safety: immutable; all members may be called from any number of threads.
class GgufArray {
 public:
  GgufValueType elem_type() const noexcept { return elem_type_; }
  size_t size() const noexcept { return size_; }
  bool empty() const noexcept { return size_ == 0; }

  /// Element `i` as a value, typed as the reader gives scalars (integers widened to 64 bits,
  /// FLOAT32 to double, a STRING copied; a nested ARRAY copied). Throws
  /// Error(kInvalidArgument) when i >= size().
  GgufValue at(size_t i) const;
  /// STRING element `i`: a view into this array's storage, valid while the array lives.
  /// Throws Error(kInvalidArgument) when the elements are not STRING or i >= size().
  std::string_view string_at(size_t i) const;
  /// ARRAY element `i`. Throws Error(kInvalidArgument) when the elements are not ARRAY or
  /// i >= size().
  const GgufArray& array_at(size_t i) const;

 private:
  friend class GgufArrayReader;  // lib/gguf/gguf.cpp fills the storage
  void check_index(size_t i, GgufValueType want) const;
  GgufValueType elem_type_ = GgufValueType::kUint8;
  size_t size_ = 0;
  std::vector<std::byte> bytes_;   ///< scalars: size_ elements at their width; STRING: the texts
  std::vector<uint64_t> ends_;     ///< STRING: end of element i in bytes_ (it starts at ends_[i-1])
  std::vector<GgufArray> arrays_;  ///< ARRAY: the elements
};

/// One metadata value. Integers are widened to 64 bits but keep their declared type.
struct GgufValue {
  GgufValueType type = GgufValueType::kUint8;
  std::variant<uint64_t, int64_t, double, bool, std::string, GgufArray> value;
};

/// One key/value pair, in file order.
struct GgufKv {
  std::string key;
  GgufValue value;
  uint64_t file_offset = 0;  ///< byte offset of the key in the file
};

/// One tensor: shape in ggml order (ne[0] is the row length, contiguous), element
/// type, and a view of its bytes inside the mapping.
struct GgufTensorInfo {
  std::string name;
  std::vector<int64_t> ne;  ///< 1..4 dims, each >= 1
  GgmlType type = GgmlType::kF32;
  uint64_t offset = 0;  ///< relative to the data section
  uint64_t n_elements = 0;
  uint64_t n_bytes = 0;
  const std::byte* data = nullptr;  ///< points into the mapping; valid while the file lives
  int64_t n_rows() const noexcept;  ///< product of ne[1..]
  int64_t row_bytes() const noexcept;
};

struct GgufOpenOptions {
  /// Refuse Inf/NaN weights: every fp16 scale and min of every quantised block (d of
  /// Q4_0/Q5_0/Q8_0/Q3_K/Q6_K, d and m of Q4_1/Q5_1, d and dmin of Q2_K/Q4_K/Q5_K) and
  /// every element of F32/F16/BF16 tensors are scanned at open (one pass over the data).
  bool check_block_scales = true;
  /// Largest accepted general.alignment in bytes (a power of two).
  uint32_t max_alignment = 1u << 20;
};

class GgufFile {
 public:
  /// Open, validate and memory-map `path`. Throws Error (kIo for a missing path or a
  /// directory, a GGUF code for a malformed file).
  static std::shared_ptr<const GgufFile> open(const std::filesystem::path& path, const GgufOpenOptions& options = {});
  /// Parse an in-memory buffer (copied). Same validation as open(). Used by the fuzzer.
  static std::shared_ptr<const GgufFile> from_bytes(std::span<const std::byte> bytes,
                                                    const GgufOpenOptions& options = {});
  ~GgufFile();
  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;

  uint32_t version() const noexcept;
  uint32_t alignment() const noexcept;
  uint64_t data_offset() const noexcept;  ///< byte offset of the data section
  uint64_t file_size() const noexcept;
  const std::filesystem::path& path() const noexcept;

  const std::vector<GgufKv>& metadata() const noexcept;
  const GgufValue* find(std::string_view key) const noexcept;

  // Typed getters: std::nullopt / nullptr when the key is absent; throw
  // Error(kGgufBadType) naming the key when it holds an incompatible type. Integer
  // getters accept any integer type whose value fits the requested type.
  std::optional<std::string> get_string(std::string_view key) const;
  std::optional<uint64_t> get_uint(std::string_view key) const;
  std::optional<int64_t> get_int(std::string_view key) const;
  std::optional<float> get_float(std::string_view key) const;  ///< any float or integer
  std::optional<bool> get_bool(std::string_view key) const;
  /// An array of strings, as a list of views into the parsed metadata.
  std::optional<std::vector<std::string_view>> get_string_array(std::string_view key) const;
  std::optional<std::vector<float>> get_float_array(std::string_view key) const;
  std::optional<std::vector<int64_t>> get_int_array(std::string_view key) const;

  const std::vector<GgufTensorInfo>& tensors() const noexcept;
  const GgufTensorInfo* find_tensor(std::string_view name) const noexcept;

  /// Drop from this process's resident memory the pages wholly inside [data, data + n_bytes)
  /// (the page-aligned interior) that belong to this file's read-only mapping: a caller that
  /// keeps its own copy of a tensor (the CPU executor's repacked weights) gives back the
  /// file's pages. The bytes do not change: a later read faults them in from the file again
  /// (unless the file was rewritten in place meanwhile; GgufWriter and AtomicFileWriter
  /// replace files, never rewrite them); the range is marked MADV_RANDOM (no readahead when
  /// it is read again, and the kernel does not map it back while its neighbours are read).
  /// A no-op for bytes outside the mapping (weights a
  /// Model converted live on its heap) and for a file made by from_bytes (a heap copy:
  /// dropping its pages would zero them). Never throws; a failing madvise is ignored (the
  /// pages stay resident). Thread-safe, also while other threads read the bytes.
  void release_pages(const std::byte* data, uint64_t n_bytes) const noexcept;

  struct Impl;

 private:
  explicit GgufFile(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace tandem
