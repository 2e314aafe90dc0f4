// A tiny random gemma3 GGUF (F32 weights) for tests that need the architecture without the
// real model: 6 layers (sliding on 0..4, full attention on 5), a small sliding window so
// short prompts cross it, optional final-logit soft-capping, and a tensor left out on
// request (load refusals).
#pragma once

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "tandem/gguf/gguf_writer.hpp"
#include "test_support.hpp"

namespace tandem::test {

struct TinyGemma3 {
  int n_embd = 64, n_head = 2, n_head_kv = 1, head_dim = 32, n_ff = 96, n_layer = 6, n_vocab = 64;
  int sliding_window = 8;  ///< 0: the key is left out (no sliding window)
  float softcap = 0.0f;    ///< 0: the key is left out
  std::string skip_tensor;
  uint32_t seed = 7;
};

inline std::filesystem::path write_tiny_gemma3(const TinyGemma3& s, const std::string& name) {
  GgufWriter w;
  const std::string a = "gemma3.";
  w.add_string("general.architecture", "gemma3");
  w.add_u32(a + "context_length", 4096);
  w.add_u32(a + "embedding_length", uint32_t(s.n_embd));
  w.add_u32(a + "block_count", uint32_t(s.n_layer));
  w.add_u32(a + "feed_forward_length", uint32_t(s.n_ff));
  w.add_u32(a + "attention.head_count", uint32_t(s.n_head));
  w.add_u32(a + "attention.head_count_kv", uint32_t(s.n_head_kv));
  w.add_u32(a + "attention.key_length", uint32_t(s.head_dim));
  w.add_u32(a + "attention.value_length", uint32_t(s.head_dim));
  w.add_f32(a + "attention.layer_norm_rms_epsilon", 1e-6f);
  w.add_f32(a + "rope.freq_base", 1000000.0f);
  if (s.sliding_window > 0) w.add_u32(a + "attention.sliding_window", uint32_t(s.sliding_window));
  if (s.softcap > 0.0f) w.add_f32(a + "final_logit_softcapping", s.softcap);
  std::vector<std::string> tokens{"<pad>", "<eos>", "<bos>", "<unk>"};
  std::vector<int32_t> types{3, 3, 3, 2};
  while (int(tokens.size()) < s.n_vocab) {
    tokens.push_back(std::string("t").append(std::to_string(tokens.size())));  // (GCC 12 -Wrestrict on "t" + s)
    types.push_back(1);
  }
  w.add_string("tokenizer.ggml.model", "llama");
  w.add_string_array("tokenizer.ggml.tokens", tokens);
  w.add_f32_array("tokenizer.ggml.scores", std::vector<float>(tokens.size(), 0.0f));
  w.add_i32_array("tokenizer.ggml.token_type", types);
  w.add_u32("tokenizer.ggml.bos_token_id", 2);
  w.add_u32("tokenizer.ggml.eos_token_id", 1);
  std::mt19937 rng(s.seed);
  auto add = [&](const std::string& n, std::vector<int64_t> ne, float mean, float spread) {
    if (n == s.skip_tensor) return;
    std::vector<float> v(size_t(ne[0] * (ne.size() > 1 ? ne[1] : 1)));
    std::uniform_real_distribution<float> u(-spread, spread);
    for (float& x : v) x = mean + u(rng);
    w.add_tensor(n, ne, GgmlType::kF32,
                 [v](std::span<std::byte> d) { std::memcpy(d.data(), v.data(), std::min(d.size(), v.size() * 4)); });
  };
  const int q_w = s.n_head * s.head_dim, kv_w = s.n_head_kv * s.head_dim;
  add("token_embd.weight", {s.n_embd, s.n_vocab}, 0.0f, 0.1f);
  add("output_norm.weight", {s.n_embd}, 1.0f, 0.2f);
  for (int il = 0; il < s.n_layer; ++il) {
    const std::string p = "blk." + std::to_string(il) + ".";
    add(p + "attn_norm.weight", {s.n_embd}, 1.0f, 0.2f);
    add(p + "attn_q.weight", {s.n_embd, q_w}, 0.0f, 0.2f);
    add(p + "attn_k.weight", {s.n_embd, kv_w}, 0.0f, 0.2f);
    add(p + "attn_v.weight", {s.n_embd, kv_w}, 0.0f, 0.2f);
    add(p + "attn_q_norm.weight", {s.head_dim}, 1.0f, 0.2f);
    add(p + "attn_k_norm.weight", {s.head_dim}, 1.0f, 0.2f);
    add(p + "attn_output.weight", {q_w, s.n_embd}, 0.0f, 0.2f);
    add(p + "post_attention_norm.weight", {s.n_embd}, 1.0f, 0.2f);
    add(p + "ffn_norm.weight", {s.n_embd}, 1.0f, 0.2f);
    add(p + "ffn_gate.weight", {s.n_embd, s.n_ff}, 0.0f, 0.2f);
    add(p + "ffn_up.weight", {s.n_embd, s.n_ff}, 0.0f, 0.2f);
    add(p + "ffn_down.weight", {s.n_ff, s.n_embd}, 0.0f, 0.2f);
    add(p + "post_ffw_norm.weight", {s.n_embd}, 1.0f, 0.2f);
  }
  const auto path = scratch_dir("gemma3") / (name + ".gguf");
  w.write(path);
  return path;
}

}  // namespace tandem::test
