// GGUF v2/v3 reader. See include/tandem/gguf/gguf.hpp for the contract.
//
// Parsing walks the file with a bounds-checked cursor: every fixed-size field is checked
// against the bytes left before it is read, and every declared length or count is
// checked against the bytes left before anything is sized from it, so a hostile file can
// neither read out of bounds nor make the reader allocate more than a small multiple of
// the file size. Tensor extents are checked with overflow-checked arithmetic against the
// file size before any tensor byte of the mapping is read.
#include "tandem/gguf/gguf.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <new>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>

namespace tandem {

// ------------------------------------------------------------------ ggml type helpers

namespace {

// One row per type Tandem reads: ggml's block size, block bytes and the byte offsets of
// the fp16 scale fields inside a block (ggml-common.h: block_q4_0 ... block_q6_K).
struct TypeTraits {
  GgmlType type;
  std::string_view name;
  int64_t block_elements;
  int64_t block_bytes;
  // fp16 fields checked for Inf/NaN: offset inside the block and the field's name.
  struct Scale {
    int offset;
    const char* name;
  };
  Scale scales[2];
  int n_scales;
};

constexpr TypeTraits kTypes[] = {
    {GgmlType::kF32, "F32", 1, 4, {}, 0},
    {GgmlType::kF16, "F16", 1, 2, {}, 0},
    {GgmlType::kQ4_0, "Q4_0", 32, 18, {{0, "scale d"}}, 1},
    {GgmlType::kQ4_1, "Q4_1", 32, 20, {{0, "scale d"}, {2, "min m"}}, 2},
    {GgmlType::kQ5_0, "Q5_0", 32, 22, {{0, "scale d"}}, 1},
    {GgmlType::kQ5_1, "Q5_1", 32, 24, {{0, "scale d"}, {2, "min m"}}, 2},
    {GgmlType::kQ8_0, "Q8_0", 32, 34, {{0, "scale d"}}, 1},
    {GgmlType::kQ2_K, "Q2_K", 256, 84, {{80, "super-block scale d"}, {82, "super-block min dmin"}}, 2},
    {GgmlType::kQ3_K, "Q3_K", 256, 110, {{108, "super-block scale d"}}, 1},
    {GgmlType::kQ4_K, "Q4_K", 256, 144, {{0, "super-block scale d"}, {2, "super-block min dmin"}}, 2},
    {GgmlType::kQ5_K, "Q5_K", 256, 176, {{0, "super-block scale d"}, {2, "super-block min dmin"}}, 2},
    {GgmlType::kQ6_K, "Q6_K", 256, 210, {{208, "super-block scale d"}}, 1},
    {GgmlType::kBF16, "BF16", 1, 2, {}, 0},
};

const TypeTraits* traits(GgmlType t) noexcept {
  for (const TypeTraits& tt : kTypes) {
    if (tt.type == t) return &tt;
  }
  return nullptr;
}

}  // namespace

std::string_view ggml_type_name(GgmlType t) noexcept {
  const TypeTraits* tt = traits(t);
  return tt ? tt->name : std::string_view("unknown");
}

int64_t ggml_block_elements(GgmlType t) noexcept {
  const TypeTraits* tt = traits(t);
  return tt ? tt->block_elements : 0;
}

int64_t ggml_block_bytes(GgmlType t) noexcept {
  const TypeTraits* tt = traits(t);
  return tt ? tt->block_bytes : 0;
}

bool ggml_is_quantized(GgmlType t) noexcept {
  const TypeTraits* tt = traits(t);
  return tt && tt->block_elements > 1;
}

int64_t GgufTensorInfo::n_rows() const noexcept {
  int64_t r = 1;
  for (size_t i = 1; i < ne.size(); ++i) r *= ne[i];
  return r;
}

int64_t GgufTensorInfo::row_bytes() const noexcept {
  const int64_t blk = ggml_block_elements(type);
  if (blk <= 0 || ne.empty()) return 0;
  return ne[0] / blk * ggml_block_bytes(type);
}

// ------------------------------------------------------------------ internals

namespace {

constexpr uint32_t kDefaultAlignment = 32;
constexpr int kMaxArrayDepth = 64;
// Smallest possible encoding of a tensor info: name length (8) + n_dims (4) + one dim
// (8) + type (4) + offset (8).
constexpr uint64_t kMinTensorInfoBytes = 32;
// Smallest possible encoding of a KV: key length (8) + type (4) + a 1-byte value.
constexpr uint64_t kMinKvBytes = 13;

std::string num(uint64_t v) {
  return std::to_string(v);
}
std::string snum(int64_t v) {
  return std::to_string(v);
}

std::string hex16(uint16_t v) {
  static const char* digits = "0123456789ABCDEF";
  std::string s = "0x";
  for (int sh = 12; sh >= 0; sh -= 4) s += digits[(v >> sh) & 0xF];
  return s;
}

std::string q_name(std::string_view s) {
  // Print at most 128 bytes; escape non-printable bytes so a hostile name cannot
  // inject control characters into logs.
  static const char* digits = "0123456789abcdef";
  std::string out = "'";
  const size_t n = std::min<size_t>(s.size(), 128);
  for (size_t i = 0; i < n; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7F && c != '\\' && c != '\'') {
      out += static_cast<char>(c);
    } else {
      out += "\\x";
      out += digits[c >> 4];
      out += digits[c & 0xF];
    }
  }
  if (s.size() > n) out += "...";
  out += "'";
  return out;
}

[[noreturn]] void fail(ErrorCode code, const std::string& msg) {
  throw Error(code, "GGUF: " + msg);
}

std::string_view value_type_name(uint32_t t) {
  static constexpr std::string_view names[] = {"UINT8", "INT8",   "UINT16", "INT16",  "UINT32", "INT32",  "FLOAT32",
                                               "BOOL",  "STRING", "ARRAY",  "UINT64", "INT64",  "FLOAT64"};
  return t < 13 ? names[t] : std::string_view("unknown");
}

std::string type_desc(GgufValueType t) {
  const auto n = static_cast<uint32_t>(t);
  return std::string(value_type_name(n)) + " (type " + num(n) + ")";
}

// Fixed encoded size of a scalar value type; 0 for STRING/ARRAY/unknown.
uint64_t scalar_size(uint32_t t) {
  switch (t) {
    case 0:
    case 1:
    case 7:
      return 1;
    case 2:
    case 3:
      return 2;
    case 4:
    case 5:
    case 6:
      return 4;
    case 10:
    case 11:
    case 12:
      return 8;
    default:
      return 0;
  }
}

bool is_integer_type(GgufValueType t) {
  switch (t) {
    case GgufValueType::kUint8:
    case GgufValueType::kInt8:
    case GgufValueType::kUint16:
    case GgufValueType::kInt16:
    case GgufValueType::kUint32:
    case GgufValueType::kInt32:
    case GgufValueType::kUint64:
    case GgufValueType::kInt64:
      return true;
    default:
      return false;
  }
}

bool is_float_type(GgufValueType t) {
  return t == GgufValueType::kFloat32 || t == GgufValueType::kFloat64;
}

bool known_ggml_type(uint32_t t) {
  return traits(static_cast<GgmlType>(t)) != nullptr;
}

std::string supported_types_list() {
  std::string s;
  for (const auto& tt : kTypes) {
    s += (s.empty() ? "" : ", ") + std::string(tt.name) + "=" + num(static_cast<uint32_t>(tt.type));
  }
  return s;
}

// Bounds-checked little-endian cursor over [base, base + size).
class Cursor {
 public:
  Cursor(const std::byte* base, uint64_t size) : base_(base), size_(size) {}

  uint64_t pos() const { return pos_; }
  uint64_t left() const { return size_ - pos_; }
  uint64_t size() const { return size_; }
  void seek(uint64_t p) { pos_ = p; }

  // `what` describes the field for the error message (e.g. "key 'x' value").
  void need(uint64_t n, const std::string& what) const {
    if (n > left()) {
      fail(ErrorCode::kGgufTruncated, what + " at offset " + num(pos_) + " needs " + num(n) + " bytes but only " +
                                          num(left()) + " are left in the file (" + num(size_) + " bytes)");
    }
  }

  template <typename T>
  T read(const std::string& what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, base_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;  // the host is little-endian (checked at compile time below)
  }

  // `n` raw bytes at the cursor, a view into the buffer.
  const std::byte* read_bytes(uint64_t n, const std::string& what) {
    need(n, what);
    const std::byte* p = base_ + pos_;
    pos_ += n;
    return p;
  }

  // A GGUF string: u64 length + bytes. Returns a view into the buffer.
  std::string_view read_string(const std::string& what) {
    const uint64_t at = pos_;
    const auto len = read<uint64_t>(what + " length");
    if (len > left()) {
      fail(ErrorCode::kGgufBadLength, what + " length " + num(len) + " at offset " + num(at) + " exceeds the " +
                                          num(left()) + " bytes left in the file after it (file is " + num(size_) +
                                          " bytes)");
    }
    std::string_view s(reinterpret_cast<const char*>(base_ + pos_), static_cast<size_t>(len));
    pos_ += len;
    return s;
  }

 private:
  const std::byte* base_;
  uint64_t size_;
  uint64_t pos_ = 0;
};

static_assert(std::endian::native == std::endian::little, "Tandem's GGUF reader assumes a little-endian host");

struct Buffer {
  // Either a read-only file mapping or an owned aligned heap copy.
  const std::byte* data = nullptr;
  uint64_t size = 0;
  void* map = nullptr;
  size_t map_len = 0;
  std::byte* heap = nullptr;

  Buffer() = default;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() {
    if (map) ::munmap(map, map_len);
    if (heap) ::operator delete[](heap, std::align_val_t{64});
  }
};

}  // namespace

// Parses one array into GgufArray's compact storage (the only code that fills it).
class GgufArrayReader {
 public:
  // The array at the cursor (element type, count, elements) of metadata key `key`, nested
  // `depth` arrays deep.
  static GgufArray read(Cursor& c, std::string_view key, int depth);
};

GgufArray GgufArrayReader::read(Cursor& c, std::string_view key, int depth) {
  const std::string kd = "key " + q_name(key);
  if (depth >= kMaxArrayDepth) {
    fail(ErrorCode::kGgufBadType,
         kd + " has arrays nested deeper than " + num(kMaxArrayDepth) + " levels at offset " + num(c.pos()));
  }
  const uint64_t type_at = c.pos();
  const auto elem = c.read<uint32_t>(kd + " array element type");
  if (elem > 12) {
    fail(ErrorCode::kGgufBadType,
         kd + " array element type " + num(elem) + " at offset " + num(type_at) + " is not a GGUF value type (0..12)");
  }
  const uint64_t count_at = c.pos();
  const auto count = c.read<uint64_t>(kd + " array count");
  // Smallest encoding of one element: its fixed size, 8 for a string (length), 12 for a
  // nested array (type + count).
  const uint64_t min_elem = elem == 8 ? 8 : elem == 9 ? 12 : scalar_size(elem);
  if (count > c.left() / min_elem) {
    fail(ErrorCode::kGgufBadLength, kd + " array of " + std::string(value_type_name(elem)) + " count " + num(count) +
                                        " at offset " + num(count_at) + " needs at least " + num(min_elem) +
                                        " bytes per element but only " + num(c.left()) +
                                        " bytes are left in the file after it");
  }
  GgufArray a;
  a.elem_type_ = static_cast<GgufValueType>(elem);
  a.size_ = static_cast<size_t>(count);
  if (elem == 8) {
    // Two passes: validate every length and sum them, then copy into one exact-size blob.
    const uint64_t start = c.pos();
    uint64_t total = 0;
    for (uint64_t i = 0; i < count; ++i) total += c.read_string(kd + " STRING element " + num(i)).size();
    c.seek(start);
    a.bytes_.reserve(static_cast<size_t>(total));
    a.ends_.reserve(static_cast<size_t>(count));
    for (uint64_t i = 0; i < count; ++i) {
      const std::string_view s = c.read_string(kd + " STRING element " + num(i));
      const auto* p = reinterpret_cast<const std::byte*>(s.data());
      a.bytes_.insert(a.bytes_.end(), p, p + s.size());
      a.ends_.push_back(a.bytes_.size());
    }
  } else if (elem == 9) {
    a.arrays_.reserve(static_cast<size_t>(count));
    for (uint64_t i = 0; i < count; ++i) a.arrays_.push_back(read(c, key, depth + 1));
  } else {
    const uint64_t n = count * min_elem;  // no overflow: checked against the bytes left
    const std::byte* p = c.read_bytes(n, kd + " array elements");
    a.bytes_.assign(p, p + n);
  }
  return a;
}

struct GgufFile::Impl {
  std::filesystem::path path;
  Buffer buf;
  uint32_t version = 0;
  uint32_t alignment = kDefaultAlignment;
  uint64_t data_offset = 0;
  std::vector<GgufKv> kvs;
  std::vector<GgufTensorInfo> tensors;
  // Views into the buffer (stable for the object's lifetime).
  std::unordered_map<std::string_view, size_t> key_index;
  std::unordered_map<std::string_view, size_t> tensor_index;

  void parse(const GgufOpenOptions& options);

 private:
  GgufValue read_value(Cursor& c, uint32_t type, std::string_view key);
  // The steps of parse(), in order.
  void parse_header(Cursor& c);
  void parse_metadata(Cursor& c, uint64_t kv_count);
  void parse_alignment(const GgufOpenOptions& options);
  void parse_tensor_infos(Cursor& c, uint64_t tensor_count, std::vector<uint64_t>& info_offsets);
  void locate_data(Cursor& c, const std::vector<uint64_t>& info_offsets);
  void check_overlaps();
  /// Every F32/F16/BF16 element and every quantisation block scale is finite.
  void check_values() const;
};

namespace {

std::string key_desc(std::string_view key) {
  return "key " + q_name(key);
}

}  // namespace

GgufValue GgufFile::Impl::read_value(Cursor& c, uint32_t type, std::string_view key) {
  GgufValue v;
  v.type = static_cast<GgufValueType>(type);
  const std::string kd = key_desc(key);
  switch (type) {
    case 0:
      v.value = uint64_t{c.read<uint8_t>(kd + " UINT8 value")};
      break;
    case 1:
      v.value = int64_t{c.read<int8_t>(kd + " INT8 value")};
      break;
    case 2:
      v.value = uint64_t{c.read<uint16_t>(kd + " UINT16 value")};
      break;
    case 3:
      v.value = int64_t{c.read<int16_t>(kd + " INT16 value")};
      break;
    case 4:
      v.value = uint64_t{c.read<uint32_t>(kd + " UINT32 value")};
      break;
    case 5:
      v.value = int64_t{c.read<int32_t>(kd + " INT32 value")};
      break;
    case 6:
      v.value = double{c.read<float>(kd + " FLOAT32 value")};
      break;
    case 7:
      v.value = c.read<uint8_t>(kd + " BOOL value") != 0;
      break;
    case 8:
      v.value = std::string(c.read_string(kd + " STRING value"));
      break;
    case 10:
      v.value = c.read<uint64_t>(kd + " UINT64 value");
      break;
    case 11:
      v.value = c.read<int64_t>(kd + " INT64 value");
      break;
    case 12:
      v.value = c.read<double>(kd + " FLOAT64 value");
      break;
    case 9:
      v.value = GgufArrayReader::read(c, key, 0);
      break;
    default:
      break;  // refused by the caller
  }
  return v;
}

void GgufFile::Impl::parse(const GgufOpenOptions& options) {
  Cursor c(buf.data, buf.size);
  parse_header(c);
  const auto tensor_count = c.read<uint64_t>("header tensor_count");
  const auto kv_count = c.read<uint64_t>("header kv_count");
  parse_metadata(c, kv_count);
  parse_alignment(options);
  std::vector<uint64_t> info_offsets;  // file offset of each tensor's info
  parse_tensor_infos(c, tensor_count, info_offsets);
  locate_data(c, info_offsets);
  check_overlaps();
  if (options.check_block_scales) check_values();
}

void GgufFile::Impl::parse_header(Cursor& c) {
  if (buf.size < 4) {
    fail(ErrorCode::kGgufTruncated,
         "file " + path.string() + " is " + num(buf.size) + " bytes, too short for the 4-byte magic at offset 0");
  }
  if (std::memcmp(buf.data, "GGUF", 4) != 0) {
    fail(ErrorCode::kGgufBadMagic, "file " + path.string() + " does not start with the magic \"GGUF\" at offset 0");
  }
  c.seek(4);
  version = c.read<uint32_t>("header version");
  if (version != 2 && version != 3) {
    const uint32_t swapped =
        ((version & 0xFFu) << 24) | ((version & 0xFF00u) << 8) | ((version >> 8) & 0xFF00u) | (version >> 24);
    fail(ErrorCode::kGgufBadVersion, "header version " + num(version) + " at offset 4 is not supported (only 2 and 3)" +
                                         (swapped == 2 || swapped == 3 ? "; this looks like a big-endian GGUF" : ""));
  }
}

void GgufFile::Impl::parse_metadata(Cursor& c, uint64_t kv_count) {
  // ---- metadata
  // Reserve only what can possibly fit; each KV is validated as it is read.
  kvs.reserve(static_cast<size_t>(std::min(kv_count, c.left() / kMinKvBytes)));
  for (uint64_t i = 0; i < kv_count; ++i) {
    const uint64_t key_at = c.pos();
    const std::string idx = "key #" + num(i);
    const std::string_view key = c.read_string(idx);
    const std::string kd = key_desc(key);
    const uint64_t type_at = c.pos();
    const auto type = c.read<uint32_t>(kd + " value type");
    if (type > 12) {
      fail(ErrorCode::kGgufBadType, kd + " (offset " + num(key_at) + ") has value type " + num(type) + " at offset " +
                                        num(type_at) + ", which is not a GGUF value type (0..12)");
    }
    if (auto [it, inserted] = key_index.emplace(key, static_cast<size_t>(i)); !inserted) {
      const GgufKv& first = kvs[it->second];
      fail(ErrorCode::kGgufDuplicateKey, "duplicate " + kd + " at offset " + num(key_at) + " (index " + num(i) +
                                             "); first defined at offset " + num(first.file_offset) + " (index " +
                                             num(it->second) + ")");
    }
    GgufKv kv;
    kv.key = std::string(key);
    kv.file_offset = key_at;
    kv.value = read_value(c, type, key);
    kvs.push_back(std::move(kv));
  }
}

void GgufFile::Impl::parse_alignment(const GgufOpenOptions& options) {
  // ---- general.alignment
  if (auto it = key_index.find("general.alignment"); it != key_index.end()) {
    const GgufKv& kv = kvs[it->second];
    const std::string rule = "; it must be a UINT32 (type 4) non-zero power of two <= " + num(options.max_alignment);
    if (kv.value.type != GgufValueType::kUint32) {
      fail(ErrorCode::kGgufBadAlignment, "key 'general.alignment' at offset " + num(kv.file_offset) + " has type " +
                                             type_desc(kv.value.type) + rule +
                                             " (a wrong-typed value is not reinterpreted)");
    }
    const uint64_t a = std::get<uint64_t>(kv.value.value);
    if (a == 0 || (a & (a - 1)) != 0 || a > options.max_alignment) {
      fail(ErrorCode::kGgufBadAlignment,
           "key 'general.alignment' at offset " + num(kv.file_offset) + " has value " + num(a) + rule);
    }
    alignment = static_cast<uint32_t>(a);
  }
}

void GgufFile::Impl::parse_tensor_infos(Cursor& c, uint64_t tensor_count, std::vector<uint64_t>& info_offsets) {
  // ---- tensor infos
  if (tensor_count > c.left() / kMinTensorInfoBytes) {
    const ErrorCode code = c.left() < kMinTensorInfoBytes ? ErrorCode::kGgufTruncated : ErrorCode::kGgufBadLength;
    fail(code, "header tensor_count " + num(tensor_count) +
                   " at offset 8 cannot fit: each tensor info needs at least " + num(kMinTensorInfoBytes) +
                   " bytes and only " + num(c.left()) + " bytes are left at offset " + num(c.pos()) + " (file is " +
                   num(c.size()) + " bytes)");
  }
  tensors.reserve(static_cast<size_t>(tensor_count));
  info_offsets.reserve(static_cast<size_t>(tensor_count));
  for (uint64_t i = 0; i < tensor_count; ++i) {
    const uint64_t name_at = c.pos();
    const std::string_view name = c.read_string("tensor #" + num(i) + " name");
    const std::string td = "tensor " + q_name(name);
    if (auto [it, inserted] = tensor_index.emplace(name, static_cast<size_t>(i)); !inserted) {
      fail(ErrorCode::kGgufDuplicateTensor, "duplicate " + td + " at offset " + num(name_at) + " (index " + num(i) +
                                                "); first defined at offset " + num(info_offsets[it->second]) +
                                                " (index " + num(it->second) + ")");
    }
    GgufTensorInfo t;
    t.name = std::string(name);
    const uint64_t ndims_at = c.pos();
    const auto n_dims = c.read<uint32_t>(td + " n_dims");
    if (n_dims < 1 || n_dims > 4) {
      fail(ErrorCode::kGgufBadTensor,
           td + " has n_dims " + num(n_dims) + " at offset " + num(ndims_at) + "; it must be 1..4");
    }
    uint64_t n_el = 1;
    t.ne.reserve(n_dims);
    for (uint32_t d = 0; d < n_dims; ++d) {
      const uint64_t dim_at = c.pos();
      const auto ne = c.read<uint64_t>(td + " ne[" + num(d) + "]");
      if (ne < 1 || ne > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        fail(ErrorCode::kGgufBadTensor,
             td + " ne[" + num(d) + "] = " + num(ne) + " at offset " + num(dim_at) + " must be in 1..2^63-1");
      }
      if (n_el > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) / ne) {
        fail(ErrorCode::kGgufBadTensor,
             td + " element count overflows at ne[" + num(d) + "] = " + num(ne) + " (offset " + num(dim_at) + ")");
      }
      n_el *= ne;
      t.ne.push_back(static_cast<int64_t>(ne));
    }
    const uint64_t type_at = c.pos();
    const auto type = c.read<uint32_t>(td + " type");
    if (!known_ggml_type(type)) {
      fail(ErrorCode::kGgufBadType, td + " has ggml type " + num(type) + " at offset " + num(type_at) +
                                        ", which Tandem does not support (" + supported_types_list() + ")");
    }
    t.type = static_cast<GgmlType>(type);
    const auto blk = static_cast<uint64_t>(ggml_block_elements(t.type));
    const auto bb = static_cast<uint64_t>(ggml_block_bytes(t.type));
    if (static_cast<uint64_t>(t.ne[0]) % blk != 0) {
      fail(ErrorCode::kGgufBadTensor, td + " (" + std::string(ggml_type_name(t.type)) +
                                          ") row length ne[0] = " + snum(t.ne[0]) + " at offset " + num(ndims_at + 4) +
                                          " is not a multiple of the block size " + num(blk));
    }
    const uint64_t n_blocks = n_el / blk;
    if (n_blocks > std::numeric_limits<uint64_t>::max() / bb) {
      fail(ErrorCode::kGgufBadTensor,
           td + " byte size overflows (" + num(n_el) + " elements, info at offset " + num(name_at) + ")");
    }
    t.n_elements = n_el;
    t.n_bytes = n_blocks * bb;
    const uint64_t off_at = c.pos();
    t.offset = c.read<uint64_t>(td + " offset");
    if (t.offset % alignment != 0) {
      fail(ErrorCode::kGgufBadAlignment, td + " data offset " + num(t.offset) + " at offset " + num(off_at) +
                                             " is not a multiple of the alignment " + num(alignment));
    }
    info_offsets.push_back(name_at);
    tensors.push_back(std::move(t));
  }
}

void GgufFile::Impl::locate_data(Cursor& c, const std::vector<uint64_t>& info_offsets) {
  // ---- data section
  const uint64_t end_of_infos = c.pos();
  data_offset = end_of_infos + (alignment - end_of_infos % alignment) % alignment;

  // Extents: [data_offset + offset, + n_bytes) must lie inside the file. All arithmetic is
  // overflow-checked; nothing of the data section is read yet.
  for (size_t i = 0; i < tensors.size(); ++i) {
    GgufTensorInfo& t = tensors[i];
    const std::string td = "tensor " + q_name(t.name);
    const uint64_t size = c.size();
    const bool start_ok = t.offset <= std::numeric_limits<uint64_t>::max() - data_offset;
    const uint64_t start = start_ok ? data_offset + t.offset : 0;
    if (!start_ok || start > size || t.n_bytes > size - start) {
      const std::string range =
          start_ok ? "[" + num(start) + ", " +
                         (t.n_bytes <= std::numeric_limits<uint64_t>::max() - start ? num(start + t.n_bytes)
                                                                                    : std::string("overflow")) +
                         ")"
                   : "(data_start " + num(data_offset) + " + offset " + num(t.offset) + " overflows)";
      fail(ErrorCode::kGgufTruncated, td + " data " + range + " (offset " + num(t.offset) + " from info at offset " +
                                          num(info_offsets[i]) + ", " + num(t.n_bytes) +
                                          " bytes) runs past the end of the file (" + num(size) + " bytes)");
    }
    t.data = buf.data + start;
  }
}

void GgufFile::Impl::check_overlaps() {
  // Overlapping data regions are refused (llama.cpp does not check this).
  if (tensors.size() > 1) {
    std::vector<size_t> order(tensors.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return tensors[a].offset < tensors[b].offset || (tensors[a].offset == tensors[b].offset && a < b);
    });
    for (size_t k = 1; k < order.size(); ++k) {
      const GgufTensorInfo& a = tensors[order[k - 1]];
      const GgufTensorInfo& b = tensors[order[k]];
      if (a.offset + a.n_bytes > b.offset) {  // no overflow: both are inside the file
        fail(ErrorCode::kGgufBadTensor, "tensor " + q_name(b.name) + " data at file offset " +
                                            num(data_offset + b.offset) + " overlaps tensor " + q_name(a.name) +
                                            " data [" + num(data_offset + a.offset) + ", " +
                                            num(data_offset + a.offset + a.n_bytes) + ")");
      }
    }
  }
}

void GgufFile::Impl::check_values() const {
  // ---- block scales and float values
  for (const GgufTensorInfo& t : tensors) {
    if (t.type == GgmlType::kF32 || t.type == GgmlType::kF16 || t.type == GgmlType::kBF16) {
      // Every element: an exponent of all ones is Inf or NaN (F32: 0x7F800000; F16:
      // 0x7C00; BF16: 0x7F80).
      const uint64_t n = t.n_elements;
      for (uint64_t i = 0; i < n; ++i) {
        bool bad;
        if (t.type == GgmlType::kF32) {
          uint32_t v;
          std::memcpy(&v, t.data + i * 4, 4);
          bad = (v & 0x7F800000u) == 0x7F800000u;
        } else {
          uint16_t v;
          std::memcpy(&v, t.data + i * 2, 2);
          bad = t.type == GgmlType::kF16 ? (v & 0x7C00u) == 0x7C00u : (v & 0x7F80u) == 0x7F80u;
        }
        if (bad) {
          const uint64_t elem_bytes = t.type == GgmlType::kF32 ? 4 : 2;
          fail(ErrorCode::kTensorNonFinite, "tensor " + q_name(t.name) + " (" + std::string(ggml_type_name(t.type)) +
                                                ") element " + num(i) + " at offset " +
                                                num(data_offset + t.offset + i * elem_bytes) + " is Inf or NaN");
        }
      }
      continue;
    }
    const TypeTraits& tt = *traits(t.type);
    const auto bb = static_cast<uint64_t>(tt.block_bytes);
    const uint64_t n_blocks = t.n_bytes / bb;
    for (uint64_t b = 0; b < n_blocks; ++b) {
      for (int si = 0; si < tt.n_scales; ++si) {
        const TypeTraits::Scale& sc = tt.scales[si];
        uint16_t d;
        std::memcpy(&d, t.data + b * bb + sc.offset, sizeof d);
        if ((d & 0x7C00u) == 0x7C00u) {
          const char* what = (d & 0x03FFu) != 0 ? "NaN" : (d & 0x8000u) ? "-Inf" : "+Inf";
          fail(ErrorCode::kTensorNonFinite, "tensor " + q_name(t.name) + " (" + std::string(tt.name) + ") block " +
                                                num(b) + " at offset " + num(data_offset + t.offset + b * bb) +
                                                " has a non-finite fp16 " + sc.name + " " + hex16(d) + " (" + what +
                                                ")");
        }
      }
    }
  }
}

// ------------------------------------------------------------------ GgufArray

void GgufArray::check_index(size_t i, GgufValueType want) const {
  if (elem_type_ != want) {
    throw Error(ErrorCode::kInvalidArgument,
                "GGUF: array of " + type_desc(elem_type_) + " read as an array of " + type_desc(want));
  }
  if (i >= size_) {
    throw Error(ErrorCode::kInvalidArgument, "GGUF: array index " + num(i) + " out of range [0, " + num(size_) + ")");
  }
}

std::string_view GgufArray::string_at(size_t i) const {
  check_index(i, GgufValueType::kString);
  const uint64_t begin = i == 0 ? 0 : ends_[i - 1];
  return {reinterpret_cast<const char*>(bytes_.data()) + begin, static_cast<size_t>(ends_[i] - begin)};
}

const GgufArray& GgufArray::array_at(size_t i) const {
  check_index(i, GgufValueType::kArray);
  return arrays_[i];
}

GgufValue GgufArray::at(size_t i) const {
  check_index(i, elem_type_);
  GgufValue v;
  v.type = elem_type_;
  const std::byte* p = bytes_.data() + i * scalar_size(static_cast<uint32_t>(elem_type_));
  const auto load = [p](auto zero) {
    std::memcpy(&zero, p, sizeof zero);
    return zero;
  };
  switch (elem_type_) {
    case GgufValueType::kUint8:
      v.value = uint64_t{load(uint8_t{})};
      break;
    case GgufValueType::kInt8:
      v.value = int64_t{load(int8_t{})};
      break;
    case GgufValueType::kUint16:
      v.value = uint64_t{load(uint16_t{})};
      break;
    case GgufValueType::kInt16:
      v.value = int64_t{load(int16_t{})};
      break;
    case GgufValueType::kUint32:
      v.value = uint64_t{load(uint32_t{})};
      break;
    case GgufValueType::kInt32:
      v.value = int64_t{load(int32_t{})};
      break;
    case GgufValueType::kUint64:
      v.value = load(uint64_t{});
      break;
    case GgufValueType::kInt64:
      v.value = load(int64_t{});
      break;
    case GgufValueType::kFloat32:
      v.value = double{load(float{})};
      break;
    case GgufValueType::kFloat64:
      v.value = load(double{});
      break;
    case GgufValueType::kBool:
      v.value = load(uint8_t{}) != 0;
      break;
    case GgufValueType::kString:
      v.value = std::string(string_at(i));
      break;
    case GgufValueType::kArray:
      v.value = arrays_[i];
      break;
  }
  return v;
}

// ------------------------------------------------------------------ GgufFile

namespace {

[[noreturn]] void io_fail(const std::filesystem::path& path, const std::string& what, int err) {
  throw Error(ErrorCode::kIo, "GGUF: cannot " + what + " " + path.string() + ": " + errno_message(err));
}

}  // namespace

GgufFile::GgufFile(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GgufFile::~GgufFile() = default;

std::shared_ptr<const GgufFile> GgufFile::open(const std::filesystem::path& path, const GgufOpenOptions& options) {
  try {
    auto impl = std::make_unique<Impl>();
    impl->path = path;
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) io_fail(path, "open", errno);
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      const int e = errno;
      ::close(fd);
      io_fail(path, "stat", e);
    }
    if (S_ISDIR(st.st_mode)) {
      ::close(fd);
      throw Error(ErrorCode::kIo, "GGUF: " + path.string() + " is a directory, not a GGUF file");
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd);
      throw Error(ErrorCode::kIo, "GGUF: " + path.string() + " is not a regular file");
    }
    const auto size = static_cast<uint64_t>(st.st_size);
    if (size == 0) {
      ::close(fd);
      throw Error(ErrorCode::kGgufTruncated,
                  "GGUF: file " + path.string() + " is empty (0 bytes); the header needs 24");
    }
    if (size > std::numeric_limits<size_t>::max()) {
      ::close(fd);
      throw Error(ErrorCode::kIo, "GGUF: " + path.string() + " is too large to map");
    }
    void* m = ::mmap(nullptr, static_cast<size_t>(size), PROT_READ, MAP_PRIVATE, fd, 0);
    const int e = errno;
    ::close(fd);
    if (m == MAP_FAILED) io_fail(path, "mmap", e);
    impl->buf.map = m;
    impl->buf.map_len = static_cast<size_t>(size);
    impl->buf.data = static_cast<const std::byte*>(m);
    impl->buf.size = size;
    impl->parse(options);
    return std::shared_ptr<const GgufFile>(new GgufFile(std::move(impl)));
  } catch (const Error&) {
    throw;
  } catch (const std::bad_alloc&) {
    throw Error(ErrorCode::kOutOfMemory, "GGUF: out of memory while reading " + path.string());
  } catch (const std::length_error&) {
    throw Error(ErrorCode::kOutOfMemory, "GGUF: out of memory while reading " + path.string());
  } catch (const std::exception& ex) {
    throw Error(ErrorCode::kInternal, std::string("GGUF: unexpected error: ") + ex.what());
  }
}

std::shared_ptr<const GgufFile> GgufFile::from_bytes(std::span<const std::byte> bytes, const GgufOpenOptions& options) {
  try {
    auto impl = std::make_unique<Impl>();
    impl->path = "<memory>";
    if (bytes.empty()) {
      throw Error(ErrorCode::kGgufTruncated, "GGUF: buffer <memory> is empty (0 bytes)");
    }
    // Aligned copy so tensor views have the same alignment as in a page-aligned mapping
    // (up to 64 bytes).
    impl->buf.heap = static_cast<std::byte*>(::operator new[](bytes.size(), std::align_val_t{64}));
    std::memcpy(impl->buf.heap, bytes.data(), bytes.size());
    impl->buf.data = impl->buf.heap;
    impl->buf.size = bytes.size();
    impl->parse(options);
    return std::shared_ptr<const GgufFile>(new GgufFile(std::move(impl)));
  } catch (const Error&) {
    throw;
  } catch (const std::bad_alloc&) {
    throw Error(ErrorCode::kOutOfMemory, "GGUF: out of memory while parsing a buffer");
  } catch (const std::length_error&) {
    throw Error(ErrorCode::kOutOfMemory, "GGUF: out of memory while parsing a buffer");
  } catch (const std::exception& ex) {
    throw Error(ErrorCode::kInternal, std::string("GGUF: unexpected error: ") + ex.what());
  }
}

uint32_t GgufFile::version() const noexcept {
  return impl_->version;
}
uint32_t GgufFile::alignment() const noexcept {
  return impl_->alignment;
}
uint64_t GgufFile::data_offset() const noexcept {
  return impl_->data_offset;
}
uint64_t GgufFile::file_size() const noexcept {
  return impl_->buf.size;
}
const std::filesystem::path& GgufFile::path() const noexcept {
  return impl_->path;
}
const std::vector<GgufKv>& GgufFile::metadata() const noexcept {
  return impl_->kvs;
}
const std::vector<GgufTensorInfo>& GgufFile::tensors() const noexcept {
  return impl_->tensors;
}

const GgufValue* GgufFile::find(std::string_view key) const noexcept {
  auto it = impl_->key_index.find(key);
  return it == impl_->key_index.end() ? nullptr : &impl_->kvs[it->second].value;
}

const GgufTensorInfo* GgufFile::find_tensor(std::string_view name) const noexcept {
  auto it = impl_->tensor_index.find(name);
  return it == impl_->tensor_index.end() ? nullptr : &impl_->tensors[it->second];
}

void GgufFile::release_pages(const std::byte* data, uint64_t n_bytes) const noexcept {
  const Buffer& b = impl_->buf;
  if (b.map == nullptr || data == nullptr) return;  // from_bytes: heap memory, never released
  const auto map_begin = reinterpret_cast<uintptr_t>(b.map);
  const auto begin = reinterpret_cast<uintptr_t>(data);
  if (begin < map_begin || begin - map_begin > b.map_len || n_bytes > b.map_len - (begin - map_begin)) return;
  const long page_size = ::sysconf(_SC_PAGESIZE);
  if (page_size <= 0) return;
  const auto page = static_cast<uintptr_t>(page_size);
  const uintptr_t first = (begin + page - 1) / page * page;
  const uintptr_t last = (begin + n_bytes) / page * page;
  if (first >= last) return;
  // MADV_RANDOM first: it gives the range a mapping (VMA) of its own, and the kernel's
  // fault-around, which maps the cached neighbours of a faulting page (a whole large folio
  // on recent kernels), stays inside one mapping. Without it, reading a small tensor beside
  // a released matrix (a norm) mapped most of the matrix's pages back (SmolLM2 Q4_K_M: 62 of
  // 72 MB after one step). MADV_DONTNEED then unmaps the pages: a read-only private mapping
  // never holds a copied-on-write page, so they are the file's and come back from it.
  void* const p = static_cast<std::byte*>(b.map) + (first - map_begin);
  const auto len = static_cast<size_t>(last - first);
  (void)::madvise(p, len, MADV_RANDOM);
  (void)::madvise(p, len, MADV_DONTNEED);
}

// ------------------------------------------------------------------ typed getters

namespace {

[[noreturn]] void bad_type(std::string_view key, const GgufValue& v, const std::string& want) {
  fail(ErrorCode::kGgufBadType, "key " + q_name(key) + " holds " + type_desc(v.type) + ", not " + want);
}

// Integer value of an integer-typed GgufValue as (negative?, magnitude-ish) pair.
// Returns true and sets `out` when the value fits in T.
template <typename T>
bool int_fits(const GgufValue& v, T& out) {
  if (std::holds_alternative<uint64_t>(v.value)) {
    const uint64_t u = std::get<uint64_t>(v.value);
    if (u > static_cast<uint64_t>(std::numeric_limits<T>::max())) return false;
    out = static_cast<T>(u);
    return true;
  }
  const int64_t s = std::get<int64_t>(v.value);
  if constexpr (std::is_unsigned_v<T>) {
    if (s < 0) return false;
    out = static_cast<T>(s);
  } else {
    out = static_cast<T>(s);
  }
  return true;
}

std::string int_repr(const GgufValue& v) {
  return std::holds_alternative<uint64_t>(v.value) ? num(std::get<uint64_t>(v.value))
                                                   : snum(std::get<int64_t>(v.value));
}

float to_float(const GgufValue& v) {
  if (std::holds_alternative<double>(v.value)) return static_cast<float>(std::get<double>(v.value));
  if (std::holds_alternative<uint64_t>(v.value)) return static_cast<float>(std::get<uint64_t>(v.value));
  return static_cast<float>(std::get<int64_t>(v.value));
}

}  // namespace

std::optional<std::string> GgufFile::get_string(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) return std::nullopt;
  if (v->type != GgufValueType::kString) bad_type(key, *v, "a STRING");
  return std::get<std::string>(v->value);
}

std::optional<uint64_t> GgufFile::get_uint(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) return std::nullopt;
  if (!is_integer_type(v->type)) bad_type(key, *v, "an unsigned integer");
  uint64_t out = 0;
  if (!int_fits(*v, out)) {
    fail(ErrorCode::kGgufBadType, "key " + q_name(key) + " holds " + type_desc(v->type) + " value " + int_repr(*v) +
                                      ", which does not fit an unsigned integer");
  }
  return out;
}

std::optional<int64_t> GgufFile::get_int(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) return std::nullopt;
  if (!is_integer_type(v->type)) bad_type(key, *v, "an integer");
  int64_t out = 0;
  if (!int_fits(*v, out)) {
    fail(ErrorCode::kGgufBadType, "key " + q_name(key) + " holds " + type_desc(v->type) + " value " + int_repr(*v) +
                                      ", which does not fit a signed 64-bit integer");
  }
  return out;
}

std::optional<float> GgufFile::get_float(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) return std::nullopt;
  if (!is_float_type(v->type) && !is_integer_type(v->type)) bad_type(key, *v, "a number");
  return to_float(*v);
}

std::optional<bool> GgufFile::get_bool(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) return std::nullopt;
  if (v->type != GgufValueType::kBool) bad_type(key, *v, "a BOOL");
  return std::get<bool>(v->value);
}

std::optional<std::vector<std::string_view>> GgufFile::get_string_array(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) return std::nullopt;
  if (v->type != GgufValueType::kArray || std::get<GgufArray>(v->value).elem_type() != GgufValueType::kString) {
    bad_type(key, *v, "an ARRAY of STRING");
  }
  const auto& arr = std::get<GgufArray>(v->value);
  std::vector<std::string_view> out;
  out.reserve(arr.size());
  for (size_t i = 0; i < arr.size(); ++i) out.push_back(arr.string_at(i));
  return out;
}

std::optional<std::vector<float>> GgufFile::get_float_array(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) return std::nullopt;
  if (v->type != GgufValueType::kArray) bad_type(key, *v, "an ARRAY of numbers");
  const auto& arr = std::get<GgufArray>(v->value);
  if (!is_float_type(arr.elem_type()) && !is_integer_type(arr.elem_type())) {
    fail(ErrorCode::kGgufBadType,
         "key " + q_name(key) + " is an ARRAY of " + type_desc(arr.elem_type()) + ", not an ARRAY of numbers");
  }
  std::vector<float> out;
  out.reserve(arr.size());
  for (size_t i = 0; i < arr.size(); ++i) out.push_back(to_float(arr.at(i)));
  return out;
}

std::optional<std::vector<int64_t>> GgufFile::get_int_array(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) return std::nullopt;
  if (v->type != GgufValueType::kArray) bad_type(key, *v, "an ARRAY of integers");
  const auto& arr = std::get<GgufArray>(v->value);
  if (!is_integer_type(arr.elem_type())) {
    fail(ErrorCode::kGgufBadType,
         "key " + q_name(key) + " is an ARRAY of " + type_desc(arr.elem_type()) + ", not an ARRAY of integers");
  }
  std::vector<int64_t> out;
  out.reserve(arr.size());
  for (size_t i = 0; i < arr.size(); ++i) {
    const GgufValue item = arr.at(i);
    int64_t x = 0;
    if (!int_fits(item, x)) {
      fail(ErrorCode::kGgufBadType, "key " + q_name(key) + " element " + num(i) + " value " + int_repr(item) +
                                        " does not fit a signed 64-bit integer");
    }
    out.push_back(x);
  }
  return out;
}

}  // namespace tandem
