// Model: an immutable transformer read from a GGUF file (hyper-parameters, tokenizer,
// weights as views into the memory-mapped file).
//
// Supported architectures (general.architecture):
//   llama  — RMSNorm, RoPE (normal, pairs (2i, 2i+1)), GQA, SwiGLU FFN.
//   qwen2  — as llama plus q/k/v biases; RoPE NeoX (pairs (i, i + n_rot/2)).
//   qwen3  — as llama with per-head RMSNorm of q and k before RoPE (NeoX); head_dim from
//            `qwen3.attention.key_length`, which may differ from n_embd / n_head.
//   gemma3 — Gemma 3 (llama.cpp's src/models/gemma3.cpp): token embeddings scaled by
//            f32 sqrt(n_embd); RMSNorm before and after attention (`post_attention_norm`)
//            and the FFN (`post_ffw_norm`); per-head q/k RMSNorm; NeoX RoPE; q scaled by
//            1/sqrt(head_dim) before attention (62 layers, the 27B: 1/sqrt(n_embd/n_head));
//            GELU(tanh)-gated FFN with ggml's f16 GELU table; interleaved sliding-window
//            attention when `gemma3.attention.sliding_window` is present (layers il % 6 < 5
//            see the window's last n_swa positions and use RoPE base 10000, the others see
//            everything with `rope.freq_base`: llama.cpp constants); optional final-logit
//            soft-capping (`gemma3.final_logit_softcapping`).
// Hyper-parameters are read with the GGUF key names of the spec ("<arch>.block_count",
// "<arch>.attention.head_count_kv", ...). When `output.weight` is absent the output
// projection is tied to `token_embd.weight`.
//
// Weight formats: the executors compute with F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K,
// Q5_K, Q6_K and Q8_0 weights (the CPU and GPU executors' own kernels, the same bits:
// docs/arithmetic.md), and a file's
// weights of those types are used as they are (memory-mapped). A 2-D weight of any other
// type the reader accepts (Q2_K, Q3_K) has no kernel yet and is converted once at load, on a thread pool, as
// ModelOptions::convert_to says:
//   - kQ8_0 (the default): each such weight becomes Q8_0 (ggml's dequantisation, then its
//     reference Q8_0 quantiser: llama-quantize's bytes for a Q8_0 target); every other
//     weight stays as it is. The loss is negligible: llama.cpp's own perplexity of such a
//     Q8_0 conversion is within 0.01 % of the original file's (SmolLM2 Q4_1, Gemma 3
//     Q4_K_M; benchmarks/README.md);
//   - kQ4_0: for a file with any weight other than Q4_0, Q8_0 or float (Q4_1 included),
//     llama-quantize's whole Q4_0 rule (requantize.hpp): the output projection
//     (`output.weight`, or a tied `token_embd.weight`) becomes Q8_0, every other weight
//     Q4_0 (Q8_0 weights of such a file too), so the bytes equal those `tandem-quantize IN
//     OUT q4_0` writes: half the bytes of Q8_0 and faster, but requantising compounds the
//     rounding (+25 % perplexity on SmolLM2's Q4_1 file, +50 % on Gemma 3's Q4_K_M).
// The converted blocks live in one 64-byte aligned allocation owned by the Model; both
// executors read (the GPU uploads) those bytes. Load prints one line on stderr saying what
// was converted to what and how long it took. Float weights are not converted (the
// executors use them as they are).
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

#include "tandem/gguf/gguf.hpp"
#include "tandem/tokenizer/tokenizer.hpp"

namespace tandem {

enum class Arch { kLlama, kQwen2, kQwen3, kGemma3 };
enum class RopeType { kNormal, kNeox };

std::string_view arch_name(Arch a) noexcept;

struct HParams {
  Arch arch = Arch::kLlama;
  int32_t n_vocab = 0;
  int32_t n_ctx_train = 0;  ///< tokens the model was trained with (<arch>.context_length)
  int32_t n_embd = 0;
  int32_t n_layer = 0;
  int32_t n_head = 0;
  int32_t n_head_kv = 0;
  int32_t head_dim = 0;    ///< per-head width of q and k (attention.key_length)
  int32_t head_dim_v = 0;  ///< per-head width of v (attention.value_length)
  int32_t n_ff = 0;
  int32_t n_rot = 0;  ///< rotated dims per head (rope.dimension_count)
  float rms_eps = 1e-5f;
  float rope_freq_base = 10000.0f;
  float rope_freq_scale = 1.0f;  ///< 1 / rope.scaling.factor for linear scaling
  RopeType rope_type = RopeType::kNormal;
  bool tied_output = false;
  // gemma3 (defaults leave the other architectures unchanged):
  float embd_scale = 1.0f;              ///< token embeddings are multiplied by this (gemma3: sqrtf(n_embd))
  float q_scale = 1.0f;                 ///< q is multiplied by this before attention, whose scale is then 1
  bool gelu_ffn = false;                ///< GELU(tanh)-gated FFN instead of SwiGLU
  bool post_norms = false;              ///< RMSNorm of the attention and FFN outputs before their residual adds
  int32_t n_swa = 0;                    ///< sliding window (positions a query sees, itself included); 0: none
  int32_t swa_pattern = 0;              ///< layer il is sliding when n_swa > 0 and il % swa_pattern < swa_pattern - 1
  float rope_freq_base_swa = 10000.0f;  ///< RoPE base of the sliding layers
  float final_logit_softcap = 0.0f;     ///< logits = c * tanh(logits / c) when > 0

  /// Whether layer il attends over a sliding window of n_swa positions.
  bool is_swa_layer(int32_t il) const noexcept {
    return n_swa > 0 && swa_pattern > 0 && il % swa_pattern < swa_pattern - 1;
  }
};

/// A 2-D weight: n rows of k elements (ggml ne = [k, n]) in one of the GGUF types.
struct TensorView {
  const GgufTensorInfo* info = nullptr;
  GgmlType type = GgmlType::kF32;
  int64_t k = 0;  ///< row length (ne[0])
  int64_t n = 0;  ///< number of rows
  const std::byte* data = nullptr;
  size_t row_bytes = 0;
  explicit operator bool() const noexcept { return data != nullptr; }
};

/// Row `id` of an embedding table `t` (F32, F16, BF16, Q8_0 or a type with a CPU kernel above: the types
/// Model::load leaves) as `t.k` floats into `y`. The one dequantisation of token embeddings shared by
/// the CPU and GPU executors, so both start from the same bits. `id` must be in [0, t.n)
/// (callers check token ids); other types write nothing. Thread-safe (reads only).
void embedding_row(const TensorView& t, int32_t id, float* y) noexcept;

struct LayerWeights {
  TensorView attn_norm, wq, wk, wv, wo;
  TensorView bq, bk, bv;      ///< qwen2 only
  TensorView q_norm, k_norm;  ///< qwen3 only, [head_dim]
  TensorView ffn_norm, ffn_gate, ffn_up, ffn_down;
  TensorView attn_post_norm, ffn_post_norm;  ///< gemma3 only, [n_embd]
};

struct ModelOptions {
  GgufOpenOptions gguf;
  /// Threads converting weights at load (see above); <= 0: physical_core_count().
  int n_threads = 0;
  /// What a weight without a kernel becomes at load (see above): kQ8_0 or kQ4_0. Any
  /// other value: load() throws Error(kInvalidArgument).
  GgmlType convert_to = GgmlType::kQ8_0;
};

class Model {
 public:
  /// Load and validate. Throws Error: kIo / GGUF codes for the file,
  /// kModelUnsupportedArch, kModelMissingTensor (naming the tensor), kModelBadHparams,
  /// kModelBadTensorShape (naming the tensor, expected vs found), kTokenizer.
  static std::shared_ptr<const Model> load(const std::filesystem::path& path, const ModelOptions& options = {});

  const HParams& hparams() const noexcept { return hp_; }
  const Tokenizer& tokenizer() const noexcept { return *tokenizer_; }
  const GgufFile& gguf() const noexcept { return *gguf_; }
  std::string name() const;  ///< general.name, or the file stem

  const TensorView& token_embd() const noexcept { return token_embd_; }
  const TensorView& output_norm() const noexcept { return output_norm_; }
  const TensorView& output() const noexcept { return output_; }
  const std::vector<LayerWeights>& layers() const noexcept { return layers_; }

  /// Number of weights converted at load (0 when the file is already in the executors'
  /// formats).
  int converted_tensors() const noexcept { return converted_tensors_; }

  /// Bytes of all tensor data as the executors read it (converted weights at their
  /// converted size): what a forward pass over every weight reads at most.
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
  static constexpr size_t kConvertedAlignment = 64;
  void convert_weights(int n_threads, GgmlType convert_to);
  std::shared_ptr<const GgufFile> gguf_;
  std::unique_ptr<Tokenizer> tokenizer_;
  HParams hp_;
  TensorView token_embd_, output_norm_, output_;
  std::vector<LayerWeights> layers_;
  uint64_t weight_bytes_ = 0;
  struct AlignedFree {
    void operator()(std::byte* p) const noexcept;
  };
  std::unique_ptr<std::byte, AlignedFree> converted_;  ///< converted weights, 64-byte aligned
  int converted_tensors_ = 0;
  mutable std::once_flag hash_once_;
  mutable uint64_t identity_hash_ = 0;
};

}  // namespace tandem
