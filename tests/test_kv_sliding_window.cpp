// Sliding-window KV paging (Gemma 3): the layer groups of a windowed layout, a windowed
// group's pages released as the window moves (no leak over 10k positions), cuts and shared
// prefixes behind the window refused, and a session saved, restored or handed off mid-window
// continuing with the uninterrupted run's logits, bit for bit.
#include <catch2/catch.hpp>

#include <filesystem>
#include <set>

#include "executor_factories.hpp"
#include "gemma3_test_support.hpp"
#include "kv_test_support.hpp"
#include "tandem/kv/kv_contract.hpp"
#include "tandem/session/session.hpp"
#include "test_support.hpp"

using namespace tandem;

namespace {

// A Gemma 3 KV shape: `n_layer` layers (every 6th, il % 6 == 5, global), 1 KV head of
// `head_dim`, a window of `window`.
HParams windowed_shape(int32_t n_layer, int32_t head_dim, int32_t window) {
  HParams hp;
  hp.n_layer = n_layer;
  hp.n_head_kv = 1;
  hp.head_dim = head_dim;
  hp.n_swa = window;
  hp.swa_pattern = 6;
  return hp;
}

// Gemma 3 270M's: 18 layers, head_dim 256, window 512.
HParams gemma3_270m_shape() {
  return windowed_shape(18, 256, 512);
}

}  // namespace

TEST_CASE("KV layout of a sliding-window model: layer groups, places and page counts", "[kv][swa]") {
  const KvLayout l = KvLayout::for_model(gemma3_270m_shape(), 16);
  CHECK(l.window == 512);
  CHECK(l.n_window_layers() == 15);
  CHECK(l.page_layers() == 3);  // gcd(15 windowed, 3 global)
  CHECK(l.n_groups() == 6);
  CHECK(l.n_full_groups() == 1);
  CHECK(l.page_bytes() == 3u * 2 * 16 * 256 * 2);
  // By hand: the global layers 5, 11, 17 fill group 0; the windowed ones, in order, groups 1..5.
  CHECK(l.place(5).group == 0);
  CHECK(l.place(5).slot == 0);
  CHECK(l.place(17).slot == 2);
  CHECK(l.place(0).group == 1);
  CHECK(l.place(4).group == 2);  // the 5th windowed layer
  CHECK(l.place(4).slot == 1);
  CHECK(l.place(6).group == 2);  // the 6th
  CHECK(l.place(6).slot == 2);
  CHECK(l.place(16).group == 5);
  CHECK(l.place(16).slot == 2);
  std::set<std::pair<int32_t, int32_t>> places;
  for (int32_t il = 0; il < 18; ++il) {
    const KvLayout::Place p = l.place(il);
    CHECK(l.group_windowed(p.group) == l.is_window_layer(il));
    places.insert({p.group, p.slot});
  }
  CHECK(places.size() == 18);  // one place per layer
  // Without slack, the first page a query at position n sees: the page of n - 511.
  KvLayout tight = l;
  tight.window_slack = 0;
  CHECK(tight.window_live_page(511) == 0);
  CHECK(tight.window_live_page(526) == 0);
  CHECK(tight.window_live_page(527) == 1);  // 527 - 511 = 16: page 1
  CHECK(tight.window_live_page(10000) == 593);
  CHECK(tight.pages_holding(10000) == 6 * 625 - 5 * 593);
  // Full group: 625 + 1; each windowed group: the 511 + 128 positions of a window and a
  // 128-token step span 40 pages, + 2.
  CHECK(tight.sequence_pages(10000, 128) == 626 + 5 * 42);
  // for_model keeps half the window (256 positions) behind it: (10000 - 511 - 256) / 16.
  CHECK(l.window_slack == 256);
  CHECK(l.window_live_page(10000) == 577);
  CHECK(l.pages_holding(10000) == 6 * 625 - 5 * 577);
  CHECK(l.sequence_pages(10000, 128) == 626 + 5 * 58);  // 511 + 256 + 128 positions: 56 pages, + 2
  CHECK(l.sequence_pages(100, 128) == 6 * 8);           // a short sequence: the full count
  // Long context: the bytes a sequence holds per token, against all layers' pages
  // (32k positions: 2288 pages of 48 KiB, 3432 bytes per token of 18432).
  const double full = 18.0 * 2 * 256 * 2;
  CHECK(double(l.pages_holding(32768)) * double(l.page_bytes()) / 32768.0 / full < 0.19);

  // Without a window: one group of every layer, the layout of a full-attention model.
  HParams plain = gemma3_270m_shape();
  plain.n_swa = 0;
  const KvLayout p = KvLayout::for_model(plain, 16);
  CHECK(p.page_layers() == 18);
  CHECK(p.n_groups() == 1);
  CHECK(p.place(7).group == 0);
  CHECK(p.place(7).slot == 7);
  CHECK(p.window_live_page(10000) == 0);
  CHECK(p.sequence_pages(10000, 128) == 626);

  // A store of layers 3..11 (a layer split): global 5 and 11, seven windowed, gcd 1.
  KvLayout part = l;
  part.layer_begin = 3;
  part.n_layer = 9;
  CHECK(part.n_window_layers() == 7);
  CHECK(part.page_layers() == 1);
  CHECK(part.place(5).group == 0);
  CHECK(part.place(11).group == 1);
  CHECK(part.place(3).group == 2);
  CHECK(part.place(10).group == 8);
}

TEST_CASE("a windowed sequence keeps one window of pages: 10k positions, then nothing left", "[kv][swa]") {
  const HParams hp = windowed_shape(6, 32, 8);  // layers 0..4 windowed, 5 global
  for (const int32_t step : {1, 37}) {
    INFO("positions per step: " << step);
    const int32_t n_max = 10000;
    auto store = test::make_store(hp, int32_t(KvLayout::for_model(hp, 4).sequence_pages(n_max, step)), 0, 4);
    const KvLayout& l = store->layout();
    REQUIRE(l.n_groups() == 6);
    {
      KvSequence seq(*store, n_max);
      int32_t most_windowed = 0;
      for (int32_t n = 0; n < n_max; n = std::min(n + step, n_max)) {
        const int32_t end = std::min(n + step, n_max);
        seq.reserve(end);
        seq.set_n_tokens(end);
        // Every page the store hands out is the sequence's, and a windowed group holds the
        // pages from the window of position n (the step's first query) to `end`.
        REQUIRE(store->used_pages() == seq.held_pages());
        const int32_t pages = (end + 3) / 4;
        REQUIRE(seq.window_pages_dropped() == l.window_live_page(n));
        REQUIRE(seq.held_pages() == 6 * pages - 5 * l.window_live_page(n));
        const int32_t live = l.window_live_page(n);
        for (int32_t g = 1; g < 6; ++g) {
          if (live > 0) REQUIRE(seq.page(g, live - 1) == kNoPage);
          REQUIRE(seq.page(g, live) != kNoPage);
        }
        most_windowed = std::max(most_windowed, pages - l.window_live_page(n));
      }
      // 10000 positions: the global group's 2500 pages, each windowed group's last few.
      const int32_t last = (n_max - 1) / step * step;  // the last step's first position
      CHECK(seq.held_pages() == 2500 + 5 * (2500 - l.window_live_page(last)));
      CHECK(most_windowed <= (l.window - 1 + l.window_slack + step + 3) / 4 + 1);
    }
    CHECK(store->used_pages() == 0);  // no leak
  }
}

TEST_CASE("cuts and shared prefixes behind the window are refused; inside it they keep the pages", "[kv][swa]") {
  const HParams hp = windowed_shape(6, 32, 8);
  auto store = test::make_store(hp, 4096, 0, 4);
  REQUIRE(store->layout().window_slack == 4);  // half the window
  KvSequence a(*store, 512);
  for (int32_t n = 0; n < 100; ++n) {
    a.reserve(n + 1);
    a.set_n_tokens(n + 1);
  }
  // The last step's queries started at 99 and see 92..99; with 4 positions of slack the
  // windowed pages before page (99 - 7 - 4) / 4 = 22 are gone: rows from position 88 held.
  CHECK(a.window_pages_dropped() == 22);
  CHECK(a.window_from() == 88);
  CHECK(a.holds_prefix(100));
  CHECK(a.holds_prefix(95));  // a query at 95 sees 88..95
  CHECK_FALSE(a.holds_prefix(94));
  CHECK(a.holds_prefix(0));
  CHECK_FALSE(a.holds_prefix(101));

  KvSequence b(*store, 512);
  CHECK(test::code_of([&] { b.share_prefix(a, 94); }) == ErrorCode::kInvalidArgument);
  const int32_t before = store->used_pages();
  b.share_prefix(a, 100);
  CHECK(store->used_pages() == before);  // referenced, not copied
  CHECK(b.held_pages() == a.held_pages());
  CHECK(store->refcount(a.page(0, 0)) == 2);
  CHECK(b.page(1, 21) == kNoPage);
  CHECK(b.page(1, 22) == a.page(1, 22));

  CHECK(a.truncate(95) == 95);  // inside the window and its slack: kept
  CHECK(a.n_tokens() == 95);
  CHECK(a.truncate(50) == 0);  // behind it: nothing can be kept
  CHECK(a.held_pages() == 0);
  CHECK(a.window_pages_dropped() == 0);
  CHECK(store->used_pages() == b.held_pages());  // b keeps what it shares
}

namespace {

// Logits after each of `steps` greedy tokens from `s`, flattened.
std::vector<float> greedy_logits(Session& s, int32_t steps) {
  std::vector<float> all;
  for (int32_t i = 0; i < steps; ++i) {
    const auto l = s.logits();
    all.insert(all.end(), l.begin(), l.end());
    const int32_t next = test::argmax(l);
    s.eval(std::span<const int32_t>(&next, 1));
  }
  return all;
}

}  // namespace

TEST_CASE("gemma3 tiny: a session saved, restored or handed off mid-window continues bit for bit",
          "[kv][swa][gemma3]") {
  test::TinyGemma3 spec;  // window 8 on layers 0..4, layer 5 global
  const auto model = Model::load(test::write_tiny_gemma3(spec, "swa8-paging"));
  CpuQ4Executor exec(model, CpuExecutorOptions{2});
  CpuQ4Executor other(model, CpuExecutorOptions{1});
  SessionOptions so;
  so.n_ctx = 256;
  so.n_batch = 13;  // prompt chunks across window and page edges
  so.page_size = 4;
  std::vector<int32_t> prompt;
  for (int32_t i = 0; i < 45; ++i) prompt.push_back(4 + (i * 7) % 60);
  const std::span<const int32_t> ids(prompt);

  // The uninterrupted run: 45 prompt tokens, 40 greedy tokens, then 30 more.
  Session ref(model, exec, so);
  ref.eval(ids);
  const auto head = greedy_logits(ref, 40);
  const auto tail = greedy_logits(ref, 30);
  // Pages held: the global layer's all, each windowed layer's from the window on.
  const KvLayout& l = ref.kv_store()->layout();
  CHECK(ref.kv().held_pages() < 2 * ref.kv().n_pages());
  CHECK(ref.kv_store()->used_pages() == ref.kv().held_pages());

  const auto dir = test::scratch_dir("kv-swa");
  Session s(model, exec, so);
  s.eval(ids);
  CHECK(test::same_bits(greedy_logits(s, 40), head));
  REQUIRE(s.kv().window_pages_dropped() > 0);  // 85 positions: the window moved far
  s.save(dir / "mid.session");
  {
    // The file carries the global layer's rows of every page, the windowed ones' from the
    // window's page only.
    const KvHandoff h = kv_export(s.kv(), *model, s.tokens());
    CHECK(h.descriptor.window == 8);
    CHECK(h.descriptor.window_begin == l.window_live_page(s.kv().n_tokens()) * 4);
    CHECK(h.descriptor.window_begin > 0);
    CHECK(h.descriptor.payload_bytes() <
          uint64_t(h.descriptor.n_pages()) * 6 * 2 * 4 * uint64_t(h.descriptor.row_bytes) / 2);
  }

  SECTION("restored into a new session") {
    Session r(model, exec, so);
    r.restore(dir / "mid.session");
    CHECK(r.kv().held_pages() == int32_t(l.pages_holding(r.kv().n_tokens())));
    CHECK(test::same_bits(greedy_logits(r, 30), tail));
  }
  SECTION("handed off to another executor and store") {
    s.migrate(other);
    CHECK(s.kv().held_pages() == int32_t(l.pages_holding(s.kv().n_tokens())));
    CHECK(test::same_bits(greedy_logits(s, 30), tail));
  }
  SECTION("cut behind the window: evaluated again, then the same") {
    const size_t n = s.tokens().size();
    s.truncate(n - 20);  // 20 positions back: behind the window of 8
    CHECK(s.tokens().size() == n - 20);
    std::vector<int32_t> again(ref.tokens().begin() + std::ptrdiff_t(n - 20), ref.tokens().begin() + std::ptrdiff_t(n));
    s.eval(again);
    CHECK(test::same_bits(greedy_logits(s, 30), tail));
  }
}
