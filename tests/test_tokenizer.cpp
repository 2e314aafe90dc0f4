// Tokenizer tests: hand-built vocabularies (SPM and byte-level BPE), field cases B10/B11,
// pre-tokenizer splits, and the llama.cpp goldens under shared/golden/tokenizer*/.
#include <pthread.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "tandem/gguf/gguf.hpp"
#include "tandem/tokenizer/tokenizer.hpp"
#include "test_support.hpp"
#include "tokenizer/tokenizer_internal.hpp"

using tandem::Error;
using tandem::ErrorCode;
using tandem::StreamingDetokenizer;
using tandem::Tokenizer;
using tandem::TokenizerVocab;

namespace {

// Run fn on a thread with a small stack (field case B10: no stack use proportional to
// the input length).
void run_with_stack(size_t stack_bytes, const std::function<void()>& fn) {
  pthread_attr_t attr;
  REQUIRE(pthread_attr_init(&attr) == 0);
  REQUIRE(pthread_attr_setstacksize(&attr, stack_bytes) == 0);
  struct Ctx {
    const std::function<void()>* fn;
    std::exception_ptr err;
  } ctx{&fn, nullptr};
  pthread_t th;
  auto body = [](void* p) -> void* {
    auto* c = static_cast<Ctx*>(p);
    try {
      (*c->fn)();
    } catch (...) {
      c->err = std::current_exception();
    }
    return nullptr;
  };
  REQUIRE(pthread_create(&th, &attr, body, &ctx) == 0);
  pthread_join(th, nullptr);
  pthread_attr_destroy(&attr);
  if (ctx.err) std::rethrow_exception(ctx.err);
}

// Python's bytes.decode('utf-8', 'backslashreplace'): how the goldens show pieces.
std::string render_piece(const std::string& bytes) {
  const std::string clean = tandem::utf8_sanitize(bytes);
  if (clean == bytes) return bytes;
  std::string out;
  size_t i = 0;
  while (i < bytes.size()) {
    // take the longest valid prefix char by char
    size_t len = 0;
    const auto c = static_cast<uint8_t>(bytes[i]);
    if (c < 0x80)
      len = 1;
    else if (c >= 0xC2 && c <= 0xDF)
      len = 2;
    else if (c >= 0xE0 && c <= 0xEF)
      len = 3;
    else if (c >= 0xF0 && c <= 0xF4)
      len = 4;
    bool ok = len > 0 && i + len <= bytes.size();
    if (ok) {
      const std::string ch = bytes.substr(i, len);
      ok = tandem::utf8_sanitize(ch) == ch;
    }
    if (ok) {
      out += bytes.substr(i, len);
      i += len;
    } else {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
      i += 1;
    }
  }
  return out;
}

std::vector<int32_t> ids_of(const nlohmann::json& j) {
  return j.get<std::vector<int32_t>>();
}

// The pre-tokens of `text` under one split kind, as strings.
std::vector<std::string> split_text(tandem::detail::SplitKind k, const std::string& text) {
  std::vector<uint32_t> cps;
  tandem::detail::utf8_decode_lax(text, cps);
  std::vector<size_t> lens;
  tandem::detail::pretokenize(k, cps, lens);
  std::vector<std::string> out;
  size_t start = 0;
  for (size_t len : lens) {
    std::string w;
    for (size_t i = start; i < start + len; ++i) tandem::detail::utf8_append(w, cps[i]);
    out.push_back(w);
    start += len;
  }
  return out;
}

std::string repeat(const std::string& s, size_t n) {
  std::string r;
  r.reserve(s.size() * n);
  for (size_t i = 0; i < n; ++i) r += s;
  return r;
}

// GPT-2 byte-level vocabulary: the 256 mapped bytes (id = byte) + extra tokens/merges.
TokenizerVocab byte_level_vocab(const std::string& pre, std::vector<std::string> extra,
                                std::vector<std::string> merges) {
  TokenizerVocab v;
  v.model = "gpt2";
  v.pre = pre;
  for (int b = 0; b < 256; ++b) v.tokens.push_back(tandem::detail::byte_to_bpe_char(static_cast<uint8_t>(b)));
  for (auto& e : extra) v.tokens.push_back(e);
  v.merges = std::move(merges);
  v.add_bos = false;
  return v;
}

// SentencePiece vocabulary of field case B11 (+ optional extra normal tokens with scores).
TokenizerVocab spm_byte_vocab(std::vector<std::pair<std::string, float>> extra) {
  TokenizerVocab v;
  v.model = "llama";
  v.tokens = {"<unk>", "<s>", "</s>"};
  v.token_types = {2, 3, 3};
  for (int b = 0; b < 256; ++b) {
    char buf[8];
    std::snprintf(buf, sizeof buf, "<0x%02X>", b);
    v.tokens.push_back(buf);
    v.token_types.push_back(6);
  }
  for (auto& [t, s] : extra) {
    v.tokens.push_back(t);
    v.token_types.push_back(1);
  }
  v.scores.assign(v.tokens.size(), 0.0f);
  for (size_t i = 0; i < extra.size(); ++i) v.scores[259 + i] = extra[i].second;
  v.bos_id = 1;
  v.eos_id = 2;
  v.unk_id = 0;
  return v;
}

const Tokenizer& llama3_tokenizer() {
  static const Tokenizer tok = [] {
    auto f = tandem::GgufFile::open(tandem::test::model_path("llama3-bpe-vocab"));
    return Tokenizer::from_gguf(*f);
  }();
  return tok;
}

}  // namespace

// ---------------------------------------------------------------------------------------

TEST_CASE("tokenizer: B11 SentencePiece byte fallback encode/decode/stream", "[tokenizer]") {
  const Tokenizer tok(spm_byte_vocab({{"\xe2\x96\x81", -1.0f},
                                      {"\xe2\x96\x81"
                                       "a",
                                       -0.5f},
                                      {"a", -2.0f}}));
  const int32_t id_sa = tok.find_token(
      "\xe2\x96\x81"
      "a");
  REQUIRE(id_sa == 260);
  const int32_t bEA = 3 + 0xEA, bB9 = 3 + 0xB9, bB0 = 3 + 0xB0, bFF = 3 + 0xFF;

  const auto ids = tok.tokenize("a\xea\xb9\xb0", false, false);
  CHECK(ids == std::vector<int32_t>{id_sa, bEA, bB9, bB0});
  CHECK(tok.tokenize("a\xea\xb9\xb0", true, false) == std::vector<int32_t>{1, id_sa, bEA, bB9, bB0});

  CHECK(tok.detokenize(ids, false, false) == "a\xea\xb9\xb0");
  CHECK(tok.detokenize_raw(ids, false) == " a\xea\xb9\xb0");
  CHECK(tok.token_to_piece(bEA, false) == "\xea");
  CHECK(tok.token_to_piece(1, false).empty());
  CHECK(tok.token_to_piece(1, true) == "<s>");

  // streaming: no chunk carries an incomplete sequence
  StreamingDetokenizer sd(tok);
  std::vector<std::string> chunks;
  for (int32_t id : ids) chunks.push_back(sd.push(id));
  chunks.push_back(sd.finish());
  CHECK(chunks == std::vector<std::string>{"a", "", "", "\xea\xb9\xb0", ""});

  // incomplete sequence at end of stream -> one U+FFFD per byte, never "<0xEA>"
  StreamingDetokenizer sd2(tok);
  CHECK(sd2.push(bEA).empty());
  CHECK(sd2.push(bB9).empty());
  CHECK(sd2.pending_bytes() == 2);
  CHECK(sd2.finish() == "\xEF\xBF\xBD\xEF\xBF\xBD");
  StreamingDetokenizer sd3(tok);
  CHECK(sd3.push(bFF) == "\xEF\xBF\xBD");
  CHECK(sd3.finish().empty());
  // invalid in the middle: replaced as soon as it can no longer complete
  StreamingDetokenizer sd4(tok, false, false);
  CHECK(sd4.push(bEA).empty());
  CHECK(sd4.push(id_sa) == "\xEF\xBF\xBD a");
  CHECK(tandem::utf8_sanitize("\xea\xb9") == "\xEF\xBF\xBD\xEF\xBF\xBD");
  CHECK(tandem::utf8_sanitize("\xed\xa0\x80") == "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
  CHECK(tandem::utf8_sanitize("\xc0\xaf") == "\xEF\xBF\xBD\xEF\xBF\xBD");

  // same text through a byte-level vocabulary
  const Tokenizer bpe(byte_level_vocab("qwen2", {}, {}));
  const auto bids = bpe.tokenize("a\xea\xb9\xb0", false, false);
  CHECK(bids == std::vector<int32_t>{'a', 0xEA, 0xB9, 0xB0});
  CHECK(bpe.detokenize(bids, false, false) == "a\xea\xb9\xb0");
  StreamingDetokenizer bsd(bpe);
  std::string streamed;
  for (int32_t id : bids) streamed += bsd.push(id);
  streamed += bsd.finish();
  CHECK(streamed == "a\xea\xb9\xb0");
}

TEST_CASE("tokenizer: B10 long runs on a small stack", "[tokenizer]") {
  const Tokenizer bpe(byte_level_vocab("qwen2", {"AA", "AAAA"}, {"A A", "AA AA"}));
  const Tokenizer spm(spm_byte_vocab({{"\xe2\x96\x81", -3.0f}, {"A", -3.0f}, {"AA", -2.0f}, {"AAAA", -1.0f}}));
  const std::vector<std::string> inputs = {repeat("A", 43000), repeat("Z", 131072), repeat(" ", 50000),
                                           repeat(".", 50000), repeat("\n", 50000), repeat("\xe4\xb8\xad", 30000)};
  struct Result {
    std::vector<int32_t> ids;
    std::string back;
  };
  std::vector<Result> rb(inputs.size()), rs(inputs.size());
  run_with_stack(256 * 1024, [&] {
    for (size_t i = 0; i < inputs.size(); ++i) {
      rb[i].ids = bpe.tokenize(inputs[i], false, true);
      rb[i].back = bpe.detokenize(rb[i].ids, false, false);
      rs[i].ids = spm.tokenize(inputs[i], false, true);
      rs[i].back = spm.detokenize(rs[i].ids, false, false);
    }
  });
  const int32_t aaaa = bpe.find_token("AAAA");
  REQUIRE(aaaa == 257);
  CHECK(rb[0].ids.size() == 10750);
  CHECK(std::all_of(rb[0].ids.begin(), rb[0].ids.end(), [&](int32_t id) { return id == aaaa; }));
  const int32_t spm_aaaa = spm.find_token("AAAA");
  // SPM: "▁" prefix, then 10,750 x "AAAA"
  REQUIRE(rs[0].ids.size() == 10751);
  CHECK(rs[0].ids[0] == spm.find_token("\xe2\x96\x81"));
  CHECK(std::all_of(rs[0].ids.begin() + 1, rs[0].ids.end(), [&](int32_t id) { return id == spm_aaaa; }));
  for (size_t i = 0; i < inputs.size(); ++i) {
    INFO("input " << i);
    CHECK(rb[i].back == inputs[i]);
    CHECK(rs[i].back == inputs[i]);
  }
}

TEST_CASE("tokenizer: pre-tokenizer splits match the reference regexes", "[tokenizer]") {
  using tandem::detail::SplitKind;
  struct Case {
    std::string text;
    std::vector<std::string> llama3, qwen2, gpt2;
  };
  // expected values computed with Python's `regex` module on the original patterns
  const std::vector<Case> cases = {
      {"Hello world!! It's 12345 ok",
       {"Hello", " world", "!!", " It", "'s", " ", "123", "45", " ok"},
       {"Hello", " world", "!!", " It", "'s", " ", "1", "2", "3", "4", "5", " ok"},
       {"Hello", " world", "!!", " It", "'s", " 12345", " ok"}},
      {"  leading\n\n  \tx",
       {" ", " leading", "\n\n", "  ", "\tx"},
       {" ", " leading", "\n\n", "  ", "\tx"},
       {" ", " leading", "\n\n  ", "\t", "x"}},
      {"a  b   \n", {"a", " ", " b", "   \n"}, {"a", " ", " b", "   \n"}, {"a", " ", " b", "   \n"}},
      {"I'M HERE'S 'll 'LL",
       {"I", "'M", " HERE", "'S", " '", "ll", " '", "LL"},
       {"I", "'M", " HERE", "'S", " '", "ll", " '", "LL"},
       {"I", "'", "M", " HERE", "'", "S", " '", "ll", " '", "LL"}},
      {"\xc2\xbd \xe2\x91\xa0 \xd9\xa1\xd9\xa2\xd9\xa3 x\xc2\xb2",
       {"\xc2\xbd", " ", "\xe2\x91\xa0", " ", "\xd9\xa1\xd9\xa2\xd9\xa3", " x", "\xc2\xb2"},
       {"\xc2\xbd", " ", "\xe2\x91\xa0", " ", "\xd9\xa1", "\xd9\xa2", "\xd9\xa3", " x", "\xc2\xb2"},
       {"\xc2\xbd", " \xe2\x91\xa0", " \xd9\xa1\xd9\xa2\xd9\xa3", " x", "\xc2\xb2"}},
      {"don't  stop...\r\n\r\nnow",
       {"don", "'t", " ", " stop", "...\r\n\r\n", "now"},
       {"don", "'t", " ", " stop", "...\r\n\r\n", "now"},
       {"don", "'t", " ", " stop", "...", "\r\n\r", "\n", "now"}},
      {"\t\tfoo  ", {"\t", "\tfoo", "  "}, {"\t", "\tfoo", "  "}, {"\t", "\t", "foo", "  "}},
      {"$$$ +++ a<=>b",
       {"$$$", " +++", " a", "<=>", "b"},
       {"$$$", " +++", " a", "<=>", "b"},
       {"$$$", " +++", " a", "<=>", "b"}},
  };
  const auto split = split_text;
  for (const auto& c : cases) {
    INFO(c.text);
    CHECK(split(SplitKind::kLlama3, c.text) == c.llama3);
    CHECK(split(SplitKind::kQwen2, c.text) == c.qwen2);
    CHECK(split(SplitKind::kGpt2, c.text) == c.gpt2);
  }
  // llama.cpp's default chain: punctuation runs, GPT-2, \p{N}+, then [0-9]{3}
  CHECK(split(SplitKind::kDefault, "ab, 12345!") == std::vector<std::string>{"ab", ",", " ", "123", "45", "!"});
}

TEST_CASE("tokenizer: smollm, tekken and deepseek-llm splits match the reference regexes", "[tokenizer]") {
  using tandem::detail::SplitKind;
  struct Case {
    std::string text;
    std::vector<std::string> smollm, tekken, deepseek_llm;
  };
  // Expected values computed with Python's `regex` module on the original patterns, each
  // stage splitting the pieces of the previous one (smollm: \p{N}, then GPT-2; tekken: the
  // pattern of its tokenizer.json; deepseek-llm: its six patterns). One exception, where
  // llama.cpp deliberately differs and Tandem follows llama.cpp: it runs the deepseek-llm
  // patterns on text whose non-ASCII whitespace became U+000B, so U+3000 is a space there,
  // not punctuation, and "\xe3\x80\x80" "b" stays one piece (last case).
  const std::vector<Case> cases = {
      {
          "Hello world!! It's 12345 ok",
          {"Hello", " world", "!!", " It", "'s", " ", "1", "2", "3", "4", "5", " ok"},
          {"Hello", " world", "!!", " It", "'s", " ", "1", "2", "3", "4", "5", " ok"},
          {"Hello", " world", "!!", " It", "'", "s", " ", "12345", " ok"},
      },
      {
          "HTMLParser getHTTPResponse iPhone",
          {"HTMLParser", " getHTTPResponse", " iPhone"},
          {"HTMLParser", " get", "HTTPResponse", " i", "Phone"},
          {"HTMLParser", " getHTTPResponse", " iPhone"},
      },
      {
          "don't  stop...\r\n\r\nnow a/b//c\n",
          {"don", "'t", " ", " stop", "...", "\r\n\r", "\n", "now", " a", "/", "b", "//", "c", "\n"},
          {"don", "'t", " ", " stop", "...\r\n\r\n", "now", " a", "/b", "//", "c", "\n"},
          {"don", "'", "t", " ", " stop", "...", "\r", "\n", "\r", "\n", "now", " a", "/", "b", "//", "c", "\n"},
      },
      {
          "\xd0\x9f\xd1\x80\xd0\xb8\xd0\xb2\xd0\xb5\xd1\x82, \xd0\xbc\xd0\xb8\xd1\x80! 2024\xe5\xb9\xb4 "
          "\xe4\xbd\xa0\xe5\xa5\xbd\xe4\xb8\x96\xe7\x95\x8c \xec\x95\x88\xeb\x85\x95",
          {"\xd0\x9f\xd1\x80\xd0\xb8\xd0\xb2\xd0\xb5\xd1\x82", ",", " \xd0\xbc\xd0\xb8\xd1\x80", "!", " ", "2", "0",
           "2", "4", "\xe5\xb9\xb4", " \xe4\xbd\xa0\xe5\xa5\xbd\xe4\xb8\x96\xe7\x95\x8c", " \xec\x95\x88\xeb\x85\x95"},
          {"\xd0\x9f\xd1\x80\xd0\xb8\xd0\xb2\xd0\xb5\xd1\x82", ",", " \xd0\xbc\xd0\xb8\xd1\x80", "!", " ", "2", "0",
           "2", "4", "\xe5\xb9\xb4", " \xe4\xbd\xa0\xe5\xa5\xbd\xe4\xb8\x96\xe7\x95\x8c", " \xec\x95\x88\xeb\x85\x95"},
          {"\xd0\x9f\xd1\x80\xd0\xb8\xd0\xb2\xd0\xb5\xd1\x82", ",", " \xd0\xbc\xd0\xb8\xd1\x80", "!", " ", "2024",
           "\xe5\xb9\xb4", " ", "\xe4\xbd\xa0\xe5\xa5\xbd\xe4\xb8\x96\xe7\x95\x8c", " ", "\xec\x95\x88\xeb\x85\x95"},
      },
      {
          "\xc3\x80\xc3\x89"
          "abc DEF ghi",
          {"\xc3\x80\xc3\x89"
           "abc",
           " DEF", " ghi"},
          {"\xc3\x80\xc3\x89"
           "abc",
           " DEF", " ghi"},
          {"\xc3\x80\xc3\x89", "abc", " DEF", " ghi"},
      },
      {
          "3.14 + x\xc2\xb2 = \xc2\xbd",
          {"3", ".", "1", "4", " +", " x", "\xc2\xb2", " =", " ", "\xc2\xbd"},
          {"3", ".", "1", "4", " +", " x", "\xc2\xb2", " =", " ", "\xc2\xbd"},
          {"3", ".", "14", " +", " x", "\xc2\xb2", " =", " ", "\xc2\xbd"},
      },
      {
          "Hello, World! 12 ab\n\n  ",
          {"Hello", ",", " World", "!", " ", "1", "2", " ab", "\n\n  "},
          {"Hello", ",", " World", "!", " ", "1", "2", " ab", "\n\n", "  "},
          {"Hello", ",", " World", "!", " ", "12", " ab", "\n", "\n", "  "},
      },
      {
          "a\xe3\x80\x80"
          "b\xe2\x80\x83 cd  ",
          {"a", "\xe3\x80\x80", "b", "\xe2\x80\x83", " cd", "  "},
          {"a",
           "\xe3\x80\x80"
           "b",
           "\xe2\x80\x83", " cd", "  "},
          {"a",
           "\xe3\x80\x80"
           "b",
           "\xe2\x80\x83", " cd", "  "},
      },
  };
  for (const auto& c : cases) {
    INFO(c.text);
    CHECK(split_text(SplitKind::kSmollm, c.text) == c.smollm);
    CHECK(split_text(SplitKind::kTekken, c.text) == c.tekken);
    CHECK(split_text(SplitKind::kDeepseekLlm, c.text) == c.deepseek_llm);
  }
}

TEST_CASE("tokenizer: validation errors", "[tokenizer]") {
  auto code_of = [](auto&& fn) {
    try {
      fn();
    } catch (const Error& e) {
      return e.code();
    }
    return ErrorCode::kOk;
  };
  TokenizerVocab empty;
  empty.model = "llama";
  CHECK(code_of([&] { Tokenizer t(empty); }) == ErrorCode::kTokenizer);
  auto v = spm_byte_vocab({});
  v.model = "bert";
  CHECK(code_of([&] { Tokenizer t(v); }) == ErrorCode::kTokenizer);
  v = spm_byte_vocab({});
  v.scores.pop_back();
  CHECK(code_of([&] { Tokenizer t(v); }) == ErrorCode::kTokenizer);
  v = spm_byte_vocab({});
  v.token_types.push_back(1);
  CHECK(code_of([&] { Tokenizer t(v); }) == ErrorCode::kTokenizer);
  v = spm_byte_vocab({});
  v.bos_id = 259;
  CHECK(code_of([&] { Tokenizer t(v); }) == ErrorCode::kTokenizer);
  v = spm_byte_vocab({{"x", 0.0f}, {"x", 0.0f}});
  CHECK(code_of([&] { Tokenizer t(v); }) == ErrorCode::kTokenizer);
  // an unknown tokenizer.ggml.pre is refused, naming it (no silent fallback to "default")
  for (const char* pre : {"no-such-pre", "deepseek-coder", "SMOLLM"}) {
    INFO(pre);
    auto b = byte_level_vocab(pre, {}, {});
    CHECK(code_of([&] { Tokenizer t(b); }) == ErrorCode::kTokenizer);
    try {
      Tokenizer t(b);
    } catch (const Error& e) {
      CHECK(std::string(e.what()).find(std::string("'") + pre + "'") != std::string::npos);
    }
  }

  const Tokenizer tok(spm_byte_vocab({}));
  CHECK(code_of([&] { (void)tok.token_to_piece(-1, false); }) == ErrorCode::kInvalidArgument);
  CHECK(code_of([&] { (void)tok.token_to_piece(259, false); }) == ErrorCode::kInvalidArgument);
  const std::vector<int32_t> bad = {1, 5000};
  CHECK(code_of([&] { (void)tok.detokenize(bad, true, false); }) == ErrorCode::kInvalidArgument);
  StreamingDetokenizer sd(tok);
  CHECK(code_of([&] { (void)sd.push(-3); }) == ErrorCode::kInvalidArgument);

  // merges that name unknown tokens are kept, as llama.cpp: the merged symbol is not a
  // token and falls back to its single bytes
  const Tokenizer m(byte_level_vocab("qwen2", {}, {"x y", "q r", "noSpaceLine"}));
  CHECK(m.tokenize("xy", false, false) == std::vector<int32_t>{'x', 'y'});
}

TEST_CASE("tokenizer: identity hash", "[tokenizer]") {
  const Tokenizer a(spm_byte_vocab({{"a", -1.0f}}));
  const Tokenizer b(spm_byte_vocab({{"a", -1.0f}}));
  const Tokenizer c(spm_byte_vocab({{"a", -2.0f}}));
  auto tv = spm_byte_vocab({{"a", -1.0f}});
  tv.chat_template = "{{ x }}";
  const Tokenizer d(tv);
  CHECK(a.identity_hash() == b.identity_hash());
  CHECK(a.identity_hash() != c.identity_hash());
  CHECK(a.identity_hash() != d.identity_hash());
  CHECK(d.chat_template() == "{{ x }}");
}

// ---------------------------------------------------------------------------------------
// goldens

namespace {

void check_spm_golden(const std::string& model, const std::string& golden) {
  auto f = tandem::GgufFile::open(tandem::test::model_path(model));
  const Tokenizer tok = Tokenizer::from_gguf(*f);
  CHECK(tok.model() == tandem::TokenizerModel::kSpm);
  CHECK(tok.n_vocab() == 512);
  CHECK(tok.bos() == 1);
  CHECK(tok.eos() == 2);
  CHECK(tok.add_bos());
  CHECK_FALSE(tok.add_eos());
  CHECK(tok.is_eog(2));
  const auto j = tandem::test::read_json(tandem::test::golden_dir() / "tokenizer" / golden);
  for (const auto& c : j["cases"]) {
    const std::string text = c["text"];
    INFO("text: " << text);
    const auto ids_ns = ids_of(c["ids_no_special"]);
    CHECK(tok.tokenize(text, true, false) == ids_of(c["ids_add_special"]));
    CHECK(tok.tokenize(text, false, false) == ids_ns);
    CHECK(tok.tokenize(text, false, true) ==
          (c.contains("ids_no_special_parse_special") ? ids_of(c["ids_no_special_parse_special"]) : ids_ns));
    std::vector<std::string> pieces;
    for (int32_t id : ids_ns) pieces.push_back(render_piece(tok.token_to_piece(id, false)));
    CHECK(pieces == c["pieces_no_special"].get<std::vector<std::string>>());
    // detokenize without BOS drops the prefixed space: the text comes back (SPM keeps
    // every byte through byte fallback; a literal U+2581 comes back as ' '). With BOS
    // first and remove_special, llama.cpp keeps the prefixed space.
    std::string expect;
    for (size_t i = 0; i < text.size();) {
      if (text.compare(i, 3, "\xe2\x96\x81") == 0) {
        expect += ' ';
        i += 3;
      } else {
        expect += text[i++];
      }
    }
    CHECK(tok.detokenize(ids_ns, false, false) == expect);
    CHECK(tok.detokenize(ids_of(c["ids_add_special"]), true, false) == (text.empty() ? "" : " " + expect));
  }
}

void check_bpe_golden(const Tokenizer& tok, const nlohmann::json& j) {
  const auto& vj = j["vocab"];
  CHECK(tok.n_vocab() == vj["n_vocab"].get<int32_t>());
  CHECK(tok.bos() == vj["bos"].get<int32_t>());
  CHECK(tok.eos() == vj["eos"].get<int32_t>());
  CHECK(tok.eot() == vj["eot"].get<int32_t>());
  CHECK(tok.eog_ids() == vj["eog"].get<std::vector<int32_t>>());
  CHECK(tok.add_bos() == vj["add_bos"].get<bool>());
  CHECK(tok.add_eos() == vj["add_eos"].get<bool>());
  CHECK(tok.tokenize("\n", false, false) == std::vector<int32_t>{vj["newline"].get<int32_t>()});
  for (const auto& c : j["cases"]) {
    const std::string name = c["name"];
    const std::string text = c["text"];
    INFO("case " << name);
    const auto ids_as = ids_of(c["ids_add_special"]);
    const auto ids_ns = ids_of(c["ids_no_special"]);
    const auto ids_ns_ps =
        c.contains("ids_no_special_parse_special") ? ids_of(c["ids_no_special_parse_special"]) : ids_ns;
    const auto ids_as_ps =
        c.contains("ids_add_special_parse_special") ? ids_of(c["ids_add_special_parse_special"]) : ids_as;
    CHECK(tok.tokenize(text, true, false) == ids_as);
    CHECK(tok.tokenize(text, false, false) == ids_ns);
    CHECK(tok.tokenize(text, false, true) == ids_ns_ps);
    CHECK(tok.tokenize(text, true, true) == ids_as_ps);
    std::vector<std::string> pieces;
    for (int32_t id : ids_ns) pieces.push_back(render_piece(tok.token_to_piece(id, false)));
    CHECK(pieces == c["pieces_no_special"].get<std::vector<std::string>>());
    CHECK(tok.detokenize_raw(ids_ns, false) == text);
    const std::string detok = tok.detokenize(ids_as, true, false);
    CHECK(detok == c["detokenized"].get<std::string>());
    CHECK(tok.detokenize(ids_ns, false, false) == detok);
    CHECK((detok == text) == c["roundtrip_exact"].get<bool>());
    if (c.contains("detokenized_parse_special")) {
      CHECK(tok.detokenize(ids_ns_ps, false, true) == c["detokenized_parse_special"].get<std::string>());
    }
    if (c.contains("detokenized_parse_special_plain")) {
      CHECK(tok.detokenize(ids_ns_ps, false, false) == c["detokenized_parse_special_plain"].get<std::string>());
    }
  }
}

}  // namespace

TEST_CASE("tokenizer: golden stories260K / aidreams260K (SPM)", "[tokenizer][golden]") {
  check_spm_golden("stories260K-q4_0", "stories260K.json");
  check_spm_golden("aidreams260K-q4_0", "aidreams260K.json");
}

TEST_CASE("tokenizer: golden llama3-bpe-vocab", "[tokenizer][golden]") {
  auto f = tandem::GgufFile::open(tandem::test::model_path("llama3-bpe-vocab"));
  const Tokenizer tok = Tokenizer::from_gguf(*f);
  CHECK(tok.pre() == tandem::PreTokenizer::kLlama3);
  CHECK(tok.clean_spaces());
  const auto j = tandem::test::read_json(tandem::test::golden_dir() / "tokenizer-llama3-bpe" / "llama3-bpe-vocab.json");
  check_bpe_golden(tok, j);

  // 50,000 x "a" is one pre-token: 6,250 x "aaaaaaaa"
  const std::string run(50000, 'a');
  const auto ids = tok.tokenize(run, false, false);
  CHECK(ids.size() == 6250);
  CHECK(tok.identity_hash() == llama3_tokenizer().identity_hash());
}

TEST_CASE("tokenizer: golden bpe-vocab-qwen2-pre", "[tokenizer][golden]") {
  auto f = tandem::GgufFile::open(tandem::test::model_path("bpe-vocab-qwen2-pre"));
  const Tokenizer tok = Tokenizer::from_gguf(*f);
  CHECK(tok.pre() == tandem::PreTokenizer::kQwen2);
  CHECK_FALSE(tok.clean_spaces());
  const auto j =
      tandem::test::read_json(tandem::test::golden_dir() / "tokenizer-qwen2-pre" / "bpe-vocab-qwen2-pre.json");
  check_bpe_golden(tok, j);
  CHECK(tok.identity_hash() != llama3_tokenizer().identity_hash());
  // long runs through the qwen2 splitter on a small stack
  std::vector<int32_t> ids;
  run_with_stack(256 * 1024, [&] { ids = tok.tokenize(std::string(50000, 'a'), false, false); });
  CHECK(ids.size() == 6250);
}

TEST_CASE("tokenizer: golden SmolLM2-135M-Instruct (smollm pre-tokenizer)", "[tokenizer][golden][smollm2]") {
  const auto path = tandem::test::smollm2_q4_1_path();
  if (!std::filesystem::exists(path)) {
    WARN("SKIPPED: SmolLM2 not found at " << path << " (scripts/fetch-smollm2, or set TANDEM_SMOLLM2)");
    return;
  }
  auto f = tandem::GgufFile::open(path);
  const Tokenizer tok = Tokenizer::from_gguf(*f);
  CHECK(tok.pre() == tandem::PreTokenizer::kSmollm);
  CHECK(tok.pre_name() == "smollm");
  CHECK_FALSE(tok.clean_spaces());
  CHECK_FALSE(tok.add_bos());
  CHECK(tok.bos() == 1);
  CHECK(tok.eos() == 2);
  // llama.cpp's end-of-generation set for this vocabulary (shared/golden/README.md)
  CHECK(tok.eog_ids() == std::vector<int32_t>{0, 2, 4});
  const auto j =
      tandem::test::read_json(tandem::test::golden_dir() / "tokenizer-smollm" / "smollm2-135m-instruct-q4_0.json");
  REQUIRE(j["cases"].size() >= 40);
  for (const auto& c : j["cases"]) {
    const std::string text = c["text"];
    INFO("text: " << text);
    CHECK(tok.tokenize(text, true, false) == ids_of(c["ids"]));
    CHECK(tok.tokenize(text, true, true) == ids_of(c["ids_parse_special"]));
    // byte-level BPE: the pieces join back to the text
    CHECK(tok.detokenize_raw(ids_of(c["ids"]), false) == text);
  }
}

TEST_CASE("tokenizer: streaming llama3 pieces equal the sanitized join", "[tokenizer][golden]") {
  const Tokenizer& tok = llama3_tokenizer();
  const std::string text = "emoji \xf0\x9f\x91\xa8\xe2\x80\x8d\xf0\x9f\x91\xa9 caf\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac";
  const auto ids = tok.tokenize(text, false, false);
  StreamingDetokenizer sd(tok);
  std::string all;
  for (int32_t id : ids) {
    const std::string chunk = sd.push(id);
    CHECK(tandem::utf8_sanitize(chunk) == chunk);
    all += chunk;
  }
  all += sd.finish();
  CHECK(all == text);
}

TEST_CASE("tokenizer: random bytes never crash; BPE join is the lax-decoded text", "[tokenizer]") {
  const Tokenizer bpe(byte_level_vocab("llama-bpe", {"AA", "AAAA", "<|x|>"}, {"A A", "AA AA"}));
  const Tokenizer spm(spm_byte_vocab({{"\xe2\x96\x81", -3.0f}, {"A", -3.0f}, {"AA", -2.0f}}));
  uint64_t state = 0x9E3779B97F4A7C15ull;
  auto next = [&] {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
  };
  const char alphabet[] = {'A',    ' ',    '\n',   '\'',   's',    '1', '.', '\xe4', '\xb8', '\xad',
                           '\xf0', '\x9f', '\x80', '\xff', '\xc0', '<', '|', 'x',    '>',    '\0'};
  for (int iter = 0; iter < 300; ++iter) {
    std::string s;
    const size_t len = next() % 64;
    for (size_t i = 0; i < len; ++i) s.push_back(alphabet[next() % sizeof(alphabet)]);
    INFO("iteration " << iter);
    for (bool parse : {false, true}) {
      const auto ids = bpe.tokenize(s, false, parse);
      std::vector<uint32_t> cps;
      tandem::detail::utf8_decode_lax(s, cps);
      std::string lax;
      for (uint32_t cp : cps) tandem::detail::utf8_append(lax, cp);
      CHECK(bpe.detokenize_raw(ids, true) == lax);
      const auto sids = spm.tokenize(s, true, parse);
      CHECK_NOTHROW(spm.detokenize(sids, true, true));
    }
  }
}
