// KvStore: tiers and exact accounting, reservations, copy-on-write prefix sharing, moves
// between Host and File, LRU eviction, and a stress of many swapped sequences. After every
// scenario all tiers are back to zero used pages.
#include <catch2/catch.hpp>

#include <random>

#include "kv_test_support.hpp"

using namespace tandem;
using tandem::test::make_store;

namespace {

std::shared_ptr<const Model> aidreams() {
  static auto m = Model::load(test::model_path("aidreams260K-q4_0"));
  return m;
}

void check_empty(const KvStore& s) {
  for (KvTier t : {KvTier::kDevice, KvTier::kHost, KvTier::kFile}) {
    INFO("tier " << kv_tier_name(t));
    CHECK(s.usage(t).used == 0);
    CHECK(s.usage(t).reserved == 0);
  }
}

// Logits of the last token after feeding `ids` to a fresh sequence (the reference).
std::vector<float> reference_logits(Executor& ex, const std::vector<int32_t>& ids) {
  auto store = make_store(ex.model().hparams(), 16);
  KvSequence kv(*store, 128);
  std::vector<float> l(size_t(ex.model().hparams().n_vocab));
  SequenceStep st{&kv, ids, 0, LogitsRows::kLast};
  ex.step(std::span<const SequenceStep>(&st, 1), l);
  return l;
}

/// One sequence's step the way a Session runs it: the placement policy first (bring it
/// into the executor's tier, make room by swapping LRU sequences to File), then the step.
void placed_step(Executor& ex, const SequenceStep& st, std::span<float> logits) {
  KvPlacement(st.kv->store()).prepare_step(*st.kv, ex.kv_tier(), st.pos0 + int32_t(st.tokens.size()));
  ex.step(std::span<const SequenceStep>(&st, 1), logits);
}

}  // namespace

TEST_CASE("KV store accounting is exact per tier", "[kv]") {
  auto store = make_store(aidreams()->hparams(), 4, 10);
  const size_t pb = store->layout().page_bytes();
  CHECK(pb == size_t(4) * 2 * 16 * 64 * 2);  // 4 layers, K+V, 16 tokens, 4x16 dims, f16
  CHECK(store->usage(KvTier::kHost).capacity == 4);
  CHECK(store->usage(KvTier::kFile).capacity == 10);
  CHECK_FALSE(store->has_tier(KvTier::kDevice));
  CHECK_FALSE(store->file_path().empty());
  std::vector<PageId> pages;
  for (int i = 0; i < 4; ++i) pages.push_back(store->allocate(KvTier::kHost));
  CHECK(store->allocate(KvTier::kHost) == -1);
  CHECK(store->usage(KvTier::kHost).used == 4);
  CHECK(store->usage(KvTier::kHost).used_bytes == 4 * pb);
  store->retain(pages[0]);
  store->release(pages[0]);
  CHECK(store->usage(KvTier::kHost).used == 4);
  store->release(pages[0]);
  CHECK(store->usage(KvTier::kHost).used == 3);
  store->reserve(KvTier::kFile, 6);
  CHECK(store->usage(KvTier::kFile).free() == 4);
  CHECK_THROWS_MATCHES(store->reserve(KvTier::kFile, 5), Error,
                       Catch::Predicate<Error>([](const Error& e) { return e.code() == ErrorCode::kOutOfMemory; }));
  const PageId f = store->allocate(KvTier::kFile, true);
  CHECK(store->usage(KvTier::kFile).reserved == 5);
  CHECK(store->usage(KvTier::kFile).used == 1);
  store->unreserve(KvTier::kFile, 5);
  store->release(f);
  for (size_t i = 1; i < pages.size(); ++i) store->release(pages[i]);
  check_empty(*store);
}

TEST_CASE("bad store options are refused", "[kv]") {
  KvStoreOptions o;
  CHECK_THROWS_AS(KvStore(std::move(o)), Error);  // empty layout
  KvStoreOptions f;
  f.layout = KvLayout::for_model(aidreams()->hparams());
  f.file_pages = 4;
  f.file_dir = "/nonexistent/dir";
  try {
    KvStore s(std::move(f));
    FAIL("accepted a missing directory");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kIo);
  }
  auto store = make_store(aidreams()->hparams(), 2);
  CHECK_THROWS_AS(KvSequence(*store, 10, KvTier::kFile), Error);  // no File tier
  CHECK_THROWS_AS(KvSequence(*store, 0), Error);
}

TEST_CASE("a sequence's reservation is drawn first and returned on destruction", "[kv]") {
  auto store = make_store(aidreams()->hparams(), 4);
  {
    KvSequence s(*store, 64);
    store->reserve(KvTier::kHost, 3);
    s.adopt_reservation(3);
    CHECK(store->usage(KvTier::kHost).free() == 1);
    s.reserve(20);  // two pages, from the reservation
    CHECK(store->usage(KvTier::kHost).used == 2);
    CHECK(store->usage(KvTier::kHost).reserved == 1);
    CHECK(s.reservation() == 1);
  }
  check_empty(*store);
}

TEST_CASE("prefix sharing references pages; writing a shared page copies it first", "[kv][parity]") {
  auto model = aidreams();
  CpuQ4Executor ex(model, CpuExecutorOptions{2});
  auto store = make_store(model->hparams(), 8);
  const auto ids = test::prompt_ids(20, model->hparams().n_vocab);
  std::vector<float> logits(size_t(model->hparams().n_vocab));
  {
    KvSequence a(*store, 128);
    SequenceStep st{&a, ids, 0, LogitsRows::kLast};
    ex.step(std::span<const SequenceStep>(&st, 1), logits);
    REQUIRE(store->usage(KvTier::kHost).used == 2);
    const auto before = test::page_checksums(a, *model, ids);

    KvSequence b(*store, 128);
    b.share_prefix(a, 20);
    CHECK(store->usage(KvTier::kHost).used == 2);  // shared, not copied
    CHECK(store->refcount(a.page(0, int32_t(1))) == 2);
    // b continues with other tokens: page 1 is copied before b writes position 20.
    const std::vector<int32_t> b_next{7, 8, 9};
    SequenceStep sb{&b, b_next, 20, LogitsRows::kLast};
    ex.step(std::span<const SequenceStep>(&sb, 1), logits);
    CHECK(store->usage(KvTier::kHost).used == 3);
    CHECK(b.page(0, int32_t(0)) == a.page(0, int32_t(0)));
    CHECK(b.page(0, int32_t(1)) != a.page(0, int32_t(1)));
    CHECK(test::page_checksums(a, *model, ids) == before);  // a's pages untouched
    std::vector<int32_t> b_all = ids;
    b_all.insert(b_all.end(), b_next.begin(), b_next.end());
    CHECK(logits == reference_logits(ex, b_all));
    // a continues too, unaffected by b.
    const std::vector<int32_t> a_next{11};
    SequenceStep sa{&a, a_next, 20, LogitsRows::kLast};
    ex.step(std::span<const SequenceStep>(&sa, 1), logits);
    std::vector<int32_t> a_all = ids;
    a_all.push_back(11);
    CHECK(logits == reference_logits(ex, a_all));
    // Sharing a page-aligned prefix: no copy needed when the next write starts a new page.
    KvSequence c(*store, 128);
    c.share_prefix(a, 16);
    const std::vector<int32_t> c_next{5};
    SequenceStep sc{&c, c_next, 16, LogitsRows::kLast};
    const int32_t used = store->usage(KvTier::kHost).used;
    ex.step(std::span<const SequenceStep>(&sc, 1), logits);
    CHECK(store->usage(KvTier::kHost).used == used + 1);
    CHECK(c.page(0, int32_t(0)) == a.page(0, int32_t(0)));
  }
  check_empty(*store);
}

TEST_CASE("Host -> File -> Host moves keep pages bit-identical and output unchanged", "[kv][parity]") {
  auto model = aidreams();
  CpuQ4Executor ex(model, CpuExecutorOptions{2});
  auto store = make_store(model->hparams(), 9, 9);
  {
    SessionOptions so;
    so.kv_store = store;
    so.n_ctx = 128;
    Session moved(model, ex, so), still(model, ex, so);
    const auto ids = test::prompt_ids(37, model->hparams().n_vocab);
    moved.eval(ids);
    still.eval(ids);
    const auto sums = test::page_checksums(moved.kv(), *model, moved.tokens());
    const auto m1 = moved.kv().move_to(KvTier::kFile);
    CHECK(m1.pages == 3);
    CHECK(m1.bytes == 3 * store->layout().page_bytes());
    CHECK(store->usage(KvTier::kFile).used == 3);
    CHECK(moved.kv().pages_outside(KvTier::kFile) == 0);
    CHECK(test::page_checksums(moved.kv(), *model, moved.tokens()) == sums);
    moved.kv().move_to(KvTier::kHost);
    CHECK(test::page_checksums(moved.kv(), *model, moved.tokens()) == sums);
    moved.kv().move_to(KvTier::kFile);  // touching it (generate) brings it back
    CHECK(test::greedy(moved, 12) == test::greedy(still, 12));
    CHECK(moved.kv().pages_outside(KvTier::kHost) == 0);
  }
  check_empty(*store);
}

TEST_CASE("move_exclusive_to moves only the pages a sequence holds alone", "[kv][parity]") {
  auto model = aidreams();
  CpuQ4Executor ex(model, CpuExecutorOptions{1});
  auto store = make_store(model->hparams(), 8, 8);
  const auto ids = test::prompt_ids(40, model->hparams().n_vocab);  // 3 pages
  std::vector<float> logits(size_t(model->hparams().n_vocab));
  {
    KvSequence a(*store, 128);
    SequenceStep st{&a, ids, 0, LogitsRows::kLast};
    ex.step(std::span<const SequenceStep>(&st, 1), logits);
    KvSequence b(*store, 128);
    b.share_prefix(a, 32);  // a's first two pages
    const KvMoveStats moved = a.move_exclusive_to(KvTier::kFile);
    CHECK(moved.pages == 1);
    CHECK(a.pages_outside(KvTier::kHost) == 1);
    CHECK(store->usage(KvTier::kHost).used == 2);
    CHECK(store->usage(KvTier::kFile).used == 1);
    CHECK(b.pages_outside(KvTier::kHost) == 0);  // b's pages never moved
    CHECK(a.move_exclusive_to(KvTier::kHost).pages == 1);
    CHECK(a.pages_outside(KvTier::kHost) == 0);
    CHECK(store->usage(KvTier::kFile).used == 0);
    // Both continue as fresh runs of their tokens would (the round trip is bit-exact).
    const std::vector<int32_t> a_next{11};
    SequenceStep sa{&a, a_next, 40, LogitsRows::kLast};
    ex.step(std::span<const SequenceStep>(&sa, 1), logits);
    std::vector<int32_t> a_all = ids;
    a_all.push_back(11);
    CHECK(logits == reference_logits(ex, a_all));
    const std::vector<int32_t> b_next{7};
    SequenceStep sb{&b, b_next, 32, LogitsRows::kLast};
    ex.step(std::span<const SequenceStep>(&sb, 1), logits);
    std::vector<int32_t> b_all(ids.begin(), ids.begin() + 32);
    b_all.push_back(7);
    CHECK(logits == reference_logits(ex, b_all));
    try {
      a.move_exclusive_to(KvTier::kDevice);  // this store has no Device tier
      FAIL("no error");
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::kInvalidArgument);
    }
  }
  check_empty(*store);
}

TEST_CASE("a File-only session computes on the memory-mapped pages", "[kv][parity]") {
  auto model = aidreams();
  CpuQ4Executor ex(model, CpuExecutorOptions{2});
  SessionOptions file_opts;
  file_opts.kv_tier = KvTier::kFile;
  file_opts.kv_dir = test::scratch_dir("file-session");
  Session on_file(model, ex, file_opts), on_host(model, ex);
  const auto ids = test::prompt_ids(25, model->hparams().n_vocab);
  on_file.eval(ids);
  on_host.eval(ids);
  CHECK(on_file.kv_store()->usage(KvTier::kFile).used == 2);
  CHECK(on_file.kv_store()->usage(KvTier::kHost).capacity == 0);
  CHECK(test::greedy(on_file, 10) == test::greedy(on_host, 10));
}

// Issue 12 item 3: one owner for where pages live. Fails on the main before this change:
// Executor::step evicted the least recently used sequence itself (and moved the stepped
// one) for any caller; now it only computes where the pages are, and the placement policy
// that the scheduler and Session use decides.
TEST_CASE("LRU eviction moves the least recently used inactive sequence to File", "[kv]") {
  auto model = aidreams();
  CpuQ4Executor ex(model, CpuExecutorOptions{1});
  auto store = make_store(model->hparams(), 4, 8);
  {
    std::vector<std::unique_ptr<KvSequence>> seqs;
    std::vector<float> logits(size_t(model->hparams().n_vocab));
    const auto ids = test::prompt_ids(20, model->hparams().n_vocab);  // 2 pages each
    for (int i = 0; i < 2; ++i) {
      seqs.push_back(std::make_unique<KvSequence>(*store, 64));
      SequenceStep st{seqs.back().get(), ids, 0, LogitsRows::kLast};
      ex.step(std::span<const SequenceStep>(&st, 1), logits);
    }
    CHECK(store->usage(KvTier::kHost).free() == 0);
    seqs[0]->touch();  // seq 1 is now the least recently used

    // The executor alone moves nothing: a new Host sequence finds the tier full.
    seqs.push_back(std::make_unique<KvSequence>(*store, 64));
    SequenceStep full{seqs.back().get(), ids, 0, LogitsRows::kLast};
    try {
      ex.step(std::span<const SequenceStep>(&full, 1), logits);
      FAIL("the step found room in a full Host tier");
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::kOutOfMemory);
    }
    CHECK(seqs[0]->pages_outside(KvTier::kHost) == 0);
    CHECK(seqs[1]->pages_outside(KvTier::kHost) == 0);
    CHECK(seqs[2]->n_tokens() == 0);
    CHECK(store->usage(KvTier::kFile).used == 0);
    seqs.pop_back();
    // A sequence on File is computed where it is (the CPU reads mapped pages), not moved.
    seqs.push_back(std::make_unique<KvSequence>(*store, 64, KvTier::kFile));
    SequenceStep on_file{seqs.back().get(), ids, 0, LogitsRows::kLast};
    ex.step(std::span<const SequenceStep>(&on_file, 1), logits);
    CHECK(seqs[2]->pages_outside(KvTier::kFile) == 0);
    CHECK(seqs[1]->pages_outside(KvTier::kHost) == 0);

    // The placement policy brings it to Host, swapping the least recently used out.
    const int32_t next = ids[1];
    SequenceStep st{seqs[2].get(), std::span<const int32_t>(&next, 1), 20, LogitsRows::kLast};
    placed_step(ex, st, logits);
    CHECK(seqs[2]->pages_outside(KvTier::kHost) == 0);
    CHECK(seqs[1]->pages_outside(KvTier::kFile) == 0);  // evicted
    CHECK(seqs[0]->pages_outside(KvTier::kHost) == 0);  // recently used: stays
    // A pinned sequence is never evicted.
    seqs[0]->pin();
    CHECK(store->evict_lru(KvTier::kHost, KvTier::kFile, 2, seqs[2].get()) == 0);
    seqs[0]->unpin();
    CHECK(store->evict_lru(KvTier::kHost, KvTier::kFile, 2, seqs[2].get()) == 2);
  }
  check_empty(*store);
}

TEST_CASE("stress: many sequences swapped to File and touched in random order", "[kv][stress]") {
  auto model = aidreams();
  CpuQ4Executor ex(model, CpuExecutorOptions{2});
  const int32_t n_seq = 1500;
  auto store = make_store(model->hparams(), 40, n_seq * 2, 8);  // Host holds < 3% of them
  const int32_t n_vocab = model->hparams().n_vocab;
  std::mt19937 rng(5);
  std::vector<std::unique_ptr<KvSequence>> seqs;
  std::vector<std::vector<int32_t>> tokens(static_cast<size_t>(n_seq));
  std::vector<float> logits(static_cast<size_t>(n_vocab));
  for (int32_t i = 0; i < n_seq; ++i) {
    auto& t = tokens[size_t(i)];
    const int32_t len = 1 + int32_t(rng() % 12);
    for (int32_t j = 0; j < len; ++j) t.push_back(int32_t(rng() % uint32_t(n_vocab)));
    seqs.push_back(std::make_unique<KvSequence>(*store, 32));
    SequenceStep st{seqs.back().get(), t, 0, LogitsRows::kNone};
    placed_step(ex, st, {});
    if (i % 2 == 0) seqs.back()->move_to(KvTier::kFile);
  }
  CHECK(store->usage(KvTier::kFile).used > 0);
  // Touch 300 at random: each continues exactly as a fresh run of its tokens would.
  int mismatches = 0;
  for (int k = 0; k < 300; ++k) {
    const size_t i = rng() % size_t(n_seq);
    auto& t = tokens[i];
    if (int32_t(t.size()) >= 32) continue;
    const int32_t next = int32_t(rng() % uint32_t(n_vocab));
    SequenceStep st{seqs[i].get(), std::span<const int32_t>(&next, 1), int32_t(t.size()), LogitsRows::kLast};
    placed_step(ex, st, logits);
    t.push_back(next);
    if (logits != reference_logits(ex, t)) ++mismatches;
  }
  CHECK(mismatches == 0);
  // Destroy in random order; usage returns to zero.
  std::shuffle(seqs.begin(), seqs.end(), rng);
  seqs.clear();
  check_empty(*store);
  CHECK(store->sequence_count() == 0);
}

// KvPlacement's moves for the scheduler and Session::migrate: a preempted sequence spills
// to File (or stays, for the caller to drop), park / unpark move only pages a sequence
// holds alone, and an import lands in the first preferred tier with room.
TEST_CASE("KvPlacement spills, parks, unparks and picks the tier an import lands in", "[kv][placement]") {
  auto model = aidreams();
  CpuQ4Executor ex(model, CpuExecutorOptions{1});
  const auto ids = test::prompt_ids(40, model->hparams().n_vocab);  // 3 pages of 16
  std::vector<float> logits(size_t(model->hparams().n_vocab));
  auto fill = [&](KvSequence& kv) {
    SequenceStep st{&kv, ids, 0, LogitsRows::kLast};
    ex.step(std::span<const SequenceStep>(&st, 1), logits);
  };
  SECTION("spill: every page to File, the reservation returned; no File tier or no room: nothing moves") {
    auto store = make_store(model->hparams(), 8, 4);
    {
      KvSequence a(*store, 128);
      fill(a);
      store->reserve(KvTier::kHost, 2);
      a.adopt_reservation(2);
      CHECK(store->usage(KvTier::kHost).reserved == 2);
      CHECK(KvPlacement(*store).spill(a));
      CHECK(a.tier() == KvTier::kFile);
      CHECK(a.pages_outside(KvTier::kFile) == 0);
      CHECK(store->usage(KvTier::kFile).used == 3);
      CHECK(store->usage(KvTier::kHost).used == 0);
      CHECK(store->usage(KvTier::kHost).reserved == 0);
      CHECK(a.reservation() == 0);
      KvSequence b(*store, 128);
      fill(b);
      CHECK_FALSE(KvPlacement(*store).spill(b));  // 1 File page left for 3
      CHECK(b.pages_outside(KvTier::kHost) == 0);
      CHECK(store->usage(KvTier::kFile).used == 3);
    }
    check_empty(*store);
    auto no_file = make_store(model->hparams(), 8);
    {
      KvSequence c(*no_file, 128);
      fill(c);
      CHECK_FALSE(KvPlacement(*no_file).spill(c));
      CHECK(c.pages_outside(KvTier::kHost) == 0);
    }
    check_empty(*no_file);
  }
  SECTION("park / unpark: the pages held alone go to File and back, bit-exact") {
    auto store = make_store(model->hparams(), 8, 8);
    {
      KvSequence a(*store, 128);
      fill(a);
      KvSequence b(*store, 128);
      b.share_prefix(a, 32);  // a's first two pages
      const KvMoveStats parked = KvPlacement(*store).park(a);
      CHECK(parked.pages == 1);
      CHECK(a.tier() == KvTier::kFile);
      CHECK(a.pages_outside(KvTier::kHost) == 1);
      CHECK(b.pages_outside(KvTier::kHost) == 0);
      const uint64_t before = a.last_use();
      CHECK(KvPlacement(*store).unpark(a, KvTier::kHost).pages == 1);
      CHECK(a.last_use() > before);  // marked used: the last to be evicted
      CHECK(a.pages_outside(KvTier::kHost) == 0);
      CHECK(store->usage(KvTier::kFile).used == 0);
      const std::vector<int32_t> next{11};
      SequenceStep st{&a, next, 40, LogitsRows::kLast};
      ex.step(std::span<const SequenceStep>(&st, 1), logits);
      std::vector<int32_t> all = ids;
      all.push_back(11);
      CHECK(logits == reference_logits(ex, all));
    }
    check_empty(*store);
    auto no_file = make_store(model->hparams(), 8);
    {
      KvSequence c(*no_file, 128);
      fill(c);
      CHECK(test::code_of([&] { KvPlacement(*no_file).park(c); }) == ErrorCode::kInvalidArgument);
      CHECK(c.pages_outside(KvTier::kHost) == 0);
    }
    check_empty(*no_file);
  }
  SECTION("import_tier: the first preferred tier with room, else the first the store has") {
    auto store = make_store(model->hparams(), 4, 8);
    const KvPlacement place(*store);
    const KvTier host_first[2] = {KvTier::kHost, KvTier::kFile};
    const KvTier device_first[3] = {KvTier::kDevice, KvTier::kHost, KvTier::kFile};
    CHECK(place.import_tier(host_first, 4) == KvTier::kHost);
    CHECK(place.import_tier(host_first, 5) == KvTier::kFile);    // Host holds 4
    CHECK(place.import_tier(host_first, 20) == KvTier::kHost);   // none has room: the first
    CHECK(place.import_tier(device_first, 2) == KvTier::kHost);  // no Device tier here
    const KvTier device_only[1] = {KvTier::kDevice};
    CHECK(test::code_of([&] { (void)place.import_tier(device_only, 1); }) == ErrorCode::kInvalidArgument);
    {
      KvSequence a(*store, 128);
      fill(a);  // 3 of 4 Host pages used
      CHECK(place.import_tier(host_first, 1) == KvTier::kHost);
      CHECK(place.import_tier(host_first, 2) == KvTier::kFile);
    }
    check_empty(*store);
  }
}
