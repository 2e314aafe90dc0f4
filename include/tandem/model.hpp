// Model: an immutable transformer read from a GGUF file (hyper-parameters, tokenizer,
// weights as views into the memory-mapped file).
//
// Supported architectures (general.architecture):
//   llama  — RMSNorm, RoPE (normal, pairs (2i, 2i+1)), GQA, SwiGLU FFN.
//   qwen2  — as llama plus q/k/v biases; RoPE NeoX (pairs (i, i + n_rot/2)).
//   qwen3  — as llama with per-head RMSNorm of q and k before RoPE (NeoX); head_dim from
//            `qwen3.attention.key_length`, which may differ from n_embd / n_head.
// Hyper-parameters are read with the GGUF key names of the spec ("<arch>.block_count",
// "<arch>.attention.head_count_kv", ...). When `output.weight` is absent the output
// projection is tied to `token_embd.weight`.
//
// Thread-safety: a Model is immutable after load(); share it (std::shared_ptr) between
// any number of executors and threads.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/gguf.hpp"
#include "tandem/tokenizer.hpp"

namespace tandem {

enum class Arch { kLlama, kQwen2, kQwen3 };
enum class RopeType { kNormal, kNeox };

std::string_view arch_name(Arch a) noexcept;

struct HParams {
  Arch arch = Arch::kLlama;
  int32_t n_vocab = 0;
  int32_t n_ctx_train = 0;   ///< tokens the model was trained with (<arch>.context_length)
  int32_t n_embd = 0;
  int32_t n_layer = 0;
  int32_t n_head = 0;
  int32_t n_head_kv = 0;
  int32_t head_dim = 0;      ///< per-head width of q and k (attention.key_length)
  int32_t head_dim_v = 0;    ///< per-head width of v (attention.value_length)
  int32_t n_ff = 0;
  int32_t n_rot = 0;         ///< rotated dims per head (rope.dimension_count)
  float rms_eps = 1e-5f;
  float rope_freq_base = 10000.0f;
  float rope_freq_scale = 1.0f;  ///< 1 / rope.scaling.factor for linear scaling
  RopeType rope_type = RopeType::kNormal;
  bool tied_output = false;
};

/// A 2-D weight: n rows of k elements (ggml ne = [k, n]) in one of the GGUF types.
struct TensorView {
  const GgufTensorInfo* info = nullptr;
  GgmlType type = GgmlType::kF32;
  int64_t k = 0;   ///< row length (ne[0])
  int64_t n = 0;   ///< number of rows
  const std::byte* data = nullptr;
  size_t row_bytes = 0;
  explicit operator bool() const noexcept { return data != nullptr; }
};

struct LayerWeights {
  TensorView attn_norm, wq, wk, wv, wo;
  TensorView bq, bk, bv;          ///< qwen2 only
  TensorView q_norm, k_norm;      ///< qwen3 only, [head_dim]
  TensorView ffn_norm, ffn_gate, ffn_up, ffn_down;
};

struct ModelOptions {
  GgufOpenOptions gguf;
};

class Model {
 public:
  /// Load and validate. Throws Error: kIo / GGUF codes for the file,
  /// kModelUnsupportedArch, kModelMissingTensor (naming the tensor), kModelBadHparams,
  /// kModelBadTensorShape (naming the tensor, expected vs found), kTokenizer.
  static std::shared_ptr<const Model> load(const std::filesystem::path& path,
                                           const ModelOptions& options = {});

  const HParams& hparams() const noexcept { return hp_; }
  const Tokenizer& tokenizer() const noexcept { return *tokenizer_; }
  const GgufFile& gguf() const noexcept { return *gguf_; }
  std::string name() const;  ///< general.name, or the file stem

  const TensorView& token_embd() const noexcept { return token_embd_; }
  const TensorView& output_norm() const noexcept { return output_norm_; }
  const TensorView& output() const noexcept { return output_; }
  const std::vector<LayerWeights>& layers() const noexcept { return layers_; }

  /// Bytes of all tensor data (what a forward pass over every weight reads at most).
  uint64_t weight_bytes() const noexcept { return weight_bytes_; }
  /// Bytes of weights a single decode token reads (everything except the embedding
  /// table, of which one row is read, unless the output is tied to it).
  uint64_t decode_bytes_per_token() const noexcept;

  /// xxHash3-64 of the hyper-parameters and of every tensor's name, shape, type and data
  /// (the weights, not the file name). Computed on first call (reads every weight once),
  /// then cached. Thread-safe.
  uint64_t identity_hash() const;

 private:
  Model() = default;
  std::shared_ptr<const GgufFile> gguf_;
  std::unique_ptr<Tokenizer> tokenizer_;
  HParams hp_;
  TensorView token_embd_, output_norm_, output_;
  std::vector<LayerWeights> layers_;
  uint64_t weight_bytes_ = 0;
  mutable std::once_flag hash_once_;
  mutable uint64_t identity_hash_ = 0;
};

}  // namespace tandem
