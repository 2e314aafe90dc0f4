// PerfModel against step times computed by hand from the datasheet figures and the
// published hyper-parameters (include/tandem/exec/perf_model.hpp states the formula).
#include <catch2/catch.hpp>

#include "tandem/core/error.hpp"
#include "tandem/exec/perf_model.hpp"

using namespace tandem;

namespace {

// Relative tolerance: the expected values below were computed in double precision with a
// different operation order; they agree to ~1e-15, so 1e-9 only absorbs rounding.
constexpr double kRel = 1e-9;

}  // namespace

TEST_CASE("Qwen2.5-7B profile: parameter, weight and KV byte counts", "[perf_model]") {
  const ModelProfile m = ModelProfile::from_shape(model_shape("qwen2.5-7b"));
  // Per layer: q and o 3584 x 3584 each, k and v 3584 x 512 each, gate/up/down 3584 x 18944
  // = 25,690,112 + 3,670,016 + 203,685,888 = 233,046,016; x 28 layers + output 3584 x 152064.
  CHECK(m.matmul_params == 7'070'285'824);
  CHECK(m.total_params == 7'615'283'200);  // + the embedding table: Qwen2.5-7B's 7.62B
  CHECK(m.weight_bytes_read == 7'070'285'824 / 32 * 18);
  CHECK(m.kv_bytes_per_token == 57'344);  // 2 (K, V) x 28 layers x 512 x 2 bytes
  CHECK(m.attn_flops_per_pair == 4.0 * 28 * 3584);
}

TEST_CASE("27B-class profile has about 27B parameters", "[perf_model]") {
  const ModelProfile m = ModelProfile::from_shape(model_shape("qwen-27b-class"));
  CHECK(m.total_params == 26'722'959'360);
  CHECK(m.kv_bytes_per_token == 262'144);  // 2 x 64 layers x 8 heads x 128 x 2 bytes
}

TEST_CASE("step times on an L40S match the hand computation", "[perf_model]") {
  const PerfModel pm(processor_profile("l40s"), ModelProfile::from_shape(model_shape("qwen2.5-7b")));
  // Effective bandwidth 864e9 x 0.75 = 648e9 B/s; effective int8 rate 733e12 x 0.25.
  SECTION("decode, one sequence at 1024 positions: bandwidth-bound") {
    // weights 3,977,035,776 B / 648e9 = 6.1374 ms; compute (2 x 7,070,285,824 + 401,408 x
    // 1024) / 183.25e12 = 0.0794 ms; KV 1024 x 57,344 / 648e9 = 0.0906 ms; + 1 ms.
    CHECK(pm.step_seconds(StepShape::single(1023, 1)) == Approx(7.228018567901235e-3).epsilon(kRel));
  }
  SECTION("prefill of 512 tokens: compute-bound") {
    // compute (2 x 7,070,285,824 x 512 + 401,408 x 131,328) / 183.25e12 = 39.796 ms >
    // weights 6.137 ms; KV 512 x 57,344 / 648e9; + 1 ms.
    CHECK(pm.step_seconds(StepShape::single(0, 512)) == Approx(40.841700619042326e-3).epsilon(kRel));
  }
  SECTION("decode batch of 32 at 1024 positions each") {
    StepShape s;
    for (int i = 0; i < 32; ++i) s += StepShape::single(1023, 1);
    CHECK(s.decode_tokens == 32);
    CHECK(s.prefill_tokens == 0);
    CHECK(s.kv_positions == 32 * 1024);
    CHECK(s.attn_pairs == 32 * 1024);
    CHECK(pm.step_seconds(s) == Approx(10.03716661728395e-3).epsilon(kRel));
  }
}

TEST_CASE("StepShape counts a mixed batch", "[perf_model]") {
  const int32_t ids[5] = {1, 2, 3, 4, 5};
  SequenceStep b[2];
  b[0].tokens = std::span<const int32_t>(ids, 4);  // prefill of 4 at positions 10..13
  b[0].pos0 = 10;
  b[1].tokens = std::span<const int32_t>(ids, 1);  // decode at position 7
  b[1].pos0 = 7;
  const StepShape s = StepShape::of(b);
  CHECK(s.prefill_tokens == 4);
  CHECK(s.decode_tokens == 1);
  CHECK(s.kv_positions == 14 + 8);
  CHECK(s.attn_pairs == (11 + 12 + 13 + 14) + 8);
}

TEST_CASE("KV budget in pages of the modelled model", "[perf_model]") {
  const ModelProfile m = ModelProfile::from_shape(model_shape("qwen-27b-class"));
  const PerfModel pm(processor_profile("l40s"), m);
  // 48e9 x 0.9 - 26,722,959,360 / 32 x 18 bytes of Q4_0 weights = 43.2e9 - 15,031,664,640.
  const uint64_t budget = uint64_t(43.2e9) - 15'031'664'640ull;
  CHECK(pm.kv_budget_bytes() == budget);
  CHECK(pm.kv_budget_pages(16) == int64_t(budget / (262'144ull * 16)));
  // A model larger than the memory leaves nothing for KV.
  const PerfModel big(processor_profile("a10"), ModelProfile::from_shape(model_shape("llama3-70b")));
  CHECK(big.kv_budget_bytes() == 0);
  CHECK(big.kv_budget_pages(16) == 0);
}

TEST_CASE("bad profiles and unknown names are refused", "[perf_model][errors]") {
  auto code_of = [](auto&& f) {
    try {
      f();
    } catch (const Error& e) {
      return e.code();
    }
    return ErrorCode::kOk;
  };
  CHECK(code_of([] { processor_profile("tpu"); }) == ErrorCode::kInvalidArgument);
  CHECK(code_of([] { model_shape("gpt-5"); }) == ErrorCode::kInvalidArgument);
  ModelShape zero = model_shape("llama3-8b");
  zero.n_head_kv = 0;
  CHECK(code_of([&] { ModelProfile::from_shape(zero); }) == ErrorCode::kInvalidArgument);
  ProcessorProfile p = processor_profile("h200");
  p.compute_efficiency = 0;
  const ModelProfile m = ModelProfile::from_shape(model_shape("llama3-8b"));
  CHECK(code_of([&] { PerfModel(p, m); }) == ErrorCode::kInvalidArgument);
  p = processor_profile("h200");
  p.bw_efficiency = 1.5;
  CHECK(code_of([&] { PerfModel(p, m); }) == ErrorCode::kInvalidArgument);
}

TEST_CASE("every built-in profile yields finite, positive step times", "[perf_model]") {
  for (const auto& p : processor_profiles()) {
    for (const auto& s : model_shapes()) {
      INFO(p.name << " x " << s.name);
      const PerfModel pm(p, ModelProfile::from_shape(s));
      const double d = pm.step_seconds(StepShape::single(0, 1));
      CHECK(d > p.step_overhead_s);
      CHECK(pm.prefill_tokens_per_s(512) > 0);
      // More work never takes less time.
      CHECK(pm.step_seconds(StepShape::single(0, 512)) >= d);
      CHECK(pm.decode_tokens_per_s(16, 2048) <= pm.decode_tokens_per_s(1, 2048));
    }
  }
}
