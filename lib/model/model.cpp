#include "tandem/model/model.hpp"

#include <fmt/format.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <new>

#include "cpu/cpu_kernels.hpp"
#include "tandem/core/thread_pool.hpp"
#include "tandem/gguf/ggml_dequant.hpp"
#include "tandem/model/requantize.hpp"

namespace tandem {

std::string_view arch_name(Arch a) noexcept {
  switch (a) {
    case Arch::kLlama:
      return "llama";
    case Arch::kQwen2:
      return "qwen2";
    case Arch::kQwen3:
      return "qwen3";
    case Arch::kGemma3:
      return "gemma3";
  }
  return "?";
}

namespace {

[[noreturn]] void bad_hparams(const std::string& msg) {
  throw Error(ErrorCode::kModelBadHparams, "model: " + msg);
}

int32_t require_i32(const GgufFile& f, const std::string& key, int32_t min_value) {
  const auto v = f.get_int(key);
  if (!v) bad_hparams(fmt::format("required key '{}' is missing", key));
  if (*v < min_value || *v > (1 << 24)) {
    bad_hparams(fmt::format("key '{}' = {} is out of range [{}, {}]", key, *v, min_value, 1 << 24));
  }
  return static_cast<int32_t>(*v);
}

int32_t optional_i32(const GgufFile& f, const std::string& key, int32_t fallback, int32_t min_value) {
  if (!f.find(key)) return fallback;
  return require_i32(f, key, min_value);
}

float optional_positive_f32(const GgufFile& f, const std::string& key, float fallback) {
  const auto v = f.get_float(key);
  if (!v) return fallback;
  if (!std::isfinite(*v) || *v <= 0.0f) {
    bad_hparams(fmt::format("key '{}' = {} must be a finite positive number", key, *v));
  }
  return *v;
}

class TensorBinder {
 public:
  explicit TensorBinder(const GgufFile& f) : f_(f) {}

  // A weight with row length k and n rows (n == 0: a 1-D vector of k elements).
  TensorView get(const std::string& name, int64_t k, int64_t n, bool required = true) const {
    const GgufTensorInfo* t = f_.find_tensor(name);
    if (!t) {
      if (required) {
        throw Error(ErrorCode::kModelMissingTensor, fmt::format("model: required tensor '{}' is missing", name));
      }
      return {};
    }
    const int64_t rows = t->n_rows();
    const bool shape_ok =
        n == 0 ? (t->ne.size() == 1 && t->ne[0] == k) : (t->ne.size() == 2 && t->ne[0] == k && t->ne[1] == n);
    if (!shape_ok) {
      std::string found;
      for (size_t i = 0; i < t->ne.size(); ++i) found += (i ? ", " : "") + std::to_string(t->ne[i]);
      throw Error(ErrorCode::kModelBadTensorShape,
                  fmt::format("model: tensor '{}' has shape [{}], expected [{}{}]", name, found, k,
                              n == 0 ? std::string() : ", " + std::to_string(n)));
    }
    if (n == 0 && t->type != GgmlType::kF32) {
      throw Error(ErrorCode::kModelBadTensorShape,
                  fmt::format("model: tensor '{}' must be F32 (a norm or bias vector), found {}", name,
                              ggml_type_name(t->type)));
    }
    TensorView v;
    v.info = t;
    v.type = t->type;
    v.k = t->ne[0];
    v.n = rows;
    v.data = t->data;
    v.row_bytes = static_cast<size_t>(t->row_bytes());
    return v;
  }

 private:
  const GgufFile& f_;
};

/// The hyper-parameters of a llama/qwen2/qwen3 GGUF (n_vocab comes with the tokenizer).
HParams read_hparams(const GgufFile& f) {
  const auto arch = f.get_string("general.architecture");
  if (!arch) {
    throw Error(ErrorCode::kModelUnsupportedArch, "model: key 'general.architecture' is missing");
  }
  HParams hp;
  if (*arch == "llama") {
    hp.arch = Arch::kLlama;
    hp.rope_type = RopeType::kNormal;
  } else if (*arch == "qwen2") {
    hp.arch = Arch::kQwen2;
    hp.rope_type = RopeType::kNeox;
  } else if (*arch == "qwen3") {
    hp.arch = Arch::kQwen3;
    hp.rope_type = RopeType::kNeox;
  } else if (*arch == "gemma3") {
    hp.arch = Arch::kGemma3;
    hp.rope_type = RopeType::kNeox;
  } else {
    throw Error(ErrorCode::kModelUnsupportedArch,
                fmt::format("model: architecture '{}' is not supported (llama, qwen2, qwen3, gemma3)", *arch));
  }
  const std::string a = *arch + ".";
  hp.n_embd = require_i32(f, a + "embedding_length", 1);
  hp.n_layer = require_i32(f, a + "block_count", 1);
  hp.n_head = require_i32(f, a + "attention.head_count", 1);
  hp.n_head_kv = optional_i32(f, a + "attention.head_count_kv", hp.n_head, 1);
  hp.n_ff = require_i32(f, a + "feed_forward_length", 1);
  hp.n_ctx_train = require_i32(f, a + "context_length", 1);
  if (hp.n_embd % hp.n_head != 0 && !f.find(a + "attention.key_length")) {
    bad_hparams(fmt::format("n_embd {} is not a multiple of n_head {} and '{}attention.key_length' is absent",
                            hp.n_embd, hp.n_head, a));
  }
  hp.head_dim = optional_i32(f, a + "attention.key_length", hp.n_embd / hp.n_head, 1);
  hp.head_dim_v = optional_i32(f, a + "attention.value_length", hp.head_dim, 1);
  if (hp.head_dim_v != hp.head_dim) {
    bad_hparams(fmt::format("attention.value_length {} != key_length {} is not supported", hp.head_dim_v, hp.head_dim));
  }
  if (hp.head_dim % 2 != 0) bad_hparams(fmt::format("head_dim {} must be even", hp.head_dim));
  hp.n_rot = optional_i32(f, a + "rope.dimension_count", hp.head_dim, 2);
  if (hp.n_rot > hp.head_dim || hp.n_rot % 2 != 0) {
    bad_hparams(fmt::format("rope.dimension_count {} must be even and <= head_dim {}", hp.n_rot, hp.head_dim));
  }
  if (hp.n_head % hp.n_head_kv != 0) {
    bad_hparams(fmt::format("attention.head_count {} is not a multiple of head_count_kv {}", hp.n_head, hp.n_head_kv));
  }
  hp.rms_eps = optional_positive_f32(f, a + "attention.layer_norm_rms_epsilon", 1e-5f);
  hp.rope_freq_base = optional_positive_f32(f, a + "rope.freq_base", 10000.0f);
  if (const auto type = f.get_string(a + "rope.scaling.type"); type && *type != "none") {
    if (*type != "linear") {
      bad_hparams(fmt::format("rope.scaling.type '{}' is not supported (none, linear)", *type));
    }
    hp.rope_freq_scale = 1.0f / optional_positive_f32(f, a + "rope.scaling.factor", 1.0f);
  }
  if (hp.arch == Arch::kGemma3) {
    // llama.cpp (llama-model.cpp, LLM_ARCH_GEMMA3): the embedding scale is the f32
    // sqrtf(n_embd); the attention scale 1/sqrt(head_dim), except for the 62-layer 27B
    // (1/sqrt(n_embd / n_head), integer division); with a sliding window, the pattern 6
    // and the local RoPE base 10000 are constants, not GGUF keys.
    hp.embd_scale = std::sqrt(static_cast<float>(hp.n_embd));
    const int32_t embd_per_head = hp.n_embd / hp.n_head;  // integer division, as llama.cpp
    hp.q_scale = hp.n_layer == 62 ? 1.0f / std::sqrt(static_cast<float>(embd_per_head))
                                  : 1.0f / std::sqrt(static_cast<float>(hp.head_dim));
    hp.gelu_ffn = true;
    hp.post_norms = true;
    hp.n_swa = optional_i32(f, a + "attention.sliding_window", 0, 0);
    if (hp.n_swa > 0) {
      hp.swa_pattern = 6;
      hp.rope_freq_base_swa = 10000.0f;
    }
    if (const auto c = f.get_float(a + "final_logit_softcapping"); c && *c != 0.0f) {
      if (!std::isfinite(*c) || *c < 0.0f) {
        bad_hparams(fmt::format("key '{}final_logit_softcapping' = {} must be a finite positive number", a, *c));
      }
      hp.final_logit_softcap = *c;
    }
  }
  return hp;
}

}  // namespace

void embedding_row(const TensorView& t, int32_t id, float* y) noexcept {
  const std::byte* row = t.data + size_t(id) * t.row_bytes;
  switch (t.type) {
    case GgmlType::kF32:
      std::memcpy(y, row, size_t(t.k) * sizeof(float));
      break;
    case GgmlType::kF16:
      kernels::fp16_to_fp32_row(reinterpret_cast<const uint16_t*>(row), y, t.k);
      break;
    case GgmlType::kBF16:
      for (int64_t i = 0; i < t.k; ++i) y[i] = kernels::bf16_to_fp32(reinterpret_cast<const uint16_t*>(row)[i]);
      break;
    case GgmlType::kQ4_0:
      kernels::dequantize_row_q4_0(reinterpret_cast<const kernels::BlockQ4_0*>(row), y, t.k);
      break;
    case GgmlType::kQ8_0:
      kernels::dequantize_row_q8_0(reinterpret_cast<const kernels::BlockQ8_0*>(row), y, t.k);
      break;
    case GgmlType::kQ4_1:
    case GgmlType::kQ5_0:
    case GgmlType::kQ5_1:
    case GgmlType::kQ4_K:
    case GgmlType::kQ5_K:
    case GgmlType::kQ6_K:
      dequantize_row(t.type, row, y, t.k);  // ggml's dequantisation
      break;
    default:
      break;  // Model::load converts every other type (model.hpp)
  }
}

std::shared_ptr<const Model> Model::load(const std::filesystem::path& path, const ModelOptions& options) {
  if (options.convert_to != GgmlType::kQ8_0 && options.convert_to != GgmlType::kQ4_0) {
    throw Error(ErrorCode::kInvalidArgument, fmt::format("ModelOptions::convert_to must be Q8_0 or Q4_0, not {}",
                                                         ggml_type_name(options.convert_to)));
  }
  std::shared_ptr<Model> m(new Model());
  m->gguf_ = GgufFile::open(path, options.gguf);
  const GgufFile& f = *m->gguf_;

  HParams& hp = m->hp_;
  hp = read_hparams(f);
  m->tokenizer_ = std::make_unique<Tokenizer>(Tokenizer::from_gguf(f));
  hp.n_vocab = m->tokenizer_->n_vocab();

  const TensorBinder b(f);
  const int64_t q_width = int64_t{hp.n_head} * hp.head_dim;
  const int64_t kv_width = int64_t{hp.n_head_kv} * hp.head_dim;
  m->token_embd_ = b.get("token_embd.weight", hp.n_embd, hp.n_vocab);
  m->output_norm_ = b.get("output_norm.weight", hp.n_embd, 0);
  m->output_ = b.get("output.weight", hp.n_embd, hp.n_vocab, false);
  if (!m->output_) {
    m->output_ = m->token_embd_;
    hp.tied_output = true;
  }
  m->layers_.resize(static_cast<size_t>(hp.n_layer));
  for (int32_t il = 0; il < hp.n_layer; ++il) {
    LayerWeights& L = m->layers_[static_cast<size_t>(il)];
    const std::string p = fmt::format("blk.{}.", il);
    L.attn_norm = b.get(p + "attn_norm.weight", hp.n_embd, 0);
    L.wq = b.get(p + "attn_q.weight", hp.n_embd, q_width);
    L.wk = b.get(p + "attn_k.weight", hp.n_embd, kv_width);
    L.wv = b.get(p + "attn_v.weight", hp.n_embd, kv_width);
    L.wo = b.get(p + "attn_output.weight", q_width, hp.n_embd);
    if (hp.arch == Arch::kQwen2) {
      L.bq = b.get(p + "attn_q.bias", q_width, 0);
      L.bk = b.get(p + "attn_k.bias", kv_width, 0);
      L.bv = b.get(p + "attn_v.bias", kv_width, 0);
    }
    if (hp.arch == Arch::kQwen3 || hp.arch == Arch::kGemma3) {
      L.q_norm = b.get(p + "attn_q_norm.weight", hp.head_dim, 0);
      L.k_norm = b.get(p + "attn_k_norm.weight", hp.head_dim, 0);
    }
    L.ffn_norm = b.get(p + "ffn_norm.weight", hp.n_embd, 0);
    L.ffn_gate = b.get(p + "ffn_gate.weight", hp.n_embd, hp.n_ff);
    L.ffn_up = b.get(p + "ffn_up.weight", hp.n_embd, hp.n_ff);
    L.ffn_down = b.get(p + "ffn_down.weight", hp.n_ff, hp.n_embd);
    if (hp.post_norms) {
      L.attn_post_norm = b.get(p + "post_attention_norm.weight", hp.n_embd, 0);
      L.ffn_post_norm = b.get(p + "post_ffw_norm.weight", hp.n_embd, 0);
    }
  }
  m->convert_weights(options.n_threads, options.convert_to);
  return m;
}

void Model::AlignedFree::operator()(std::byte* p) const noexcept {
  ::operator delete[](p, std::align_val_t{kConvertedAlignment});
}

void Model::convert_weights(int n_threads, GgmlType convert_to) {
  // Every bound 2-D weight, once (a tied output shares token_embd's view).
  std::vector<TensorView*> views{&token_embd_, &output_};
  for (LayerWeights& L : layers_) {
    for (TensorView* v : {&L.wq, &L.wk, &L.wv, &L.wo, &L.ffn_gate, &L.ffn_up, &L.ffn_down}) views.push_back(v);
  }
  struct Conversion {
    const GgufTensorInfo* info;
    GgmlType type;
    uint64_t offset;
  };
  std::vector<Conversion> todo;
  uint64_t total = 0;
  const bool has_output = !hp_.tied_output;
  // Types with a CPU kernel run as the file has them.
  auto native = [](const GgufTensorInfo* t) {
    return !ggml_is_quantized(t->type) || t->type == GgmlType::kQ4_0 || t->type == GgmlType::kQ8_0 ||
           t->type == GgmlType::kQ4_1 || t->type == GgmlType::kQ5_0 || t->type == GgmlType::kQ5_1 ||
           t->type == GgmlType::kQ4_K || t->type == GgmlType::kQ5_K || t->type == GgmlType::kQ6_K;
  };
  // Q8_0: each weight without a kernel becomes Q8_0, the others stay. Q4_0 (asked for): a
  // file with weights other than Q4_0, Q8_0 and floats gets llama-quantize's whole Q4_0
  // rule, so the result is the file `tandem-quantize IN OUT q4_0` (and llama.cpp) would
  // make: its Q8_0 weights (e.g. a Q4_K_M's) become Q4_0 too; other files stay as they are.
  const bool convert_all = std::any_of(views.begin(), views.end(), [&](const TensorView* v) {
    const GgmlType t = v->info->type;
    return ggml_is_quantized(t) && t != GgmlType::kQ4_0 && t != GgmlType::kQ8_0;
  });
  for (TensorView* v : views) {
    const GgufTensorInfo* t = v->info;
    const bool skip = convert_to == GgmlType::kQ8_0 ? native(t) : !convert_all || !ggml_is_quantized(t->type);
    if (skip || std::any_of(todo.begin(), todo.end(), [t](const Conversion& c) { return c.info == t; })) continue;
    const GgmlType type =
        convert_to == GgmlType::kQ8_0 ? GgmlType::kQ8_0 : requantized_type(*t, has_output, GgmlType::kQ4_0, false);
    if (type == t->type) continue;
    todo.push_back({t, type, total});
    total += (requantized_bytes(*t, type) + kConvertedAlignment - 1) / kConvertedAlignment * kConvertedAlignment;
  }
  weight_bytes_ = 0;
  for (const auto& t : gguf_->tensors()) weight_bytes_ += t.n_bytes;
  if (todo.empty()) return;

  const auto start = std::chrono::steady_clock::now();
  converted_.reset(static_cast<std::byte*>(::operator new[](total, std::align_val_t{kConvertedAlignment})));
  ThreadPool pool(n_threads);
  std::map<std::pair<GgmlType, GgmlType>, int> kinds;
  for (const Conversion& c : todo) {
    requantize_tensor(*c.info, c.type, converted_.get() + c.offset, pool);
    weight_bytes_ += requantized_bytes(*c.info, c.type);
    weight_bytes_ -= c.info->n_bytes;
    ++kinds[{c.info->type, c.type}];
  }
  for (TensorView* v : views) {
    for (const Conversion& c : todo) {
      if (v->info != c.info) continue;
      v->type = c.type;
      v->data = converted_.get() + c.offset;
      v->row_bytes = static_cast<size_t>(requantized_bytes(*c.info, c.type) / static_cast<uint64_t>(v->n));
    }
  }
  converted_tensors_ = static_cast<int>(todo.size());
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::string what;
  for (const auto& [from_to, count] : kinds) {
    what += fmt::format("{}{} {} -> {}", what.empty() ? "" : ", ", count, ggml_type_name(from_to.first),
                        ggml_type_name(from_to.second));
  }
  fmt::print(stderr, "tandem: converted {} weights of {} at load ({}) in {:.2f} s on {} threads: {}\n", todo.size(),
             gguf_->path().filename().string(), what, seconds, pool.size(),
             convert_to == GgmlType::kQ8_0
                 ? "these types have no kernel yet; Q8_0 keeps their accuracy (tandem-quantize ... q4_0 writes a "
                   "smaller, faster Q4_0 file that loses accuracy)"
                 : "Q4_0 as asked (llama-quantize's rule; it compounds the file's rounding)");
}

std::string Model::name() const {
  if (auto n = gguf_->get_string("general.name"); n && !n->empty()) return *n;
  return gguf_->path().stem().string();
}

uint64_t Model::decode_bytes_per_token() const noexcept {
  const uint64_t embd = token_embd_.info ? token_embd_.info->n_bytes : 0;
  if (hp_.tied_output) return weight_bytes_;
  return weight_bytes_ - embd + token_embd_.row_bytes;
}

uint64_t Model::identity_hash() const {
  std::call_once(hash_once_, [this] {
    XXH3_state_t* st = XXH3_createState();
    XXH3_64bits_reset(st);
    const HParams& h = hp_;
    const int32_t ints[] = {static_cast<int32_t>(h.arch),
                            h.n_vocab,
                            h.n_embd,
                            h.n_layer,
                            h.n_head,
                            h.n_head_kv,
                            h.head_dim,
                            h.head_dim_v,
                            h.n_ff,
                            h.n_rot,
                            static_cast<int32_t>(h.rope_type),
                            h.tied_output ? 1 : 0};
    const float floats[] = {h.rms_eps, h.rope_freq_base, h.rope_freq_scale};
    XXH3_64bits_update(st, ints, sizeof(ints));
    XXH3_64bits_update(st, floats, sizeof(floats));
    if (h.arch == Arch::kGemma3) {  // only here, so the other architectures' hashes stay as they were
      const int32_t g_ints[] = {h.gelu_ffn ? 1 : 0, h.post_norms ? 1 : 0, h.n_swa, h.swa_pattern};
      const float g_floats[] = {h.embd_scale, h.q_scale, h.rope_freq_base_swa, h.final_logit_softcap};
      XXH3_64bits_update(st, g_ints, sizeof(g_ints));
      XXH3_64bits_update(st, g_floats, sizeof(g_floats));
    }
    for (const auto& t : gguf_->tensors()) {
      XXH3_64bits_update(st, t.name.data(), t.name.size());
      XXH3_64bits_update(st, t.ne.data(), t.ne.size() * sizeof(int64_t));
      const auto type = static_cast<uint32_t>(t.type);
      XXH3_64bits_update(st, &type, sizeof(type));
      XXH3_64bits_update(st, t.data, t.n_bytes);
    }
    identity_hash_ = XXH3_64bits_digest(st);
    XXH3_freeState(st);
  });
  return identity_hash_;
}

}  // namespace tandem
