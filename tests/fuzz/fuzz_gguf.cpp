// libFuzzer entry point for the GGUF reader: any input must either parse or throw
// tandem::Error; never crash, read out of bounds, or throw anything else. When a file
// parses, every getter is called on every key and every tensor's first and last byte is
// read, so a tensor view outside the buffer is caught by ASan.
#include <cstddef>
#include <cstdint>
#include <span>

#include "tandem/core/error.hpp"
#include "tandem/gguf/gguf.hpp"

namespace {

template <typename F>
void swallow(F&& f) {
  try {
    f();
  } catch (const tandem::Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::shared_ptr<const tandem::GgufFile> file;
  try {
    file = tandem::GgufFile::from_bytes(std::span<const std::byte>(reinterpret_cast<const std::byte*>(data), size));
  } catch (const tandem::Error&) {
    return 0;
  }
  volatile uint64_t sink = file->version() + file->alignment() + file->data_offset();
  for (const auto& kv : file->metadata()) {
    const std::string_view k = kv.key;
    if (file->find(k) == nullptr) __builtin_trap();
    swallow([&] { (void)file->get_string(k); });
    swallow([&] { (void)file->get_uint(k); });
    swallow([&] { (void)file->get_int(k); });
    swallow([&] { (void)file->get_float(k); });
    swallow([&] { (void)file->get_bool(k); });
    swallow([&] { (void)file->get_string_array(k); });
    swallow([&] { (void)file->get_float_array(k); });
    swallow([&] { (void)file->get_int_array(k); });
  }
  for (const auto& t : file->tensors()) {
    if (file->find_tensor(t.name) == nullptr) __builtin_trap();
    if (t.n_bytes == 0 || t.data == nullptr) __builtin_trap();
    sink = sink + static_cast<uint64_t>(t.data[0]) + static_cast<uint64_t>(t.data[t.n_bytes - 1]);
    sink = sink + static_cast<uint64_t>(t.n_rows()) + static_cast<uint64_t>(t.row_bytes());
  }
  (void)sink;
  return 0;
}
