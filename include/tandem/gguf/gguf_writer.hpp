// GGUF writer (version 3), used by tandem-synth and by tests that build model files.
//
// Layout as the GGUF spec: header, metadata in insertion order, tensor infos, padding to
// `general.alignment` (32), tensor data each aligned. Tensor data is produced by a fill
// callback at write time, so multi-gigabyte files stream without being held in memory.
// write() is atomic (AtomicFileWriter, include/tandem/core/atomic_file.hpp): symbolic links are
// followed, a non-regular target is refused, and a failure leaves the old file intact.
//
// Thread-safety: one thread builds and writes a GgufWriter.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "tandem/gguf/gguf.hpp"

namespace tandem {

class GgufWriter {
 public:
  /// Receives a buffer of exactly the tensor's byte size to fill.
  using Fill = std::function<void(std::span<std::byte>)>;

  void add_string(const std::string& key, const std::string& value);
  void add_u32(const std::string& key, uint32_t value);
  void add_i32(const std::string& key, int32_t value);
  void add_f32(const std::string& key, float value);
  void add_bool(const std::string& key, bool value);
  void add_string_array(const std::string& key, const std::vector<std::string>& values);
  void add_f32_array(const std::string& key, const std::vector<float>& values);
  void add_i32_array(const std::string& key, const std::vector<int32_t>& values);
  /// Any value as the reader returns it (copying metadata from one file to another): the
  /// declared type is kept, arrays nest. Throws Error(kInvalidArgument) when the value does
  /// not hold its declared type.
  void add_value(const std::string& key, const GgufValue& value);

  /// ne in ggml order (ne[0] = row length). Throws Error(kInvalidArgument) when ne[0] is
  /// not a multiple of the type's block size or a name repeats.
  void add_tensor(const std::string& name, std::vector<int64_t> ne, GgmlType type, Fill fill);

  /// Write the file. Throws Error(kIo) on failure (the temporary file is removed).
  void write(const std::filesystem::path& path) const;

 private:
  struct Tensor {
    std::string name;
    std::vector<int64_t> ne;
    GgmlType type;
    uint64_t n_bytes;
    Fill fill;
  };
  void put_key(const std::string& key, GgufValueType type);
  void put_value(const std::string& key, const GgufValue& value);
  std::vector<std::byte> kv_;
  uint64_t n_kv_ = 0;
  std::vector<Tensor> tensors_;
};

}  // namespace tandem
