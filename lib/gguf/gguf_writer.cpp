#include "tandem/gguf/gguf_writer.hpp"

#include <fmt/format.h>

#include <cerrno>
#include <cstring>
#include <variant>
#include "tandem/core/atomic_file.hpp"

namespace tandem {

namespace {

constexpr uint64_t kAlignment = 32;

template <class T>
void put(std::vector<std::byte>& out, const T& v) {
  const auto* p = reinterpret_cast<const std::byte*>(&v);
  out.insert(out.end(), p, p + sizeof(T));
}

void put_str(std::vector<std::byte>& out, const std::string& s) {
  put<uint64_t>(out, s.size());
  const auto* p = reinterpret_cast<const std::byte*>(s.data());
  out.insert(out.end(), p, p + s.size());
}

uint64_t align_up(uint64_t x) {
  return (x + kAlignment - 1) / kAlignment * kAlignment;
}

}  // namespace

void GgufWriter::put_key(const std::string& key, GgufValueType type) {
  put_str(kv_, key);
  put<uint32_t>(kv_, static_cast<uint32_t>(type));
  ++n_kv_;
}

void GgufWriter::add_string(const std::string& key, const std::string& value) {
  put_key(key, GgufValueType::kString);
  put_str(kv_, value);
}
void GgufWriter::add_u32(const std::string& key, uint32_t value) {
  put_key(key, GgufValueType::kUint32);
  put(kv_, value);
}
void GgufWriter::add_i32(const std::string& key, int32_t value) {
  put_key(key, GgufValueType::kInt32);
  put(kv_, value);
}
void GgufWriter::add_f32(const std::string& key, float value) {
  put_key(key, GgufValueType::kFloat32);
  put(kv_, value);
}
void GgufWriter::add_bool(const std::string& key, bool value) {
  put_key(key, GgufValueType::kBool);
  put<uint8_t>(kv_, value ? 1 : 0);
}
void GgufWriter::add_string_array(const std::string& key, const std::vector<std::string>& values) {
  put_key(key, GgufValueType::kArray);
  put<uint32_t>(kv_, static_cast<uint32_t>(GgufValueType::kString));
  put<uint64_t>(kv_, values.size());
  for (const auto& v : values) put_str(kv_, v);
}
void GgufWriter::add_f32_array(const std::string& key, const std::vector<float>& values) {
  put_key(key, GgufValueType::kArray);
  put<uint32_t>(kv_, static_cast<uint32_t>(GgufValueType::kFloat32));
  put<uint64_t>(kv_, values.size());
  for (float v : values) put(kv_, v);
}
void GgufWriter::add_i32_array(const std::string& key, const std::vector<int32_t>& values) {
  put_key(key, GgufValueType::kArray);
  put<uint32_t>(kv_, static_cast<uint32_t>(GgufValueType::kInt32));
  put<uint64_t>(kv_, values.size());
  for (int32_t v : values) put(kv_, v);
}

void GgufWriter::add_value(const std::string& key, const GgufValue& value) {
  put_key(key, value.type);
  put_value(key, value);
}

void GgufWriter::put_value(const std::string& key, const GgufValue& v) {
  const auto u = [&] { return std::get<uint64_t>(v.value); };
  const auto i = [&] { return std::get<int64_t>(v.value); };
  try {
    switch (v.type) {
      case GgufValueType::kUint8:
        put(kv_, static_cast<uint8_t>(u()));
        break;
      case GgufValueType::kInt8:
        put(kv_, static_cast<int8_t>(i()));
        break;
      case GgufValueType::kUint16:
        put(kv_, static_cast<uint16_t>(u()));
        break;
      case GgufValueType::kInt16:
        put(kv_, static_cast<int16_t>(i()));
        break;
      case GgufValueType::kUint32:
        put(kv_, static_cast<uint32_t>(u()));
        break;
      case GgufValueType::kInt32:
        put(kv_, static_cast<int32_t>(i()));
        break;
      case GgufValueType::kUint64:
        put(kv_, u());
        break;
      case GgufValueType::kInt64:
        put(kv_, i());
        break;
      case GgufValueType::kFloat32:
        put(kv_, static_cast<float>(std::get<double>(v.value)));
        break;
      case GgufValueType::kFloat64:
        put(kv_, std::get<double>(v.value));
        break;
      case GgufValueType::kBool:
        put<uint8_t>(kv_, std::get<bool>(v.value) ? 1 : 0);
        break;
      case GgufValueType::kString:
        put_str(kv_, std::get<std::string>(v.value));
        break;
      case GgufValueType::kArray: {
        const auto& arr = std::get<GgufArray>(v.value);
        put<uint32_t>(kv_, static_cast<uint32_t>(arr.elem_type()));
        put<uint64_t>(kv_, arr.size());
        for (size_t k = 0; k < arr.size(); ++k) put_value(key, arr.at(k));
        break;
      }
    }
  } catch (const std::bad_variant_access&) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("GGUF writer: key '{}' value does not hold its declared type", key));
  }
}

void GgufWriter::add_tensor(const std::string& name, std::vector<int64_t> ne, GgmlType type, Fill fill) {
  if (ne.empty() || ne.size() > 4) {
    throw Error(ErrorCode::kInvalidArgument, fmt::format("GGUF writer: tensor '{}' needs 1..4 dims", name));
  }
  for (const auto& t : tensors_) {
    if (t.name == name)
      throw Error(ErrorCode::kInvalidArgument, fmt::format("GGUF writer: tensor '{}' added twice", name));
  }
  const int64_t be = ggml_block_elements(type);
  if (ne[0] % be != 0) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("GGUF writer: tensor '{}' row of {} is not a multiple of {}", name, ne[0], be));
  }
  uint64_t n = 1;
  for (int64_t d : ne) n *= uint64_t(d);
  const uint64_t bytes = n / uint64_t(be) * uint64_t(ggml_block_bytes(type));
  tensors_.push_back(Tensor{name, std::move(ne), type, bytes, std::move(fill)});
}

void GgufWriter::write(const std::filesystem::path& path) const {
  std::vector<std::byte> head;
  head.insert(head.end(), {std::byte{'G'}, std::byte{'G'}, std::byte{'U'}, std::byte{'F'}});
  put<uint32_t>(head, 3);
  put<uint64_t>(head, tensors_.size());
  put<uint64_t>(head, n_kv_);
  head.insert(head.end(), kv_.begin(), kv_.end());
  uint64_t offset = 0;
  for (const auto& t : tensors_) {
    put_str(head, t.name);
    put<uint32_t>(head, static_cast<uint32_t>(t.ne.size()));
    for (int64_t d : t.ne) put<uint64_t>(head, uint64_t(d));
    put<uint32_t>(head, static_cast<uint32_t>(t.type));
    put<uint64_t>(head, offset);
    offset = align_up(offset + t.n_bytes);
  }
  head.resize(align_up(head.size()));

  AtomicFileWriter f(path);
  f.write(head.data(), head.size());
  std::vector<std::byte> buf;
  for (const auto& t : tensors_) {
    buf.assign(align_up(t.n_bytes), std::byte{0});
    t.fill(std::span<std::byte>(buf.data(), t.n_bytes));
    f.write(buf.data(), &t == &tensors_.back() ? t.n_bytes : buf.size());
  }
  f.commit();
}

}  // namespace tandem
