// Perplexity of a model on a token sequence, as llama.cpp's llama-perplexity computes it
// (tools/perplexity/perplexity.cpp, its default mode):
//   - the tokens (the whole text tokenised once, BOS first when the vocabulary adds it)
//     are cut into n_chunk = min(n_chunks, n_tokens / n_ctx) chunks of n_ctx tokens
//     (n_chunks < 0: all); the tail that fills no chunk is not used;
//   - each chunk is evaluated from an empty KV cache, with its first token replaced by BOS
//     when the vocabulary adds BOS;
//   - only the second half is scored: the logits after positions first = n_ctx / 2 ..
//     n_ctx - 2 of the chunk, each against the chunk's next token (n_ctx - first - 1 tokens);
//   - a token's negative log-likelihood is -(logit[tok] - max - log(sum_i exp(logit[i] -
//     max))), max over floats, exp in float, the sum in double; nll and nll^2 are summed
//     in double over every scored token;
//   - the running value after chunk i is exp(nll / count); the final estimate is
//     PPL = exp(mean nll) with uncertainty PPL * sqrt((mean nll^2 - mean nll^2) /
//     (count - 1)).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "tandem/exec/executor.hpp"

namespace tandem {

struct PerplexityOptions {
  int32_t n_ctx = 512;     ///< tokens per chunk (llama-perplexity -c); at least 3
  int32_t n_batch = 2048;  ///< tokens per executor step (-b); capped at n_ctx; at least 1
  int32_t n_chunks = -1;   ///< chunks to evaluate (--chunks); < 0: every full chunk
  /// Called after each chunk with its 1-based index and the running perplexity (what
  /// llama-perplexity prints as `[i]x`). May be empty.
  std::function<void(int32_t chunk, double running_ppl)> on_chunk;
};

struct PerplexityResult {
  double ppl = 0.0;             ///< final estimate
  double uncertainty = 0.0;     ///< its ± (0 when fewer than 2 tokens were scored)
  int32_t n_chunks = 0;         ///< chunks evaluated
  int64_t n_scored = 0;         ///< tokens scored (n_chunks * (n_ctx - n_ctx / 2 - 1))
  std::vector<double> running;  ///< running perplexity after each chunk
};

/// Perplexity of `tokens` (already tokenised, e.g. Tokenizer::tokenize(text, true, false),
/// as llama-perplexity does) on `executor`, each chunk in a KV cache of its own (f16,
/// as llama.cpp's default). Errors: Error(kInvalidArgument) for n_ctx < 3, n_batch < 1,
/// fewer than 2 * n_ctx tokens (llama-perplexity's rule, the message says how many there
/// are), n_chunks == 0, a token outside the vocabulary; the executor's errors. Memory: the logits of at
/// most min(n_batch, 64 MiB / (4 n_vocab)) rows at a time. Thread-safety: uses `executor`
/// for the whole call (one caller at a time, as every executor).
PerplexityResult perplexity(Executor& executor, std::span<const int32_t> tokens, const PerplexityOptions& options = {});

}  // namespace tandem
