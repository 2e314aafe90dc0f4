// The per-token generation logic shared by Session::generate and the scheduler
// (lib/session/generation.hpp), driven with chosen tokens: end-of-generation, UTF-8 held back
// across tokens, stop strings held back then cut, the output limit, the context clamp.
#include <catch2/catch.hpp>

#include "session/generation.hpp"
#include "tandem/model/model.hpp"
#include "test_support.hpp"

using namespace tandem;

namespace {

std::shared_ptr<const Model> aidreams() {
  static auto m = Model::load(test::model_path("aidreams260K-q4_0"));
  return m;
}

struct Run {
  std::string streamed;
  GenEnd end = GenEnd::kNone;
  int32_t n = 0;
};

Run feed(Generation& g, const std::vector<int32_t>& ids) {
  Run r;
  for (int32_t id : ids) {
    const TokenStep t = g.accept(id);
    CHECK(utf8_sanitize(t.piece) == t.piece);  // never half a character
    r.streamed += t.piece;
    ++r.n;
    if (t.end != GenEnd::kNone) {
      r.end = t.end;
      break;
    }
  }
  return r;
}

}  // namespace

TEST_CASE("generation: UTF-8 split over tokens is held back, then streamed whole", "[generation]") {
  const Tokenizer& tok = aidreams()->tokenizer();
  const std::string text = "h\xC3\xA9llo w\xC3\xB6rld \xE2\x82\xAC";  // héllo wörld €
  const auto ids = tok.tokenize(text, false, false);
  Generation g(tok);
  const std::vector<std::string> stops;
  g.begin(SamplingParams::greedy(), aidreams()->hparams().n_vocab, stops, true, 1000);
  const Run r = feed(g, ids);
  CHECK(r.end == GenEnd::kNone);
  g.flush_utf8();
  const std::string all = r.streamed + std::string(g.take_unsent());
  CHECK(all.size() >= text.size());
  CHECK(all.substr(all.size() - text.size()) == text);
  CHECK(g.text() == all);
  CHECK(g.n_gen() == int32_t(ids.size()));
}

TEST_CASE("generation: a stop string is held back while it may form, then cut", "[generation]") {
  const Tokenizer& tok = aidreams()->tokenizer();
  const auto ids = tok.tokenize("Once upon a time there was a flower in the garden", false, false);
  Generation g(tok);
  const std::vector<std::string> stops{"a flow", "zzz"};
  g.begin(SamplingParams::greedy(), aidreams()->hparams().n_vocab, stops, true, 1000);
  const Run r = feed(g, ids);
  CHECK(r.end == GenEnd::kStopString);
  CHECK(g.text().find("a flow") == std::string::npos);
  CHECK(g.text().size() >= std::string("Once upon a time there was").size());
  CHECK(g.text().substr(g.text().size() - 4) == "was ");
  CHECK(r.streamed == g.text());  // everything before the stop went out, nothing after
  CHECK(g.take_unsent().empty());
}

TEST_CASE("generation: end of generation, the output limit and the context clamp", "[generation]") {
  const Tokenizer& tok = aidreams()->tokenizer();
  const int32_t n_vocab = aidreams()->hparams().n_vocab;
  const std::vector<std::string> stops;
  int32_t eog = -1;
  for (int32_t id = 0; id < n_vocab && eog < 0; ++id) {
    if (tok.is_eog(id)) eog = id;
  }
  REQUIRE(eog >= 0);
  const auto ids = tok.tokenize("Once upon a time", false, false);
  REQUIRE(ids.size() >= 3);

  Generation g(tok);
  g.begin(SamplingParams::greedy(), n_vocab, stops, false, 100);
  CHECK(g.accept(ids[0]).end == GenEnd::kNone);
  const TokenStep t = g.accept(eog);
  CHECK(t.end == GenEnd::kEog);
  CHECK(t.piece.empty());
  CHECK(g.n_gen() == 1);  // the end-of-generation token is not output

  g.begin(SamplingParams::greedy(), n_vocab, stops, true, 3);  // ignore_eos: it is output
  CHECK(g.accept(eog).end == GenEnd::kNone);
  CHECK(g.accept(ids[0]).end == GenEnd::kNone);
  CHECK(g.accept(ids[1]).end == GenEnd::kLength);
  CHECK(g.n_gen() == 3);

  // n_ctx - positions + 1 tokens fit (the last one is never fed); max_tokens caps it.
  CHECK(clamp_output_tokens(1000, 20, 64) == 45);
  CHECK(clamp_output_tokens(10, 20, 64) == 10);
  CHECK(clamp_output_tokens(1000, 64, 64) == 1);
  CHECK(clamp_output_tokens(INT32_MAX, 0, 1 << 24) == (1 << 24) + 1);

  const std::vector<std::string> empty_stop{""};
  CHECK_THROWS_AS(g.begin(SamplingParams::greedy(), n_vocab, empty_stop, true, 3), Error);
}
