// Session and executor behaviour: context overflow (field case B15), bad positions,
// chunked prefill and multi-sequence batches equal to single runs, stop strings,
// streaming callbacks.
#include <catch2/catch.hpp>

#include <climits>
#include <cstring>
#include <filesystem>
#include <thread>

#include "executor_factories.hpp"
#include "kv_test_support.hpp"
#include "tandem/session/session.hpp"

using namespace tandem;
using test::code_of;

namespace {

std::shared_ptr<const Model> aidreams() {
  static auto m = Model::load(test::model_path("aidreams260K-q4_0"));
  return m;
}

std::vector<int32_t> some_ids(int n) {
  std::vector<int32_t> ids{1};
  for (int i = 1; i < n; ++i) ids.push_back(259 + (i * 37) % 250);
  return ids;
}

std::shared_ptr<KvStore> host_store(const HParams& hp, int32_t pages, int32_t page_size = 16) {
  KvStoreOptions o;
  o.layout = KvLayout::for_model(hp, page_size);
  o.host_pages = pages;
  return std::make_shared<KvStore>(std::move(o));
}

}  // namespace

TEST_CASE("B15: context overflow is refused before any compute", "[session][field-case][parity]") {
  const auto exec_name = GENERATE(from_range(test::executor_names()));
  auto exec = test::make_executor(exec_name, aidreams());
  SessionOptions so;
  so.n_ctx = 32;

  SECTION("(a) a 33-token prompt") {
    Session s(aidreams(), *exec, so);
    CHECK(code_of([&] { s.eval(some_ids(33)); }) == ErrorCode::kContextOverflow);
    CHECK(s.tokens().empty());
    CHECK(s.logits().empty());
    GenerateOptions go;
    go.sampling = SamplingParams::greedy();
    CHECK(code_of([&] { s.generate(std::span<const int32_t>(some_ids(33)), go); }) == ErrorCode::kContextOverflow);
  }
  SECTION("(b) 28 prompt tokens and max_tokens 16 end with 'length' at 32 positions") {
    Session s(aidreams(), *exec, so);
    GenerateOptions go;
    go.sampling = SamplingParams::greedy();
    go.max_tokens = 16;
    go.ignore_eos = true;
    const auto r = s.generate(std::span<const int32_t>(some_ids(28)), go);
    CHECK(r.finish == FinishReason::kLength);
    CHECK(s.tokens().size() == 32);
    CHECK(r.tokens.size() == 5);
    // Continuing is refused: the pending token no longer fits.
    CHECK(code_of([&] { s.generate(std::span<const int32_t>(), go); }) == ErrorCode::kContextOverflow);
  }
  SECTION("(c) a 5-token follow-up on a session holding 30") {
    Session s(aidreams(), *exec, so);
    s.eval(some_ids(30));
    const std::vector<float> before(s.logits().begin(), s.logits().end());
    CHECK(code_of([&] { s.eval(some_ids(5)); }) == ErrorCode::kContextOverflow);
    CHECK(s.tokens().size() == 30);
    CHECK(std::vector<float>(s.logits().begin(), s.logits().end()) == before);
  }
  SECTION("(d) low-level steps at positions 32, -1 and 40 (holding 10) are refused") {
    auto pool = host_store(aidreams()->hparams(), 2);
    KvSequence kv(*pool, 32);
    std::vector<float> logits(size_t(aidreams()->hparams().n_vocab));
    const auto ten = some_ids(10);
    SequenceStep st{&kv, ten, 0, LogitsRows::kLast};
    exec->step(std::span<const SequenceStep>(&st, 1), logits);
    REQUIRE(kv.n_tokens() == 10);
    const std::vector<std::byte> snapshot(pool->page_data(kv.page(0, int32_t(0))),
                                          pool->page_data(kv.page(0, int32_t(0))) + pool->layout().page_bytes());
    const int32_t id = 5;
    for (int32_t pos : {32, -1, 40, 9, 11}) {
      SequenceStep bad{&kv, std::span<const int32_t>(&id, 1), pos, LogitsRows::kLast};
      INFO("position " << pos);
      CHECK(code_of([&] { exec->step(std::span<const SequenceStep>(&bad, 1), logits); }) == ErrorCode::kBadPosition);
      CHECK(kv.n_tokens() == 10);
    }
    CHECK(std::memcmp(snapshot.data(), pool->page_data(kv.page(0, int32_t(0))), snapshot.size()) == 0);
    CHECK(pool->used_pages() == 1);
  }
}

TEST_CASE("executor refuses malformed batches without changing any sequence", "[executor][parity]") {
  const auto exec_name = GENERATE(from_range(test::executor_names()));
  auto exec = test::make_executor(exec_name, aidreams());
  const int32_t n_vocab = aidreams()->hparams().n_vocab;
  auto pool = host_store(aidreams()->hparams(), 8);
  KvSequence kv(*pool, 64);
  std::vector<float> logits(size_t(n_vocab) * 4);
  const std::vector<int32_t> good{1, 2, 3};
  const std::vector<int32_t> bad_id{1, n_vocab};
  const std::vector<int32_t> negative{1, -3};
  const std::vector<int32_t> empty;

  SequenceStep s1{&kv, bad_id, 0, LogitsRows::kLast};
  CHECK(code_of([&] { exec->step(std::span<const SequenceStep>(&s1, 1), logits); }) == ErrorCode::kInvalidArgument);
  SequenceStep s2{&kv, negative, 0, LogitsRows::kLast};
  CHECK(code_of([&] { exec->step(std::span<const SequenceStep>(&s2, 1), logits); }) == ErrorCode::kInvalidArgument);
  SequenceStep s3{&kv, empty, 0, LogitsRows::kLast};
  CHECK(code_of([&] { exec->step(std::span<const SequenceStep>(&s3, 1), logits); }) == ErrorCode::kInvalidArgument);
  SequenceStep s4{nullptr, good, 0, LogitsRows::kLast};
  CHECK(code_of([&] { exec->step(std::span<const SequenceStep>(&s4, 1), logits); }) == ErrorCode::kInvalidArgument);
  SequenceStep twice[2] = {{&kv, good, 0, LogitsRows::kLast}, {&kv, good, 0, LogitsRows::kLast}};
  CHECK(code_of([&] { exec->step(twice, logits); }) == ErrorCode::kInvalidArgument);
  SequenceStep all{&kv, good, 0, LogitsRows::kAll};
  CHECK(code_of([&] {
          exec->step(std::span<const SequenceStep>(&all, 1), std::span<float>(logits).first(size_t(n_vocab) * 2));
        }) == ErrorCode::kInvalidArgument);
  CHECK(kv.n_tokens() == 0);
  CHECK(pool->used_pages() == 0);

  SECTION("a full KV pool is kOutOfMemory and leaves the sequence as it was") {
    auto tiny = host_store(aidreams()->hparams(), 1, 4);
    KvSequence small(*tiny, 64);
    const auto ids = some_ids(5);
    SequenceStep st{&small, ids, 0, LogitsRows::kLast};
    CHECK(code_of([&] { exec->step(std::span<const SequenceStep>(&st, 1), logits); }) == ErrorCode::kOutOfMemory);
    CHECK(small.n_tokens() == 0);
    CHECK(tiny->used_pages() == 0);
  }
}

TEST_CASE("chunked prefill and multi-sequence batches give the same logits as one run", "[executor][parity]") {
  const auto exec_name = GENERATE(from_range(test::executor_names()));
  const auto model_name =
      GENERATE(as<std::string>{}, "aidreams260K-q4_0", "synth-qwen2-small-q4_0", "synth-qwen3-hd64-small-q4_0");
  auto model = Model::load(test::model_path(model_name));
  auto exec = test::make_executor(exec_name, model);
  const auto ids = some_ids(40);
  INFO(exec_name << " / " << model_name);

  auto pool = host_store(model->hparams(), 16);
  KvSequence a(*pool, 64), b(*pool, 64);
  test::check_batch_invariance(model, *exec, ids, SessionOptions{}, a, b);
}

TEST_CASE("stop strings cut the text and the stream holds back a possible stop", "[session]") {
  auto model = aidreams();
  CpuQ4Executor exec(model, CpuExecutorOptions{2});
  const auto ids = model->tokenizer().tokenize("Once upon a time", true, false);
  GenerateOptions go;
  go.sampling = SamplingParams::greedy();
  go.max_tokens = 64;
  Session plain(model, exec);
  const auto full = plain.generate(std::span<const int32_t>(ids), go);
  REQUIRE(full.text.find("flower") != std::string::npos);

  Session s(model, exec);
  std::string streamed;
  go.stop = {"flower"};
  go.on_text = [&](std::string_view t, int32_t) {
    streamed += t;
    return true;
  };
  const auto r = s.generate(std::span<const int32_t>(ids), go);
  CHECK(r.finish == FinishReason::kStopString);
  CHECK(r.text == full.text.substr(0, full.text.find("flower")));
  CHECK(streamed == r.text);

  Session c(model, exec);
  int calls = 0;
  go.stop.clear();
  go.on_text = [&](std::string_view, int32_t) { return ++calls < 3; };
  const auto rc = c.generate(std::span<const int32_t>(ids), go);
  CHECK(rc.finish == FinishReason::kCancelled);
  CHECK(calls == 3);
}

TEST_CASE("a continued session equals one long evaluation", "[session][parity]") {
  const auto exec_name = GENERATE(from_range(test::executor_names()));
  auto model = aidreams();
  auto exec = test::make_executor(exec_name, model);
  GenerateOptions go;
  go.sampling = SamplingParams::greedy();
  go.max_tokens = 10;
  go.ignore_eos = true;
  Session s(model, *exec);
  const auto first = s.generate(std::span<const int32_t>(some_ids(6)), go);
  const auto follow = some_ids(4);
  const auto second = s.generate(std::span<const int32_t>(follow), go);

  std::vector<int32_t> all = some_ids(6);
  all.insert(all.end(), first.tokens.begin(), first.tokens.end());
  all.insert(all.end(), follow.begin(), follow.end());
  Session once(model, *exec);
  const auto r = once.generate(std::span<const int32_t>(all), go);
  CHECK(r.tokens == second.tokens);
}

// Issue 15 item 5: sizes asked for are bounded before anything is allocated. Fails on
// the main before this change: n_ctx = INT32_MAX was accepted and sized a store and a
// block table for 2^31 positions.
TEST_CASE("a session refuses a context beyond the limit and clamps max_tokens to the context", "[session][sizes]") {
  auto model = aidreams();
  CpuQ4Executor ex(model, CpuExecutorOptions{1});
  SessionOptions huge;
  huge.n_ctx = INT32_MAX;
  CHECK(code_of([&] { Session s(model, ex, huge); }) == ErrorCode::kInvalidArgument);
  huge.n_ctx = kMaxContextSize + 1;
  CHECK(code_of([&] { Session s(model, ex, huge); }) == ErrorCode::kInvalidArgument);

  SessionOptions so;
  so.n_ctx = 64;
  Session s(model, ex, so);
  GenerateOptions go;
  go.sampling = SamplingParams::greedy();
  go.ignore_eos = true;
  go.max_tokens = INT32_MAX;
  const auto r = s.generate(std::span<const int32_t>(some_ids(20)), go);
  CHECK(r.finish == FinishReason::kLength);
  CHECK(r.tokens.size() == 64 - 20 + 1);  // the last sampled token is not in the KV yet
  CHECK(s.tokens().size() == 64);
}

namespace {

int thread_count() {
  int n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/task")) ++n;
  return n;
}

}  // namespace

// Fails on the main before this change: every CpuQ4Executor built its own pool of all
// physical cores, so two default executors ran twice as many compute threads as cores.
TEST_CASE("default CPU executors share one node pool; steps from several threads take turns on it",
          "[executor][threads]") {
  auto model = aidreams();
  const int before = thread_count();
  CpuQ4Executor a(model), b(model);
  CHECK(a.pool() == b.pool());
  CHECK(a.pool() == CpuQ4Executor::node_pool());
  CHECK(a.n_threads() == physical_core_count());
  CHECK(thread_count() - before <= physical_core_count() - 1);  // the node pool's workers, once
  CpuQ4Executor own(model, CpuExecutorOptions{1});
  CHECK(own.pool() != a.pool());
  CHECK(own.n_threads() == 1);
  auto shared = CpuQ4Executor::make_pool(2);
  CpuQ4Executor c(model, shared);
  CHECK(c.pool() == shared);

  // Two sessions on the two executors, stepped at once from two threads, give their solo
  // results (the pool runs one parallel_for at a time; each executor has its own scratch).
  auto run = [&](Executor& ex, int salt) {
    SessionOptions so;
    so.n_ctx = 128;
    Session s(model, ex, so);
    GenerateOptions go;
    go.sampling = SamplingParams::greedy();
    go.ignore_eos = true;
    go.max_tokens = 40;
    auto ids = some_ids(20 + salt);
    return s.generate(std::span<const int32_t>(ids), go).tokens;
  };
  const auto solo_a = run(own, 0), solo_b = run(own, 5);
  std::vector<int32_t> got_a, got_b;
  std::thread ta([&] { got_a = run(a, 0); });
  std::thread tb([&] { got_b = run(b, 5); });
  ta.join();
  tb.join();
  CHECK(got_a == solo_a);
  CHECK(got_b == solo_b);
}

// The repack of the Q4_0 weights is made once per Model: executors of one model alive
// together share it and another model gets its own; CpuExecutorOptions::repack = false
// opts one executor out. Skipped under TANDEM_CPU_REPACK=0.
TEST_CASE("executors of one model share one repacked copy of the Q4_0 weights", "[executor][repack]") {
  auto model = aidreams();
  auto a = std::make_unique<CpuQ4Executor>(model);
  if (!a->repacked_weights()) {
    WARN("SKIPPED: TANDEM_CPU_REPACK=0 turns the repack off: nothing to share");
    CHECK(a->repacked_weights_id() == nullptr);
    return;
  }
  CpuQ4Executor b(model, CpuExecutorOptions{1});
  REQUIRE(a->repacked_weights_id() != nullptr);
  CHECK(b.repacked_weights_id() == a->repacked_weights_id());
  auto other = Model::load(test::model_path("stories260K-q4_0"));
  CpuQ4Executor c(other);
  CHECK(c.repacked_weights_id() != nullptr);
  CHECK(c.repacked_weights_id() != a->repacked_weights_id());
  // b alone keeps the shared copy alive; it computes what a fresh executor computes.
  a.reset();
  auto run = [&](Executor& ex) {
    SessionOptions so;
    so.n_ctx = 64;
    Session s(model, ex, so);
    GenerateOptions go;
    go.sampling = SamplingParams::greedy();
    go.ignore_eos = true;
    go.max_tokens = 16;
    auto ids = some_ids(12);
    return s.generate(std::span<const int32_t>(ids), go).tokens;
  };
  CpuQ4Executor d(model);
  CHECK(d.repacked_weights_id() == b.repacked_weights_id());
  CHECK(run(b) == run(d));
  // repack = false: this executor multiplies the GGUF layout; the others keep theirs.
  CpuExecutorOptions plain;
  plain.repack = false;
  CpuQ4Executor e(model, plain);
  CHECK_FALSE(e.repacked_weights());
  CHECK(e.repacked_weights_id() == nullptr);
  CHECK(d.repacked_weights_id() == b.repacked_weights_id());
}

// Issue 15 item 8 (prompt cache): truncate() returns exactly the pages past the cut, and a
// session reusing a prefix generates what a fresh session given the whole prompt does.
// Fails on main before this change: Session had no truncate() / reuse_prefix().
TEST_CASE("truncate frees the pages past the cut; a reused prefix generates as a fresh prompt", "[session][cache]") {
  const auto exec_name = GENERATE(from_range(test::executor_names()));
  auto model = aidreams();
  auto exec = test::make_executor(exec_name, model);
  GenerateOptions go;
  go.sampling = SamplingParams::greedy();
  go.max_tokens = 12;
  go.ignore_eos = true;
  SessionOptions so;
  so.n_ctx = 256;
  so.page_size = 16;
  Session s(model, *exec, so);
  const auto a = some_ids(40);
  const auto first = s.generate(std::span<const int32_t>(a), go);
  REQUIRE(first.tokens.size() == 12);
  const auto& store = *s.kv_store();
  CHECK(s.tokens().size() == 51);  // the 12th token waits, not evaluated
  CHECK(store.used_pages() == 4);  // ceil(51 / 16)
  s.truncate(60);                  // beyond the conversation: nothing changes
  CHECK(s.tokens().size() == 51);
  s.truncate(33);
  CHECK(s.tokens().size() == 33);
  CHECK(s.kv().n_tokens() == 33);
  CHECK(store.used_pages() == 3);
  CHECK(s.logits().empty());
  s.truncate(32);
  CHECK(store.used_pages() == 2);

  // A prompt diverging from the conversation at position 20: 20 positions reused.
  std::vector<int32_t> b(a.begin(), a.begin() + 20);
  for (int i = 0; i < 15; ++i) b.push_back(300 + i);
  CHECK(s.reuse_prefix(b) == 20);
  CHECK(store.used_pages() == 2);
  const auto reused = s.generate(std::span<const int32_t>(b).subspan(20), go);
  Session fresh(model, *exec, so);
  const auto want = fresh.generate(std::span<const int32_t>(b), go);
  CHECK(reused.tokens == want.tokens);
  CHECK(s.tokens() == fresh.tokens());
  CHECK(store.used_pages() == fresh.kv_store()->used_pages());

  // The whole prompt cached (and more): all but its last token are reused.
  CHECK(s.reuse_prefix(b) == b.size() - 1);
  const auto again = s.generate(std::span<const int32_t>(b).subspan(b.size() - 1), go);
  CHECK(again.tokens == want.tokens);
  // A prompt continuing the conversation, the waiting token included: all but its last reused.
  std::vector<int32_t> cont = s.tokens();
  cont.push_back(again.tokens.back());
  cont.push_back(301);
  CHECK(s.reuse_prefix(cont) == cont.size() - 1);
  // Nothing in common: everything goes.
  CHECK(s.reuse_prefix(std::vector<int32_t>{2, 5, 7}) == 0);
  CHECK(s.tokens().empty());
  CHECK(store.used_pages() == 0);
}

// Issue 15 item 3: should_stop is polled between prompt chunks, so an interrupt stops a
// long prefill at the next chunk with the chunks done kept (and their logits). Fails on
// main before this change: GenerateOptions had no should_stop.
TEST_CASE("should_stop stops a prefill at a chunk boundary and keeps what was evaluated", "[session][cancel]") {
  auto model = aidreams();
  auto exec = test::make_executor(test::executor_names().front(), model);
  SessionOptions so;
  so.n_ctx = 128;
  so.n_batch = 4;
  Session s(model, *exec, so);
  GenerateOptions go;
  go.sampling = SamplingParams::greedy();
  go.max_tokens = 5;
  int polls = 0;
  go.should_stop = [&] { return ++polls > 3; };  // three chunks, then stop
  const auto prompt = some_ids(30);
  const auto r = s.generate(std::span<const int32_t>(prompt), go);
  CHECK(r.finish == FinishReason::kCancelled);
  CHECK(r.tokens.empty());
  CHECK(r.n_prompt == 12);
  CHECK(s.tokens() == std::vector<int32_t>(prompt.begin(), prompt.begin() + 12));
  REQUIRE(s.logits().size() == size_t(model->hparams().n_vocab));
  // The logits kept are those after token 12: as a session that evaluated 12 tokens.
  Session twelve(model, *exec, so);
  twelve.eval(std::span<const int32_t>(prompt).first(12));
  CHECK(std::equal(s.logits().begin(), s.logits().end(), twelve.logits().begin()));
  // Saved and restored, the rest of the prompt continues it like one run.
  const auto path = test::scratch_dir("session-cancel") / "part.session";
  s.save(path);
  Session back(model, *exec, so);
  back.restore(path);
  go.should_stop = nullptr;
  const auto rest = back.generate(std::span<const int32_t>(prompt).subspan(12), go);
  Session once(model, *exec, so);
  CHECK(rest.tokens == once.generate(std::span<const int32_t>(prompt), go).tokens);
  // Polled between sampled tokens too.
  polls = 0;
  go.should_stop = [&] { return ++polls > 2; };
  Session dec(model, *exec, so);
  go.max_tokens = 50;
  go.ignore_eos = true;
  const auto d = dec.generate(std::span<const int32_t>(prompt).first(4), go);  // 1 chunk poll + 1 token
  CHECK(d.finish == FinishReason::kCancelled);
  CHECK(d.tokens.size() == 1);
}
