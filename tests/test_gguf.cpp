// GGUF reader tests: field cases B01, B02, B05, B06, B07 (docs/field-cases.md) built byte
// by byte, value-type round trips, getters, and the real models in shared/models.
//
// The malformed inputs are also stored in tests/data/gguf-malformed/<name>.gguf with the
// expected code in expected.txt; the "[gguf][corpus]" test checks the stored files equal
// what the builders here produce and fail with that code. To rewrite them after changing
// a builder: TANDEM_REGEN_GGUF_CORPUS=1 tandem-tests "[corpus]".
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <sstream>
#include <tuple>

#include "tandem/core/error.hpp"
#include "tandem/gguf/gguf.hpp"
#include "test_support.hpp"

using tandem::Error;
using tandem::ErrorCode;
using tandem::GgmlType;
using tandem::GgufFile;
using tandem::GgufOpenOptions;
using tandem::GgufValueType;

namespace {

// ------------------------------------------------------------------ byte builder

struct Bytes {
  std::vector<uint8_t> b;
  size_t size() const { return b.size(); }
  template <typename T>
  Bytes& put(T v) {
    const size_t n = b.size();
    b.resize(n + sizeof(T));
    std::memcpy(b.data() + n, &v, sizeof(T));
    return *this;
  }
  Bytes& u8(uint8_t v) { return put(v); }
  Bytes& u16(uint16_t v) { return put(v); }
  Bytes& u32(uint32_t v) { return put(v); }
  Bytes& u64(uint64_t v) { return put(v); }
  Bytes& str(std::string_view s) {
    u64(s.size());
    const size_t n = b.size();
    b.resize(n + s.size());
    if (!s.empty()) std::memcpy(b.data() + n, s.data(), s.size());
    return *this;
  }
  Bytes& raw(std::initializer_list<uint8_t> v) {
    const size_t n = b.size();
    b.resize(n + v.size());
    std::memcpy(b.data() + n, v.begin(), v.size());
    return *this;
  }
  Bytes& fill(size_t n, uint8_t v) {
    b.resize(b.size() + n, v);
    return *this;
  }
  Bytes& pad_to(size_t n) {
    if (b.size() < n) b.resize(n, 0);
    return *this;
  }
  Bytes truncated(size_t n) const {
    Bytes r;
    r.b.assign(b.begin(), b.begin() + static_cast<std::ptrdiff_t>(std::min(n, b.size())));
    return r;
  }
  std::span<const std::byte> span() const { return {reinterpret_cast<const std::byte*>(b.data()), b.size()}; }
};

Bytes header(uint64_t n_tensors, uint64_t n_kv, uint32_t version = 3) {
  Bytes h;
  h.raw({'G', 'G', 'U', 'F'}).u32(version).u64(n_tensors).u64(n_kv);
  return h;
}
void kv_u32(Bytes& b, std::string_view key, uint32_t v) {
  b.str(key).u32(4).u32(v);
}
void kv_str(Bytes& b, std::string_view key, std::string_view v) {
  b.str(key).u32(8).str(v);
}
void tensor_info(Bytes& b, std::string_view name, std::vector<uint64_t> ne, uint32_t type, uint64_t offset) {
  b.str(name).u32(static_cast<uint32_t>(ne.size()));
  for (auto d : ne) b.u64(d);
  b.u32(type).u64(offset);
}
void q4_block(Bytes& b, uint16_t d, uint8_t qs) {
  b.u16(d).fill(16, qs);
}

// The "base file" of docs/field-cases.md: 1 tensor `t`, Q4_0, ne=[32,2], offset 0, padded
// to 96, two blocks (d=0x3C00, qs=0x0F*16), padded to 160. `kvs` adds KV pairs.
Bytes base_file(uint64_t offset = 0, const std::function<void(Bytes&)>& kvs = {}, uint64_t n_kv = 0,
                std::string_view name = "t") {
  Bytes b = header(1, n_kv);
  if (kvs) kvs(b);
  tensor_info(b, name, {32, 2}, 2, offset);
  b.pad_to((b.size() + 31) / 32 * 32);
  q4_block(b, 0x3C00, 0x0F);
  q4_block(b, 0x3C00, 0x0F);
  b.pad_to((b.size() + 31) / 32 * 32);
  return b;
}

// One-tensor Q4_0 file (B07): ne=[32,1], qs=0x0F*16, scale d.
Bytes one_block_file(uint16_t d, uint32_t type = 2) {
  Bytes b = header(1, 0);
  tensor_info(b, "t", {32, 1}, type, 0);
  b.pad_to(96);
  if (type == 2) {
    q4_block(b, d, 0x0F);
  } else {
    b.u16(d).fill(32, 1);
  }
  return b.pad_to(128);
}

float fp16_to_float(uint16_t h) {
  const uint32_t sign = (h >> 15) & 1u, exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
  float v;
  if (exp == 0) {
    v = std::ldexp(static_cast<float>(mant), -24);
  } else if (exp == 31) {
    v = mant ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  } else {
    v = std::ldexp(static_cast<float>(mant | 0x400u), static_cast<int>(exp) - 25);
  }
  return sign ? -v : v;
}

std::vector<float> dequant_q4_0(const std::byte* p, uint64_t n_blocks) {
  std::vector<float> out;
  for (uint64_t i = 0; i < n_blocks; ++i) {
    const auto* blk = reinterpret_cast<const uint8_t*>(p) + i * 18;
    uint16_t d;
    std::memcpy(&d, blk, 2);
    const float df = fp16_to_float(d);
    for (int j = 0; j < 16; ++j) out.push_back(df * static_cast<float>((blk[2 + j] & 0xF) - 8));
    for (int j = 0; j < 16; ++j) out.push_back(df * static_cast<float>((blk[2 + j] >> 4) - 8));
  }
  return out;
}

std::string code_name(ErrorCode c) {
  return std::string(tandem::error_code_name(c));
}

// Parse and expect failure with `code` and every needle in the message.
void expect_error(const Bytes& b, ErrorCode code, const std::vector<std::string>& needles,
                  const GgufOpenOptions& opt = {}) {
  try {
    auto f = GgufFile::from_bytes(b.span(), opt);
    FAIL("expected " << code_name(code) << " but the file loaded");
  } catch (const Error& e) {
    INFO("message: " << e.what());
    CHECK(code_name(e.code()) == code_name(code));
    for (const auto& n : needles) CHECK_THAT(e.what(), Catch::Contains(n));
  }
}

// ------------------------------------------------------------------ malformed cases

struct Case {
  std::string name;
  Bytes bytes;
  ErrorCode code;
  std::vector<std::string> needles;
};

std::vector<Case> malformed_cases() {
  std::vector<Case> cs;
  const std::string huge48 = "281474976710655";

  // ---- B01: huge lengths and counts
  {
    Bytes b = header(0, 1);
    b.u64(0x0000FFFFFFFFFFFFull);
    REQUIRE(b.size() == 32);
    cs.push_back({"b01_key_length_2p48", b, ErrorCode::kGgufBadLength, {"key #0 length", huge48, "offset 24"}});
  }
  {
    Bytes b = header(0, 1);
    b.u64(~0ull);
    cs.push_back(
        {"b01_key_length_max", b, ErrorCode::kGgufBadLength, {"key #0 length", "18446744073709551615", "offset 24"}});
  }
  {
    Bytes b = header(0, 1);
    b.str("k").u32(8);
    const size_t at = b.size();
    b.u64((1ull << 30) + 1).pad_to(100);
    cs.push_back({"b01_string_value_2p30",
                  b,
                  ErrorCode::kGgufBadLength,
                  {"'k'", "STRING value length 1073741825", "offset " + std::to_string(at)}});
  }
  {
    Bytes b = header(0, 1);
    b.str("a").u32(9).u32(4);
    const size_t at = b.size();
    b.u64(1ull << 62).pad_to(100);
    cs.push_back({"b01_array_u32_2p62",
                  b,
                  ErrorCode::kGgufBadLength,
                  {"'a'", "4611686018427387904", "offset " + std::to_string(at)}});
  }
  {
    Bytes b = header(1ull << 61, 0);
    b.pad_to(64);
    cs.push_back(
        {"b01_tensor_count_2p61", b, ErrorCode::kGgufBadLength, {"tensor_count 2305843009213693952", "offset 8"}});
    cs.push_back({"b01_tensor_count_2p61_header_only",
                  header(1ull << 61, 0),
                  ErrorCode::kGgufTruncated,
                  {"tensor_count 2305843009213693952", "offset 8"}});
  }
  {
    Bytes b = header(0, 1ull << 60);
    b.str("k").u32(0).u8(1).pad_to(48);  // kv #1 runs out of bytes
    cs.push_back({"b01_kv_count_2p60", b, ErrorCode::kGgufTruncated, {"offset 46", "value type"}});
  }
  {  // array of arrays, inner count too large
    Bytes b = header(0, 1);
    b.str("n").u32(9).u32(9).u64(1).u32(0);
    const size_t at = b.size();
    b.u64(1000).fill(10, 0);
    cs.push_back({"b01_nested_array_count",
                  b,
                  ErrorCode::kGgufBadLength,
                  {"'n'", "count 1000", "offset " + std::to_string(at)}});
  }

  // ---- B02: alignment
  {
    Bytes b = header(0, 1);
    kv_u32(b, "general.alignment", 0);
    REQUIRE(b.size() == 57);
    cs.push_back({"b02_alignment_0",
                  b,
                  ErrorCode::kGgufBadAlignment,
                  {"general.alignment", "offset 24", "value 0", "non-zero power of two"}});
  }
  for (uint32_t v : {3u, 0x80000000u, 48u}) {
    Bytes b = header(0, 1);
    kv_u32(b, "general.alignment", v);
    cs.push_back(
        {"b02_alignment_" + std::to_string(v),
         b,
         ErrorCode::kGgufBadAlignment,
         {"general.alignment", "offset 24", "value " + std::to_string(v), "non-zero power of two", "1048576"}});
  }
  {
    Bytes b = header(0, 1);
    b.str("general.alignment").u32(5).u32(32);
    cs.push_back({"b02_alignment_int32",
                  b,
                  ErrorCode::kGgufBadAlignment,
                  {"general.alignment", "offset 24", "INT32 (type 5)", "UINT32 (type 4)"}});
  }
  {
    Bytes b = header(0, 1);
    b.str("general.alignment").u32(10).u64(32);
    cs.push_back({"b02_alignment_uint64", b, ErrorCode::kGgufBadAlignment, {"general.alignment", "UINT64 (type 10)"}});
  }
  {
    Bytes b = header(0, 1);
    kv_u32(b, "general.alignment", 1u << 21);
    cs.push_back({"b02_alignment_above_cap",
                  b,
                  ErrorCode::kGgufBadAlignment,
                  {"general.alignment", "value 2097152", "1048576"}});
  }
  {
    // Offset field of the only tensor: 24 + (8 + 1) + 4 + 2*8 + 4 = 57.
    cs.push_back({"b02_tensor_offset_16",
                  base_file(16),
                  ErrorCode::kGgufBadAlignment,
                  {"tensor 't'", "offset 57", "16", "alignment 32"}});
  }

  // ---- B05: duplicates
  {
    Bytes b = base_file(
        0,
        [](Bytes& x) {
          kv_str(x, "general.architecture", "llama");
          kv_str(x, "general.architecture", "qwen2");
        },
        2);
    // second key at 24 + (8+20) + 4 + (8+5) = 69
    cs.push_back({"b05_dup_architecture",
                  b,
                  ErrorCode::kGgufDuplicateKey,
                  {"'general.architecture'", "index 1", "index 0", "offset 69", "offset 24"}});
  }
  {
    Bytes b = base_file(
        0,
        [](Bytes& x) {
          kv_u32(x, "llama.block_count", 2);
          kv_u32(x, "llama.block_count", 40);
        },
        2);
    cs.push_back({"b05_dup_block_count",
                  b,
                  ErrorCode::kGgufDuplicateKey,
                  {"'llama.block_count'", "index 1", "index 0", "offset 57", "offset 24"}});
  }
  {
    Bytes b = header(2, 0);
    tensor_info(b, "token_embd.weight", {32, 1}, 2, 0);
    const size_t at = b.size();
    tensor_info(b, "token_embd.weight", {32, 1}, 2, 32);
    b.pad_to((b.size() + 31) / 32 * 32);
    q4_block(b, 0x3C00, 0x0F);
    b.pad_to(b.size() + 14);
    q4_block(b, 0x3C00, 0x0F);
    cs.push_back({"b05_dup_tensor",
                  b,
                  ErrorCode::kGgufDuplicateTensor,
                  {"'token_embd.weight'", "index 1", "index 0", "offset " + std::to_string(at), "offset 24"}});
  }

  // ---- B06: truncation
  const Bytes base = base_file();
  for (size_t n : {131u, 114u, 96u}) {
    cs.push_back({"b06_truncated_" + std::to_string(n),
                  base.truncated(n),
                  ErrorCode::kGgufTruncated,
                  {"tensor 't'", "[96, 132)", "(" + std::to_string(n) + " bytes)"}});
  }
  cs.push_back({"b06_truncated_24", base.truncated(24), ErrorCode::kGgufTruncated, {"tensor_count 1", "offset 24"}});
  for (size_t n : {40u, 60u}) {  // inside the tensor info
    cs.push_back({"b06_truncated_" + std::to_string(n), base.truncated(n), ErrorCode::kGgufTruncated, {"offset"}});
  }
  cs.push_back({"b06_wrapping_offset",
                base_file(0xFFFFFFFFFFFFFFE0ull),
                ErrorCode::kGgufTruncated,
                {"tensor 't'", "18446744073709551584", "overflows"}});
  cs.push_back({"b06_offset_past_end",
                base_file(1024),
                ErrorCode::kGgufTruncated,
                {"tensor 't'", "[1120, 1156)", "(160 bytes)"}});

  // ---- B07: non-finite scales
  for (auto [d, what] : {std::pair<uint16_t, const char*>{0x7C00, "+Inf"}, {0xFC00, "-Inf"}, {0x7E00, "NaN"}}) {
    std::ostringstream nm;
    nm << "b07_q4_0_scale_" << std::hex << d;
    cs.push_back(
        {nm.str(), one_block_file(d), ErrorCode::kTensorNonFinite, {"tensor 't'", "block 0", "offset 96", what}});
  }
  {
    Bytes b = header(1, 0);
    tensor_info(b, "w8", {64, 1}, 8, 0);
    b.pad_to(96);
    b.u16(0x3C00).fill(32, 1);
    b.u16(0x7E01).fill(32, 1);
    cs.push_back({"b07_q8_0_nan_block1",
                  b,
                  ErrorCode::kTensorNonFinite,
                  {"tensor 'w8'", "Q8_0", "block 1", "offset 130", "NaN"}});
  }

  // ---- header
  {
    Bytes b = header(0, 0);
    b.b[3] = 'X';
    cs.push_back({"bad_magic", b, ErrorCode::kGgufBadMagic, {"GGUF", "offset 0"}});
  }
  cs.push_back({"version_1", header(0, 0, 1), ErrorCode::kGgufBadVersion, {"version 1", "offset 4"}});
  cs.push_back({"version_4", header(0, 0, 4), ErrorCode::kGgufBadVersion, {"version 4", "offset 4"}});
  cs.push_back({"short_3_bytes", header(0, 0).truncated(3), ErrorCode::kGgufTruncated, {"3 bytes", "offset 0"}});
  cs.push_back({"short_header_20", header(0, 0).truncated(20), ErrorCode::kGgufTruncated, {"kv_count", "offset 16"}});

  // ---- value types
  {
    Bytes b = header(0, 1);
    b.str("k");
    const size_t at = b.size();
    b.u32(13).u32(0);
    cs.push_back(
        {"unknown_value_type", b, ErrorCode::kGgufBadType, {"'k'", "value type 13", "offset " + std::to_string(at)}});
  }
  {
    Bytes b = header(0, 1);
    b.str("arr").u32(9);
    const size_t at = b.size();
    b.u32(77).u64(0);
    cs.push_back({"unknown_array_elem_type",
                  b,
                  ErrorCode::kGgufBadType,
                  {"'arr'", "element type 77", "offset " + std::to_string(at)}});
  }
  {
    Bytes b = header(0, 1);
    b.str("k").u32(6).u16(0);
    cs.push_back({"truncated_float_value",
                  b,
                  ErrorCode::kGgufTruncated,
                  {"'k'", "FLOAT32 value", "offset 37", "needs 4 bytes"}});
  }
  {
    Bytes b = header(0, 1);
    b.str("deep").u32(9);
    for (int i = 0; i < 100; ++i) b.u32(9).u64(1);
    b.u32(0).u64(0);
    cs.push_back({"array_nesting_too_deep", b, ErrorCode::kGgufBadType, {"'deep'", "nested"}});
  }

  // ---- tensor infos
  auto tensor_case = [&](const std::string& name, std::vector<uint64_t> ne, uint32_t type, ErrorCode code,
                         std::vector<std::string> needles) {
    Bytes b = header(1, 0);
    tensor_info(b, "w", std::move(ne), type, 0);
    b.pad_to((b.size() + 31) / 32 * 32).fill(64, 0);
    needles.push_back("tensor 'w'");
    cs.push_back({name, b, code, needles});
  };
  tensor_case("tensor_ndims_0", {}, 0, ErrorCode::kGgufBadTensor, {"n_dims 0", "offset 33"});
  tensor_case("tensor_ndims_5", {1, 1, 1, 1, 1}, 0, ErrorCode::kGgufBadTensor, {"n_dims 5", "offset 33"});
  tensor_case("tensor_dim_zero", {4, 0}, 0, ErrorCode::kGgufBadTensor, {"ne[1] = 0", "offset 45"});
  tensor_case("tensor_dim_2p63", {1ull << 63}, 0, ErrorCode::kGgufBadTensor, {"ne[0]", "offset 37"});
  tensor_case("tensor_elements_overflow", {1ull << 32, 1ull << 32}, 0, ErrorCode::kGgufBadTensor,
              {"overflow", "ne[1]"});
  tensor_case("tensor_bytes_overflow", {1ull << 62}, 0, ErrorCode::kGgufBadTensor, {"byte size overflows"});
  tensor_case("tensor_type_iq2_xxs", {256}, 16, ErrorCode::kGgufBadType, {"ggml type 16", "offset 45"});
  tensor_case("tensor_type_huge", {32}, 0xFFFFFFFFu, ErrorCode::kGgufBadType, {"ggml type 4294967295"});
  tensor_case("tensor_q4_0_row_16", {16, 2}, 2, ErrorCode::kGgufBadTensor,
              {"ne[0] = 16", "block size 32", "offset 37"});
  tensor_case("tensor_q8_0_row_48", {48}, 8, ErrorCode::kGgufBadTensor, {"ne[0] = 48", "Q8_0"});
  {
    Bytes b = header(1, 0);
    b.u64(1ull << 40);
    cs.push_back({"tensor_name_length",
                  b.pad_to(80),
                  ErrorCode::kGgufBadLength,
                  {"tensor #0 name length 1099511627776", "offset 24"}});
  }
  {
    Bytes b = header(2, 0);
    tensor_info(b, "a", {32}, 0, 0);   // bytes [0, 128)
    tensor_info(b, "b", {32}, 0, 96);  // bytes [96, 224): overlaps a
    b.pad_to((b.size() + 31) / 32 * 32).fill(224, 0);
    cs.push_back({"tensor_overlap", b, ErrorCode::kGgufBadTensor, {"'a'", "'b'", "overlaps"}});
  }

  // ---- quantised types beyond Q4_0/Q8_0: short data, wrong row length, bad scale or min.
  // Block sizes and the offsets of the fp16 fields are ggml's (ggml-common.h), written out
  // here independently of the reader's table.
  struct QuantType {
    const char* name;
    uint32_t id;
    uint64_t block_elements, block_bytes;
    std::vector<std::pair<size_t, const char*>> fp16_fields;  // offset in block, name
  };
  const QuantType quant_types[] = {
      {"q4_1", 3, 32, 20, {{0, "scale d"}, {2, "min m"}}},
      {"q5_0", 6, 32, 22, {{0, "scale d"}}},
      {"q5_1", 7, 32, 24, {{0, "scale d"}, {2, "min m"}}},
      {"q2_k", 10, 256, 84, {{80, "scale d"}, {82, "min dmin"}}},
      {"q3_k", 11, 256, 110, {{108, "scale d"}}},
      {"q4_k", 12, 256, 144, {{0, "scale d"}, {2, "min dmin"}}},
      {"q5_k", 13, 256, 176, {{0, "scale d"}, {2, "min dmin"}}},
      {"q6_k", 14, 256, 210, {{208, "scale d"}}},
  };
  for (const QuantType& q : quant_types) {
    // Two rows of one block each; every fp16 field 1.0, `bad` (offset) of block 1 set to
    // `value` when given.
    auto file = [&](std::optional<std::pair<size_t, uint16_t>> bad) {
      Bytes b = header(1, 0);
      tensor_info(b, "w", {q.block_elements, 2}, q.id, 0);
      b.pad_to((b.size() + 31) / 32 * 32);
      for (int blk = 0; blk < 2; ++blk) {
        const size_t at = b.size();
        b.fill(q.block_bytes, 0x11);
        for (const auto& [off, field] : q.fp16_fields) {
          const uint16_t v = blk == 1 && bad && bad->first == off ? bad->second : uint16_t{0x3C00};
          std::memcpy(b.b.data() + at + off, &v, 2);
        }
      }
      return b;
    };
    const Bytes good = file(std::nullopt);
    const size_t data_at = good.size() - 2 * q.block_bytes;
    const std::string nm = std::string("quant_") + q.name;
    cs.push_back({nm + "_short_data",
                  good.truncated(good.size() - 1),
                  ErrorCode::kGgufTruncated,
                  {"tensor 'w'", "runs past the end"}});
    tensor_case(nm + "_row_half_block", {q.block_elements / 2, 2}, q.id, ErrorCode::kGgufBadTensor,
                {"ne[0] = " + std::to_string(q.block_elements / 2), "block size " + std::to_string(q.block_elements)});
    for (const auto& [off, field] : q.fp16_fields) {
      const std::string f = std::string(field).substr(std::string(field).find(' ') + 1);
      cs.push_back({nm + "_nan_" + f + "_block1",
                    file(std::pair{off, uint16_t{0x7E00}}),
                    ErrorCode::kTensorNonFinite,
                    {"tensor 'w'", "block 1", "offset " + std::to_string(data_at + q.block_bytes), field, "NaN"}});
      cs.push_back({nm + "_inf_" + f + "_block1",
                    file(std::pair{off, uint16_t{0xFC00}}),
                    ErrorCode::kTensorNonFinite,
                    {"tensor 'w'", "block 1", field, "-Inf"}});
    }
  }
  return cs;
}

std::filesystem::path corpus_dir() {
  return std::filesystem::path(TANDEM_SOURCE_DIR) / "tests" / "data" / "gguf-malformed";
}

std::vector<uint8_t> read_file(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

}  // namespace

// ==================================================================== tests

TEST_CASE("error_code_name gives the upper-snake enumerator name", "[gguf][error]") {
  CHECK(tandem::error_code_name(ErrorCode::kGgufTruncated) == "GGUF_TRUNCATED");
  CHECK(tandem::error_code_name(ErrorCode::kGgufBadLength) == "GGUF_BAD_LENGTH");
  CHECK(tandem::error_code_name(ErrorCode::kTensorNonFinite) == "TENSOR_NON_FINITE");
  CHECK(tandem::error_code_name(ErrorCode::kOk) == "OK");
  CHECK(tandem::error_code_name(ErrorCode::kIo) == "IO");
  CHECK(tandem::error_code_name(ErrorCode::kModelUnsupportedArch) == "MODEL_UNSUPPORTED_ARCH");
  CHECK(tandem::error_code_name(static_cast<ErrorCode>(12345)) == "UNKNOWN");
}

TEST_CASE("ggml type helpers", "[gguf]") {
  CHECK(tandem::ggml_type_name(GgmlType::kQ4_0) == "Q4_0");
  CHECK(tandem::ggml_type_name(GgmlType::kBF16) == "BF16");
  CHECK(tandem::ggml_block_elements(GgmlType::kQ8_0) == 32);
  CHECK(tandem::ggml_block_elements(GgmlType::kF16) == 1);
  CHECK(tandem::ggml_block_bytes(GgmlType::kF32) == 4);
  CHECK(tandem::ggml_block_bytes(GgmlType::kBF16) == 2);
  CHECK(tandem::ggml_block_bytes(GgmlType::kQ4_0) == 18);
  CHECK(tandem::ggml_block_bytes(GgmlType::kQ8_0) == 34);
  // ggml-common.h block sizes of the types Model converts at load.
  const std::tuple<GgmlType, const char*, int64_t, int64_t> more[] = {
      {GgmlType::kQ4_1, "Q4_1", 32, 20},   {GgmlType::kQ5_0, "Q5_0", 32, 22},   {GgmlType::kQ5_1, "Q5_1", 32, 24},
      {GgmlType::kQ2_K, "Q2_K", 256, 84},  {GgmlType::kQ3_K, "Q3_K", 256, 110}, {GgmlType::kQ4_K, "Q4_K", 256, 144},
      {GgmlType::kQ5_K, "Q5_K", 256, 176}, {GgmlType::kQ6_K, "Q6_K", 256, 210}};
  for (const auto& [t, name, elements, bytes] : more) {
    CHECK(tandem::ggml_type_name(t) == name);
    CHECK(tandem::ggml_block_elements(t) == elements);
    CHECK(tandem::ggml_block_bytes(t) == bytes);
    CHECK(tandem::ggml_is_quantized(t));
  }
  CHECK_FALSE(tandem::ggml_is_quantized(GgmlType::kBF16));
  CHECK(tandem::ggml_type_name(static_cast<GgmlType>(16)) == "unknown");
  CHECK(tandem::ggml_block_bytes(static_cast<GgmlType>(16)) == 0);
}

TEST_CASE("malformed GGUF inputs are refused with the right code and message", "[gguf]") {
  for (const Case& c : malformed_cases()) {
    SECTION(c.name) {
      expect_error(c.bytes, c.code, c.needles);
    }
  }
}

TEST_CASE("stored malformed corpus matches the builders and fails via open()", "[gguf][corpus]") {
  const auto dir = corpus_dir();
  const auto cases = malformed_cases();
  const char* regen = std::getenv("TANDEM_REGEN_GGUF_CORPUS");
  if (regen && *regen == '1') {
    std::filesystem::create_directories(dir);
    std::ofstream manifest(dir / "expected.txt");
    manifest << "# <file> <ERROR_NAME>: generated by tests/test_gguf.cpp (TANDEM_REGEN_GGUF_CORPUS=1)\n";
    for (const Case& c : cases) {
      std::ofstream f(dir / (c.name + ".gguf"), std::ios::binary);
      f.write(reinterpret_cast<const char*>(c.bytes.b.data()), static_cast<std::streamsize>(c.bytes.size()));
      manifest << c.name << ".gguf " << tandem::error_code_name(c.code) << "\n";
    }
  }
  std::map<std::string, std::string> expected;
  std::ifstream manifest(dir / "expected.txt");
  REQUIRE(manifest.good());
  std::string line;
  while (std::getline(manifest, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream is(line);
    std::string file, code;
    is >> file >> code;
    expected[file] = code;
  }
  CHECK(expected.size() == cases.size());
  for (const Case& c : cases) {
    const std::string file = c.name + ".gguf";
    INFO("corpus file " << file);
    REQUIRE(expected.count(file) == 1);
    CHECK(expected[file] == code_name(c.code));
    CHECK(read_file(dir / file) == c.bytes.b);
  }
  // Every file listed in the manifest fails through open() with its code.
  for (const auto& [file, code] : expected) {
    INFO("corpus file " << file);
    try {
      GgufFile::open(dir / file);
      FAIL("loaded");
    } catch (const Error& e) {
      CHECK(code_name(e.code()) == code);
    }
  }
}

TEST_CASE("B06 132-byte control loads and dequantizes to 7 / -8", "[gguf][B06]") {
  const Bytes base = base_file();
  REQUIRE(base.size() == 160);
  for (size_t n : {132u, 160u}) {
    auto f = GgufFile::from_bytes(base.truncated(n).span());
    REQUIRE(f->tensors().size() == 1);
    const auto& t = f->tensors()[0];
    CHECK(t.name == "t");
    CHECK(t.type == GgmlType::kQ4_0);
    CHECK(t.ne == std::vector<int64_t>{32, 2});
    CHECK(t.n_elements == 64);
    CHECK(t.n_bytes == 36);
    CHECK(t.n_rows() == 2);
    CHECK(t.row_bytes() == 18);
    CHECK(f->data_offset() == 96);
    CHECK(f->file_size() == n);
    CHECK(f->alignment() == 32);
    CHECK(f->version() == 3);
    const auto w = dequant_q4_0(t.data, 2);
    REQUIRE(w.size() == 64);
    for (int r = 0; r < 2; ++r) {
      for (int j = 0; j < 16; ++j) CHECK(w[static_cast<size_t>(r * 32 + j)] == 7.0f);
      for (int j = 16; j < 32; ++j) CHECK(w[static_cast<size_t>(r * 32 + j)] == -8.0f);
    }
  }
}

TEST_CASE("B07 zero and max-finite scales load; the scan can be disabled", "[gguf][B07]") {
  {
    auto f = GgufFile::from_bytes(one_block_file(0x0000).span());
    const auto w = dequant_q4_0(f->tensors()[0].data, 1);
    for (float x : w) CHECK(x == 0.0f);
  }
  {
    auto f = GgufFile::from_bytes(one_block_file(0x7BFF).span());
    const auto w = dequant_q4_0(f->tensors()[0].data, 1);
    for (int j = 0; j < 16; ++j) CHECK(w[static_cast<size_t>(j)] == 458528.0f);
    for (int j = 16; j < 32; ++j) CHECK(w[static_cast<size_t>(j)] == -524032.0f);
  }
  GgufOpenOptions lax;
  lax.check_block_scales = false;
  auto f = GgufFile::from_bytes(one_block_file(0x7C00).span(), lax);
  CHECK(f->tensors().size() == 1);
}

TEST_CASE("alignment: a valid general.alignment moves the data section", "[gguf][B02]") {
  Bytes b = header(1, 1);
  kv_u32(b, "general.alignment", 64);
  tensor_info(b, "t", {32}, 2, 0);
  b.pad_to(128);
  q4_block(b, 0x3C00, 0x0F);
  auto f = GgufFile::from_bytes(b.span());
  CHECK(f->alignment() == 64);
  CHECK(f->data_offset() == 128);
  CHECK(f->tensors()[0].data != nullptr);
  // Raising max_alignment admits a larger power of two.
  Bytes big = header(0, 1);
  kv_u32(big, "general.alignment", 1u << 21);
  GgufOpenOptions opt;
  opt.max_alignment = 1u << 22;
  CHECK(GgufFile::from_bytes(big.span(), opt)->alignment() == (1u << 21));
  // alignment 1 is a power of two
  Bytes one = header(0, 1);
  kv_u32(one, "general.alignment", 1);
  CHECK(GgufFile::from_bytes(one.span())->alignment() == 1);
}

TEST_CASE("every scalar value type round-trips through the getters", "[gguf]") {
  Bytes b = header(0, 14, 2);  // version 2 loads too
  b.str("u8").u32(0).u8(200);
  b.str("i8").u32(1).u8(0x80);  // -128
  b.str("u16").u32(2).u16(65535);
  b.str("i16").u32(3).u16(0x8000);  // -32768
  b.str("u32").u32(4).u32(4000000000u);
  b.str("i32").u32(5).u32(0xFFFFFFFFu);  // -1
  b.str("f32").u32(6).put(1.5f);
  b.str("b1").u32(7).u8(1);
  b.str("b0").u32(7).u8(0);
  b.str("s").u32(8).str("h\xc3\xa9llo");  // not NUL-terminated, UTF-8
  b.str("u64").u32(10).u64(~0ull);
  b.str("i64").u32(11).u64(static_cast<uint64_t>(std::numeric_limits<int64_t>::min()));
  b.str("f64").u32(12).put(-2.25);
  b.str("empty").u32(8).str("");
  auto f = GgufFile::from_bytes(b.span());
  CHECK(f->version() == 2);
  CHECK(f->metadata().size() == 14);
  CHECK(f->metadata()[0].key == "u8");
  CHECK(f->metadata()[0].file_offset == 24);
  CHECK(f->get_uint("u8") == 200u);
  CHECK(f->get_int("u8") == 200);
  CHECK(f->get_int("i8") == -128);
  CHECK(f->get_uint("u16") == 65535u);
  CHECK(f->get_int("i16") == -32768);
  CHECK(f->get_uint("u32") == 4000000000u);
  CHECK(f->get_int("i32") == -1);
  CHECK(f->get_float("f32") == 1.5f);
  CHECK(f->get_bool("b1") == true);
  CHECK(f->get_bool("b0") == false);
  CHECK(f->get_string("s") == std::string("h\xc3\xa9llo"));
  CHECK(f->get_string("empty") == std::string());
  CHECK(f->get_uint("u64") == ~0ull);
  CHECK(f->get_int("i64") == std::numeric_limits<int64_t>::min());
  CHECK(f->get_float("f64") == -2.25f);
  CHECK(f->get_float("u32") == 4000000000.0f);
  CHECK(f->get_float("i8") == -128.0f);
  CHECK(f->find("i8")->type == GgufValueType::kInt8);
  CHECK(f->find("missing") == nullptr);
  CHECK_FALSE(f->get_uint("missing").has_value());
  CHECK_FALSE(f->get_string("missing").has_value());
  CHECK_FALSE(f->get_string_array("missing").has_value());

  auto expect_bad_type = [&](auto&& fn, const std::string& key) {
    try {
      fn();
      FAIL("no error for " << key);
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::kGgufBadType);
      CHECK_THAT(e.what(), Catch::Contains("'" + key + "'"));
    }
  };
  expect_bad_type([&] { (void)f->get_uint("i8"); }, "i8");   // negative
  expect_bad_type([&] { (void)f->get_int("u64"); }, "u64");  // > INT64_MAX
  expect_bad_type([&] { (void)f->get_uint("s"); }, "s");
  expect_bad_type([&] { (void)f->get_int("f32"); }, "f32");
  expect_bad_type([&] { (void)f->get_string("u32"); }, "u32");
  expect_bad_type([&] { (void)f->get_bool("u8"); }, "u8");
  expect_bad_type([&] { (void)f->get_float("s"); }, "s");
  expect_bad_type([&] { (void)f->get_float("b1"); }, "b1");
  expect_bad_type([&] { (void)f->get_string_array("s"); }, "s");
  expect_bad_type([&] { (void)f->get_int_array("u8"); }, "u8");
  expect_bad_type([&] { (void)f->get_float_array("s"); }, "s");
}

TEST_CASE("arrays: typed getters and nested arrays of arrays", "[gguf]") {
  Bytes b = header(0, 6);
  b.str("strs").u32(9).u32(8).u64(3).str("a").str("").str("ccc");
  b.str("f32s").u32(9).u32(6).u64(2).put(0.5f).put(-1.0f);
  b.str("i32s").u32(9).u32(5).u64(3).u32(1).u32(0xFFFFFFFEu).u32(7);
  b.str("u64s").u32(9).u32(10).u64(1).u64(~0ull);
  // [[1, 2], [], [3]] as array of arrays of UINT16
  b.str("nested").u32(9).u32(9).u64(3);
  b.u32(2).u64(2).u16(1).u16(2);
  b.u32(2).u64(0);
  b.u32(2).u64(1).u16(3);
  b.str("empty").u32(9).u32(4).u64(0);
  auto f = GgufFile::from_bytes(b.span());
  CHECK(*f->get_string_array("strs") == std::vector<std::string_view>{"a", "", "ccc"});
  CHECK(*f->get_float_array("f32s") == std::vector<float>{0.5f, -1.0f});
  CHECK(*f->get_int_array("i32s") == std::vector<int64_t>{1, -2, 7});
  CHECK(*f->get_float_array("i32s") == std::vector<float>{1.0f, -2.0f, 7.0f});
  CHECK(f->get_int_array("empty")->empty());
  CHECK_THROWS_AS(f->get_int_array("u64s"), Error);
  CHECK_THROWS_AS(f->get_int_array("f32s"), Error);
  CHECK_THROWS_AS(f->get_string_array("i32s"), Error);
  const auto* nested = f->find("nested");
  REQUIRE(nested);
  const auto& outer = std::get<tandem::GgufArray>(nested->value);
  CHECK(outer.elem_type() == GgufValueType::kArray);
  REQUIRE(outer.size() == 3);
  const auto& a0 = outer.array_at(0);
  CHECK(a0.elem_type() == GgufValueType::kUint16);
  REQUIRE(a0.size() == 2);
  CHECK(std::get<uint64_t>(a0.at(1).value) == 2u);
  CHECK(a0.at(1).type == GgufValueType::kUint16);
  CHECK(outer.array_at(1).empty());
  CHECK(std::get<uint64_t>(outer.array_at(2).at(0).value) == 3u);
  // at() on an ARRAY element copies the nested array.
  CHECK(std::get<tandem::GgufArray>(outer.at(2).value).size() == 1);
  // The element accessors refuse the wrong element type and an index past the end.
  CHECK_THROWS_AS(outer.array_at(3), Error);
  CHECK_THROWS_AS(outer.string_at(0), Error);
  CHECK_THROWS_AS(a0.at(2), Error);
  CHECK_THROWS_AS(a0.array_at(0), Error);
  const auto& strs = std::get<tandem::GgufArray>(f->find("strs")->value);
  CHECK(strs.string_at(2) == "ccc");
  CHECK(strs.string_at(1).empty());
  CHECK(std::get<std::string>(strs.at(0).value) == "a");
  CHECK_THROWS_AS(strs.string_at(3), Error);
  const auto& i32s = std::get<tandem::GgufArray>(f->find("i32s")->value);
  CHECK(std::get<int64_t>(i32s.at(1).value) == -2);
  const auto& f32s = std::get<tandem::GgufArray>(f->find("f32s")->value);
  CHECK(std::get<double>(f32s.at(1).value) == -1.0);
  CHECK_THROWS_AS(f->get_int_array("nested"), Error);
}

TEST_CASE("multiple tensors, all float types, find_tensor", "[gguf]") {
  Bytes b = header(4, 0);
  tensor_info(b, "f32", {3, 2}, 0, 0);           // 24 bytes
  tensor_info(b, "f16", {5}, 1, 32);             // 10 bytes
  tensor_info(b, "bf16", {2, 2, 2, 2}, 30, 64);  // 32 bytes
  tensor_info(b, "q8", {32, 1, 1}, 8, 96);       // 34 bytes -> ends at 130
  b.pad_to((b.size() + 31) / 32 * 32);
  const size_t ds = b.size();
  b.fill(96, 0).u16(0x3C00).fill(32, 0xFF);
  auto f = GgufFile::from_bytes(b.span());
  REQUIRE(f->tensors().size() == 4);
  CHECK(f->data_offset() == ds);
  CHECK(f->find_tensor("f16")->n_bytes == 10);
  CHECK(f->find_tensor("bf16")->n_elements == 16);
  CHECK(f->find_tensor("bf16")->n_rows() == 8);
  CHECK(f->find_tensor("q8")->row_bytes() == 34);
  CHECK(f->find_tensor("q8")->data == f->find_tensor("f32")->data + 96);
  CHECK(f->find_tensor("nope") == nullptr);
  CHECK(reinterpret_cast<uintptr_t>(f->find_tensor("f32")->data) % 32 == 0);
}

TEST_CASE("open(): missing file, directory, empty and short files", "[gguf]") {
  const auto dir = tandem::test::scratch_dir("gguf-open");
  auto expect = [](const std::filesystem::path& p, ErrorCode code) {
    try {
      GgufFile::open(p);
      FAIL("loaded " << p);
    } catch (const Error& e) {
      CHECK(code_name(e.code()) == code_name(code));
      CHECK_THAT(e.what(), Catch::Contains(p.string()));
    }
  };
  expect(dir / "does-not-exist.gguf", ErrorCode::kIo);
  expect(dir, ErrorCode::kIo);
  { std::ofstream(dir / "empty.gguf"); }
  expect(dir / "empty.gguf", ErrorCode::kGgufTruncated);
  { std::ofstream(dir / "two.gguf") << "GG"; }
  expect(dir / "two.gguf", ErrorCode::kGgufTruncated);
  { std::ofstream(dir / "magic.gguf") << "GGML and more bytes here"; }
  expect(dir / "magic.gguf", ErrorCode::kGgufBadMagic);
  // and a good file through the mapping
  const Bytes base = base_file();
  {
    std::ofstream f(dir / "ok.gguf", std::ios::binary);
    f.write(reinterpret_cast<const char*>(base.b.data()), static_cast<std::streamsize>(base.size()));
  }
  auto f = GgufFile::open(dir / "ok.gguf");
  CHECK(f->path() == dir / "ok.gguf");
  CHECK(dequant_q4_0(f->find_tensor("t")->data, 2)[0] == 7.0f);
  try {
    (void)GgufFile::from_bytes({});
    FAIL("empty buffer loaded");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kGgufTruncated);
  }
}

TEST_CASE("real models in shared/models load", "[gguf][models]") {
  {
    auto f = GgufFile::open(tandem::test::model_path("aidreams260K-q4_0"));
    CHECK(f->get_string("general.architecture") == std::string("llama"));
    CHECK(f->tensors().size() == 38);
    CHECK(f->metadata().size() == 23);
    CHECK(f->data_offset() == 13760);
    const auto* t = f->find_tensor("token_embd.weight");
    REQUIRE(t);
    CHECK(t->type == GgmlType::kQ4_0);
    CHECK(t->ne == std::vector<int64_t>{64, 512});
    CHECK(f->get_string_array("tokenizer.ggml.tokens")->size() == 512);
    CHECK(f->get_uint("llama.block_count").has_value());
  }
  {
    auto f = GgufFile::open(tandem::test::model_path("llama3-bpe-vocab"));
    CHECK(f->tensors().empty());
    CHECK(f->get_string_array("tokenizer.ggml.tokens")->size() == 128256);
    CHECK(f->get_string_array("tokenizer.ggml.merges")->size() == 280147);
  }
  for (const auto& e : std::filesystem::directory_iterator(tandem::test::models_dir())) {
    if (e.path().extension() != ".gguf") continue;
    INFO("model " << e.path());
    auto f = GgufFile::open(e.path());
    CHECK(f->get_string("general.architecture").has_value());
    for (const auto& t : f->tensors()) {
      CHECK(f->data_offset() + t.offset + t.n_bytes <= f->file_size());
      CHECK(t.offset % f->alignment() == 0);
    }
  }
}

TEST_CASE("SmolLM2 Q4_1 file as the PyPI wheel ships it opens", "[gguf][smollm2]") {
  const auto path = tandem::test::smollm2_q4_1_path();
  if (!std::filesystem::exists(path)) {
    WARN("SKIPPED: " << path << " is absent (scripts/fetch-smollm2 downloads it)");
    return;
  }
  auto f = GgufFile::open(path);
  CHECK(f->file_size() == 98362432);
  CHECK(f->get_string("tokenizer.ggml.pre") == std::string("smollm"));
  CHECK(f->get_string_array("tokenizer.ggml.tokens")->size() == 49152);
  std::map<GgmlType, int> by_type;
  for (const auto& t : f->tensors()) ++by_type[t.type];
  // README of shared/golden: 210 Q4_1 weights, token_embd Q8_0, the norms F32.
  CHECK(by_type[GgmlType::kQ4_1] == 210);
  CHECK(by_type[GgmlType::kQ8_0] == 1);
  CHECK(by_type[GgmlType::kF32] == 61);
  CHECK(f->find_tensor("blk.0.ffn_down.weight")->type == GgmlType::kQ4_1);
}
