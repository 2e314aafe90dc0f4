// Dequantisation of every GGUF type and ggml's reference Q4_0 / Q8_0 quantisers, against
// scalar references written here from the block definitions (ggml-common.h comments and
// the GGUF spec), element by element: for each output index the reference finds that
// element's quant bits and (sub-)block scale and applies the block's formula in the same
// f32 operation order ggml documents, so results must be bit-identical. fp16 is
// converted with the compiler's _Float16 (round to nearest even), independently of the
// library's conversion. Inputs: random blocks and edge blocks (zero, subnormal, largest,
// Inf and NaN scales and mins).
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "tandem/core/error.hpp"
#include "tandem/gguf/ggml_dequant.hpp"

using tandem::GgmlType;

namespace {

float h2f(uint16_t h) {
  _Float16 v;
  std::memcpy(&v, &h, 2);
  return static_cast<float>(v);
}
uint16_t f2h(float f) {
  const auto v = static_cast<_Float16>(f);
  uint16_t h;
  std::memcpy(&h, &v, 2);
  return h;
}
uint16_t rd16(const uint8_t* p) {
  return static_cast<uint16_t>(p[0] | (p[1] << 8));
}
float fl(int v) {
  return static_cast<float>(v);
}

// ---- reference: value of element e (0..block_elements) of one block ------------------

float ref_q4_0(const uint8_t* b, int e) {
  const int nib = e < 16 ? b[2 + e] & 15 : b[2 + e - 16] >> 4;
  return fl(nib - 8) * h2f(rd16(b));
}
float ref_q4_1(const uint8_t* b, int e) {
  const int nib = e < 16 ? b[4 + e] & 15 : b[4 + e - 16] >> 4;
  return fl(nib) * h2f(rd16(b)) + h2f(rd16(b + 2));
}
int q5_value(const uint8_t* qh4, const uint8_t* qs, int e) {
  const uint32_t qh = uint32_t(qh4[0]) | uint32_t(qh4[1]) << 8 | uint32_t(qh4[2]) << 16 | uint32_t(qh4[3]) << 24;
  const int nib = e < 16 ? qs[e] & 15 : qs[e - 16] >> 4;
  return nib | int((qh >> e) & 1u) << 4;  // bit e of qh is the 5th bit of element e
}
float ref_q5_0(const uint8_t* b, int e) {
  return fl(q5_value(b + 2, b + 6, e) - 16) * h2f(rd16(b));
}
float ref_q5_1(const uint8_t* b, int e) {
  return fl(q5_value(b + 4, b + 8, e)) * h2f(rd16(b)) + h2f(rd16(b + 2));
}
float ref_q8_0(const uint8_t* b, int e) {
  return fl(static_cast<int8_t>(b[2 + e])) * h2f(rd16(b));
}

// Q2_K: 256 = 2 halves of 128; a half = 4 bit-pairs (shift 0,2,4,6) x 32 bytes; sub-block
// of 16 = (half, pair, byte 0..15 or 16..31); scales[16] low nibble scale, high nibble min.
float ref_q2_k(const uint8_t* b, int e) {
  const int half = e / 128, pair = (e % 128) / 32, l = e % 32;
  const int sub = half * 8 + pair * 2 + l / 16;
  const int q = (b[16 + half * 32 + l] >> (2 * pair)) & 3;
  const float d = h2f(rd16(b + 80)), dmin = h2f(rd16(b + 82));
  return (d * fl(b[sub] & 15)) * fl(q) - (dmin * fl(b[sub] >> 4));
}
// Q3_K: as Q2_K for the low 2 bits; the 3rd bit is hmask[l] bit (half * 4 + pair), set = +0,
// clear = -4; 16 six-bit scales: ggml packs scales 0..7 low nibbles in bytes 0..7, 8..15
// in their high nibbles, and the top 2 bits of scale i in byte 8 + i % 4 at bit 2 * (i / 4).
float ref_q3_k(const uint8_t* b, int e) {
  const int half = e / 128, pair = (e % 128) / 32, l = e % 32;
  const int sub = half * 8 + pair * 2 + l / 16;
  const uint8_t* sc = b + 96;
  uint32_t aux[4];
  std::memcpy(aux, sc, 12);
  const uint32_t tmp = aux[2], k1 = 0x03030303, k2 = 0x0f0f0f0f;
  aux[2] = ((aux[0] >> 4) & k2) | (((tmp >> 4) & k1) << 4);
  aux[3] = ((aux[1] >> 4) & k2) | (((tmp >> 6) & k1) << 4);
  aux[0] = (aux[0] & k2) | (((tmp >> 0) & k1) << 4);
  aux[1] = (aux[1] & k2) | (((tmp >> 2) & k1) << 4);
  int8_t scales[16];
  std::memcpy(scales, aux, 16);
  const int low = (b[32 + half * 32 + l] >> (2 * pair)) & 3;
  const int high = (b[l] >> (half * 4 + pair)) & 1;
  return (h2f(rd16(b + 108)) * fl(scales[sub] - 32)) * fl(low - (high ? 0 : 4));
}
// Q4_K / Q5_K: 8 sub-blocks of 32; 6-bit scale/min of sub-block j from the 12 bytes.
void k4_scale_min(const uint8_t* q, int j, int& sc, int& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}
float ref_q4_k(const uint8_t* b, int e) {
  const int sub = e / 32, l = e % 32;
  const uint8_t byte = b[16 + (sub / 2) * 32 + l];
  const int q = sub % 2 == 0 ? byte & 15 : byte >> 4;
  int sc, m;
  k4_scale_min(b + 4, sub, sc, m);
  return (h2f(rd16(b)) * fl(sc)) * fl(q) - (h2f(rd16(b + 2)) * fl(m));
}
float ref_q5_k(const uint8_t* b, int e) {
  const int sub = e / 32, l = e % 32;
  const uint8_t byte = b[48 + (sub / 2) * 32 + l];
  const int q = (sub % 2 == 0 ? byte & 15 : byte >> 4) + (((b[16 + l] >> sub) & 1) ? 16 : 0);
  int sc, m;
  k4_scale_min(b + 4, sub, sc, m);
  return (h2f(rd16(b)) * fl(sc)) * fl(q) - (h2f(rd16(b + 2)) * fl(m));
}
// Q6_K: 2 halves of 128; in a half, quarter k (0..3) of 32 takes the low (k < 2) or high
// nibble of ql[64 * half + 32 * (k % 2) + l] and bits 2k..2k+1 of qh[32 * half + l];
// sub-block of 16 has scale[8 * half + 2 * k + l / 16].
float ref_q6_k(const uint8_t* b, int e) {
  const int half = e / 128, k = (e % 128) / 32, l = e % 32;
  const uint8_t lo = b[64 * half + 32 * (k % 2) + l];
  const int q = ((k < 2 ? lo & 15 : lo >> 4) | (((b[128 + 32 * half + l] >> (2 * k)) & 3) << 4)) - 32;
  const auto sc = static_cast<int8_t>(b[192 + 8 * half + 2 * k + l / 16]);
  return h2f(rd16(b + 208)) * fl(sc) * fl(q);
}

struct TypeCase {
  GgmlType type;
  int elements, bytes;
  float (*ref)(const uint8_t*, int);
  std::vector<int> fp16_fields;  // byte offsets of the scale / min fields
};

const std::vector<TypeCase>& type_cases() {
  static const std::vector<TypeCase> cases = {
      {GgmlType::kQ4_0, 32, 18, ref_q4_0, {0}},      {GgmlType::kQ4_1, 32, 20, ref_q4_1, {0, 2}},
      {GgmlType::kQ5_0, 32, 22, ref_q5_0, {0}},      {GgmlType::kQ5_1, 32, 24, ref_q5_1, {0, 2}},
      {GgmlType::kQ8_0, 32, 34, ref_q8_0, {0}},      {GgmlType::kQ2_K, 256, 84, ref_q2_k, {80, 82}},
      {GgmlType::kQ3_K, 256, 110, ref_q3_k, {108}},  {GgmlType::kQ4_K, 256, 144, ref_q4_k, {0, 2}},
      {GgmlType::kQ5_K, 256, 176, ref_q5_k, {0, 2}}, {GgmlType::kQ6_K, 256, 210, ref_q6_k, {208}},
  };
  return cases;
}

bool same(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  uint32_t x, y;
  std::memcpy(&x, &a, 4);
  std::memcpy(&y, &b, 4);
  return x == y;
}

// ---- reference Q4_0 / Q8_0 quantisers, from the rule in the ggml source comments --------

void ref_quantize_q4_0(const float* x, uint8_t* out) {
  float max = 0.0f;  // the element of largest magnitude, first one on ties
  for (int j = 0; j < 32; ++j) {
    if (std::fabs(x[j]) > std::fabs(max)) max = x[j];
  }
  const float d = max / -8.0f;
  const float id = d == 0.0f ? 0.0f : 1.0f / d;
  const uint16_t dh = f2h(d);
  out[0] = uint8_t(dh & 0xFF);
  out[1] = uint8_t(dh >> 8);
  for (int j = 0; j < 32; ++j) {
    const float scaled = x[j] * id;
    int q = static_cast<int>(scaled + 8.5f);  // truncation toward zero; always in [0, 17)
    if (q > 15) q = 15;
    uint8_t& byte = out[2 + j % 16];
    if (j < 16) {
      byte = uint8_t(q);
    } else {
      byte = uint8_t(byte | (q << 4));
    }
  }
}

void ref_quantize_q8_0(const float* x, uint8_t* out) {
  float amax = 0.0f;
  for (int j = 0; j < 32; ++j) amax = std::fabs(x[j]) > amax ? std::fabs(x[j]) : amax;
  const float d = amax / 127.0f;
  const float id = d == 0.0f ? 0.0f : 1.0f / d;
  const uint16_t dh = f2h(d);
  out[0] = uint8_t(dh & 0xFF);
  out[1] = uint8_t(dh >> 8);
  for (int j = 0; j < 32; ++j) out[2 + j] = static_cast<uint8_t>(static_cast<int8_t>(std::lround(x[j] * id)));
}

}  // namespace

TEST_CASE("dequantize_row matches the scalar reference of every quantised type", "[dequant]") {
  std::mt19937 rng(1234);
  std::uniform_int_distribution<int> byte(0, 255);
  // Scale/min values: random finite fp16 plus the edge values.
  const uint16_t edges[] = {0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0400, 0x7BFF,
                            0xFBFF, 0x3C00, 0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFE00};
  for (const TypeCase& tc : type_cases()) {
    INFO("type " << tandem::ggml_type_name(tc.type));
    constexpr int kBlocks = 64;
    std::vector<uint8_t> data(size_t(kBlocks) * tc.bytes);
    for (auto& v : data) v = uint8_t(byte(rng));
    for (int blk = 0; blk < kBlocks; ++blk) {
      uint8_t* b = data.data() + blk * tc.bytes;
      for (size_t fi = 0; fi < tc.fp16_fields.size(); ++fi) {
        uint16_t h;
        if (blk < 40) {  // random finite: exponent 0..30
          do {
            h = uint16_t(byte(rng) | byte(rng) << 8);
          } while ((h & 0x7C00) == 0x7C00);
        } else {  // each edge value in each field, the other field 1.0
          const int edge = blk - 40;
          h = int(fi) == edge % int(tc.fp16_fields.size()) ? edges[edge % std::size(edges)] : uint16_t{0x3C00};
        }
        b[tc.fp16_fields[fi]] = uint8_t(h & 0xFF);
        b[tc.fp16_fields[fi] + 1] = uint8_t(h >> 8);
      }
      if (blk == 63) std::fill(b, b + tc.bytes, uint8_t{0});  // the all-zero block
    }
    std::vector<float> got(size_t(kBlocks) * tc.elements);
    tandem::dequantize_row(tc.type, reinterpret_cast<const std::byte*>(data.data()), got.data(),
                           int64_t(kBlocks) * tc.elements);
    int mismatches = 0;
    for (int blk = 0; blk < kBlocks; ++blk) {
      for (int e = 0; e < tc.elements; ++e) {
        const float want = tc.ref(data.data() + blk * tc.bytes, e);
        const float have = got[size_t(blk) * tc.elements + e];
        if (!same(want, have) && mismatches++ < 5) {
          FAIL_CHECK("block " << blk << " element " << e << ": reference " << want << ", got " << have);
        }
      }
    }
    CHECK(mismatches == 0);
    // The all-zero block is all zeros.
    for (int e = 0; e < tc.elements; ++e) CHECK(got[size_t(63) * tc.elements + e] == 0.0f);
  }
}

TEST_CASE("dequantize_row of the float types is exact", "[dequant]") {
  const float f32[4] = {1.5f, -0.0f, 3.0e38f, 1.0e-45f};
  float out[4];
  tandem::dequantize_row(GgmlType::kF32, reinterpret_cast<const std::byte*>(f32), out, 4);
  for (int i = 0; i < 4; ++i) CHECK(same(out[i], f32[i]));
  const uint16_t f16[3] = {0x3C00, 0xC000, 0x0001};  // 1, -2, 2^-24
  tandem::dequantize_row(GgmlType::kF16, reinterpret_cast<const std::byte*>(f16), out, 3);
  CHECK(out[0] == 1.0f);
  CHECK(out[1] == -2.0f);
  CHECK(out[2] == std::ldexp(1.0f, -24));
  const uint16_t bf16[2] = {0x3FC0, 0xC2F7};  // 1.5, -123.5
  tandem::dequantize_row(GgmlType::kBF16, reinterpret_cast<const std::byte*>(bf16), out, 2);
  CHECK(out[0] == 1.5f);
  CHECK(out[1] == -123.5f);
}

TEST_CASE("dequantize_row refuses a row that is not whole blocks", "[dequant]") {
  std::vector<std::byte> buf(256);
  float out[64];
  CHECK_THROWS_MATCHES(tandem::dequantize_row(GgmlType::kQ4_K, buf.data(), out, 64), tandem::Error,
                       Catch::Predicate<tandem::Error>(
                           [](const tandem::Error& e) { return e.code() == tandem::ErrorCode::kInvalidArgument; }));
}

TEST_CASE("Q4_0 and Q8_0 reference quantisers match the rule, bit for bit", "[dequant]") {
  std::mt19937 rng(99);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::vector<float>> blocks;
  for (int i = 0; i < 200; ++i) {
    std::vector<float> x(32);
    const float scale = std::ldexp(1.0f, i % 40 - 20);
    for (auto& v : x) v = normal(rng) * scale;
    blocks.push_back(x);
  }
  blocks.push_back(std::vector<float>(32, 0.0f));      // zero: d = 0, id = 0, q = 8
  blocks.push_back(std::vector<float>(32, 1.0e-42f));  // subnormal input
  std::vector<float> tie(32, 0.5f);
  tie[3] = -2.0f;
  tie[9] = 2.0f;  // |max| tie: the first (-2) wins, d = 0.25
  blocks.push_back(tie);
  std::vector<float> big(32, 70000.0f);  // d = -8750 fits fp16; x * id = -8
  big[0] = -65504.0f * 8;
  blocks.push_back(big);
  for (const auto& x : blocks) {
    uint8_t want[34], have[34];
    ref_quantize_q4_0(x.data(), want);
    tandem::quantize_row_q4_0_ref(x.data(), reinterpret_cast<std::byte*>(have), 32);
    CHECK(std::memcmp(want, have, 18) == 0);
    ref_quantize_q8_0(x.data(), want);
    tandem::quantize_row_q8_0_ref(x.data(), reinterpret_cast<std::byte*>(have), 32);
    CHECK(std::memcmp(want, have, 34) == 0);
  }
  // Hand-computed: max = -8 -> d = 1 (0x3C00), id = 1, q = trunc(x + 8.5), capped at 15.
  float x[32];
  for (int j = 0; j < 32; ++j) x[j] = float(j % 16) - 8.0f;  // -8..7 twice
  x[31] = 7.6f;                                              // 16.1 -> 16 -> capped 15
  uint8_t q[18];
  tandem::quantize_row_q4_0_ref(x, reinterpret_cast<std::byte*>(q), 32);
  CHECK(rd16(q) == 0x3C00);
  for (int j = 0; j < 15; ++j) CHECK(q[2 + j] == uint8_t(j | (j << 4)));
  CHECK(q[2 + 15] == uint8_t(15 | (15 << 4)));
  // The tie block: -2 (the first of the two largest magnitudes) is kept, so d = 0.25
  // (0x3400), id = 4: x = -2 -> 0.5 -> 0 and x = 2 -> 16.5 -> 16 -> 15 (had +2 been kept,
  // the two would swap).
  tandem::quantize_row_q4_0_ref(tie.data(), reinterpret_cast<std::byte*>(q), 32);
  CHECK(rd16(q) == 0x3400);
  CHECK((q[2 + 3] & 15) == 0);
  CHECK((q[2 + 9] & 15) == 15);
}
