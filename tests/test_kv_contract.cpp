// The KV contract: hand-offs between stores and executors (migration without recompute),
// conversions (page size, dtype, layer split), every refusal, leases, and field case B17
// (moves at page boundaries).
#include <catch2/catch.hpp>

#include <thread>

#include <fmt/format.h>

#include "cpu/cpu_kernels.hpp"

#include "executor_factories.hpp"
#include "kv_test_support.hpp"

using namespace tandem;
using test::error_of;
using test::load_model;
using test::make_store;

TEST_CASE("migration between executors continues exactly as without the move", "[kv][migration][parity]") {
  const auto model_name = GENERATE(as<std::string>{}, "aidreams260K-q4_0", "synth-qwen2-small-q4_0");
  auto model = load_model(model_name);
  CpuQ4Executor a(model, CpuExecutorOptions{2}), b(model, CpuExecutorOptions{1});
  const auto ids = test::prompt_ids(21, model->hparams().n_vocab);
  SessionOptions so;
  so.n_ctx = 128;
  Session baseline(model, a, so);
  baseline.eval(ids);
  const auto expect = test::greedy(baseline, 24);
  for (int cut : {0, 1, 7, 11}) {
    INFO(model_name << ", migrate after " << cut << " generated tokens");
    Session s(model, a, so);
    s.eval(ids);
    auto first = test::greedy(s, cut);
    const auto old_store = s.kv_store();
    const auto report = s.migrate(b);
    CHECK(&s.executor() == &b);
    CHECK(report.pages > 0);
    CHECK(report.bytes == uint64_t(report.pages) * old_store->layout().page_bytes());
    CHECK(old_store->used_pages() == 0);  // the sender's pages are released after confirmation
    auto rest = test::greedy(s, 24 - cut);
    first.insert(first.end(), rest.begin(), rest.end());
    CHECK(first == expect);
  }
}

TEST_CASE("page size, dtype and layer-split conversions are explicit and verified", "[kv][contract]") {
  auto model = load_model("aidreams260K-q4_0");
  CpuQ4Executor ex(model, CpuExecutorOptions{2});
  const auto& hp = model->hparams();
  const auto ids = test::prompt_ids(29, hp.n_vocab);
  auto src = make_store(hp, 8);
  SessionOptions so;
  so.kv_store = src;
  so.n_ctx = 128;
  Session s(model, ex, so);
  s.eval(ids);

  SECTION("page size 16 -> 5: same continuation") {
    auto dst = make_store(hp, 40, 0, 5);
    KvHandoff h = kv_export(s.kv(), *model, s.tokens());
    auto seq = kv_import(std::span<const KvHandoff>(&h, 1), *model, *dst, KvTier::kHost, 128, s.tokens());
    CHECK(h.lease->state() == KvLeaseState::kConfirmed);
    CHECK(seq->n_tokens() == 29);
    CHECK(dst->usage(KvTier::kHost).used == 6);
    std::vector<float> l1(static_cast<size_t>(hp.n_vocab)), l2(l1.size());
    const int32_t next = 42;
    SequenceStep st1{&s.kv(), std::span<const int32_t>(&next, 1), 29, LogitsRows::kLast};
    SequenceStep st2{seq.get(), std::span<const int32_t>(&next, 1), 29, LogitsRows::kLast};
    ex.step(std::span<const SequenceStep>(&st1, 1), l1);
    ex.step(std::span<const SequenceStep>(&st2, 1), l2);
    CHECK(l1 == l2);
  }
  SECTION("f16 -> f32 is exact, and f32 -> f16 gives back the original pages") {
    auto f32 = make_store(hp, 8, 0, 16, KvDtype::kF32);
    KvHandoff h = kv_export(s.kv(), *model, s.tokens());
    auto wide = kv_import(std::span<const KvHandoff>(&h, 1), *model, *f32, KvTier::kHost, 128);
    // Every f32 value is the f16 value it came from.
    const auto& lay16 = src->layout();
    const auto& lay32 = f32->layout();
    for (int32_t pos = 0; pos < 29; ++pos) {
      const auto* a = reinterpret_cast<const uint16_t*>(src->page_data(s.kv().page(0, int32_t(size_t(pos / 16)))) +
                                                        lay16.row_offset(2, 1, pos % 16));
      const auto* b = reinterpret_cast<const float*>(f32->page_data(wide->page(0, int32_t(size_t(pos / 16)))) +
                                                     lay32.row_offset(2, 1, pos % 16));
      for (size_t i = 0; i < lay16.row_elems(); ++i) REQUIRE(kernels::fp16_to_fp32(a[i]) == b[i]);
    }
    auto back_store = make_store(hp, 8);
    KvHandoff h2 = kv_export(*wide, *model, s.tokens());
    auto back = kv_import(std::span<const KvHandoff>(&h2, 1), *model, *back_store, KvTier::kHost, 128);
    CHECK(test::page_checksums(*back, *model, s.tokens()) == test::page_checksums(s.kv(), *model, s.tokens()));
  }
  SECTION("two layer ranges join into one sequence") {
    KvHandoff parts[2] = {kv_export(s.kv(), *model, s.tokens(), std::chrono::seconds(5), 2, 4),
                          kv_export(s.kv(), *model, s.tokens(), std::chrono::seconds(5), 0, 2)};
    auto dst = make_store(hp, 8);
    auto joined = kv_import(parts, *model, *dst, KvTier::kHost, 128);
    CHECK(test::page_checksums(*joined, *model, s.tokens()) == test::page_checksums(s.kv(), *model, s.tokens()));
    // One range alone does not cover the layers.
    auto dst2 = make_store(hp, 8);
    KvHandoff lone = kv_export(s.kv(), *model, s.tokens(), std::chrono::seconds(5), 0, 2);
    CHECK(error_of([&] { kv_import(std::span<const KvHandoff>(&lone, 1), *model, *dst2, KvTier::kHost, 128); }).first ==
          ErrorCode::kKvMismatch);
    CHECK(lone.lease->state() == KvLeaseState::kFailed);
    CHECK(dst2->used_pages() == 0);
  }
}

TEST_CASE("every contract violation is refused precisely and leaks nothing", "[kv][contract]") {
  auto model = load_model("aidreams260K-q4_0");
  CpuQ4Executor ex(model, CpuExecutorOptions{2});
  const auto& hp = model->hparams();
  const auto ids = test::prompt_ids(40, hp.n_vocab);
  auto src = make_store(hp, 8);
  auto dst = make_store(hp, 8);
  SessionOptions so;
  so.kv_store = src;
  so.n_ctx = 128;
  Session s(model, ex, so);
  s.eval(ids);
  const int32_t src_used = src->used_pages();

  auto refused = [&](KvHandoff h, const Model& m, ErrorCode want, const std::string& text) {
    const auto [code, msg] =
        error_of([&] { kv_import(std::span<const KvHandoff>(&h, 1), m, *dst, KvTier::kHost, 128); });
    INFO(msg);
    CHECK(code == want);
    CHECK(msg.find(text) != std::string::npos);
    CHECK(h.lease->state() == KvLeaseState::kFailed);  // reported to the sender too
    CHECK(h.lease->failure() == msg);
    CHECK(dst->used_pages() == 0);
    h.lease.reset();
    CHECK(src->used_pages() == src_used);  // the lease's references are gone
  };
  auto handoff = [&] { return kv_export(s.kv(), *model, s.tokens()); };

  SECTION("wrong model (same shapes, other weights)") {
    refused(handoff(), *load_model("aidreams260K-f32"), ErrorCode::kKvMismatch, "model identity");
  }
  SECTION("wrong model (other shapes)") {
    refused(handoff(), *load_model("synth-llama-small-q4_0"), ErrorCode::kKvMismatch, "model identity");
  }
  SECTION("wrong tokenizer") {
    auto h = handoff();
    h.descriptor.tokenizer_identity ^= 1;
    refused(std::move(h), *model, ErrorCode::kKvMismatch, "tokenizer identity");
  }
  SECTION("different RoPE base") {
    auto h = handoff();
    h.descriptor.rope_freq_base = 500000.0f;
    refused(std::move(h), *model, ErrorCode::kKvMismatch, "RoPE");
  }
  SECTION("token range with a gap") {
    auto h = handoff();
    h.descriptor.token_begin = 1;
    refused(std::move(h), *model, ErrorCode::kKvTokenRange, "token range");
  }
  SECTION("expected tokens differ") {
    auto h = handoff();
    auto expected = s.tokens();
    expected[17] ^= 1;
    const auto [code, msg] =
        error_of([&] { kv_import(std::span<const KvHandoff>(&h, 1), *model, *dst, KvTier::kHost, 128, expected); });
    CHECK(code == ErrorCode::kKvTokenRange);
    CHECK(h.lease->state() == KvLeaseState::kFailed);
  }
  SECTION("one flipped byte in any page is caught with its index") {
    for (int page = 0; page < 3; ++page) {
      auto h = handoff();
      std::byte* p = src->page_data(s.kv().page(0, int32_t(size_t(page)))) + 1000 + page;
      *p ^= std::byte{0x01};
      refused(std::move(h), *model, ErrorCode::kKvChecksum, fmt::format("page {} ", page));
      *p ^= std::byte{0x01};
    }
  }
  SECTION("context of the receiver too small") {
    auto h = handoff();
    const auto [code, msg] =
        error_of([&] { kv_import(std::span<const KvHandoff>(&h, 1), *model, *dst, KvTier::kHost, 32); });
    CHECK(code == ErrorCode::kKvTokenRange);
    CHECK(dst->used_pages() == 0);
  }
  SECTION("receiver store without room") {
    auto tiny = make_store(hp, 2);
    auto h = handoff();
    const auto [code, msg] =
        error_of([&] { kv_import(std::span<const KvHandoff>(&h, 1), *model, *tiny, KvTier::kHost, 128); });
    CHECK(code == ErrorCode::kOutOfMemory);
    CHECK(tiny->used_pages() == 0);
    CHECK(h.lease->state() == KvLeaseState::kFailed);
  }
}

TEST_CASE("leases: the sender keeps pages until confirmed or expired", "[kv][contract]") {
  auto model = load_model("aidreams260K-q4_0");
  CpuQ4Executor ex(model, CpuExecutorOptions{1});
  const auto& hp = model->hparams();
  auto src = make_store(hp, 8);
  auto dst = make_store(hp, 8);
  const auto ids = test::prompt_ids(20, hp.n_vocab);
  KvHandoff h;
  {
    KvSequence seq(*src, 64);
    SequenceStep st{&seq, ids, 0, LogitsRows::kNone};
    ex.step(std::span<const SequenceStep>(&st, 1), {});
    h = kv_export(seq, *model, ids, std::chrono::milliseconds(50));
  }  // the sender's sequence is gone; its pages live on under the lease
  CHECK(src->used_pages() == 2);
  CHECK(h.lease->state() == KvLeaseState::kPending);
  std::this_thread::sleep_for(std::chrono::milliseconds(80));
  CHECK(h.lease->state() == KvLeaseState::kExpired);  // reported to the sender
  CHECK(src->used_pages() == 0);                      // and released
  const auto [code, msg] =
      error_of([&] { kv_import(std::span<const KvHandoff>(&h, 1), *model, *dst, KvTier::kHost, 64); });
  CHECK(code == ErrorCode::kKvLeaseExpired);  // reported to the receiver
  CHECK(dst->used_pages() == 0);
  // A second import of a confirmed hand-off is refused (no reading released pages).
  KvSequence again(*src, 64);
  SequenceStep st{&again, ids, 0, LogitsRows::kNone};
  ex.step(std::span<const SequenceStep>(&st, 1), {});
  KvHandoff ok = kv_export(again, *model, ids);
  auto imported = kv_import(std::span<const KvHandoff>(&ok, 1), *model, *dst, KvTier::kHost, 64);
  CHECK(ok.lease->state() == KvLeaseState::kConfirmed);
  CHECK(error_of([&] { kv_import(std::span<const KvHandoff>(&ok, 1), *model, *dst, KvTier::kHost, 64); }).first ==
        ErrorCode::kInvalidArgument);
}

TEST_CASE("B17: moves at page boundaries continue like the unmoved baseline", "[kv][field-case][parity]") {
  auto model = load_model("synth-qwen3-small-q4_0");
  const auto& hp = model->hparams();
  CpuQ4Executor a(model, CpuExecutorOptions{2}), b(model, CpuExecutorOptions{1});
  constexpr int32_t P = 16;
  SessionOptions so;
  so.n_ctx = 160;
  so.page_size = P;
  const auto path = test::scratch_dir("b17") / "s.session";
  for (int32_t L : {1, P - 1, P, P + 1, 2 * P - 1, 2 * P, 2 * P + 1, 127}) {
    const auto ids = test::prompt_ids(L, hp.n_vocab);
    Session base(model, a, so);
    base.eval(ids);
    const auto expect = test::greedy(base, 8);
    for (const char* how : {"executor", "file-tier", "save-restore"}) {
      INFO("L = " << L << ", move via " << how);
      Session s(model, a, so), other(model, a, so);
      s.eval(ids);
      other.eval(test::prompt_ids(L + 3, hp.n_vocab));
      const auto other_sums = test::page_checksums(other.kv(), *model, other.tokens());
      const auto sums = test::page_checksums(s.kv(), *model, s.tokens());
      if (std::string(how) == "executor") {
        s.migrate(b);
      } else if (std::string(how) == "file-tier") {
        SessionOptions fo = so;
        fo.kv_tier = KvTier::kFile;
        fo.kv_dir = test::scratch_dir("b17-file");
        Session on_file(model, b, fo);
        s.migrate(b, on_file.kv_store());
      } else {
        s.save(path);
        Session fresh(model, b, so);
        fresh.restore(path);
        CHECK(test::page_checksums(fresh.kv(), *model, fresh.tokens()) == sums);
        CHECK(fresh.tokens().size() == size_t(L));
        CHECK(test::greedy(fresh, 8) == expect);
        continue;
      }
      CHECK(test::page_checksums(s.kv(), *model, s.tokens()) == sums);  // bit-identical pages
      CHECK(s.tokens().size() == size_t(L));
      CHECK(s.kv().n_tokens() == L);  // the next token goes to position L
      CHECK(test::greedy(s, 8) == expect);
      CHECK(test::page_checksums(other.kv(), *model, other.tokens()) == other_sums);  // untouched
    }
  }
}

TEST_CASE("a sender that keeps generating during a pending hand-off does not change the leased pages",
          "[kv][contract]") {
  auto model = load_model("aidreams260K-q4_0");
  CpuQ4Executor ex(model, CpuExecutorOptions{1});
  const auto& hp = model->hparams();
  auto src = make_store(hp, 8), dst = make_store(hp, 8);
  SessionOptions so;
  so.kv_store = src;
  so.n_ctx = 128;
  Session s(model, ex, so);
  s.eval(test::prompt_ids(21, hp.n_vocab));
  const auto sent_tokens = s.tokens();
  KvHandoff h = kv_export(s.kv(), *model, s.tokens());
  test::greedy(s, 6);  // writes positions 21.. into the tail page: it must be copied first
  auto got = kv_import(std::span<const KvHandoff>(&h, 1), *model, *dst, KvTier::kHost, 128, sent_tokens);
  CHECK(got->n_tokens() == 21);
  Session twin(model, ex, so);
  twin.eval(sent_tokens);
  CHECK(test::page_checksums(*got, *model, sent_tokens) == test::page_checksums(twin.kv(), *model, sent_tokens));
}
