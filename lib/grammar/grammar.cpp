#include "tandem/grammar/grammar.hpp"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <future>
#include <list>
#include <map>
#include <mutex>
#include <optional>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tandem/core/error.hpp"

#if TANDEM_HAVE_GRAMMAR
#include <xgrammar/xgrammar.h>
#endif

namespace tandem {

#if TANDEM_HAVE_GRAMMAR

struct Grammar::Impl {
  xgrammar::CompiledGrammar compiled;
  uint64_t vocab_hash = 0;
  int32_t n_vocab = 0;
};

namespace {

// Compiled grammars kept per vocabulary, least recently used dropped first.
constexpr int64_t kCacheBytes = int64_t(256) << 20;

using Clock = std::chrono::steady_clock;
using CompileFn = std::function<xgrammar::CompiledGrammar(xgrammar::GrammarCompiler&)>;

// One compile at a time per vocabulary (GrammarCompiler is documented thread-safe;
// serialising keeps its compile threads bounded). The turn is a flag, not a held mutex,
// because a compile past its caller's deadline finishes on a thread of its own. The cache
// of compiled grammars is this one (xgrammar's own is off): a cached grammar is served at
// once, without the turn, the deadline or a thread, even while another grammar compiles.
struct VocabCompiler {
  VocabCompiler(const xgrammar::TokenizerInfo& info, int threads, int32_t n)
      : compiler(info, threads, /*cache_enabled=*/false), n_vocab(n) {}
  xgrammar::GrammarCompiler compiler;
  int32_t n_vocab;

  /// The compiled grammar of `key` (what was compiled and its source), if kept.
  std::optional<xgrammar::CompiledGrammar> cached(const std::string& key) {
    std::lock_guard lock(cache_mu);
    const auto it = index.find(key);
    if (it == index.end()) return std::nullopt;
    lru.splice(lru.begin(), lru, it->second);
    return it->second->grammar;
  }
  /// Keeps `g` as `key`'s grammar, dropping the least recently used past kCacheBytes.
  void remember(const std::string& key, const xgrammar::CompiledGrammar& g) {
    std::lock_guard lock(cache_mu);
    if (index.count(key) != 0) return;
    const int64_t bytes = int64_t(g.MemorySizeBytes() + key.size());
    lru.push_front(Entry{key, g, bytes});
    index.emplace(key, lru.begin());
    cache_bytes += bytes;
    while (cache_bytes > kCacheBytes && lru.size() > 1) {
      cache_bytes -= lru.back().bytes;
      index.erase(lru.back().key);
      lru.pop_back();
    }
  }

  /// Waits for the compiler's turn until `until` (none: forever); false when it did not come.
  bool take_turn(std::optional<Clock::time_point> until) {
    std::unique_lock lock(mu);
    const auto free = [&] { return !compiling; };
    if (!until) {
      cv.wait(lock, free);
    } else if (!cv.wait_until(lock, *until, free)) {
      return false;
    }
    compiling = true;
    return true;
  }
  void end_turn() {
    {
      std::lock_guard lock(mu);
      compiling = false;
    }
    cv.notify_one();
  }

 private:
  std::mutex mu;
  std::condition_variable cv;
  bool compiling = false;

  struct Entry {
    std::string key;
    xgrammar::CompiledGrammar grammar;
    int64_t bytes;
  };
  std::mutex cache_mu;
  std::list<Entry> lru;  ///< most recently used first
  std::unordered_map<std::string, std::list<Entry>::iterator> index;
  int64_t cache_bytes = 0;
};

xgrammar::TokenizerInfo tokenizer_info(const Tokenizer& tok) {
  const int32_t n = tok.n_vocab();
  std::vector<std::string> pieces(static_cast<size_t>(n));
  // The bytes each token adds to generated text; "" (control, unused) marks a token the
  // grammar never allows.
  for (int32_t i = 0; i < n; ++i) pieces[size_t(i)] = tok.token_to_piece(i, /*special=*/false);
  const std::vector<int32_t>& eog = tok.eog_ids();
  return xgrammar::TokenizerInfo(pieces, xgrammar::VocabType::RAW, n, eog, /*add_prefix_space=*/false);
}

std::shared_ptr<VocabCompiler> compiler_for(const Tokenizer& tok) {
  static std::mutex mu;
  static std::map<uint64_t, std::shared_ptr<VocabCompiler>> compilers;
  const uint64_t key = tok.identity_hash();
  {
    std::lock_guard lock(mu);
    if (auto it = compilers.find(key); it != compilers.end()) return it->second;
  }
  const int threads = int(std::clamp(std::thread::hardware_concurrency(), 1u, 8u));
  auto c = std::make_shared<VocabCompiler>(tokenizer_info(tok), threads, tok.n_vocab());
  std::lock_guard lock(mu);
  return compilers.emplace(key, std::move(c)).first->second;  // a racing thread's entry wins
}

// xgrammar's message without its "[hh:mm:ss] path/file.cc:line: " prefix and final newline.
std::string_view reason(std::string_view m) {
  if (m.starts_with('[')) {
    if (const size_t at = m.find(".cc:"); at != m.npos) {
      if (const size_t colon = m.find(": ", at + 4); colon != m.npos) m.remove_prefix(colon + 2);
    }
  }
  while (!m.empty() && (m.back() == '\n' || m.back() == ' ')) m.remove_suffix(1);
  return m;
}

// Compiles on the caller's thread (no deadline), or on a thread of its own that the caller
// waits for until the deadline; past it the compile goes on there (xgrammar cannot be
// stopped), keeps the vocabulary's turn and leaves its result in the cache. A grammar that
// a compile ahead in the queue put in the cache is taken from there.
xgrammar::CompiledGrammar run_compile(const std::shared_ptr<VocabCompiler>& vc, const char* what,
                                      const std::string& key, std::chrono::milliseconds deadline, CompileFn f) {
  std::optional<Clock::time_point> until;
  if (deadline.count() > 0) until = Clock::now() + deadline;
  if (!vc->take_turn(until)) {
    throw Error(ErrorCode::kOutOfMemory, fmt::format("{}: the grammar compiler stayed busy with another grammar for "
                                                     "the whole compile deadline ({} ms)",
                                                     what, deadline.count()));
  }
  if (auto hit = vc->cached(key)) {
    vc->end_turn();
    return std::move(*hit);
  }
  if (!until) {
    struct Turn {
      VocabCompiler& vc;
      ~Turn() { vc.end_turn(); }
    } turn{*vc};
    xgrammar::CompiledGrammar g = f(vc->compiler);
    vc->remember(key, g);
    return g;
  }
  auto done = std::make_shared<std::promise<xgrammar::CompiledGrammar>>();
  std::future<xgrammar::CompiledGrammar> result = done->get_future();
  try {
    std::thread([vc, f = std::move(f), done, key] {
      try {
        xgrammar::CompiledGrammar g = f(vc->compiler);
        vc->remember(key, g);
        done->set_value(std::move(g));
      } catch (...) {
        done->set_exception(std::current_exception());
      }
      vc->end_turn();
    }).detach();
  } catch (const std::system_error& e) {
    vc->end_turn();
    throw Error(ErrorCode::kOutOfMemory, fmt::format("{}: cannot start a compile thread: {}", what, e.what()));
  }
  if (result.wait_until(*until) != std::future_status::ready) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("{}: compiling it takes longer than the compile deadline ({} ms); it is too complex", what,
                            deadline.count()));
  }
  return result.get();
}

// `source`: what f compiles (with `what`, the cache's key).
std::shared_ptr<const Grammar> compile(const Tokenizer& tok, const char* what, std::string_view source,
                                       std::chrono::milliseconds deadline, CompileFn f) {
  auto vc = compiler_for(tok);
  const std::string key = fmt::format("{}\n{}", what, source);
  std::optional<xgrammar::CompiledGrammar> compiled = vc->cached(key);
  try {
    if (!compiled) compiled.emplace(run_compile(vc, what, key, deadline, std::move(f)));
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error(ErrorCode::kInvalidArgument, fmt::format("{}: {}", what, reason(e.what())));
  }
  // A grammar that allows no token at its start (no string matches it, e.g. `root ::= root`;
  // or none of its first characters is a token's text) compiles, but every generation
  // under it would fail at its first step: refuse it here, with the reason.
  xgrammar::GrammarMatcher start(*compiled, std::nullopt, /*terminate_without_stop_token=*/false,
                                 /*max_rollback_tokens=*/0);
  std::vector<uint32_t> mask(size_t(xgrammar::GetBitmaskSize(vc->n_vocab)));
  int64_t shape = int64_t(mask.size());
  DLTensor tensor{};
  tensor.data = mask.data();
  tensor.device = DLDevice{kDLCPU, 0};
  tensor.ndim = 1;
  tensor.dtype = xgrammar::GetBitmaskDLType();
  tensor.shape = &shape;
  start.FillNextTokenBitmask(&tensor);
  if (std::all_of(mask.begin(), mask.end(), [](uint32_t w) { return w == 0; })) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("{}: it allows no token of this vocabulary at its start (no string matches it, e.g. a "
                            "rule defined only by itself, or its first characters are no token's text)",
                            what));
  }
  auto impl =
      std::make_shared<const Grammar::Impl>(Grammar::Impl{std::move(*compiled), tok.identity_hash(), vc->n_vocab});
  return std::make_shared<const Grammar>(std::move(impl));
}

// Refuses a JSON schema whose constraints xgrammar 0.2.9 would drop (it logs a warning, or
// nothing, and compiles without them, so the output would not validate); read from its
// json_schema_converter.cc. Walks every subschema iteratively (no recursion depth).
bool is_integer_type(const nlohmann::json& type) {
  if (type == "integer") return true;
  if (!type.is_array() || type.empty()) return false;
  return std::all_of(type.begin(), type.end(), [](const nlohmann::json& t) { return t == "integer"; });
}

bool has_type(const nlohmann::json& v, const nlohmann::json& type) {
  if (type.is_array()) {
    return std::any_of(type.begin(), type.end(), [&](const nlohmann::json& t) { return has_type(v, t); });
  }
  if (type == "string") return v.is_string();
  if (type == "integer") return v.is_number_integer();
  if (type == "number") return v.is_number();
  if (type == "boolean") return v.is_boolean();
  if (type == "null") return v.is_null();
  if (type == "array") return v.is_array();
  if (type == "object") return v.is_object();
  return false;
}

// One subschema's own keywords; throws naming the first constraint xgrammar would drop.
void check_subschema(const nlohmann::json& s, const std::string& at) {
  const auto refuse = [&](std::string_view what) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("json_schema: {} at '{}' is not enforced by the grammar engine (xgrammar would "
                            "drop it and the output could fail the schema)",
                            what, at.empty() ? "/" : at));
  };
  for (const char* kw : {"not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies",
                         "contains", "minContains", "maxContains"}) {
    if (s.contains(kw)) refuse(fmt::format("'{}'", kw));
  }
  if (s.contains("uniqueItems") && s["uniqueItems"] != false) refuse("'uniqueItems'");
  // The first of these takes the whole subschema: the others beside it are dropped, and so
  // is every constraint but `type` on const/enum values that all have that type.
  static constexpr std::array kDispatch = {"$ref", "const", "enum", "anyOf", "oneOf", "allOf"};
  static constexpr std::array kAnnotations = {"title",    "description", "default",    "examples",     "$comment",
                                              "$schema",  "$id",         "$anchor",    "$defs",        "definitions",
                                              "readOnly", "writeOnly",   "deprecated", "discriminator"};
  const auto first = std::find_if(kDispatch.begin(), kDispatch.end(), [&](const char* k) { return s.contains(k); });
  if (first != kDispatch.end()) {
    for (const auto& [key, value] : s.items()) {
      if (key == *first || std::find(kAnnotations.begin(), kAnnotations.end(), key) != kAnnotations.end()) continue;
      if (key == "type" && (std::string_view(*first) == "const" || std::string_view(*first) == "enum")) {
        const nlohmann::json& values = s[*first];
        const nlohmann::json& type = value;
        const bool typed =
            std::string_view(*first) == "const"
                ? has_type(values, type)
                : values.is_array() && std::all_of(values.begin(), values.end(),
                                                   [&](const nlohmann::json& v) { return has_type(v, type); });
        if (typed) continue;
      }
      refuse(fmt::format("'{}' beside '{}' (only '{}' is read)", key, *first, *first));
    }
  }
  if (s.contains("allOf") && s["allOf"].is_array() && s["allOf"].size() > 1) refuse("'allOf' of several schemas");
  if (s.contains("multipleOf")) {
    const nlohmann::json& m = s["multipleOf"];
    const bool lower = s.contains("minimum") || s.contains("exclusiveMinimum");
    const bool upper = s.contains("maximum") || s.contains("exclusiveMaximum");
    bool enforced = is_integer_type(s.value("type", nlohmann::json())) && m.is_number_integer() &&
                    m.get<int64_t>() >= 1 && m.get<int64_t>() <= 1024 && lower == upper;
    if (enforced && lower) {
      const auto bound = [&](const char* inclusive, const char* exclusive, int64_t step) {
        const nlohmann::json& b = s.contains(inclusive) ? s[inclusive] : s[exclusive];
        const double v = b.is_number() ? b.get<double>() : 0.0;
        return s.contains(inclusive) ? v : v + double(step);
      };
      enforced = bound("maximum", "exclusiveMaximum", -1) - bound("minimum", "exclusiveMinimum", 1) <= 10000.0;
    }
    if (!enforced) {
      refuse("'multipleOf' (enforced on integers only, at most 1024, alone or with both bounds at most 10000 apart)");
    }
  }
  if (s.contains("minLength") || s.contains("maxLength")) {
    static constexpr std::array kBuiltinFormats = {
        "email",    "date", "time", "date-time",     "duration",     "ipv4",         "ipv6",
        "hostname", "uuid", "uri",  "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"};
    if (s.contains("pattern")) refuse("'minLength'/'maxLength' beside 'pattern'");
    if (s.contains("format") && s["format"].is_string() &&
        std::find(kBuiltinFormats.begin(), kBuiltinFormats.end(), s["format"].get<std::string>()) !=
            kBuiltinFormats.end()) {
      refuse("'minLength'/'maxLength' beside a built-in 'format'");
    }
  }
  if (s.contains("required") && s["required"].is_array()) {
    const nlohmann::json* props = s.contains("properties") ? &s["properties"] : nullptr;
    for (const auto& name : s["required"]) {
      if (name.is_string() && (!props || !props->is_object() || !props->contains(name.get<std::string>()))) {
        refuse(fmt::format("required property '{}', which 'properties' does not define,", name.get<std::string>()));
      }
    }
  }
}

void check_enforceable(std::string_view text) {
  nlohmann::json root;
  try {
    root = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception&) {
    return;  // xgrammar names the syntax error
  }
  // Every object reached through a keyword is a subschema, except the values of keywords
  // that hold data (enum, const, default, examples, required) and the maps whose keys are
  // names (properties, patternProperties, $defs, definitions), whose values are.
  static constexpr std::array kData = {"enum", "const", "default", "examples", "required"};
  static constexpr std::array kNameMaps = {"properties", "patternProperties", "$defs", "definitions"};
  std::vector<std::pair<const nlohmann::json*, std::string>> todo{{&root, ""}};
  while (!todo.empty()) {
    const auto [node, at] = todo.back();
    todo.pop_back();
    if (!node->is_object()) continue;
    check_subschema(*node, at);
    for (const auto& [key, value] : node->items()) {
      if (std::find(kData.begin(), kData.end(), key) != kData.end()) continue;
      const bool names = std::find(kNameMaps.begin(), kNameMaps.end(), key) != kNameMaps.end();
      if (value.is_object()) {
        if (!names) {
          todo.emplace_back(&value, at + "/" + key);
          continue;
        }
        for (const auto& [name, sub] : value.items()) todo.emplace_back(&sub, at + "/" + key + "/" + name);
      } else if (value.is_array()) {
        for (size_t i = 0; i < value.size(); ++i) todo.emplace_back(&value[i], fmt::format("{}/{}/{}", at, key, i));
      }
    }
  }
}

}  // namespace

bool Grammar::available() noexcept {
  return true;
}

std::shared_ptr<const Grammar> Grammar::from_json_schema(const Tokenizer& tokenizer, std::string_view schema,
                                                         std::chrono::milliseconds deadline) {
  check_enforceable(schema);
  return compile(
      tokenizer, "json_schema", schema, deadline, [text = std::string(schema)](xgrammar::GrammarCompiler& c) {
        return c.CompileJSONSchema(text, /*any_whitespace=*/false, std::nullopt, std::nullopt, /*strict_mode=*/true);
      });
}

std::shared_ptr<const Grammar> Grammar::json_object(const Tokenizer& tokenizer, std::chrono::milliseconds deadline) {
  return compile(tokenizer, "json_object", "", deadline, [](xgrammar::GrammarCompiler& c) {
    return c.CompileJSONSchema(R"({"type": "object"})", /*any_whitespace=*/false, std::nullopt, std::nullopt,
                               /*strict_mode=*/false);
  });
}

std::shared_ptr<const Grammar> Grammar::from_gbnf(const Tokenizer& tokenizer, std::string_view gbnf,
                                                  std::chrono::milliseconds deadline) {
  return compile(tokenizer, "grammar", gbnf, deadline,
                 [text = std::string(gbnf)](xgrammar::GrammarCompiler& c) { return c.CompileGrammar(text, "root"); });
}

uint64_t Grammar::vocab_hash() const noexcept {
  return impl_->vocab_hash;
}
int32_t Grammar::n_vocab() const noexcept {
  return impl_->n_vocab;
}

struct GrammarMatcher::State {
  std::shared_ptr<const Grammar> grammar;
  xgrammar::GrammarMatcher matcher;
  std::vector<uint32_t> mask;
  int64_t shape = 0;
  DLTensor tensor{};
};

GrammarMatcher::GrammarMatcher(std::shared_ptr<const Grammar> grammar) {
  if (!grammar) throw Error(ErrorCode::kInvalidArgument, "grammar matcher: no grammar");
  const int32_t words = xgrammar::GetBitmaskSize(grammar->n_vocab());
  xgrammar::GrammarMatcher matcher(grammar->impl().compiled, std::nullopt,
                                   /*terminate_without_stop_token=*/false,
                                   /*max_rollback_tokens=*/0);
  s_ = std::unique_ptr<State>(
      new State{std::move(grammar), std::move(matcher), std::vector<uint32_t>(size_t(words)), words, {}});
  s_->tensor.data = s_->mask.data();
  s_->tensor.device = DLDevice{kDLCPU, 0};
  s_->tensor.ndim = 1;
  s_->tensor.dtype = xgrammar::GetBitmaskDLType();
  s_->tensor.shape = &s_->shape;
}

std::span<const uint32_t> GrammarMatcher::fill_mask() {
  if (s_->matcher.IsTerminated()) {
    std::fill(s_->mask.begin(), s_->mask.end(), 0u);
  } else {
    s_->matcher.FillNextTokenBitmask(&s_->tensor);
  }
  return s_->mask;
}

bool GrammarMatcher::accept(int32_t token) {
  if (token < 0 || token >= s_->grammar->n_vocab() || s_->matcher.IsTerminated()) return false;
  return s_->matcher.AcceptToken(token);
}

bool GrammarMatcher::is_completed() const {
  return s_->matcher.IsCompleted();
}
bool GrammarMatcher::is_terminated() const {
  return s_->matcher.IsTerminated();
}
void GrammarMatcher::reset() {
  s_->matcher.Reset();
}

#else  // built without xgrammar

struct Grammar::Impl {};
struct GrammarMatcher::State {};

namespace {
[[noreturn]] void unavailable() {
  throw Error(ErrorCode::kInvalidArgument,
              "structured outputs: this build of Tandem has no grammar engine (xgrammar was not available when it "
              "was configured; see cmake/TandemXgrammar.cmake)");
}
}  // namespace

bool Grammar::available() noexcept {
  return false;
}
std::shared_ptr<const Grammar> Grammar::from_json_schema(const Tokenizer&, std::string_view,
                                                         std::chrono::milliseconds) {
  unavailable();
}
std::shared_ptr<const Grammar> Grammar::json_object(const Tokenizer&, std::chrono::milliseconds) {
  unavailable();
}
std::shared_ptr<const Grammar> Grammar::from_gbnf(const Tokenizer&, std::string_view, std::chrono::milliseconds) {
  unavailable();
}
uint64_t Grammar::vocab_hash() const noexcept {
  return 0;
}
int32_t Grammar::n_vocab() const noexcept {
  return 0;
}
GrammarMatcher::GrammarMatcher(std::shared_ptr<const Grammar>) {
  unavailable();
}
std::span<const uint32_t> GrammarMatcher::fill_mask() {
  unavailable();
}
bool GrammarMatcher::accept(int32_t) {
  unavailable();
}
bool GrammarMatcher::is_completed() const {
  unavailable();
}
bool GrammarMatcher::is_terminated() const {
  unavailable();
}
void GrammarMatcher::reset() {
  unavailable();
}

#endif

GrammarMatcher::~GrammarMatcher() = default;
GrammarMatcher::GrammarMatcher(GrammarMatcher&&) noexcept = default;
GrammarMatcher& GrammarMatcher::operator=(GrammarMatcher&&) noexcept = default;

}  // namespace tandem
