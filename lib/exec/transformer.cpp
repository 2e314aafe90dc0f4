#include "transformer.hpp"

#include <cmath>

#include "rope_table.hpp"

namespace tandem {

LayerPlan describe_layer(const Model& model, int32_t il) noexcept {
  const HParams& hp = model.hparams();
  const LayerWeights& L = model.layers()[size_t(il)];
  LayerPlan l;
  l.il = il;
  l.qkv_bias = bool(L.bq);
  l.q_norm = bool(L.q_norm);
  l.k_norm = bool(L.k_norm);
  l.neox = hp.rope_type == RopeType::kNeox;
  l.swa = hp.is_swa_layer(il);
  l.window = l.swa ? hp.n_swa : 0;
  // gemma3 scales q (llama.cpp's f_attention_scale) and attends with scale 1; the others
  // scale the scores by 1/sqrt(head_dim).
  l.q_scale = hp.q_scale;
  l.kq_scale = hp.q_scale != 1.0f ? 1.0f : 1.0f / std::sqrt(static_cast<float>(hp.head_dim));
  l.attn_post_norm = bool(L.attn_post_norm);
  l.ffn_post_norm = bool(L.ffn_post_norm);
  l.gelu = hp.gelu_ffn;
  return l;
}

int64_t step_token_rows(std::span<const SequenceStep> batch) noexcept {
  int64_t T = 0;
  for (const auto& s : batch) T += static_cast<int64_t>(s.tokens.size());
  return T;
}

void fill_step_inputs(const Model& model, std::span<const SequenceStep> batch, const StepInputs& in) noexcept {
  const HParams& hp = model.hparams();
  const int64_t n_embd = hp.n_embd;
  int64_t t = 0, r = 0;
  for (size_t si = 0; si < batch.size(); ++si) {
    const SequenceStep& s = batch[si];
    const auto n = static_cast<int64_t>(s.tokens.size());
    for (int64_t j = 0; j < n; ++j, ++t) {
      if (in.seq != nullptr) in.seq[t] = static_cast<int32_t>(si);
      in.pos[t] = s.pos0 + static_cast<int32_t>(j);
      float* xe = in.x + t * n_embd;
      embedding_row(model.token_embd(), s.tokens[size_t(j)], xe);
      if (hp.embd_scale != 1.0f)  // gemma3: sqrtf(n_embd), as ggml_scale does
        for (int64_t i = 0; i < n_embd; ++i) xe[i] *= hp.embd_scale;
      const bool want = s.logits == LogitsRows::kAll || (s.logits == LogitsRows::kLast && j == n - 1);
      if (want) in.out_row[r++] = static_cast<int32_t>(t);
    }
  }
  // RoPE angles per row: theta_i = freq_scale * pos * base^(-2i/n_rot) (kernels/rope_table.hpp);
  // the sliding layers (gemma3) have their own base and no frequency scaling.
  auto rope_table = [&](float* table, float base, float freq_scale) {
    const float theta_scale = kernels::rope_theta_scale(base, hp.n_rot);
    for (int64_t row = 0; row < t; ++row)
      kernels::rope_table_row(table + row * hp.n_rot, in.pos[row], hp.n_rot, theta_scale, freq_scale);
  };
  rope_table(in.rope, hp.rope_freq_base, hp.rope_freq_scale);
  if (in.rope_swa != nullptr) rope_table(in.rope_swa, hp.rope_freq_base_swa, 1.0f);
}

}  // namespace tandem
