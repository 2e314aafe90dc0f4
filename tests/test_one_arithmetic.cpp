// One arithmetic on every machine (docs/arithmetic.md): the CPU executor's logits are the
// same bytes under every ISA this machine runs (TANDEM_CPU_ISA: avx512vnni, avx512, avx2,
// scalar), with the Q4_0 weights repacked or not, on 1 or 2 threads, for prefill, decode
// and a step that mixes both. ISAs this machine lacks are named in a warning (not
// compared); the SmolLM2 case is reported skipped when its file is absent (and under
// sanitizers, for CI time). Each model's logits are compared with the first configuration's.
// A long context's decode (its keys split over the threads, kernels::attn_split_*) is
// checked the same way on 1, 2 and 3 threads.
#include <catch2/catch.hpp>

#include <filesystem>
#include <initializer_list>
#include <span>
#include <string>
#include <vector>

#include "cpu_test_support.hpp"
#include "kv_test_support.hpp"
#include "tandem/exec/cpu/cpu_q4_executor.hpp"
#include "test_support.hpp"

using namespace tandem;

namespace {

/// One step's logit rows, appended to `all`.
void step_into(CpuQ4Executor& cpu, std::span<SequenceStep> batch, size_t rows, int32_t n_vocab,
               std::vector<float>& all) {
  std::vector<float> out(rows * size_t(n_vocab));
  cpu.step(batch, out);
  all.insert(all.end(), out.begin(), out.end());
}

/// Checks that run(threads, repack) gives the first configuration's bytes under every ISA,
/// each repack setting and each thread count.
template <class Run>
void check_configs(const std::string& name, std::initializer_list<bool> repacks,
                   std::initializer_list<int> thread_counts, Run run) {
  std::vector<float> want;
  std::string want_of;
  for (const auto& isa : test::isas()) {
    test::IsaScope scope(isa);
    for (const bool repack : repacks)
      for (const int threads : thread_counts) {
        const std::string config =
            isa + (repack ? " repack" : " no-repack") + ", " + std::to_string(threads) + " threads";
        const auto got = run(threads, repack);
        if (want.empty()) {
          want = got;
          want_of = config;
          continue;
        }
        INFO(name << ": " << config << " vs " << want_of);
        CHECK(test::same_bits(got, want));
      }
  }
}

/// Prefill of two sequences (37 tokens, all rows; 17 tokens, last row), three decode steps
/// of both, then one step with a's decode token beside c's 5-token prompt: every logit row.
std::vector<float> run(const std::shared_ptr<const Model>& model, int threads, bool repack) {
  const auto& hp = model->hparams();
  const int32_t nv = hp.n_vocab;
  CpuQ4Executor cpu(model, CpuExecutorOptions{.n_threads = threads, .repack = repack});
  auto store = test::make_store(hp, 64);
  KvSequence a(*store, 128), b(*store, 128), c(*store, 128);
  const auto ids = test::prompt_ids(42, nv);
  std::vector<float> all;
  auto step = [&](std::span<SequenceStep> batch, size_t rows) { step_into(cpu, batch, rows, nv, all); };
  SequenceStep prefill[2] = {{&a, std::span(ids.data(), 37), 0, LogitsRows::kAll},
                             {&b, std::span(ids.data() + 5, 17), 0, LogitsRows::kLast}};
  step(prefill, 38);
  for (int i = 0; i < 3; ++i) {
    const int32_t ta = ids[size_t(i)], tb = ids[size_t(40 - i)];
    SequenceStep decode[2] = {{&a, std::span(&ta, 1), a.n_tokens(), LogitsRows::kLast},
                              {&b, std::span(&tb, 1), b.n_tokens(), LogitsRows::kLast}};
    step(decode, 2);
  }
  const int32_t ta = ids[7];
  SequenceStep mixed[2] = {{&a, std::span(&ta, 1), a.n_tokens(), LogitsRows::kLast},
                           {&c, std::span(ids.data() + 30, 5), 0, LogitsRows::kAll}};
  step(mixed, 6);
  return all;
}

void check_model(const std::shared_ptr<const Model>& model, const std::string& name) {
  check_configs(name, {true, false}, {2, 1}, [&](int threads, bool repack) { return run(model, threads, repack); });
}

}  // namespace

TEST_CASE("one arithmetic: the shared models' logits are the same bytes on every ISA, repack, thread count",
          "[executor][isa]") {
  for (const char* isa : {"avx512vnni", "avx512", "avx2"})
    if (!kernels::cpu_isa_supported(isa)) WARN("not compared on this machine (the CPU lacks it): " << isa);
  for (const char* name :
       {"stories260K-f32", "stories260K-q4_0", "aidreams260K-f32", "aidreams260K-q4_0", "synth-llama-small-q4_0",
        "synth-qwen2-small-q4_0", "synth-qwen3-small-q4_0", "synth-qwen3-hd64-small-q4_0"})
    check_model(test::load_model(name), name);
}

TEST_CASE("one arithmetic: SmolLM2's logits are the same bytes on every ISA, repack, thread count",
          "[executor][isa][smollm2]") {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  WARN("SKIPPED under a sanitizer (about 1 min in Release, mostly the scalar path): the Release run covers it");
  return;
#endif
  const auto path = test::smollm2_q4_1_path();
  if (!std::filesystem::exists(path)) {
    WARN("SKIPPED: " << path << " is absent (scripts/fetch-smollm2 downloads it)");
    return;
  }
  check_model(Model::load(path), "SmolLM2-135M-Instruct");
}

TEST_CASE("one arithmetic: a long context's decode split over the threads' key ranges is the same bytes",
          "[executor][isa][attention]") {
  // 2100 positions: past the executor's split threshold (32 chunks of 64 keys), a partial
  // last chunk. The synthetic qwen3 with head_dim 64 has 2 KV heads: one decoding sequence
  // is 2 attention tasks, fewer than two per thread on 2 and 3 threads, so its keys are
  // split in ranges there (2 and 3 per task), and not on 1 thread. The prompt is prefilled
  // once; each configuration decodes from a copy-on-write share of it: 3 steps of one
  // sequence, a step of two (4 tasks: split on 3 threads only), and one beside a 5-token
  // prompt (whole tasks beside the split ones).
  const auto model = test::load_model("synth-qwen3-hd64-small-q4_0");
  const auto& hp = model->hparams();
  const int32_t nv = hp.n_vocab, n_ctx = 2100;
  auto store = test::make_store(hp, 2 * (n_ctx / 16 + 4) + 8);
  KvSequence base(*store, n_ctx + 16);
  const auto ids = test::prompt_ids(n_ctx, nv);
  {
    CpuQ4Executor cpu(model, CpuExecutorOptions{.n_threads = 2});
    SequenceStep prefill{&base, std::span(ids), 0, LogitsRows::kLast};
    std::vector<float> out(static_cast<size_t>(nv));
    cpu.step(std::span(&prefill, 1), out);
  }
  auto run_long = [&](int threads, bool repack) {
    CpuQ4Executor cpu(model, CpuExecutorOptions{.n_threads = threads, .repack = repack});
    KvSequence a(*store, n_ctx + 16), b(*store, n_ctx + 16), c(*store, 16);
    a.share_prefix(base, n_ctx);
    b.share_prefix(base, n_ctx - 7);
    std::vector<float> all;
    auto step = [&](std::span<SequenceStep> batch, size_t rows) { step_into(cpu, batch, rows, nv, all); };
    for (int i = 0; i < 3; ++i) {
      const int32_t t = ids[size_t(i)];
      SequenceStep decode{&a, std::span(&t, 1), a.n_tokens(), LogitsRows::kLast};
      step(std::span(&decode, 1), 1);
    }
    const int32_t ta = ids[3], tb = ids[4];
    SequenceStep two[2] = {{&a, std::span(&ta, 1), a.n_tokens(), LogitsRows::kLast},
                           {&b, std::span(&tb, 1), b.n_tokens(), LogitsRows::kLast}};
    step(two, 2);
    const int32_t t5 = ids[5];
    SequenceStep mixed[2] = {{&a, std::span(&t5, 1), a.n_tokens(), LogitsRows::kLast},
                             {&c, std::span(ids.data() + 30, 5), 0, LogitsRows::kAll}};
    step(mixed, 6);
    return all;
  };
  check_configs("synth-qwen3-hd64-small, 2100 positions", {true}, {1, 2, 3}, run_long);
}
