// The decoder, written once for every executor: what each layer of a supported model does and
// in which order (llama, qwen2, qwen3, gemma3 — the architectures Model::load takes), and the
// host-side inputs of a step. An executor supplies the primitives run_decoder() calls, each
// with the arithmetic docs/arithmetic.md writes down, and keeps its own fusions of them
// private (the CPU's per-token loops, the GPU's fused kernels); the order of the primitives
// and the per-architecture choices (biases, head norms, the q scale, post-norms, the window,
// the activation, the logit soft-cap) are decided here only.
#pragma once

#include <cstdint>
#include <span>

#include "tandem/exec/executor.hpp"
#include "tandem/model/model.hpp"

namespace tandem {

/// What layer `il` of a model does, decided by describe_layer() from the hyper-parameters
/// and which optional tensors the layer has. Plain values; no pointers into the model.
struct LayerPlan {
  int32_t il = 0;
  bool qkv_bias = false;        ///< q, k, v += bq, bk, bv after the projections (qwen2)
  bool q_norm = false;          ///< per-head RMSNorm of q (weights [head_dim]) before RoPE (qwen3, gemma3)
  bool k_norm = false;          ///< the same for k
  bool neox = false;            ///< RoPE rotates pairs (i, i + n_rot/2), else (2i, 2i + 1)
  bool swa = false;             ///< a sliding-window layer: the step's sliding RoPE table, `window`
  int32_t window = 0;           ///< positions a query sees, itself included; 0: every earlier one
  float q_scale = 1.0f;         ///< q *= q_scale after RoPE when != 1 (gemma3); kq_scale is then 1
  float kq_scale = 1.0f;        ///< scores = kq_scale * q . k (1 / sqrt(head_dim) unless q is scaled)
  bool attn_post_norm = false;  ///< RMSNorm of Wo attn before its residual add (gemma3)
  bool ffn_post_norm = false;   ///< RMSNorm of W_down h before its residual add (gemma3)
  bool gelu = false;            ///< h = GELU(tanh)(gate) * up (gemma3), else SiLU(gate) * up
};

/// The plan of layer `il` in [0, n_layer). Thread-safe; no allocation.
LayerPlan describe_layer(const Model& model, int32_t il) noexcept;

/// The two halves of a layer. Each begins with an RMSNorm of the residual stream x into xn
/// and ends with a residual add into x.
enum class LayerHalf { kAttention, kFfn };

/// One step's host-side inputs, laid out the same way for every executor: the batch's tokens
/// as rows t in [0, T), sequence by sequence in batch order (T = step_token_rows(batch)).
/// The caller owns the arrays; fill_step_inputs() writes them.
struct StepInputs {
  int32_t* seq = nullptr;      ///< [T] row t's sequence (index into the batch); null: not written
  int32_t* pos = nullptr;      ///< [T] row t's position in its sequence
  int32_t* out_row = nullptr;  ///< [Executor::logits_rows(batch)] the token row of each logits row
  float* x = nullptr;          ///< [T][n_embd] token embeddings (embedding_row) times hp.embd_scale
  float* rope = nullptr;       ///< [T][n_rot] cosines then sines (kernels/rope_table.hpp), full-attention layers
  float* rope_swa = nullptr;   ///< [T][n_rot] the sliding layers' table (their base, no frequency
                               ///< scaling); non-null exactly when has_sliding_window(hp)
};

/// Whether the model has sliding-window layers, so that a step needs StepInputs::rope_swa.
inline bool has_sliding_window(const HParams& hp) noexcept {
  return hp.n_swa > 0;
}

/// Token rows of a batch: the sum of its sequences' token counts.
int64_t step_token_rows(std::span<const SequenceStep> batch) noexcept;

/// Writes every array of `in` for `batch` (validated by Executor::step). No allocation.
void fill_step_inputs(const Model& model, std::span<const SequenceStep> batch, const StepInputs& in) noexcept;

/// One step of the decoder over an executor's primitives, on the inputs it holds from
/// fill_step_inputs(). Backend provides, called in this order per layer (each over the T rows
/// of the step; a primitive may rely on state an earlier one of the same layer left):
///   input_norm(l, half)    xn = RMSNorm(x) * (attn_norm | ffn_norm)
///   attention_inputs(l)    q, k, v = Wq xn, Wk xn, Wv xn (+ biases); per-head RMSNorm of q and
///                          k (q_norm, k_norm); RoPE of q and k by the layer's table; q *= q_scale
///                          after RoPE; each row's K (normed, rotated) and V stored in its
///                          sequence's KV page at its position (the store and the q scale are
///                          independent of each other)
///   attention(l)           attn = softmax(kq_scale * q K^T over the causal positions within
///                          the window) V, per query head with its GQA KV head
///   residual(l, half)      x += [RMSNorm * post_norm](Wo attn | W_down h)
///   ffn_inputs(l)          gate = W_gate xn, up = W_up xn
///   activation(l)          h = act(gate) * up (in place of gate)
///   logits(softcap)        over the n_out logits rows instead: for each row r,
///                          RMSNorm(x[out_row[r]]) * output_norm, then W_out, then
///                          tanh(logits * (1 / c)) * c when softcap c > 0
/// and sets nothing else: the executor advances the sequences' n_tokens afterwards.
template <class Backend>
void run_decoder(const Model& model, Backend& b) {
  const HParams& hp = model.hparams();
  for (int32_t il = 0; il < hp.n_layer; ++il) {
    const LayerPlan l = describe_layer(model, il);
    b.input_norm(l, LayerHalf::kAttention);
    b.attention_inputs(l);
    b.attention(l);
    b.residual(l, LayerHalf::kAttention);
    b.input_norm(l, LayerHalf::kFfn);
    b.ffn_inputs(l);
    b.activation(l);
    b.residual(l, LayerHalf::kFfn);
  }
  b.logits(hp.final_logit_softcap);
}

}  // namespace tandem
