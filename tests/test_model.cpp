// Model loading: architectures, hyper-parameters, tied output, and each refusal
// (unsupported architecture, missing tensor, bad shape, bad hyper-parameter).
#include <catch2/catch.hpp>

#include <cstring>
#include <functional>

#include "tandem/gguf/gguf_writer.hpp"
#include "tandem/model/model.hpp"
#include "test_support.hpp"

using namespace tandem;

namespace {

struct TinySpec {
  std::string arch = "llama";
  int n_embd = 64, n_head = 2, n_head_kv = 1, n_ff = 96, n_vocab = 8;
  std::string skip_tensor;       // leave this tensor out
  std::string bad_shape_tensor;  // give this tensor one extra row
  bool tied = false;
  std::function<void(GgufWriter&)> extra_kv;
};

std::filesystem::path write_tiny(const TinySpec& s, const std::string& name) {
  GgufWriter w;
  const std::string a = s.arch;
  w.add_string("general.architecture", a);
  w.add_u32(a + ".context_length", 64);
  w.add_u32(a + ".embedding_length", uint32_t(s.n_embd));
  w.add_u32(a + ".block_count", 1);
  w.add_u32(a + ".feed_forward_length", uint32_t(s.n_ff));
  w.add_u32(a + ".attention.head_count", uint32_t(s.n_head));
  w.add_u32(a + ".attention.head_count_kv", uint32_t(s.n_head_kv));
  w.add_f32(a + ".attention.layer_norm_rms_epsilon", 1e-5f);
  if (s.extra_kv) s.extra_kv(w);
  std::vector<std::string> tokens{"<unk>", "<s>", "</s>"};
  while (int(tokens.size()) < s.n_vocab) tokens.push_back(std::string(1, char('a' + tokens.size())));
  w.add_string("tokenizer.ggml.model", "llama");
  w.add_string_array("tokenizer.ggml.tokens", tokens);
  w.add_f32_array("tokenizer.ggml.scores", std::vector<float>(tokens.size(), 0.0f));
  w.add_i32_array("tokenizer.ggml.token_type", {2, 3, 3, 1, 1, 1, 1, 1});
  w.add_u32("tokenizer.ggml.bos_token_id", 1);
  w.add_u32("tokenizer.ggml.eos_token_id", 2);
  const int hd = s.n_embd / s.n_head;
  auto add = [&](const std::string& n, std::vector<int64_t> ne) {
    if (n == s.skip_tensor) return;
    if (n == s.bad_shape_tensor) ne.back() += 1;
    w.add_tensor(n, ne, GgmlType::kF32, [](std::span<std::byte> d) {
      auto* f = reinterpret_cast<float*>(d.data());
      for (size_t i = 0; i < d.size() / 4; ++i) f[i] = 0.01f * float(i % 7);
    });
  };
  add("token_embd.weight", {s.n_embd, s.n_vocab});
  add("output_norm.weight", {s.n_embd});
  if (!s.tied) add("output.weight", {s.n_embd, s.n_vocab});
  add("blk.0.attn_norm.weight", {s.n_embd});
  add("blk.0.attn_q.weight", {s.n_embd, s.n_head * hd});
  add("blk.0.attn_k.weight", {s.n_embd, s.n_head_kv * hd});
  add("blk.0.attn_v.weight", {s.n_embd, s.n_head_kv * hd});
  if (a == "qwen2") {
    add("blk.0.attn_q.bias", {s.n_head * hd});
    add("blk.0.attn_k.bias", {s.n_head_kv * hd});
    add("blk.0.attn_v.bias", {s.n_head_kv * hd});
  }
  add("blk.0.attn_output.weight", {s.n_head * hd, s.n_embd});
  add("blk.0.ffn_norm.weight", {s.n_embd});
  add("blk.0.ffn_gate.weight", {s.n_embd, s.n_ff});
  add("blk.0.ffn_up.weight", {s.n_embd, s.n_ff});
  add("blk.0.ffn_down.weight", {s.n_ff, s.n_embd});
  const auto path = test::scratch_dir("model") / (name + ".gguf");
  w.write(path);
  return path;
}

std::pair<ErrorCode, std::string> load_error(const std::filesystem::path& p) {
  try {
    Model::load(p);
  } catch (const Error& e) {
    return {e.code(), e.what()};
  }
  return {ErrorCode::kOk, ""};
}

}  // namespace

TEST_CASE("hyper-parameters of the shared models", "[model]") {
  auto m = Model::load(test::model_path("synth-qwen3-hd64-small-q4_0"));
  const HParams& hp = m->hparams();
  CHECK(hp.arch == Arch::kQwen3);
  CHECK(hp.n_embd == 256);
  CHECK(hp.n_head == 8);
  CHECK(hp.n_head_kv == 2);
  CHECK(hp.head_dim == 64);  // attention.key_length, not 256 / 8
  CHECK(hp.rope_type == RopeType::kNeox);
  CHECK(hp.tied_output);
  auto q2 = Model::load(test::model_path("synth-qwen2-small-q4_0"));
  CHECK(q2->hparams().arch == Arch::kQwen2);
  CHECK(q2->layers()[0].bq);
  CHECK(q2->hparams().rope_freq_base == 1000000.0f);
  auto ll = Model::load(test::model_path("aidreams260K-q4_0"));
  CHECK(ll->hparams().rope_type == RopeType::kNormal);
  CHECK(ll->hparams().n_ctx_train == 128);
  CHECK(ll->hparams().n_ff == 172);
  CHECK(ll->layers()[0].ffn_down.type == GgmlType::kF32);  // 172 is not a multiple of 32
  CHECK(ll->output().data == ll->token_embd().data);
}

TEST_CASE("model identity hashes the weights, not the file name", "[model]") {
  const auto a = Model::load(test::model_path("aidreams260K-q4_0"));
  const auto dir = test::scratch_dir("identity");
  std::filesystem::copy_file(test::model_path("aidreams260K-q4_0"), dir / "renamed.gguf");
  const auto b = Model::load(dir / "renamed.gguf");
  CHECK(a->identity_hash() == b->identity_hash());
  const auto f32 = Model::load(test::model_path("aidreams260K-f32"));
  CHECK(a->identity_hash() != f32->identity_hash());
  TinySpec s1;
  TinySpec s2;
  s2.extra_kv = [](GgufWriter& w) { w.add_f32("llama.rope.freq_base", 500000.0f); };
  const auto m1 = Model::load(write_tiny(s1, "base"));
  const auto m2 = Model::load(write_tiny(s2, "rope"));
  CHECK(m1->identity_hash() != m2->identity_hash());  // same tensors, other RoPE base
}

TEST_CASE("a tiny written model loads, with tied output when output.weight is absent", "[model]") {
  TinySpec s;
  s.tied = true;
  const auto m = Model::load(write_tiny(s, "tied"));
  CHECK(m->hparams().tied_output);
  CHECK(m->hparams().head_dim == 32);
  CHECK(m->hparams().n_rot == 32);
}

TEST_CASE("model refusals name what is wrong", "[model]") {
  SECTION("unsupported architecture") {
    TinySpec s;
    s.arch = "mamba";
    const auto [code, msg] = load_error(write_tiny(s, "mamba"));
    CHECK(code == ErrorCode::kModelUnsupportedArch);
    CHECK(msg.find("mamba") != std::string::npos);
  }
  SECTION("missing tensor") {
    TinySpec s;
    s.skip_tensor = "blk.0.ffn_up.weight";
    const auto [code, msg] = load_error(write_tiny(s, "missing"));
    CHECK(code == ErrorCode::kModelMissingTensor);
    CHECK(msg.find("blk.0.ffn_up.weight") != std::string::npos);
  }
  SECTION("missing qwen2 bias") {
    TinySpec s;
    s.arch = "qwen2";
    s.skip_tensor = "blk.0.attn_k.bias";
    const auto [code, msg] = load_error(write_tiny(s, "nobias"));
    CHECK(code == ErrorCode::kModelMissingTensor);
    CHECK(msg.find("blk.0.attn_k.bias") != std::string::npos);
  }
  SECTION("tensor shape that does not fit the hyper-parameters") {
    TinySpec s;
    s.bad_shape_tensor = "blk.0.attn_k.weight";
    const auto [code, msg] = load_error(write_tiny(s, "shape"));
    CHECK(code == ErrorCode::kModelBadTensorShape);
    CHECK(msg.find("blk.0.attn_k.weight") != std::string::npos);
  }
  SECTION("head_count not a multiple of head_count_kv") {
    TinySpec s;
    s.n_head = 4;
    s.n_head_kv = 3;
    s.n_embd = 64;
    const auto [code, msg] = load_error(write_tiny(s, "gqa"));
    CHECK(code == ErrorCode::kModelBadHparams);
    CHECK(msg.find("head_count_kv") != std::string::npos);
  }
  SECTION("unsupported RoPE scaling") {
    TinySpec s;
    s.extra_kv = [](GgufWriter& w) { w.add_string("llama.rope.scaling.type", "yarn"); };
    const auto [code, msg] = load_error(write_tiny(s, "yarn"));
    CHECK(code == ErrorCode::kModelBadHparams);
    CHECK(msg.find("yarn") != std::string::npos);
  }
  SECTION("a vocabulary-only file is not a model") {
    const auto [code, msg] = load_error(test::model_path("llama3-bpe-vocab"));
    CHECK(code == ErrorCode::kModelMissingTensor);
    CHECK(msg.find("token_embd.weight") != std::string::npos);
  }
  SECTION("a missing file and a directory") {
    CHECK(load_error("/nonexistent/model.gguf").first == ErrorCode::kIo);
    CHECK(load_error(test::models_dir()).first == ErrorCode::kIo);
  }
}

TEST_CASE("Inf or NaN in a float tensor is refused at load, naming tensor and element", "[model][gguf]") {
  struct Case {
    GgmlType type;
    uint32_t bits;  // the bad value's bit pattern (16 low bits for F16/BF16)
    const char* name;
  };
  for (const Case c : {Case{GgmlType::kF32, 0x7FC00000u, "f32-nan"}, Case{GgmlType::kF32, 0xFF800000u, "f32-ninf"},
                       Case{GgmlType::kF16, 0x7C00u, "f16-inf"}, Case{GgmlType::kBF16, 0x7FC0u, "bf16-nan"}}) {
    GgufWriter w;
    w.add_string("general.architecture", "llama");
    w.add_tensor("good", {8}, GgmlType::kF32,
                 [](std::span<std::byte> d) { std::fill(d.begin(), d.end(), std::byte{0}); });
    w.add_tensor("bad", {32}, c.type, [c](std::span<std::byte> d) {
      std::fill(d.begin(), d.end(), std::byte{0});
      const size_t elem = c.type == GgmlType::kF32 ? 4 : 2;
      std::memcpy(d.data() + 5 * elem, &c.bits, elem);
    });
    const auto path = test::scratch_dir("nonfinite") / (std::string(c.name) + ".gguf");
    w.write(path);
    INFO(c.name);
    try {
      GgufFile::open(path);
      FAIL("accepted a non-finite value");
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::kTensorNonFinite);
      CHECK(std::string(e.what()).find("'bad'") != std::string::npos);
      CHECK(std::string(e.what()).find("element 5") != std::string::npos);
    }
  }
}
