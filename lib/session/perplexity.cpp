#include "tandem/session/perplexity.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "tandem/core/error.hpp"
#include "tandem/session/session.hpp"

namespace tandem {

namespace {

// -log p(tok) under `logits` (llama-perplexity's log_softmax: float max, float exp, double sum).
double neg_log_prob(std::span<const float> logits, int32_t tok) {
  float max_logit = logits[0];
  for (float l : logits) max_logit = std::max(max_logit, l);
  double sum_exp = 0.0;
  for (float l : logits) sum_exp += std::exp(l - max_logit);
  return -(double(logits[size_t(tok)] - max_logit) - std::log(sum_exp));
}

}  // namespace

PerplexityResult perplexity(Executor& executor, std::span<const int32_t> tokens, const PerplexityOptions& options) {
  const int32_t n_ctx = options.n_ctx;
  if (n_ctx < 3)
    throw Error(ErrorCode::kInvalidArgument, fmt::format("perplexity: n_ctx {} must be at least 3", n_ctx));
  if (options.n_batch < 1) {
    throw Error(ErrorCode::kInvalidArgument, fmt::format("perplexity: n_batch {} must be at least 1", options.n_batch));
  }
  if (tokens.size() < 2 * size_t(n_ctx)) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("perplexity: at least {} tokens are needed for a context of {}; the text has {}",
                            2 * int64_t(n_ctx), n_ctx, tokens.size()));
  }
  const Model& model = executor.model();
  const int32_t n_vocab = model.hparams().n_vocab;
  const Tokenizer& tok = model.tokenizer();
  const int64_t n_chunk_max = int64_t(tokens.size()) / n_ctx;
  const int32_t n_chunk =
      int32_t(options.n_chunks < 0 ? n_chunk_max : std::min<int64_t>(options.n_chunks, n_chunk_max));
  if (n_chunk == 0) throw Error(ErrorCode::kInvalidArgument, "perplexity: n_chunks 0 leaves nothing to evaluate");
  const int32_t n_batch = std::min(options.n_batch, n_ctx);
  const int32_t first = n_ctx / 2;
  const int32_t rows_cap = std::max<int32_t>(1, int32_t((size_t(64) << 20) / (sizeof(float) * size_t(n_vocab))));
  const int32_t rows = std::min(n_batch, rows_cap);

  SessionOptions so;
  so.n_ctx = n_ctx;
  so.n_batch = n_batch;
  Session session(executor.model_ptr(), executor, so);
  std::vector<int32_t> chunk(size_t(n_ctx), 0);
  std::vector<float> logits(size_t(rows) * size_t(n_vocab));
  PerplexityResult r;
  double nll = 0.0, nll2 = 0.0;
  for (int32_t i = 0; i < n_chunk; ++i) {
    std::copy_n(tokens.begin() + std::ptrdiff_t(i) * n_ctx, n_ctx, chunk.begin());
    if (tok.add_bos() && tok.bos() >= 0) chunk[0] = tok.bos();
    session.reset();
    session.eval(std::span<const int32_t>(chunk).first(size_t(first)));
    // Logits after positions first .. n_ctx - 2 score tokens first + 1 .. n_ctx - 1.
    for (int32_t b = first; b < n_ctx - 1; b += rows) {
      const int32_t n = std::min(rows, n_ctx - 1 - b);
      session.eval(std::span<const int32_t>(chunk).subspan(size_t(b), size_t(n)),
                   std::span<float>(logits).first(size_t(n) * size_t(n_vocab)));
      for (int32_t j = 0; j < n; ++j) {
        const double v =
            neg_log_prob(std::span<const float>(logits).subspan(size_t(j) * size_t(n_vocab), size_t(n_vocab)),
                         chunk[size_t(b) + size_t(j) + 1]);
        nll += v;
        nll2 += v * v;
      }
    }
    r.n_scored += n_ctx - first - 1;
    r.running.push_back(std::exp(nll / double(r.n_scored)));
    ++r.n_chunks;
    if (options.on_chunk) options.on_chunk(i + 1, r.running.back());
  }
  const double mean = nll / double(r.n_scored);
  const double var = nll2 / double(r.n_scored) - mean * mean;
  r.ppl = std::exp(mean);
  r.uncertainty = var > 0 && r.n_scored > 1 ? r.ppl * std::sqrt(var / double(r.n_scored - 1)) : 0.0;
  return r;
}

}  // namespace tandem
