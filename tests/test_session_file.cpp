// Session save/restore and field case B20: truncated, corrupt and foreign session files
// are refused with their own errors and leave the target session exactly as it was.
#include <catch2/catch.hpp>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <atomic>
#include <cstring>
#include <fstream>
#include <thread>

#include "kv_test_support.hpp"

using namespace tandem;

namespace {

std::vector<char> read_all(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

void write_all(const std::filesystem::path& p, const std::vector<char>& d) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(d.data(), static_cast<std::streamsize>(d.size()));
}

// Rewrite the trailing checksum so the parser (not the checksum) meets a bad field.
void reseal(std::vector<char>& d) {
  const uint64_t h = XXH3_64bits(d.data(), d.size() - 8);
  std::memcpy(d.data() + d.size() - 8, &h, 8);
}

// Body offsets of fields (see lib/session/session_file.cpp): header is 24 bytes.
constexpr size_t kHeader = 24;
constexpr size_t kTokenCountAt = kHeader + 4 + 8 + 8 + 4 * 3 + 8 + 4 + 4 + 4 + 4 * 2 + 4 + 4 * 8 + 8;

std::pair<ErrorCode, std::string> restore_error(Session& s, const std::filesystem::path& p) {
  try {
    s.restore(p);
  } catch (const Error& e) {
    return {e.code(), e.what()};
  }
  return {ErrorCode::kOk, ""};
}

}  // namespace

TEST_CASE("save then restore continues exactly, in another session and executor", "[session][kv]") {
  auto model = Model::load(test::model_path("aidreams260K-q4_0"));
  CpuQ4Executor a(model, CpuExecutorOptions{2}), b(model, CpuExecutorOptions{1});
  const auto dir = test::scratch_dir("save");
  Session s(model, a);
  GenerateOptions go;
  go.max_tokens = 9;
  go.sampling.temperature = 0.9f;  // sampled: the random state must travel too
  go.sampling.seed = 77;
  s.generate("Once upon a time", go);
  s.save(dir / "s.session");
  const auto saved_tokens = s.tokens();
  CHECK(std::distance(std::filesystem::directory_iterator(dir), std::filesystem::directory_iterator()) == 1);
  go.sampling.seed = SamplingParams::kSessionSeed;  // continue the session's random stream
  const auto expect = s.generate(" The end", go);

  Session r(model, b);
  r.restore(dir / "s.session");
  CHECK(r.tokens() == saved_tokens);
  const auto got = r.generate(" The end", go);
  CHECK(got.tokens == expect.tokens);
  CHECK(got.text == expect.text);
}

TEST_CASE("B20: damaged, truncated, future and foreign session files are refused", "[session][field-case]") {
  auto model = Model::load(test::model_path("aidreams260K-q4_0"));
  CpuQ4Executor ex(model, CpuExecutorOptions{2});
  const auto dir = test::scratch_dir("b20");
  const auto good = dir / "good.session";
  {
    Session src(model, ex);
    src.eval(test::prompt_ids(20, model->hparams().n_vocab));
    src.save(good);
  }
  const auto bytes = read_all(good);
  REQUIRE(bytes.size() > 200);

  // The target holds its own conversation; every refusal must leave it as it was.
  Session target(model, ex);
  const auto own = test::prompt_ids(7, model->hparams().n_vocab);
  target.eval(own);
  const auto own_sums = test::page_checksums(target.kv(), *model, target.tokens());
  auto unchanged = [&] {
    CHECK(target.tokens() == own);
    CHECK(test::page_checksums(target.kv(), *model, target.tokens()) == own_sums);
    CHECK(target.kv_store()->used_pages() == 1);
  };
  auto refused = [&](const std::vector<char>& data, ErrorCode want, const char* name) {
    const auto p = dir / (std::string(name) + ".session");
    write_all(p, data);
    const auto [code, msg] = restore_error(target, p);
    INFO(name << ": " << msg);
    CHECK(code == want);
    unchanged();
  };

  refused(std::vector<char>(bytes.begin(), bytes.begin() + std::ptrdiff_t(bytes.size() / 2)),
          ErrorCode::kSessionCorrupt, "half");
  refused(std::vector<char>(bytes.begin(), bytes.begin() + 8), ErrorCode::kSessionCorrupt, "eight");
  refused({}, ErrorCode::kSessionCorrupt, "empty");
  auto magic = bytes;
  magic[0] ^= 0x20;
  refused(magic, ErrorCode::kSessionCorrupt, "magic");
  auto future = bytes;
  const uint32_t v9999 = 9999;
  std::memcpy(future.data() + 8, &v9999, 4);
  refused(future, ErrorCode::kSessionVersion, "version9999");
  auto count = bytes;
  const uint64_t huge = uint64_t{1} << 31;
  std::memcpy(count.data() + kTokenCountAt, &huge, 8);
  refused(count, ErrorCode::kSessionCorrupt, "token-count-unsealed");
  reseal(count);
  refused(count, ErrorCode::kSessionCorrupt, "token-count-sealed");  // caught by the bounds check
  auto body = bytes;
  const uint64_t big = bytes.size() * 4;
  std::memcpy(body.data() + 16, &big, 8);
  reseal(body);
  refused(body, ErrorCode::kSessionCorrupt, "body-length");
  // A flipped byte anywhere (header, tokens, logits, pages) is caught.
  for (size_t at = 0; at < bytes.size(); at += 61) {
    auto flipped = bytes;
    flipped[at] ^= 0x01;
    const auto p = dir / "flipped.session";
    write_all(p, flipped);
    const auto [code, msg] = restore_error(target, p);
    INFO("flipped byte " << at << ": " << msg);
    CHECK((code == ErrorCode::kSessionCorrupt || code == ErrorCode::kSessionVersion));
  }
  unchanged();
  CHECK(restore_error(target, dir / "missing.session").first == ErrorCode::kIo);
  CHECK(restore_error(target, dir).first == ErrorCode::kIo);

  // Foreign: same shapes, other weights; and another shape altogether.
  auto f32 = Model::load(test::model_path("aidreams260K-f32"));
  CpuQ4Executor ex32(f32, CpuExecutorOptions{1});
  Session other(f32, ex32);
  CHECK(restore_error(other, good).first == ErrorCode::kSessionModelMismatch);
  auto wide = Model::load(test::model_path("synth-llama-small-q4_0"));
  CpuQ4Executor exw(wide, CpuExecutorOptions{1});
  Session third(wide, exw);
  CHECK(restore_error(third, good).first == ErrorCode::kSessionModelMismatch);
  // A context too small for the saved positions.
  SessionOptions small;
  small.n_ctx = 16;
  Session tight(model, ex, small);
  CHECK(restore_error(tight, good).first == ErrorCode::kContextOverflow);

  // After all that, the target still generates exactly as an untouched twin does.
  Session twin(model, ex);
  twin.eval(own);
  CHECK(test::greedy(target, 10) == test::greedy(twin, 10));
}

TEST_CASE("concurrent saves of one path leave one complete, loadable file", "[session]") {
  auto model = Model::load(test::model_path("aidreams260K-q4_0"));
  CpuQ4Executor ex(model, CpuExecutorOptions{1});
  const auto dir = test::scratch_dir("concurrent-save");
  const auto path = dir / "shared.session";
  std::vector<std::unique_ptr<Session>> sessions;
  for (int i = 0; i < 4; ++i) {
    sessions.push_back(std::make_unique<Session>(model, ex));
    sessions.back()->eval(test::prompt_ids(5 + i, model->hparams().n_vocab));
  }
  std::vector<std::thread> savers;
  std::atomic<int> failures{0};
  for (int i = 0; i < 4; ++i) {
    savers.emplace_back([&, i] {
      for (int k = 0; k < 10; ++k) {
        try {
          sessions[size_t(i)]->save(path);
        } catch (const Error&) {
          ++failures;
        }
      }
    });
  }
  for (auto& t : savers) t.join();
  CHECK(failures == 0);
  CHECK(std::distance(std::filesystem::directory_iterator(dir), std::filesystem::directory_iterator()) == 1);
  Session r(model, ex);
  r.restore(path);
  CHECK(r.tokens().size() >= 5);
}

// Issue 12 item 6: one serialisation of KvDescriptor. The session file's body starts with
// the descriptor's byte form from kv_contract (format version 1 unchanged: files saved
// before this change stay readable), and that form round-trips every field.
TEST_CASE("a session file stores the KV descriptor in the contract's one byte form", "[session][kv]") {
  auto model = Model::load(test::model_path("aidreams260K-q4_0"));
  CpuQ4Executor ex(model, CpuExecutorOptions{1});
  const auto dir = test::scratch_dir("descriptor");
  Session s(model, ex);
  GenerateOptions go;
  go.max_tokens = 5;
  go.sampling = SamplingParams::greedy();
  s.generate("Once upon a time", go);
  s.save(dir / "s.session");

  KvHandoff h = kv_export(s.kv(), *model, s.tokens());
  h.lease->begin_read();
  h.lease->confirm();
  std::vector<std::byte> bytes;
  kv_descriptor_append(h.descriptor, bytes);
  CHECK(bytes.size() == kTokenCountAt - kHeader + 8 + 4 * s.tokens().size() + 8 + 8 * size_t(h.descriptor.n_pages()));

  const auto file = read_all(dir / "s.session");
  REQUIRE(file.size() > kHeader + bytes.size());
  CHECK(std::memcmp(file.data() + kHeader, bytes.data(), bytes.size()) == 0);

  KvDescriptor back;
  CHECK(kv_descriptor_parse(bytes, back) == bytes.size());
  const KvDescriptor& d = h.descriptor;
  CHECK(back.model_identity == d.model_identity);
  CHECK(back.tokenizer_identity == d.tokenizer_identity);
  CHECK((back.n_layer == d.n_layer && back.n_head_kv == d.n_head_kv && back.head_dim == d.head_dim));
  CHECK((back.row_bytes == d.row_bytes && back.rope_type == d.rope_type && back.n_rot == d.n_rot));
  CHECK((back.rope_freq_base == d.rope_freq_base && back.rope_freq_scale == d.rope_freq_scale));
  CHECK((back.n_ctx == d.n_ctx && back.dtype == d.dtype && back.page_size == d.page_size));
  CHECK((back.layer_begin == d.layer_begin && back.layer_end == d.layer_end));
  CHECK((back.token_begin == d.token_begin && back.token_end == d.token_end && back.sequence_id == d.sequence_id));
  CHECK(back.tokens == d.tokens);
  CHECK(back.page_checksums == d.page_checksums);
  CHECK_NOTHROW(kv_check_invariants(back, *model));

  // A cut anywhere is refused with the field named, never read past the end.
  for (size_t n : {size_t(0), size_t(3), size_t(30), bytes.size() - 1}) {
    KvDescriptor cut;
    try {
      kv_descriptor_parse(std::span<const std::byte>(bytes.data(), n), cut);
      FAIL("a descriptor cut to " << n << " bytes was accepted");
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::kInvalidArgument);
      CHECK(std::string(e.what()).find("KV descriptor") != std::string::npos);
    }
  }
}

TEST_CASE("a session saved at a full context restores and continues as the live one", "[session][kv]") {
  auto model = Model::load(test::model_path("aidreams260K-q4_0"));
  CpuQ4Executor ex(model, CpuExecutorOptions{1});
  const auto dir = test::scratch_dir("full-ctx");
  SessionOptions so;
  so.n_ctx = 40;
  Session s(model, ex, so);
  GenerateOptions go;
  go.max_tokens = 500;
  go.ignore_eos = true;
  go.sampling.temperature = 0.0f;
  const auto first = s.generate("Once upon a time", go);
  REQUIRE(first.finish == FinishReason::kLength);
  REQUIRE(s.tokens().size() == size_t(so.n_ctx));  // full, the last sampled token pending
  s.save(dir / "full.session");

  Session r(model, ex, so);
  r.restore(dir / "full.session");  // was kContextOverflow: 41 positions for n_ctx 40
  CHECK(r.tokens() == s.tokens());
  CHECK(std::equal(r.logits().begin(), r.logits().end(), s.logits().begin(), s.logits().end()));
  CHECK(r.kv_store()->used_pages() == s.kv_store()->used_pages());
  // The whole state (pending token, logits, random engine, pages) saves to the same bytes,
  // but for the KV sequence's id (the u64 before the token count) and so the checksum.
  auto state = [](std::vector<char> d) {
    std::fill_n(d.begin() + std::ptrdiff_t(kTokenCountAt - 8), 8, char{0});
    d.erase(d.end() - 8, d.end());  // the checksum (resize(size - 8) trips GCC 12's -Wstringop-overflow under ASan)
    return d;
  };
  r.save(dir / "again.session");
  CHECK(state(read_all(dir / "again.session")) == state(read_all(dir / "full.session")));
  // Continuing needs a position for the pending token: refused as in the live session,
  // both left as they were.
  CHECK(test::code_of([&] { s.generate(std::span<const int32_t>(), go); }) == ErrorCode::kContextOverflow);
  CHECK(test::code_of([&] { r.generate(std::span<const int32_t>(), go); }) == ErrorCode::kContextOverflow);
  CHECK(r.tokens() == s.tokens());
  CHECK(r.kv_store()->used_pages() == s.kv_store()->used_pages());
  // A prompt needs positions: refused, nothing changed.
  const std::vector<int32_t> extra = {r.tokens()[1]};
  CHECK(test::code_of([&] { r.generate(std::span<const int32_t>(extra), go); }) == ErrorCode::kContextOverflow);
  CHECK(r.tokens() == s.tokens());
  // The prompt cache makes room: same tokens as a fresh session given the whole prompt.
  const std::vector<int32_t> prompt(s.tokens().begin(), s.tokens().begin() + 12);
  const size_t kept = r.reuse_prefix(prompt);
  CHECK(kept == prompt.size() - 1);
  go.max_tokens = 10;
  const auto cached = r.generate(std::span<const int32_t>(prompt).subspan(kept), go);
  Session fresh(model, ex, so);
  const auto expect = fresh.generate(std::span<const int32_t>(prompt), go);
  CHECK(cached.tokens == expect.tokens);
  CHECK(r.tokens() == fresh.tokens());
  CHECK(r.kv_store()->used_pages() == fresh.kv_store()->used_pages());

  // The evaluated tokens alone must fit: one position short is refused, nothing taken.
  SessionOptions tight_o = so;
  tight_o.n_ctx = so.n_ctx - 1;
  Session tight(model, ex, tight_o);
  CHECK(restore_error(tight, dir / "full.session").first == ErrorCode::kContextOverflow);
  CHECK(tight.tokens().empty());
  CHECK(tight.kv_store()->used_pages() == 0);
}
