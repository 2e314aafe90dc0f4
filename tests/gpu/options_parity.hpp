// Shared by the GPU tests that switch one GpuExecutorOptions feature (fused kernels, Tensor
// Core prefill, merged matmuls) and require the same logits bit for bit either way.
#pragma once

#include <catch2/catch.hpp>

#include <limits>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "gpu_test_support.hpp"
#include "tandem/exec/gpu/gpu_q4_executor.hpp"
#include "tandem/kv/kv_store.hpp"
#include "test_support.hpp"

namespace tandem::test {

/// One decode step: the token of sequence A and, when `b` >= 0, the token of sequence B.
struct DecodeTokens {
  int32_t a = 0, b = -1;
};

/// Runs the same steps on two GPU executors of `model`, built with `opts_a` and `opts_b`, on
/// Device-tier stores of `dtype` (pages of 16 positions), and CHECKs every step's logits bit
/// for bit: one step prefilling sequence A with `prompt_a` (every row's logits) and sequence
/// B with `prompt_b` (the last row's), then one decode step per entry of `decode`. Every
/// logits buffer starts as NaN.
inline void check_same_logits(const std::shared_ptr<const Model>& model, const GpuExecutorOptions& opts_a,
                              const GpuExecutorOptions& opts_b, std::span<const int32_t> prompt_a,
                              std::span<const int32_t> prompt_b, const std::vector<DecodeTokens>& decode,
                              KvDtype dtype = KvDtype::kF16) {
  const auto n_vocab = size_t(model->hparams().n_vocab);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  GpuQ4Executor ex_a(model, opts_a), ex_b(model, opts_b);
  auto st_a = test::gpu_kv_store(ex_a, 16, 0, 16, dtype), st_b = test::gpu_kv_store(ex_b, 16, 0, 16, dtype);
  KvSequence a1(*st_a, 128, KvTier::kDevice), b1(*st_a, 128, KvTier::kDevice);
  KvSequence a2(*st_b, 128, KvTier::kDevice), b2(*st_b, 128, KvTier::kDevice);
  SequenceStep p1[2] = {{&a1, prompt_a, 0, LogitsRows::kAll}, {&b1, prompt_b, 0, LogitsRows::kLast}};
  SequenceStep p2[2] = {{&a2, prompt_a, 0, LogitsRows::kAll}, {&b2, prompt_b, 0, LogitsRows::kLast}};
  std::vector<float> l1((prompt_a.size() + 1) * n_vocab, nan), l2(l1.size(), nan);
  ex_a.step(p1, l1);
  ex_b.step(p2, l2);
  CHECK(same_bits(l1, l2));
  for (size_t step = 0; step < decode.size(); ++step) {
    INFO("decode step " << step);
    const DecodeTokens t = decode[step];
    const size_t rows = t.b >= 0 ? 2 : 1;
    SequenceStep d1[2] = {{&a1, std::span<const int32_t>(&t.a, 1), a1.n_tokens(), LogitsRows::kLast},
                          {&b1, std::span<const int32_t>(&t.b, 1), b1.n_tokens(), LogitsRows::kLast}};
    SequenceStep d2[2] = {{&a2, std::span<const int32_t>(&t.a, 1), a2.n_tokens(), LogitsRows::kLast},
                          {&b2, std::span<const int32_t>(&t.b, 1), b2.n_tokens(), LogitsRows::kLast}};
    std::vector<float> o1(rows * n_vocab, nan), o2(o1.size(), nan);
    ex_a.step(std::span<const SequenceStep>(d1, rows), o1);
    ex_b.step(std::span<const SequenceStep>(d2, rows), o2);
    CHECK(same_bits(o1, o2));
  }
}

}  // namespace tandem::test
