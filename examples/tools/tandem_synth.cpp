// tandem-synth: write a GGUF with seeded random weights at the real shapes of a named
// model, Q4_0 matrices (F32 norms and biases), so benchmarks run at real sizes without
// shipping big files.
//
//   tandem-synth --preset tinyllama-1.1b -o tinyllama-synth.gguf [--seed 1]
//   tandem-synth --list
//
// Weights are N(0, 0.02^2)-like (uniform with that standard deviation), quantised with
// ggml's reference Q4_0 rule (d = max / -8, q = min(15, trunc(x / d + 8.5))). The
// vocabulary is a SentencePiece-style one of the preset's size: <unk> <s> </s>, the 256
// byte tokens <0x00>..<0xFF>, then synthetic pieces. The text such a model writes is
// noise; its speed is that of the real shapes.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "cpu/cpu_kernels.hpp"
#include "tandem/gguf/gguf_writer.hpp"

namespace {

struct Preset {
  const char* name;
  const char* arch;
  int n_vocab, n_ctx, n_embd, n_layer, n_head, n_head_kv, n_ff;
  float rope_base, eps;
  bool tied, qkv_bias, qk_norm;
  const char* about;
};

constexpr Preset kPresets[] = {
    {"tinyllama-1.1b", "llama", 32000, 2048, 2048, 22, 32, 4, 5632, 10000.0f, 1e-5f, false, false, false,
     "TinyLlama-1.1B shapes (llama, GQA 32/4, separate output)"},
    {"qwen2.5-0.5b", "qwen2", 151936, 32768, 896, 24, 14, 2, 4864, 1000000.0f, 1e-6f, true, true, false,
     "Qwen2.5-0.5B shapes (qwen2, q/k/v biases, tied output)"},
    {"small-llama", "llama", 512, 1024, 256, 4, 8, 2, 768, 10000.0f, 1e-5f, false, false, false,
     "a 256-wide llama for tests"},
    {"small-qwen3", "qwen3", 512, 1024, 256, 4, 8, 2, 768, 1000000.0f, 1e-6f, false, false, true,
     "a 256-wide qwen3 for tests"},
};

void quantize_q4_0(const float* x, tandem::kernels::BlockQ4_0* y, int64_t n) {
  for (int64_t b = 0; b < n / 32; ++b) {
    const float* xb = x + b * 32;
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < 32; ++j) {
      if (std::fabs(xb[j]) > amax) {
        amax = std::fabs(xb[j]);
        max = xb[j];
      }
    }
    const float d = max / -8.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[b].d = tandem::kernels::fp32_to_fp16(d);
    for (int j = 0; j < 16; ++j) {
      const auto q0 = uint8_t(std::min(15.0f, std::trunc(xb[j] * id + 8.5f)));
      const auto q1 = uint8_t(std::min(15.0f, std::trunc(xb[j + 16] * id + 8.5f)));
      y[b].qs[j] = uint8_t(q0 | (q1 << 4));
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::signal(SIGPIPE, SIG_IGN);  // a closed stdout pipe: a failed write (exit 1), not a kill
  CLI::App app{"tandem-synth: GGUF files with random Q4_0 weights at real model shapes", "tandem-synth"};
  std::string preset_name, out;
  uint64_t seed = 1;
  bool list = false;
  app.add_option("--preset", preset_name, "preset name (see --list)");
  app.add_option("-o,--output", out, "output GGUF path");
  app.add_option("--seed", seed, "random seed");
  app.add_flag("--list", list, "list presets");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);  // --help: 0; a refused flag: usage, 2
    return rc == 0 ? 0 : 2;
  }
  std::signal(SIGXFSZ, SIG_IGN);  // a file size limit is an EFBIG error, reported
  if (list) {
    for (const auto& p : kPresets) fmt::print("{:16} {}\n", p.name, p.about);
    if (std::fflush(stdout) != 0 || std::ferror(stdout)) {
      std::cerr << "tandem-synth: error: cannot write standard output: " << std::strerror(errno) << "\n";
      return 1;
    }
    return 0;
  }
  const Preset* p = nullptr;
  for (const auto& c : kPresets) {
    if (preset_name == c.name) p = &c;
  }
  if (!p) {
    std::string names;
    for (const auto& c : kPresets) names += (names.empty() ? "" : ", ") + std::string(c.name);
    if (preset_name.empty())  // -o is named only when it is missing too
      std::cerr << "tandem-synth: error: give --preset NAME (one of " << names << ")"
                << (out.empty() ? " and -o FILE" : "") << "\n";
    else
      std::cerr << "tandem-synth: error: --preset '" << preset_name << "' is not one of " << names << "\n";
    return 2;
  }
  if (out.empty()) {
    std::cerr << "tandem-synth: error: give -o FILE\n";
    return 2;
  }
  try {
    using tandem::GgmlType;
    tandem::GgufWriter w;
    const std::string a = p->arch;
    const int head_dim = p->n_embd / p->n_head;
    w.add_string("general.architecture", a);
    w.add_string("general.name", fmt::format("tandem-synth {} seed {}", p->name, seed));
    w.add_u32("general.file_type", 2);
    w.add_u32("general.quantization_version", 2);
    w.add_u32(a + ".context_length", uint32_t(p->n_ctx));
    w.add_u32(a + ".embedding_length", uint32_t(p->n_embd));
    w.add_u32(a + ".block_count", uint32_t(p->n_layer));
    w.add_u32(a + ".feed_forward_length", uint32_t(p->n_ff));
    w.add_u32(a + ".rope.dimension_count", uint32_t(head_dim));
    w.add_u32(a + ".attention.head_count", uint32_t(p->n_head));
    w.add_u32(a + ".attention.head_count_kv", uint32_t(p->n_head_kv));
    w.add_f32(a + ".attention.layer_norm_rms_epsilon", p->eps);
    w.add_f32(a + ".rope.freq_base", p->rope_base);
    w.add_u32(a + ".vocab_size", uint32_t(p->n_vocab));

    std::vector<std::string> tokens{"<unk>", "<s>", "</s>"};
    std::vector<float> scores{0.0f, 0.0f, 0.0f};
    std::vector<int32_t> types{2, 3, 3};
    for (int b = 0; b < 256; ++b) {
      tokens.push_back(fmt::format("<0x{:02X}>", b));
      scores.push_back(0.0f);
      types.push_back(6);
    }
    for (int i = 0; int(tokens.size()) < p->n_vocab; ++i) {
      tokens.push_back(i < 26 ? std::string(1, char('a' + i)) : fmt::format("\xe2\x96\x81t{}", i));
      scores.push_back(-float(i));
      types.push_back(1);
    }
    w.add_string("tokenizer.ggml.model", "llama");
    w.add_string_array("tokenizer.ggml.tokens", tokens);
    w.add_f32_array("tokenizer.ggml.scores", scores);
    w.add_i32_array("tokenizer.ggml.token_type", types);
    w.add_u32("tokenizer.ggml.bos_token_id", 1);
    w.add_u32("tokenizer.ggml.eos_token_id", 2);
    w.add_u32("tokenizer.ggml.unknown_token_id", 0);
    w.add_bool("tokenizer.ggml.add_bos_token", true);
    w.add_bool("tokenizer.ggml.add_eos_token", false);

    uint64_t tensor_seed = seed;
    auto q4 = [&](const std::string& name, int64_t k, int64_t n) {
      const uint64_t s = tensor_seed++;
      w.add_tensor(name, {k, n}, GgmlType::kQ4_0, [s, k, n](std::span<std::byte> dst) {
        std::mt19937_64 rng(s);
        const float r = 0.02f * std::sqrt(3.0f);
        std::uniform_real_distribution<float> uni(-r, r);
        std::vector<float> row(static_cast<size_t>(k));
        auto* blocks = reinterpret_cast<tandem::kernels::BlockQ4_0*>(dst.data());
        for (int64_t i = 0; i < n; ++i) {
          for (auto& v : row) v = uni(rng);
          quantize_q4_0(row.data(), blocks + i * (k / 32), k);
        }
      });
    };
    auto f32 = [&](const std::string& name, int64_t k, float value) {
      w.add_tensor(name, {k}, GgmlType::kF32, [k, value](std::span<std::byte> dst) {
        auto* f = reinterpret_cast<float*>(dst.data());
        for (int64_t i = 0; i < k; ++i) f[i] = value;
      });
    };
    const int64_t E = p->n_embd, Q = int64_t(p->n_head) * head_dim, KV = int64_t(p->n_head_kv) * head_dim;
    q4("token_embd.weight", E, p->n_vocab);
    for (int il = 0; il < p->n_layer; ++il) {
      const std::string b = fmt::format("blk.{}.", il);
      f32(b + "attn_norm.weight", E, 1.0f);
      q4(b + "attn_q.weight", E, Q);
      q4(b + "attn_k.weight", E, KV);
      q4(b + "attn_v.weight", E, KV);
      if (p->qkv_bias) {
        f32(b + "attn_q.bias", Q, 0.01f);
        f32(b + "attn_k.bias", KV, 0.01f);
        f32(b + "attn_v.bias", KV, 0.01f);
      }
      if (p->qk_norm) {
        f32(b + "attn_q_norm.weight", head_dim, 1.0f);
        f32(b + "attn_k_norm.weight", head_dim, 1.0f);
      }
      q4(b + "attn_output.weight", Q, E);
      f32(b + "ffn_norm.weight", E, 1.0f);
      q4(b + "ffn_gate.weight", E, p->n_ff);
      q4(b + "ffn_up.weight", E, p->n_ff);
      q4(b + "ffn_down.weight", p->n_ff, E);
    }
    f32("output_norm.weight", E, 1.0f);
    if (!p->tied) q4("output.weight", E, p->n_vocab);
    w.write(out);
    std::cerr << fmt::format("tandem-synth: wrote {} ({})\n", out, p->about);
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "tandem-synth: error: " << e.what() << "\n";
    return 1;
  }
}
