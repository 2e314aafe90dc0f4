// Structured outputs (tandem/grammar/grammar.hpp): the sampler's mask, masks of a hand-made
// vocabulary checked by hand, compile errors, and constrained generation on SmolLM2 whose
// output is parsed and checked against its schema (and equal on 1 and 2 threads), with
// unconstrained neighbours in the same scheduler batch unchanged.
#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>

#include "kv_test_support.hpp"
#include "tandem/core/error.hpp"
#include "tandem/exec/cpu/cpu_q4_executor.hpp"
#include "tandem/grammar/grammar.hpp"
#include "tandem/sched/scheduler.hpp"
#include "tandem/session/sampler.hpp"
#include "tandem/session/session.hpp"
#include "tandem/template/chat_template.hpp"
#include "test_support.hpp"

using namespace tandem;

namespace {

std::vector<uint32_t> mask_of(int32_t n_vocab, std::initializer_list<int32_t> ids) {
  std::vector<uint32_t> m(size_t((n_vocab + 31) / 32), 0u);
  for (int32_t id : ids) m[size_t(id / 32)] |= 1u << (id % 32);
  return m;
}

std::vector<int32_t> allowed_ids(std::span<const uint32_t> mask, int32_t n_vocab) {
  std::vector<int32_t> out;
  for (int32_t i = 0; i < n_vocab; ++i)
    if ((mask[size_t(i / 32)] >> (i % 32)) & 1u) out.push_back(i);
  return out;
}

// A SentencePiece vocabulary small enough to reason about by hand.
Tokenizer tiny_tokenizer() {
  TokenizerVocab v;
  v.model = "llama";
  v.tokens = {"<unk>", "<s>", "</s>", "a", "b", "ab", "c", "\xe2\x96\x81", "ba"};
  v.token_types = {2, 3, 3, 1, 1, 1, 1, 1, 1};
  v.bos_id = 1;
  v.eos_id = 2;
  v.unk_id = 0;
  return Tokenizer(std::move(v));
}

// SmolLM2 (Q4_1), loaded once for every test here that needs it; null when absent.
std::shared_ptr<const Model> smollm2() {
  static const std::shared_ptr<const Model> model = std::filesystem::exists(test::smollm2_q4_1_path())
                                                        ? Model::load(test::smollm2_q4_1_path(), ModelOptions{})
                                                        : nullptr;
  return model;
}

#define REQUIRE_GRAMMAR()                                                 \
  if (!Grammar::available()) {                                            \
    WARN("SKIPPED: built without xgrammar (cmake/TandemXgrammar.cmake)"); \
    return;                                                               \
  }

}  // namespace

TEST_CASE("Sampler: a grammar mask keeps only allowed tokens, an empty mask changes nothing", "[grammar][sampler]") {
  const std::vector<float> logits = {5.0f, 1.0f, 4.0f, 3.0f, 2.0f, -1.0f, 0.5f, 6.0f};
  const int32_t n = int32_t(logits.size());
  Sampler greedy(SamplingParams::greedy(), n);
  CHECK(greedy.sample(logits, {}) == 7);
  CHECK(greedy.sample(logits, {}, mask_of(n, {1, 2, 5})) == 2);  // 4.0 is the best of 1.0, 4.0, -1.0
  CHECK(greedy.sample(logits, {}, mask_of(n, {5})) == 5);
  CHECK_THROWS_MATCHES(
      greedy.sample(logits, {}, mask_of(n, {})), Error,
      Catch::Matchers::Predicate<Error>([](const Error& e) { return e.code() == ErrorCode::kInvalidArgument; }));

  // At temperature > 0: masked tokens never drawn; a mask allowing everything draws what no
  // mask draws (same seed), so constrained and unconstrained chains are one code path.
  SamplingParams p;
  p.temperature = 1.5f;
  p.top_k = 0;
  p.top_p = 1.0f;
  p.min_p = 0.0f;
  p.seed = 42;
  Sampler a(p, n), b(p, n), c(p, n);
  const auto all = mask_of(n, {0, 1, 2, 3, 4, 5, 6, 7});
  const auto some = mask_of(n, {1, 4, 6});
  for (int i = 0; i < 500; ++i) {
    CHECK(a.sample(logits, {}) == b.sample(logits, {}, all));
    const int32_t t = c.sample(logits, {}, some);
    CHECK((t == 1 || t == 4 || t == 6));
  }
}

TEST_CASE("Grammar masks on a hand-made vocabulary", "[grammar]") {
  REQUIRE_GRAMMAR();
  const Tokenizer tok = tiny_tokenizer();
  // Pieces: 3 "a", 4 "b", 5 "ab", 6 "c", 7 " ", 8 "ba"; 0-2 have no text; 2 is EOS.
  SECTION("a GBNF grammar") {
    auto g = Grammar::from_gbnf(tok, R"(root ::= "ab" ("c" | "ba"))");
    CHECK(g->n_vocab() == 9);
    CHECK(g->vocab_hash() == tok.identity_hash());
    GrammarMatcher m(g);
    CHECK(allowed_ids(m.fill_mask(), 9) == std::vector<int32_t>{3, 5});  // "a", "ab"
    CHECK_FALSE(m.accept(4));                                            // "b" first: refused
    REQUIRE(m.accept(3));
    CHECK(allowed_ids(m.fill_mask(), 9) == std::vector<int32_t>{4});  // "b" ("a" + "ba" = "aba" is not)
    REQUIRE(m.accept(4));
    CHECK(allowed_ids(m.fill_mask(), 9) == std::vector<int32_t>{4, 6, 8});  // "b", "c", "ba"
    CHECK_FALSE(m.is_completed());
    REQUIRE(m.accept(6));
    CHECK(m.is_completed());
    CHECK(allowed_ids(m.fill_mask(), 9) == std::vector<int32_t>{2});  // only EOS now
    REQUIRE(m.accept(2));
    CHECK(m.is_terminated());
    CHECK(allowed_ids(m.fill_mask(), 9).empty());
    CHECK_FALSE(m.accept(3));
    m.reset();
    CHECK(allowed_ids(m.fill_mask(), 9) == std::vector<int32_t>{3, 5});
  }
  SECTION("the same source compiles once per vocabulary and is shared") {
    auto g1 = Grammar::from_gbnf(tok, R"(root ::= ("ab" | "ba")+)");
    auto g2 = Grammar::from_gbnf(tok, R"(root ::= ("ab" | "ba")+)");
    GrammarMatcher m1(g1), m2(g2);
    const auto a = allowed_ids(m1.fill_mask(), 9);
    CHECK(a == allowed_ids(m2.fill_mask(), 9));
    CHECK(a == std::vector<int32_t>{3, 4, 5, 8});  // "a", "b", "ab", "ba"
  }
  SECTION("left recursion is parsed (xgrammar's Earley parser), not refused") {
    GrammarMatcher m(Grammar::from_gbnf(tok, R"(root ::= root "a" | "b")"));  // b a*
    CHECK(allowed_ids(m.fill_mask(), 9) == std::vector<int32_t>{4, 8});       // "b", "ba"
    REQUIRE(m.accept(8));
    CHECK(m.is_completed());
    REQUIRE(m.accept(3));
    CHECK(m.is_completed());
    CHECK(allowed_ids(m.fill_mask(), 9) == std::vector<int32_t>{2, 3});  // EOS or another "a"
    CHECK_FALSE(m.accept(4));
  }
}

TEST_CASE("Grammar compile errors are kInvalidArgument with the reason", "[grammar]") {
  REQUIRE_GRAMMAR();
  const Tokenizer tok = tiny_tokenizer();
  auto code_and_text = [&](auto&& f, std::string_view needle) {
    try {
      f();
      FAIL("no error");
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::kInvalidArgument);
      INFO(e.what());
      CHECK(std::string_view(e.what()).find(needle) != std::string_view::npos);
    }
  };
  code_and_text([&] { Grammar::from_json_schema(tok, "{not json"); }, "json_schema");
  code_and_text([&] { Grammar::from_json_schema(tok, R"({"type": "no-such-type"})"); }, "json_schema");
  code_and_text([&] { Grammar::from_gbnf(tok, R"(root ::= undefined_rule)"); }, "grammar");
  code_and_text([&] { Grammar::from_gbnf(tok, R"(start ::= "a")"); }, "grammar");
  // Grammars that compile but allow no first token: no sentence at all, or first characters
  // that no token has (a JSON string's '"' is not in this vocabulary).
  code_and_text([&] { Grammar::from_gbnf(tok, R"(root ::= root)"); }, "allows no token");
  code_and_text([&] { Grammar::from_gbnf(tok, "root ::= x\nx ::= x \"a\""); }, "allows no token");
  code_and_text([&] { Grammar::from_gbnf(tok, R"(root ::= "z")"); }, "allows no token");
  code_and_text([&] { Grammar::from_json_schema(tok, R"({"type": "string"})"); }, "allows no token");
  // Constraints xgrammar would drop with a warning: refused, naming the keyword and where.
  code_and_text([&] { Grammar::from_json_schema(tok, R"({"type": "object", "required": ["x"]})"); },
                "required property 'x'");
  code_and_text([&] { Grammar::from_json_schema(tok, R"({"anyOf": [{"not": {"type": "string"}}]})"); },
                "'not' at '/anyOf/0'");
  code_and_text([&] { Grammar::from_json_schema(tok, R"({"type": "string", "format": "date", "maxLength": 5})"); },
                "beside a built-in 'format'");
  code_and_text([&] { Grammar::from_json_schema(tok, R"({"type": "array", "items": {"uniqueItems": true}})"); },
                "'uniqueItems' at '/items'");
  code_and_text([&] { Grammar::from_json_schema(tok, R"({"type": "integer", "multipleOf": 3, "minimum": 1})"); },
                "'multipleOf'");
  code_and_text([&] { Grammar::from_json_schema(tok, R"({"type": "integer", "multipleOf": 100000})"); },
                "'multipleOf'");
  code_and_text([&] { Grammar::from_json_schema(tok, R"({"type": "string", "pattern": "^a+$", "minLength": 6})"); },
                "beside 'pattern'");
  code_and_text(
      [&] { Grammar::from_json_schema(tok, R"({"anyOf": [{"type": "object"}], "type": "object", "required": []})"); },
      "'required' beside 'anyOf'");
  code_and_text([&] { Grammar::from_json_schema(tok, R"({"enum": [1, "x"], "type": "integer"})"); },
                "'type' beside 'enum'");
  code_and_text(
      [&] {
        Grammar::from_json_schema(
            tok, R"({"properties": {"a": {"$ref": "#/components/U"}}, "components": {"U": {"uniqueItems": true}}})");
      },
      "'uniqueItems' at '/components/U'");
  code_and_text([&] { Grammar::from_json_schema(tok, R"({"allOf": [{"type": "object"}, {"required": []}]})"); },
                "'allOf'");
  // What xgrammar enforces is not refused (the tiny vocabulary then has no first token: the
  // schema got past the check to the compiler): multipleOf with both bounds close enough,
  // lengths beside a format it does not build in, type beside enum values of that type,
  // annotations beside $ref.
  for (const char* ok : {R"({"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100})",
                         R"({"type": "string", "format": "password", "maxLength": 8})",
                         R"({"enum": ["ab", "ba"], "type": "string", "title": "E"})",
                         R"({"$defs": {"A": {"const": "ab"}}, "$ref": "#/$defs/A", "description": "d"})"}) {
    INFO(ok);
    code_and_text([&] { Grammar::from_json_schema(tok, ok); }, "allows no token");
  }
  // A property named like a keyword is a name, not the keyword.
  try {
    Grammar::from_json_schema(tok,
                              R"({"type": "object", "properties": {"not": {"const": "ab"}}, "required": ["not"]})");
    FAIL("a schema whose only string is not in this vocabulary compiled");
  } catch (const Error& e) {
    INFO(e.what());
    CHECK(std::string_view(e.what()).find("allows no token") != std::string_view::npos);
  }
  CHECK_THROWS_AS(GrammarMatcher(nullptr), Error);
}

TEST_CASE(
    "A compile deadline: past it kInvalidArgument while the compile finishes in the background, no turn "
    "within it kOutOfMemory, no deadline waits",
    "[grammar][smollm2]") {
  REQUIRE_GRAMMAR();
  const std::shared_ptr<const Model> model = smollm2();
  if (!model) {
    WARN("SKIPPED: " << test::smollm2_q4_1_path() << " is absent (scripts/fetch-smollm2 downloads it)");
    return;
  }
  const Tokenizer& tok = model->tokenizer();
  // 150 optional three-way alternatives: 2.4 KB that take xgrammar seconds on SmolLM2's
  // 49152 tokens (100 took 1.4 s, 200 6.4 s on this project's VM); a 1 ms deadline is a
  // thousandth of that, whatever the machine.
  std::string slow = "root ::= ";
  for (int i = 0; i < 150; ++i) slow += R"(("a" | "a" | "a")? )";
  slow += R"("b")";
  const auto ms = std::chrono::milliseconds(1);
  REQUIRE(Grammar::json_object(tok) != nullptr);  // compiled (or cached) before the slow one
  try {
    Grammar::from_gbnf(tok, slow, ms);
    FAIL("a seconds-long compile met a 1 ms deadline");
  } catch (const Error& e) {
    INFO(e.what());
    CHECK(e.code() == ErrorCode::kInvalidArgument);
    CHECK(std::string_view(e.what()).find("compile deadline (1 ms)") != std::string_view::npos);
  }
  // The slow compile still has the vocabulary's turn: a trivial grammar not compiled before
  // does not get it with a deadline; without one it waits and compiles. A grammar compiled
  // before (json_object, above) is served from the cache at once, turn or not.
  try {
    Grammar::from_gbnf(tok, R"(root ::= "busy-turn-check")", ms);
    FAIL("the compiler's turn was free while the slow grammar compiled");
  } catch (const Error& e) {
    INFO(e.what());
    CHECK(e.code() == ErrorCode::kOutOfMemory);
    CHECK(std::string_view(e.what()).find("busy") != std::string_view::npos);
  }
  CHECK(Grammar::json_object(tok, ms) != nullptr);
  CHECK(Grammar::from_gbnf(tok, R"(root ::= "busy-turn-check")") != nullptr);
  // The background compile left a usable grammar (from the cache): it accepts "b".
  const auto g = Grammar::from_gbnf(tok, slow);
  GrammarMatcher m(g);
  const std::vector<int32_t> b = tok.tokenize("b", /*add_special=*/false, /*parse_special=*/false);
  REQUIRE(b.size() == 1);
  CHECK(allowed_ids(m.fill_mask(), tok.n_vocab()).size() > 0);
  CHECK(m.accept(b[0]));
  CHECK(m.is_completed());
}

TEST_CASE("Constrained greedy decoding on SmolLM2 yields JSON of the schema, on 1 and 2 threads",
          "[grammar][smollm2]") {
  REQUIRE_GRAMMAR();
  const std::shared_ptr<const Model> model = smollm2();
  if (!model) {
    WARN("SKIPPED: " << test::smollm2_q4_1_path() << " is absent (scripts/fetch-smollm2 downloads it)");
    return;
  }
  const Tokenizer& tok = model->tokenizer();
  const std::string schema = R"({"type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12},
                   "age": {"type": "integer", "minimum": 18, "maximum": 99},
                   "city": {"type": "string", "enum": ["Paris", "Berlin", "Rome"]},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3}},
    "required": ["name", "age", "city", "tags"], "additionalProperties": false})";
  const auto grammar = Grammar::from_json_schema(tok, schema);
  auto chat = [&](const char* text) {
    auto msgs = nlohmann::ordered_json::array({{{"role", "user"}, {"content", text}}});
    return ChatTemplate::for_model(*model).tokenize_json(tok, msgs, true);
  };
  auto run = [&](int threads, std::shared_ptr<const Grammar> g, const char* text = "Describe a person as JSON.",
                 bool ignore_eos = false) {
    const auto prompt = chat(text);
    CpuQ4Executor exec(model, CpuExecutorOptions{threads});
    Session s(model, exec, {.n_ctx = 512});
    GenerateOptions o;
    o.sampling = SamplingParams::greedy();
    o.max_tokens = 120;
    o.ignore_eos = ignore_eos;
    o.grammar = std::move(g);
    return s.generate(std::span<const int32_t>(prompt), o);
  };
  const GenerateResult r1 = run(1, grammar);
  const GenerateResult r2 = run(2, grammar);
  INFO(r1.text);
  CHECK(r1.tokens == r2.tokens);
  REQUIRE(r1.finish == FinishReason::kStop);  // ended by EOS, where the grammar allows it
  const auto j = nlohmann::json::parse(r1.text);
  REQUIRE(j.is_object());
  CHECK(j.size() == 4);
  REQUIRE(j["name"].is_string());
  CHECK(j["name"].get<std::string>().size() <= 12);  // bytes >= characters
  REQUIRE(j["age"].is_number_integer());
  CHECK(j["age"].get<int>() >= 18);
  CHECK(j["age"].get<int>() <= 99);
  const auto city = j["city"].get<std::string>();
  CHECK((city == "Paris" || city == "Berlin" || city == "Rome"));
  REQUIRE(j["tags"].is_array());
  CHECK(j["tags"].size() >= 1);
  CHECK(j["tags"].size() <= 3);

  // ignore_eos does not outlive the grammar: the completed object ends the output as before.
  const GenerateResult ri = run(1, grammar, "Describe a person as JSON.", /*ignore_eos=*/true);
  CHECK(ri.finish == FinishReason::kStop);
  CHECK(ri.tokens == r1.tokens);

  // json_object: any object, also parsed.
  const GenerateResult ro =
      run(2, Grammar::json_object(tok), "Answer in JSON with the key \"capital\": what is the capital of France?");
  INFO(ro.text);
  REQUIRE(ro.finish == FinishReason::kStop);
  CHECK(nlohmann::json::parse(ro.text).is_object());

  // Without a grammar the same greedy text is not JSON-shaped: the constraint did the work.
  const GenerateResult free = run(2, nullptr);
  CHECK(free.tokens != r1.tokens);
}

TEST_CASE("Scheduler: a grammar request leaves its unconstrained batch neighbour unchanged", "[grammar][smollm2]") {
  REQUIRE_GRAMMAR();
  const std::shared_ptr<const Model> model = smollm2();
  if (!model) {
    WARN("SKIPPED: " << test::smollm2_q4_1_path() << " is absent (scripts/fetch-smollm2 downloads it)");
    return;
  }
  const Tokenizer& tok = model->tokenizer();
  CpuQ4Executor exec(model, CpuExecutorOptions{2});
  const auto chat = ChatTemplate::for_model(*model);
  auto prompt = [&](const char* text) {
    auto msgs = nlohmann::ordered_json::array({{{"role", "user"}, {"content", text}}});
    return chat.tokenize_json(tok, msgs, true);
  };
  const auto pa = prompt("Give me a JSON object with a name and an age.");
  const auto pb = prompt("Write a haiku about the sea.");

  // The neighbour alone, in a Session: the reference.
  Session ref(model, exec, {.n_ctx = 512});
  GenerateOptions go;
  go.sampling = SamplingParams::greedy();
  go.max_tokens = 40;
  const auto alone = ref.generate(std::span<const int32_t>(pb), go);

  SchedulerOptions so;
  so.max_context = 512;
  ExecutorConfig ec;
  ec.executor = &exec;
  ec.store = test::make_store(model->hparams(), 128);
  so.executors.push_back(ec);
  Scheduler sched(std::move(so));
  Request ra;
  ra.prompt_ids = pa;
  ra.max_tokens = 60;
  ra.grammar =
      Grammar::from_json_schema(tok, R"({"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
              "age": {"type": "integer"}}, "required": ["name", "age"], "additionalProperties": false})");
  Request rb;
  rb.prompt_ids = pb;
  rb.max_tokens = 40;
  auto ha = sched.submit(std::move(ra));
  auto hb = sched.submit(std::move(rb));
  const auto& A = ha.wait();
  const auto& B = hb.wait();
  INFO(A.message << " / " << A.text);
  REQUIRE(A.finish == RequestFinish::kStop);
  const auto j = nlohmann::json::parse(A.text);
  CHECK(j["name"].is_string());
  CHECK(j["age"].is_number_integer());
  CHECK(B.tokens == alone.tokens);

  // Another vocabulary's grammar is refused.
  Request rc;
  rc.prompt_ids = pb;
  rc.grammar = Grammar::from_gbnf(tiny_tokenizer(), R"(root ::= "a")");
  auto hc = sched.submit(std::move(rc));
  const auto& C = hc.wait();
  CHECK(C.finish == RequestFinish::kError);
  CHECK(C.error == ErrorCode::kInvalidArgument);
}
