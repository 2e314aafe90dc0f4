// Requantisation: llama-quantize's type rule, quantize_file (tandem-quantize) reproducing
// llama.cpp's Q4_0 conversion of SmolLM2-135M-Instruct byte for byte per tensor
// (shared/golden/smollm2-135m-instruct-q4_0/cases.json `tensors`), and Model::load's
// conversion giving the same bytes.
#include <catch2/catch.hpp>

#include <cstring>
#include <map>

#include "sha256.hpp"
#include "tandem/gguf/gguf_writer.hpp"
#include "tandem/model/model.hpp"
#include "tandem/model/requantize.hpp"
#include "test_support.hpp"

using namespace tandem;

namespace {

GgufTensorInfo info(std::string name, std::vector<int64_t> ne, GgmlType type) {
  GgufTensorInfo t;
  t.name = std::move(name);
  t.ne = std::move(ne);
  t.type = type;
  return t;
}

}  // namespace

TEST_CASE("sha256 helper matches the FIPS 180-4 examples", "[requantize]") {
  CHECK(test::sha256_hex("abc", 3) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  CHECK(test::sha256_hex("", 0) == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  const char* two = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";  // 56 bytes: two blocks
  CHECK(test::sha256_hex(two, 56) == "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
}

TEST_CASE("requantized_type follows llama-quantize's rule for Q4_0 and Q8_0", "[requantize]") {
  const auto q4_1 = GgmlType::kQ4_1;
  // Weights become the target; norms, 1-D tensors and non-weights are copied.
  CHECK(requantized_type(info("blk.0.attn_q.weight", {576, 576}, q4_1), false, GgmlType::kQ4_0, false) ==
        GgmlType::kQ4_0);
  CHECK(requantized_type(info("blk.0.attn_q.weight", {576, 576}, q4_1), false, GgmlType::kQ8_0, false) ==
        GgmlType::kQ8_0);
  CHECK(requantized_type(info("blk.0.attn_norm.weight", {576}, GgmlType::kF32), false, GgmlType::kQ4_0, false) ==
        GgmlType::kF32);
  CHECK(requantized_type(info("blk.0.attn_q.bias", {576, 2}, GgmlType::kF32), false, GgmlType::kQ4_0, false) ==
        GgmlType::kF32);
  CHECK(requantized_type(info("blk.0.attn_q_norm.weight", {64, 2}, GgmlType::kF32), false, GgmlType::kQ4_0, false) ==
        GgmlType::kF32);
  // Trailing 1-sized dimensions do not count (ggml_n_dims): a [576, 1] weight is 1-D.
  CHECK(requantized_type(info("x.weight", {576, 1}, GgmlType::kF16), false, GgmlType::kQ4_0, false) == GgmlType::kF16);
  // Row length not a multiple of 32: copied.
  CHECK(requantized_type(info("x.weight", {172, 8}, GgmlType::kF32), false, GgmlType::kQ4_0, false) == GgmlType::kF32);
  // Output projection: Q8_0 unless --pure; the tied token_embd counts as the output.
  CHECK(requantized_type(info("output.weight", {576, 100}, q4_1), true, GgmlType::kQ4_0, false) == GgmlType::kQ8_0);
  CHECK(requantized_type(info("token_embd.weight", {576, 100}, q4_1), false, GgmlType::kQ4_0, false) ==
        GgmlType::kQ8_0);
  CHECK(requantized_type(info("token_embd.weight", {576, 100}, q4_1), true, GgmlType::kQ4_0, false) == GgmlType::kQ4_0);
  CHECK(requantized_type(info("output.weight", {576, 100}, q4_1), true, GgmlType::kQ4_0, true) == GgmlType::kQ4_0);
  CHECK_THROWS_AS(requantized_type(info("output.weight", {576, 100}, q4_1), true, GgmlType::kQ4_1, false), Error);
}

TEST_CASE("quantize_file never leaves a half-written output", "[requantize]") {
  const auto dir = test::scratch_dir("requantize-bad");
  // A Q4_1 block with a NaN scale: the reader refuses the input before anything is written.
  GgufWriter w;
  w.add_string("general.architecture", "llama");
  w.add_tensor("blk.0.attn_q.weight", {32, 1}, GgmlType::kQ4_1, [](std::span<std::byte> d) {
    std::memset(d.data(), 0, d.size());
    d[0] = std::byte{0x00};
    d[1] = std::byte{0x7E};  // fp16 NaN
  });
  w.write(dir / "bad.gguf");
  try {
    quantize_file(dir / "bad.gguf", dir / "out.gguf");
    FAIL("converted a file with a NaN scale");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kTensorNonFinite);
    CHECK_THAT(e.what(), Catch::Contains("blk.0.attn_q.weight") && Catch::Contains("block 0"));
  }
  CHECK_FALSE(std::filesystem::exists(dir / "out.gguf"));
  CHECK_FALSE(std::filesystem::exists(dir / "out.gguf.tmp"));
  std::filesystem::remove_all(dir);
}

TEST_CASE("quantize_file and Model::load reproduce llama.cpp's Q4_0 conversion of SmolLM2 byte for byte",
          "[requantize][smollm2]") {
  const auto src = test::smollm2_q4_1_path();
  if (!std::filesystem::exists(src)) {
    WARN("SKIPPED: " << src << " is absent (scripts/fetch-smollm2 downloads it)");
    return;
  }
  const auto golden = test::read_json(test::golden_dir() / "smollm2-135m-instruct-q4_0" / "cases.json");
  const auto& tensors = golden["tensors"];
  const auto dir = test::scratch_dir("requantize-smollm2");
  const auto out = dir / "smollm2-q4_0.gguf";
  size_t progress_calls = 0;
  QuantizeFileOptions opt;
  opt.n_threads = 2;
  opt.on_tensor = [&](size_t done, size_t total, const std::string&, GgmlType) {
    ++progress_calls;
    CHECK(done <= total);
  };
  const QuantizeFileResult r = quantize_file(src, out, opt);
  CHECK(r.n_tensors == tensors.size());
  CHECK(r.n_converted == 210);  // every Q4_1 weight; token_embd stays Q8_0, norms F32
  CHECK(progress_calls == r.n_tensors);

  const auto in_file = GgufFile::open(src);
  const auto q = GgufFile::open(out);
  REQUIRE(q->tensors().size() == tensors.size());
  int mismatches = 0;
  for (const GgufTensorInfo& t : q->tensors()) {
    INFO("tensor " << t.name);
    REQUIRE(tensors.contains(t.name));
    const auto& g = tensors[t.name];
    CHECK(static_cast<uint32_t>(t.type) == g["ggml_type"].get<uint32_t>());
    CHECK(t.ne == g["ne"].get<std::vector<int64_t>>());
    if (test::sha256_hex(t.data, t.n_bytes) != g["sha256"].get<std::string>()) ++mismatches;
  }
  CHECK(mismatches == 0);
  // Metadata: the input's, plus file type MOSTLY_Q4_0 (2) and quantization version 2.
  CHECK(q->get_uint("general.file_type") == 2u);
  CHECK(q->get_uint("general.quantization_version") == 2u);
  CHECK(q->get_string("tokenizer.ggml.pre") == in_file->get_string("tokenizer.ggml.pre"));
  CHECK(q->get_string_array("tokenizer.ggml.merges") == in_file->get_string_array("tokenizer.ggml.merges"));
  for (const GgufKv& kv : in_file->metadata()) {
    if (kv.key == "general.file_type" || kv.key == "general.quantization_version") continue;
    INFO("key " << kv.key);
    CHECK(q->find(kv.key) != nullptr);
  }

  // Conversion at load: the same bytes as the converted file, for every weight the
  // executors read; the converted file loads with nothing to convert.
  ModelOptions mo;
  mo.n_threads = 2;
  mo.convert_to = GgmlType::kQ4_0;
  const auto converted = Model::load(src, mo);
  const auto direct = Model::load(out, mo);
  CHECK(converted->converted_tensors() == 210);
  CHECK(direct->converted_tensors() == 0);
  CHECK(converted->weight_bytes() == direct->weight_bytes());
  auto same = [](const TensorView& a, const TensorView& b) {
    return a.type == b.type && a.k == b.k && a.n == b.n && a.row_bytes == b.row_bytes &&
           std::memcmp(a.data, b.data, a.row_bytes * size_t(a.n)) == 0;
  };
  CHECK(same(converted->token_embd(), direct->token_embd()));
  CHECK(same(converted->output(), direct->output()));
  for (size_t il = 0; il < converted->layers().size(); ++il) {
    INFO("layer " << il);
    const LayerWeights& a = converted->layers()[il];
    const LayerWeights& b = direct->layers()[il];
    CHECK(a.wq.type == GgmlType::kQ4_0);
    CHECK(reinterpret_cast<uintptr_t>(a.wq.data) % 64 == 0);
    for (auto m : {&LayerWeights::wq, &LayerWeights::wk, &LayerWeights::wv, &LayerWeights::wo, &LayerWeights::ffn_gate,
                   &LayerWeights::ffn_up, &LayerWeights::ffn_down}) {
      CHECK(same(a.*m, b.*m));
    }
  }
  std::filesystem::remove_all(dir);
}
