// tandem-server: OpenAI JSON mapping (see openai_json.hpp).
#include "openai_json.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <random>

#include "tandem/core/error.hpp"

namespace tandem::server {

using nlohmann::json;

ApiError::ApiError(int status, std::string message, std::string param, std::string code)
    : std::runtime_error(message),
      status_(status),
      message_(std::move(message)),
      param_(std::move(param)),
      code_(std::move(code)) {}

std::string_view ApiError::type() const noexcept {
  switch (status_) {
    case 401:
      return "authentication_error";
    case 404:
      return "not_found_error";
    case 429:
      return "rate_limit_error";
    case 503:
      return "unavailable_error";
    default:
      return status_ >= 500 ? "server_error" : "invalid_request_error";
  }
}

json ApiError::body() const {
  json e;
  e["message"] = message_;  // whole: what() stops at a NUL a client's value may carry
  e["type"] = type();
  e["param"] = param_.empty() ? json(nullptr) : json(param_);
  e["code"] = code_.empty() ? json(nullptr) : json(code_);
  return json{{"error", e}};
}

namespace {

const char* kind_of(const json& v) {
  switch (v.type()) {
    case json::value_t::null:
      return "null";
    case json::value_t::boolean:
      return "a boolean";
    case json::value_t::string:
      return "a string";
    case json::value_t::array:
      return "an array";
    case json::value_t::object:
      return "an object";
    default:
      return "a number";
  }
}

[[noreturn]] void bad(const std::string& param, const std::string& message) {
  throw ApiError(400, message, param, "invalid_value");
}

// A grammar the library refused: overloaded (no compile turn within the deadline) is 503,
// anything else (does not compile, or past the deadline) 400 with the reason.
[[noreturn]] void grammar_refused(const std::string& param, const Error& e, std::string_view prefix = {}) {
  if (e.code() == ErrorCode::kOutOfMemory) {
    throw ApiError(503, fmt::format("{}{}", prefix, e.what()), param, "grammar_compiler_busy");
  }
  // The library's deadline message, "<kind>: compiling it takes longer than ...", read from
  // its start: a schema's own text quoted in other messages cannot pass for it.
  const std::string_view m = e.what();
  const size_t colon = m.find(": ");
  const bool slow = colon != std::string_view::npos &&
                    m.substr(colon + 2).starts_with("compiling it takes longer than the compile deadline");
  throw ApiError(400, fmt::format("{}{}", prefix, e.what()), param, slow ? "grammar_too_complex" : "invalid_value");
}

[[noreturn]] void bad_type(const std::string& param, const json& v, const char* want) {
  throw ApiError(400, fmt::format("'{}' must be {}, got {}", param, want, kind_of(v)), param, "invalid_type");
}

/// The field when present and not null.
const json* field(const json& body, const char* key) {
  const auto it = body.find(key);
  return it == body.end() || it->is_null() ? nullptr : &*it;
}

double number_in(const json& body, const char* key, double lo, double hi, double dflt) {
  const json* v = field(body, key);
  if (!v) return dflt;
  if (!v->is_number()) bad_type(key, *v, "a number");
  const double x = v->get<double>();
  if (!std::isfinite(x) || x < lo || x > hi) bad(key, fmt::format("'{}' must be in [{}, {}], got {}", key, lo, hi, x));
  return x;
}

std::optional<int64_t> integer(const json& body, const char* key) {
  const json* v = field(body, key);
  if (!v) return std::nullopt;
  if (!v->is_number_integer()) bad_type(key, *v, "an integer");
  if (v->is_number_unsigned() && v->get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max())) {
    bad(key, fmt::format("'{}' is too large", key));
  }
  return v->get<int64_t>();
}

bool boolean(const json& body, const char* key, bool dflt) {
  const json* v = field(body, key);
  if (!v) return dflt;
  if (!v->is_boolean()) bad_type(key, *v, "a boolean");
  return v->get<bool>();
}

std::vector<int32_t> token_ids(const json& arr, const std::string& param, const Tokenizer& tok) {
  std::vector<int32_t> ids;
  ids.reserve(arr.size());
  for (const auto& t : arr) {
    if (!t.is_number_integer()) bad_type(param, t, "an array of integer token ids");
    const int64_t id = t.get<int64_t>();
    if (id < 0 || id >= tok.n_vocab()) {
      bad(param, fmt::format("token id {} is outside the vocabulary [0, {})", id, tok.n_vocab()));
    }
    ids.push_back(int32_t(id));
  }
  return ids;
}

/// The nesting depth of a JSON value's objects and arrays (a scalar: 0), without recursion
/// (the value may be nested deeper than the stack allows).
template <class Json>
int32_t json_depth(const Json& root) {
  int32_t deepest = 0;
  std::vector<std::pair<const Json*, int32_t>> todo{{&root, 0}};
  while (!todo.empty()) {
    const auto [v, d] = todo.back();
    todo.pop_back();
    if (!v->is_structured()) continue;
    deepest = std::max(deepest, d + 1);
    for (const auto& child : *v) todo.emplace_back(&child, d + 1);
  }
  return deepest;
}

/// The deepest parenthesis nesting of GBNF text (outside "strings", [classes] and # comments).
int32_t gbnf_depth(std::string_view g) {
  int32_t depth = 0, deepest = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    const char c = g[i];
    if (c == '"' || c == '[') {
      const char close = c == '"' ? '"' : ']';
      for (++i; i < g.size() && g[i] != close; ++i) {
        if (g[i] == '\\') ++i;
      }
    } else if (c == '#') {
      while (i < g.size() && g[i] != '\n') ++i;
    } else if (c == '(') {
      deepest = std::max(deepest, ++depth);
    } else if (c == ')') {
      depth = std::max(depth - 1, 0);
    }
  }
  return deepest;
}

/// kMaxGrammarBytes / kMaxGrammarDepth for one client grammar (`what` its kind in the message).
void check_grammar_bounds(const std::string& param, size_t bytes, int32_t depth, std::string_view what) {
  if (bytes > kMaxGrammarBytes) {
    throw ApiError(400,
                   fmt::format("'{}' is {} bytes as {}; the limit is {} bytes (tandem-server bounds the grammars it "
                               "compiles)",
                               param, bytes, what, kMaxGrammarBytes),
                   param, "grammar_too_large");
  }
  if (depth > kMaxGrammarDepth) {
    throw ApiError(400,
                   fmt::format("'{}' is nested {} levels deep; the limit is {} levels (tandem-server bounds the "
                               "grammars it compiles)",
                               param, depth, kMaxGrammarDepth),
                   param, "grammar_too_deep");
  }
}

/// The properties a schema declares: the members of every object under a "properties"
/// key, at any depth (counted without recursion).
template <class Json>
size_t schema_properties(const Json& root) {
  size_t n = 0;
  std::vector<const Json*> todo{&root};
  while (!todo.empty()) {
    const Json* v = todo.back();
    todo.pop_back();
    if (v->is_object()) {
      if (const auto p = v->find("properties"); p != v->end() && p->is_object()) n += p->size();
    }
    if (v->is_structured()) {
      for (const auto& child : *v) todo.push_back(&child);
    }
  }
  return n;
}

/// A JSON schema within the bounds, as the compact JSON text the grammar engine compiles.
template <class Json>
std::string bounded_schema(const std::string& param, const Json& schema) {
  check_grammar_bounds(param, 0, json_depth(schema), "JSON");  // depth first: dump() recurses
  if (const size_t n = schema_properties(schema); n > kMaxSchemaProperties) {
    throw ApiError(400,
                   fmt::format("'{}' declares {} properties; the limit is {} properties (tandem-server bounds the "
                               "grammars it compiles)",
                               param, n, kMaxSchemaProperties),
                   param, "grammar_too_large");
  }
  std::string text = schema.dump();
  check_grammar_bounds(param, text.size(), 0, "JSON");
  return text;
}

// Structured outputs: OpenAI's response_format (text, json_object, json_schema) and
// llama-server's `json_schema` (a schema object) and `grammar` (GBNF text); at most one.
void parse_structured(const json& body, const ModelInfo& info, GenerationSpec& s) {
  enum class Kind { kNone, kObject, kSchema, kGbnf };
  Kind kind = Kind::kNone;
  std::string param, source;
  auto set = [&](Kind k, std::string p, std::string src) {
    if (kind != Kind::kNone) {
      bad(p, fmt::format("'{}' and '{}' both constrain the output; give one", param, p));
    }
    kind = k;
    param = std::move(p);
    source = std::move(src);
  };
  if (const json* rf = field(body, "response_format")) {
    if (!rf->is_object()) bad_type("response_format", *rf, "an object");
    const json* type = field(*rf, "type");
    if (!type || !type->is_string()) bad("response_format.type", "'response_format.type' must be a string");
    const std::string t = type->get<std::string>();
    if (t == "json_object") {
      set(Kind::kObject, "response_format", "");
    } else if (t == "json_schema") {
      const json* js = field(*rf, "json_schema");
      if (!js || !js->is_object())
        bad("response_format.json_schema", "'response_format.json_schema' must be an object");
      if (const json* name = field(*js, "name"); name && !name->is_string()) {
        bad_type("response_format.json_schema.name", *name, "a string");
      }
      if (const json* strict = field(*js, "strict"); strict && !strict->is_boolean()) {
        bad_type("response_format.json_schema.strict", *strict, "a boolean");
      }
      const json* schema = field(*js, "schema");
      if (!schema || !schema->is_object()) {
        bad("response_format.json_schema.schema", "'response_format.json_schema.schema' must be an object");
      }
      set(Kind::kSchema, "response_format.json_schema.schema",
          bounded_schema("response_format.json_schema.schema", *schema));
    } else if (t != "text") {
      throw ApiError(400, fmt::format("response_format type '{}' is not supported (text, json_object, json_schema)", t),
                     "response_format.type", "unsupported_value");
    }
  }
  if (const json* js = field(body, "json_schema")) {
    if (!js->is_object()) bad_type("json_schema", *js, "an object");
    set(Kind::kSchema, "json_schema", bounded_schema("json_schema", *js));
  }
  if (const json* g = field(body, "grammar"); g && !(g->is_string() && g->get<std::string>().empty())) {
    if (!g->is_string()) bad_type("grammar", *g, "a string (GBNF)");
    const auto& text = g->get_ref<const std::string&>();
    check_grammar_bounds("grammar", text.size(), gbnf_depth(text), "GBNF");
    set(Kind::kGbnf, "grammar", text);
  }
  if (kind == Kind::kNone) return;
  if (s.grammar) bad(param, fmt::format("'{}' cannot be combined with a forced tool call (tool_choice)", param));
  if (!Grammar::available()) {
    throw ApiError(400, "structured outputs are not available: this tandem-server was built without xgrammar", param,
                   "unsupported_parameter");
  }
  try {
    const Tokenizer& tok = *info.tokenizer;
    s.grammar = kind == Kind::kObject   ? Grammar::json_object(tok, info.grammar_deadline)
                : kind == Kind::kSchema ? Grammar::from_json_schema(tok, source, info.grammar_deadline)
                                        : Grammar::from_gbnf(tok, source, info.grammar_deadline);
  } catch (const Error& e) {
    grammar_refused(param, e);
  }
}

// Fields shared by chat and completions: sampling, limits, stop, stream, SLA, timeout.
void parse_common(const json& body, const ModelInfo& info, std::string_view sla_header, GenerationSpec& s) {
  check_model(body, info);
  s.model = info.names.front();
  if (const auto n = integer(body, "n")) {
    if (*n < 1 || *n > Scheduler::kMaxChoices) {
      bad("n", fmt::format("'n' must be in [1, {}], got {}", Scheduler::kMaxChoices, *n));
    }
    s.n = int32_t(*n);
  }
  if (const auto best_of = integer(body, "best_of"); best_of && *best_of != s.n) {  // vLLM: best_of == n only
    throw ApiError(400, "best_of is supported only equal to n", "best_of", "unsupported_value");
  }
  if (const json* lb = field(body, "logit_bias"); lb && !(lb->is_object() && lb->empty())) {
    throw ApiError(400, "logit_bias is not supported", "logit_bias", "unsupported_parameter");
  }
  // The number of alternatives per token, field `name`: 0..20 (OpenAI's chat limit; the
  // legacy API's is 5, vLLM's 20).
  const auto top_count = [&](const char* name) {
    const auto n = integer(body, name);
    if (n && (*n < 0 || *n > kMaxTopLogprobs)) {
      bad(name, fmt::format("'{}' must be in [0, {}], got {}", name, kMaxTopLogprobs, *n));
    }
    return n;
  };
  if (s.chat) {  // logprobs: true, top_logprobs (OpenAI: top_logprobs needs logprobs)
    const bool lp = boolean(body, "logprobs", false);
    const auto top = top_count("top_logprobs");
    if (top && !lp) bad("top_logprobs", "'logprobs' must be true when 'top_logprobs' is given");
    s.logprobs = lp ? int32_t(top.value_or(0)) : -1;
  } else if (const auto n = top_count("logprobs")) {  // the legacy API: an integer
    s.logprobs = int32_t(*n);
  }
  if (const json* tools = field(body, "tools"); !s.chat && tools && !(tools->is_array() && tools->empty())) {
    throw ApiError(400, "tools are a chat completions parameter", "tools", "unsupported_parameter");
  }
  s.stream = boolean(body, "stream", false);
  s.ignore_eos = boolean(body, "ignore_eos", false);
  parse_structured(body, info, s);
  if (const json* so = field(body, "stream_options")) {
    if (!so->is_object()) bad_type("stream_options", *so, "an object");
    if (!s.stream) bad("stream_options", "'stream_options' is only allowed when 'stream' is true");
    s.include_usage = boolean(*so, "include_usage", false);
  }

  SamplingParams& sp = s.sampling;  // llama-server's defaults for what the body leaves out
  sp.temperature = float(number_in(body, "temperature", 0.0, 2.0, 0.8));
  sp.top_p = float(number_in(body, "top_p", 0.0, 1.0, 0.95));
  sp.min_p = float(number_in(body, "min_p", 0.0, 1.0, 0.05));
  sp.presence_penalty = float(number_in(body, "presence_penalty", -2.0, 2.0, 0.0));
  sp.frequency_penalty = float(number_in(body, "frequency_penalty", -2.0, 2.0, 0.0));
  sp.repeat_penalty = float(number_in(body, "repeat_penalty", 0.0, 10.0, 1.0));
  if (const auto k = integer(body, "top_k")) {
    if (*k < 0) bad("top_k", "'top_k' must be >= 0");
    sp.top_k = int32_t(std::min<int64_t>(*k, std::numeric_limits<int32_t>::max()));  // beyond the vocabulary: no cut
  }
  if (const auto seed = integer(body, "seed")) {
    sp.seed = uint64_t(*seed);
  } else {
    thread_local uint64_t state = uint64_t(std::chrono::steady_clock::now().time_since_epoch().count());
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;  // PCG multiplier (Knuth MMIX)
    sp.seed = state >> 1;
  }
  try {
    sp.validate();
  } catch (const Error& e) {
    bad("", e.what());
  }

  if (const json* st = field(body, "stop")) {
    if (st->is_string()) {
      s.stop.push_back(st->get<std::string>());
    } else if (st->is_array()) {
      for (const auto& x : *st) {
        if (!x.is_string()) bad_type("stop", x, "a string or an array of strings");
        s.stop.push_back(x.get<std::string>());
      }
    } else {
      bad_type("stop", *st, "a string or an array of strings");
    }
    if (s.stop.size() > 16) bad("stop", "at most 16 stop strings");
    for (const auto& x : s.stop) {
      if (x.empty()) bad("stop", "a stop string is empty");
    }
  }

  std::string sla_name;
  if (const json* v = field(body, "sla")) {
    if (!v->is_string()) bad_type("sla", *v, "a string");
    sla_name = v->get<std::string>();
  } else {
    sla_name = std::string(sla_header);
  }
  if (!sla_name.empty()) {
    const auto c = parse_sla_class(sla_name);
    if (!c) bad("sla", fmt::format("'sla' must be interactive, standard or batch, got '{}'", sla_name));
    s.sla = *c;
  }
  if (field(body, "timeout")) s.timeout_s = number_in(body, "timeout", 1e-3, 86400.0, 0.0);

  // max_tokens after the prompt is known: the rest of the context when absent.
  const int32_t n_prompt = int32_t(s.prompt_ids.size());
  if (n_prompt == 0) bad(s.chat ? "messages" : "prompt", "the prompt has no tokens");
  if (n_prompt >= info.n_ctx) {
    throw ApiError(400,
                   fmt::format("the prompt has {} tokens; this model's context is {} tokens", n_prompt, info.n_ctx),
                   s.chat ? "messages" : "prompt", "context_length_exceeded");
  }
  std::optional<int64_t> mt = integer(body, "max_completion_tokens");
  const char* mt_key = "max_completion_tokens";
  if (!mt) {
    mt = integer(body, "max_tokens");
    mt_key = "max_tokens";
  }
  if (mt) {
    if (*mt < 1) bad(mt_key, fmt::format("'{}' must be >= 1", mt_key));
    if (*mt > int64_t(info.n_ctx - n_prompt)) {
      throw ApiError(400,
                     fmt::format("this model's context is {} tokens; the prompt has {} and {} were requested",
                                 info.n_ctx, n_prompt, *mt),
                     mt_key, "context_length_exceeded");
    }
    s.max_tokens = int32_t(*mt);
  } else {
    s.max_tokens = info.n_ctx - n_prompt;
  }
}

std::string message_content(const json& m, size_t i) {
  const std::string param = fmt::format("messages[{}].content", i);
  const json* c = field(m, "content");
  if (!c) bad(param, "a message needs 'content'");
  if (c->is_string()) return c->get<std::string>();
  if (!c->is_array()) bad_type(param, *c, "a string or an array of text parts");
  std::string text;
  for (const auto& part : *c) {
    if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") || !part["text"].is_string()) {
      throw ApiError(400, "only text content parts ({\"type\": \"text\", \"text\": ...}) are supported", param,
                     "unsupported_value");
    }
    text += part["text"].get<std::string>();
  }
  return text;
}

}  // namespace

template <class Json>
void check_body_depth(const Json& body) {
  if (const int32_t d = json_depth(body); d > kMaxBodyDepth) {
    throw ApiError(400, fmt::format("the request body is nested {} levels deep; the limit is {}", d, kMaxBodyDepth), "",
                   "invalid_json");
  }
}
template void check_body_depth(const json&);
template void check_body_depth(const nlohmann::ordered_json&);

json parse_body(std::string_view body) {
  json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) throw ApiError(400, "the request body is not valid JSON", "", "invalid_json");
  if (!j.is_object()) throw ApiError(400, "the request body must be a JSON object", "", "invalid_json");
  check_body_depth(j);
  return j;
}

void check_model(const json& body, const ModelInfo& info) {
  const json* m = field(body, "model");
  if (!m) return;
  if (!m->is_string()) bad_type("model", *m, "a string");
  const auto name = m->get<std::string>();
  for (const auto& n : info.names) {
    if (n == name) return;
  }
  throw ApiError(404, fmt::format("the model '{}' does not exist; this server serves '{}'", name, info.names.front()),
                 "model", "model_not_found");
}

namespace {

/// One entry of `tools`, as OpenAI checks it: {"type": "function", "function": {"name":
/// ^[a-zA-Z0-9_-]{1,64}$, "description": a string, "parameters": a JSON schema object
/// ("type" "object" when it has a type), within the grammar bounds (a forced call compiles
/// it), "strict": a boolean}}.
void check_tool(const nlohmann::ordered_json& t, size_t i) {
  const std::string at = fmt::format("tools[{}]", i);
  if (!t.is_object() || t.value("type", "") != "function" || !t.contains("function") || !t["function"].is_object() ||
      !t["function"].contains("name") || !t["function"]["name"].is_string()) {
    bad(at, "a tool must be {\"type\": \"function\", \"function\": {\"name\": ...}}");
  }
  const auto& f = t["function"];
  const auto& name = f["name"].get_ref<const std::string&>();
  const bool name_ok = !name.empty() && name.size() <= 64 && std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
  });
  if (!name_ok) {
    bad(at + ".function.name",
        fmt::format("a function name must be 1 to 64 of a-z, A-Z, 0-9, '_' and '-', got '{}'", utf8_sanitize(name)));
  }
  if (const auto d = f.find("description"); d != f.end() && !d->is_null() && !d->is_string()) {
    bad(at + ".function.description", "'description' must be a string");
  }
  if (const auto st = f.find("strict"); st != f.end() && !st->is_null() && !st->is_boolean()) {
    bad(at + ".function.strict", "'strict' must be a boolean");
  }
  const auto p = f.find("parameters");
  if (p == f.end() || p->is_null()) return;
  const std::string pp = at + ".function.parameters";
  if (!p->is_object()) bad(pp, "'parameters' must be a JSON schema object");
  if (const auto type = p->find("type"); type != p->end() && *type != "object") {
    bad(pp, fmt::format("'parameters' must be a JSON schema of type \"object\", got type {}", type->dump()));
  }
  bounded_schema(pp, *p);
}

/// The tool path of parse_chat_request: validates tools / tool_choice / messages, renders
/// the prompt, and says how to parse the output.
void parse_tools(const json& body, const ModelInfo& info, std::string_view raw, GenerationSpec& s) {
  const nlohmann::ordered_json ordered =
      raw.empty() ? nlohmann::ordered_json::parse(body.dump()) : nlohmann::ordered_json::parse(raw);
  nlohmann::ordered_json tools = ordered.value("tools", nlohmann::ordered_json());
  if (tools.is_null()) tools = nlohmann::ordered_json::array();
  if (!tools.is_array()) bad_type("tools", body["tools"], "an array");
  for (size_t i = 0; i < tools.size(); ++i) check_tool(tools[i], i);
  std::string choice = tools.empty() ? "none" : "auto";
  std::optional<std::string> forced_name;
  if (const json* tc = field(body, "tool_choice")) {
    if (tc->is_string()) {
      choice = tc->get<std::string>();
      if (choice != "none" && choice != "auto" && choice != "required") {
        bad("tool_choice", fmt::format("'tool_choice' must be none, auto, required or a function, got '{}'", choice));
      }
    } else if (tc->is_object() && tc->value("type", "") == "function" && tc->contains("function") &&
               (*tc)["function"].is_object() && (*tc)["function"].contains("name") &&
               (*tc)["function"]["name"].is_string()) {
      choice = "function";
      forced_name = (*tc)["function"]["name"].get<std::string>();
      const bool known =
          std::any_of(tools.begin(), tools.end(), [&](const auto& t) { return t["function"]["name"] == *forced_name; });
      if (!known) bad("tool_choice", fmt::format("tool_choice names '{}', which is not in tools", *forced_name));
    } else {
      bad_type("tool_choice", *tc, "a string or {\"type\": \"function\", \"function\": {\"name\": ...}}");
    }
    if (choice != "none" && tools.empty()) bad("tool_choice", "'tool_choice' needs 'tools'");
  }
  if (choice == "required" && tools.size() == 1) forced_name = tools[0]["function"]["name"].get<std::string>();
  const bool parallel = boolean(body, "parallel_tool_calls", true);
  const bool use = choice != "none";
  try {
    const ToolTemplateInput in =
        tool_template_input(info.tool_prompt, ordered["messages"], use ? tools : nlohmann::ordered_json::array());
    s.prompt_ids =
        info.chat_template->tokenize_json(*info.tokenizer, in.messages, /*add_generation_prompt=*/true, in.tools);
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kInvalidArgument && e.code() != ErrorCode::kOutOfMemory) throw;
    throw ApiError(400, fmt::format("the chat template cannot render this request: {}", e.what()), "messages",
                   std::string(error_code_name(e.code())));
  }
  if (!use) return;
  GenerationSpec::Tools t;
  t.format = info.tool_prompt.format;
  t.parallel = parallel;
  if ((choice == "required" || choice == "function") && Grammar::available()) {
    // The call is decoded under a grammar: one {"name": ..., "arguments": <the tool's
    // parameters schema>}, so a call that completes within max_tokens always parses. One call
    // even with parallel_tool_calls: an array would let the model run on with calls until
    // max_tokens cuts them all off.
    t.prefix = t.format == ToolCallFormat::kHermes ? "<tool_call>\n" : "";
    t.parallel = false;
    try {
      s.grammar = Grammar::from_json_schema(*info.tokenizer, forced_tool_call_schema(tools, forced_name, false).dump(),
                                            info.grammar_deadline);
    } catch (const Error& e) {
      grammar_refused("tools", e, "the forced tool call's schema does not compile: ");
    }
  } else if (choice == "required" || choice == "function") {  // without a grammar engine: prompted only
    t.prefix = forced_call_prefix(t.format, forced_name);
  }
  if (!t.prefix.empty()) {
    const auto ids = info.tokenizer->tokenize(t.prefix, /*add_special=*/false, /*parse_special=*/true);
    s.prompt_ids.insert(s.prompt_ids.end(), ids.begin(), ids.end());
  }
  s.tools = std::move(t);
}

}  // namespace

GenerationSpec parse_chat_request(const json& body, const ModelInfo& info, std::string_view sla_header,
                                  std::string_view raw) {
  GenerationSpec s;
  s.chat = true;
  const json* msgs = field(body, "messages");
  if (!msgs) bad("messages", "'messages' is required");
  if (!msgs->is_array()) bad_type("messages", *msgs, "an array");
  if (msgs->empty()) bad("messages", "'messages' must not be empty");
  if (chat_request_uses_tools(body)) {
    parse_tools(body, info, raw, s);
    parse_common(body, info, sla_header, s);
    if (s.tools && !s.tools->prefix.empty() && !s.tools->parallel && s.tools->format == ToolCallFormat::kHermes) {
      s.stop.push_back("</tool_call>");  // one forced call: stop at its end
    }
    return s;
  }
  std::vector<ChatMessage> conv;
  conv.reserve(msgs->size());
  for (size_t i = 0; i < msgs->size(); ++i) {
    const json& m = (*msgs)[i];
    if (!m.is_object()) bad_type(fmt::format("messages[{}]", i), m, "an object");
    const json* role = field(m, "role");
    const std::string rp = fmt::format("messages[{}].role", i);
    if (!role || !role->is_string()) bad(rp, "a message needs a string 'role'");
    std::string r = role->get<std::string>();
    if (r == "developer") r = "system";  // OpenAI's newer name for the system role
    if (r != "system" && r != "user" && r != "assistant") {
      bad(rp, fmt::format("role '{}' is not supported (system, developer, user, assistant)", r));
    }
    conv.push_back({std::move(r), message_content(m, i)});
  }
  s.prompt_ids = info.chat_template->tokenize(*info.tokenizer, conv, /*add_assistant=*/true);
  parse_common(body, info, sla_header, s);
  return s;
}

GenerationSpec parse_completion_request(const json& body, const ModelInfo& info, std::string_view sla_header) {
  GenerationSpec s;
  const json* p = field(body, "prompt");
  if (!p) bad("prompt", "'prompt' is required");
  const json* one = p;
  if (p->is_array() && !p->empty() && (p->front().is_string() || p->front().is_array())) {
    if (p->size() != 1) {
      throw ApiError(400,
                     fmt::format("a batch of {} prompts: this server takes one prompt per request (a string, an "
                                 "array of token ids, or a one-element array of either); send one request each",
                                 p->size()),
                     "prompt", "unsupported_value");
    }
    one = &p->front();
  }
  if (one->is_string()) {
    // Special tokens in the text are parsed ("<|im_start|>" is one token), as llama-server
    // and vLLM do: clients that render their own template send them so. Chat messages'
    // content stays plain text (parse_chat_request).
    s.prompt_ids = info.tokenizer->tokenize(one->get<std::string>(), /*add_special=*/true, /*parse_special=*/true);
  } else if (one->is_array()) {
    s.prompt_ids = token_ids(*one, "prompt", *info.tokenizer);
  } else {
    bad_type("prompt", *one, "a string or an array of token ids");
  }
  if (field(body, "suffix")) throw ApiError(400, "suffix is not supported", "suffix", "unsupported_parameter");
  if (boolean(body, "echo", false)) throw ApiError(400, "echo is not supported", "echo", "unsupported_parameter");
  parse_common(body, info, sla_header, s);
  return s;
}

bool cut_short(RequestFinish f) noexcept {
  return f == RequestFinish::kLength || f == RequestFinish::kTimeout;
}

std::string_view finish_reason_name(RequestFinish f) noexcept {
  switch (f) {
    case RequestFinish::kStop:
    case RequestFinish::kStopString:
      return "stop";
    case RequestFinish::kLength:
    case RequestFinish::kTimeout:  // said by the choice's "tandem_timeout": true
      return "length";
    default:
      return "abort";
  }
}

namespace {

json usage(int32_t prompt_tokens, int32_t completion_tokens) {
  return {{"prompt_tokens", prompt_tokens},
          {"completion_tokens", completion_tokens},
          {"total_tokens", prompt_tokens + completion_tokens}};
}

json envelope(const GenerationSpec& spec, const std::string& id, int64_t created, bool chunk) {
  return {{"id", id},
          {"object", spec.chat ? (chunk ? "chat.completion.chunk" : "chat.completion") : "text_completion"},
          {"created", created},
          {"model", spec.model},
          {"system_fingerprint", "tandem"}};
}

}  // namespace

namespace {

size_t code_points(std::string_view bytes) {
  size_t n = 0;
  for (const unsigned char c : bytes) n += (c & 0xC0) != 0x80;
  return n;
}

double finite_logprob(float lp) {
  return std::isfinite(lp) ? double(lp) : -9999.0;
}

json bytes_of(std::string_view piece) {
  json b = json::array();
  for (const unsigned char c : piece) b.push_back(int(c));
  return b;
}

}  // namespace

json logprobs_json(const GenerationSpec& spec, const Tokenizer& tok, std::span<const TokenLogprob> entries,
                   size_t& text_offset) {
  const auto piece = [&tok](int32_t id) { return tok.token_to_piece(id, false); };
  if (spec.chat) {
    json content = json::array();
    for (const TokenLogprob& e : entries) {
      const std::string p = piece(e.token);
      json top = json::array();
      for (int32_t i = 0; i < e.n_top; ++i) {
        const std::string q = piece(e.top[size_t(i)].token);
        top.push_back({{"token", utf8_sanitize(q)},
                       {"logprob", finite_logprob(e.top[size_t(i)].logprob)},
                       {"bytes", bytes_of(q)}});
      }
      content.push_back({{"token", utf8_sanitize(p)},
                         {"logprob", finite_logprob(e.logprob)},
                         {"bytes", bytes_of(p)},
                         {"top_logprobs", std::move(top)}});
      text_offset += code_points(p);
    }
    return {{"content", std::move(content)}, {"refusal", nullptr}};
  }
  json tokens = json::array(), token_logprobs = json::array(), top_logprobs = json::array(), offsets = json::array();
  for (const TokenLogprob& e : entries) {
    const std::string p = piece(e.token);
    tokens.push_back(utf8_sanitize(p));
    token_logprobs.push_back(finite_logprob(e.logprob));
    json top = json::object();
    for (int32_t i = 0; i < e.n_top; ++i) {
      const std::string key = utf8_sanitize(piece(e.top[size_t(i)].token));
      if (!top.contains(key)) top[key] = finite_logprob(e.top[size_t(i)].logprob);  // the likelier of equal strings
    }
    top_logprobs.push_back(std::move(top));
    offsets.push_back(text_offset);
    text_offset += code_points(p);
  }
  return {{"tokens", std::move(tokens)},
          {"token_logprobs", std::move(token_logprobs)},
          {"top_logprobs", std::move(top_logprobs)},
          {"text_offset", std::move(offsets)}};
}

json tool_calls_json(std::span<const ToolCall> calls, bool with_index) {
  static constexpr std::string_view kAlnum = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
  thread_local std::mt19937_64 rng{std::random_device{}()};
  json out = json::array();
  for (size_t i = 0; i < calls.size(); ++i) {
    std::string id = "call_";
    for (int k = 0; k < 24; ++k) id += kAlnum[rng() % kAlnum.size()];
    json c = {
        {"id", id}, {"type", "function"}, {"function", {{"name", calls[i].name}, {"arguments", calls[i].arguments}}}};
    if (with_index) c["index"] = i;
    out.push_back(std::move(c));
  }
  return out;
}

json completion_body(const GenerationSpec& spec, const std::string& id, int64_t created,
                     std::span<const ChoiceResult> choices, int32_t prompt_tokens, int32_t completion_tokens) {
  json j = envelope(spec, id, created, false);
  j["choices"] = json::array();
  for (size_t i = 0; i < choices.size(); ++i) {
    const ChoiceResult& c = choices[i];
    const bool called = c.parsed && !c.parsed->calls.empty();
    const bool cut = cut_short(c.finish);
    json choice = {{"index", i},
                   {"logprobs", c.logprobs},
                   {"finish_reason", called && !cut ? std::string_view("tool_calls") : finish_reason_name(c.finish)}};
    if (c.finish == RequestFinish::kTimeout) choice["tandem_timeout"] = true;
    if (spec.chat) {
      choice["message"] = {{"role", "assistant"}, {"content", c.text}};
      if (c.parsed) {
        const bool none = c.parsed->content.empty() && (called || cut);
        choice["message"]["content"] = none ? json(nullptr) : json(c.parsed->content);
      }
      if (called) choice["message"]["tool_calls"] = tool_calls_json(c.parsed->calls, false);
    } else {
      choice["text"] = c.text;
    }
    j["choices"].push_back(std::move(choice));
  }
  j["usage"] = usage(prompt_tokens, completion_tokens);
  return j;
}

json stream_chunk(const GenerationSpec& spec, const std::string& id, int64_t created, int32_t index,
                  std::string_view text, bool role_only, std::optional<RequestFinish> finish, json logprobs,
                  json tool_calls, bool tools_called) {
  json j = envelope(spec, id, created, true);
  json choice = {{"index", index}, {"logprobs", std::move(logprobs)}};
  choice["finish_reason"] = !finish        ? json(nullptr)
                            : tools_called ? json("tool_calls")
                                           : json(finish_reason_name(*finish));
  if (finish == RequestFinish::kTimeout) choice["tandem_timeout"] = true;
  if (spec.chat) {
    json delta = json::object();
    if (role_only) {
      delta["role"] = "assistant";
      delta["content"] = "";
    } else if (!text.empty() || (!finish && tool_calls.is_null())) {
      delta["content"] = text;
    }
    if (!tool_calls.is_null()) delta["tool_calls"] = std::move(tool_calls);
    choice["delta"] = delta;
  } else {
    choice["text"] = text;
  }
  j["choices"] = json::array({choice});
  if (spec.include_usage) j["usage"] = nullptr;
  return j;
}

json usage_chunk(const GenerationSpec& spec, const std::string& id, int64_t created, int32_t prompt_tokens,
                 int32_t completion_tokens) {
  json j = envelope(spec, id, created, true);
  j["choices"] = json::array();
  j["usage"] = usage(prompt_tokens, completion_tokens);
  return j;
}

json tokenize_response(const json& body, const Tokenizer& tok) {
  const json* c = field(body, "content");
  if (!c) bad("content", "'content' is required");
  if (!c->is_string()) bad_type("content", *c, "a string");
  const bool add_special = boolean(body, "add_special", false);
  const bool parse_special = boolean(body, "parse_special", true);
  const bool with_pieces = boolean(body, "with_pieces", false);
  const auto ids = tok.tokenize(c->get<std::string>(), add_special, parse_special);
  json tokens = json::array();
  for (const int32_t id : ids) {
    if (with_pieces) {
      const std::string piece = tok.token_to_piece(id, true);
      const std::string clean = utf8_sanitize(piece);
      if (clean == piece) {
        tokens.push_back({{"id", id}, {"piece", piece}});
      } else {  // llama-server: a piece that is not valid UTF-8 is given as its bytes
        json bytes = json::array();
        for (const unsigned char b : piece) bytes.push_back(int(b));
        tokens.push_back({{"id", id}, {"piece", bytes}});
      }
    } else {
      tokens.push_back(id);
    }
  }
  return {{"tokens", tokens}};
}

json detokenize_response(const json& body, const Tokenizer& tok) {
  const json* t = field(body, "tokens");
  if (!t) bad("tokens", "'tokens' is required");
  if (!t->is_array()) bad_type("tokens", *t, "an array of integer token ids");
  const auto ids = token_ids(*t, "tokens", tok);
  return {{"content", utf8_sanitize(tok.detokenize_raw(ids, /*special=*/true))}};
}

}  // namespace tandem::server
