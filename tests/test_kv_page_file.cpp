// The File KV tier's backing file: a full disk is a kIo error (never SIGBUS) that refuses
// only the sequence that needed the space; the file never outlives its store, whatever the
// exit path; stale files of dead processes are removed; a bad TMPDIR is named.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>

#include <cstdlib>

#include "file_size_limit.hpp"
#include "kv/kv_page_file.hpp"
#include "kv_test_support.hpp"

using namespace tandem;

namespace {

std::shared_ptr<const Model> aidreams() {
  static auto m = Model::load(test::model_path("aidreams260K-q4_0"));
  return m;
}

std::shared_ptr<KvStore> store_in(const std::filesystem::path& dir, int32_t host_pages, int32_t file_pages) {
  KvStoreOptions o;
  o.layout = KvLayout::for_model(aidreams()->hparams(), 16);
  o.host_pages = host_pages;
  o.file_pages = file_pages;
  o.file_chunk_pages = 8;
  o.file_dir = dir;
  return std::make_shared<KvStore>(std::move(o));
}

std::vector<float> last_logits(Executor& ex, KvSequence& kv, const std::vector<int32_t>& ids) {
  std::vector<float> l(size_t(ex.model().hparams().n_vocab));
  SequenceStep st{&kv, ids, kv.n_tokens(), LogitsRows::kLast};
  ex.step(std::span<const SequenceStep>(&st, 1), l);
  return l;
}

size_t entries_in(const std::filesystem::path& dir) {
  return size_t(std::distance(std::filesystem::directory_iterator(dir), std::filesystem::directory_iterator()));
}

// A PID that was just used and is no longer alive (a reaped child).
pid_t dead_pid() {
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(0);
  ::waitpid(pid, nullptr, 0);
  return pid;
}

void touch(const std::filesystem::path& p) {
  const int fd = ::open(p.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
  REQUIRE(fd >= 0);
  ::close(fd);
}

}  // namespace

TEST_CASE("a full disk while the File tier grows refuses that sequence with kIo; others are unaffected",
          "[kv][faults]") {
  auto model = aidreams();
  CpuQ4Executor ex(model, CpuExecutorOptions{1});
  const auto dir = test::scratch_dir("kv-full");
  const auto ids = test::prompt_ids(20, model->hparams().n_vocab);
  const std::vector<int32_t> more(8 * 16 + 1, 7);  // 9 pages: a second chunk of the file
  const std::vector<int32_t> next{5};
  auto ref_store = store_in(dir, 8, 0);
  KvSequence ref(*ref_store, 256);
  last_logits(ex, ref, ids);
  const auto want = last_logits(ex, ref, next);

  SECTION("a File-only store (tandem-cli --kv-tier file)") {
    auto store = store_in(dir, 0, 64);
    const uint64_t chunk_bytes = 8 * store->layout().page_bytes();
    KvSequence other(*store, 256, KvTier::kFile);
    last_logits(ex, other, ids);  // 2 pages in the first chunk
    {
      KvSequence grows(*store, 256, KvTier::kFile);
      test::FileSizeLimit full(chunk_bytes);  // room for the first chunk only
      std::string what;
      try {
        last_logits(ex, grows, more);
        FAIL("grew past a full disk");
      } catch (const Error& e) {
        CHECK(e.code() == ErrorCode::kIo);
        what = e.what();
      }
      CHECK(what.find("File too large") != std::string::npos);
      CHECK(grows.n_tokens() == 0);
      CHECK(store->usage(KvTier::kFile).used == 2);  // refused whole: no page taken
      last_logits(ex, grows, ids);                   // what fits the first chunk still works
      CHECK(store->usage(KvTier::kFile).used == 4);
    }
    CHECK(last_logits(ex, other, next) == want);
  }
  SECTION("eviction to File on a full disk (Host + File store)") {
    auto store = store_in(dir, 2, 16);
    KvSequence victim(*store, 256);
    last_logits(ex, victim, ids);  // fills the Host tier
    {
      KvSequence newcomer(*store, 256);
      test::FileSizeLimit full(0);
      // The placement policy (as a Session runs it) swaps the victim out to make room.
      auto placed = [&] {
        KvPlacement(*store).prepare_step(newcomer, ex.kv_tier(), int32_t(ids.size()));
        return last_logits(ex, newcomer, ids);
      };
      CHECK_THROWS_MATCHES(placed(), Error,
                           Catch::Predicate<Error>([](const Error& e) { return e.code() == ErrorCode::kIo; }));
      CHECK(newcomer.n_tokens() == 0);
      CHECK(victim.pages_outside(KvTier::kHost) == 0);  // not half-moved
      CHECK(store->usage(KvTier::kFile).used == 0);
      CHECK_THROWS_AS(victim.move_to(KvTier::kFile), Error);  // an explicit move: refused before any page moves
      CHECK(victim.pages_outside(KvTier::kHost) == 0);
    }
    CHECK(last_logits(ex, victim, next) == want);
  }
}

TEST_CASE("the File tier's file has no name while in use and stale ones are removed at start", "[kv][faults]") {
  const auto dir = test::scratch_dir("kv-stale");
  const pid_t dead = dead_pid();
  const auto stale = dir / fmt::format("tandem-kv-{}-0.pages", dead);
  const auto alive = dir / fmt::format("tandem-kv-{}-0.pages", ::getppid());  // our parent: alive
  touch(stale);
  touch(alive);
  touch(dir / "tandem-kv-notes.txt");  // not a page file's name
  {
    auto store = store_in(dir, 2, 16);
    CHECK(store->file_path().parent_path() == dir);
    CHECK_FALSE(std::filesystem::exists(store->file_path()));  // unlinked at creation
    KvSequence s(*store, 64, KvTier::kFile);
    s.reserve(40);  // the file grows and is used without a name
    CHECK_FALSE(std::filesystem::exists(stale));
    CHECK(std::filesystem::exists(alive));
    CHECK(entries_in(dir) == 2);
  }
  // A process killed outright (no destructor, no handler) leaves nothing either.
  const pid_t child = ::fork();
  if (child == 0) {
    auto store = store_in(dir, 2, 16);
    KvSequence s(*store, 64, KvTier::kFile);
    s.reserve(40);
    ::kill(::getpid(), SIGKILL);
    ::_exit(1);
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  CHECK(WIFSIGNALED(status));
  CHECK(entries_in(dir) == 2);  // the live process's name and the notes
}

TEST_CASE("a File tier in a bad TMPDIR is refused with the directory named", "[kv][faults]") {
  const char* old = std::getenv("TMPDIR");
  const std::string saved = old ? old : "";
  ::setenv("TMPDIR", "/nonexistent/tandem-tmp", 1);
  std::string what;
  try {
    store_in("", 2, 4);
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kIo);
    what = e.what();
  }
  // A store without a File tier never looks at TMPDIR.
  CHECK_NOTHROW(store_in("", 2, 0));
  if (old) {
    ::setenv("TMPDIR", saved.c_str(), 1);
  } else {
    ::unsetenv("TMPDIR");
  }
  CHECK(what.find("/nonexistent/tandem-tmp") != std::string::npos);
  CHECK(what.find("TMPDIR") != std::string::npos);
}
