// Tool calls: template formats, parsing generated calls, the Hermes tool prompt, the forced
// call's JSON schema (see tool_calls.hpp).
#include "tandem/template/tool_calls.hpp"

#include <fmt/format.h>

#include "tandem/core/error.hpp"
#include "tandem/template/jinja.hpp"

namespace tandem {

namespace {

using ojson = nlohmann::ordered_json;

constexpr std::string_view kOpen = "<tool_call>";
constexpr std::string_view kClose = "</tool_call>";
constexpr std::string_view kPythonTag = "<|python_tag|>";

std::string_view trim(std::string_view s) {
  const auto ws = [](char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; };
  while (!s.empty() && ws(s.front())) s.remove_prefix(1);
  while (!s.empty() && ws(s.back())) s.remove_suffix(1);
  return s;
}

/// A call object {"name": string, args_key: object or string}; nullopt when not one.
std::optional<ToolCall> call_of(const nlohmann::json& j, std::initializer_list<std::string_view> args_keys) {
  if (!j.is_object()) return std::nullopt;
  const auto name = j.find("name");
  if (name == j.end() || !name->is_string() || name->get<std::string>().empty()) return std::nullopt;
  ToolCall c{name->get<std::string>(), "{}"};
  for (const auto key : args_keys) {
    const auto a = j.find(std::string(key));
    if (a == j.end()) continue;
    if (a->is_string()) {
      c.arguments = a->get<std::string>();  // already JSON text (some models write it so)
    } else {
      c.arguments = a->dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    }
    break;
  }
  return c;
}

/// The calls of a JSON text: one call object, or an array of them (what the JSON schema of
/// forced_tool_call_schema with `parallel` generates); empty when it is anything else.
std::vector<ToolCall> calls_of(std::string_view text, std::initializer_list<std::string_view> args_keys) {
  const auto j = nlohmann::json::parse(trim(text), nullptr, /*allow_exceptions=*/false);
  std::vector<ToolCall> out;
  if (j.is_array()) {
    for (const auto& e : j) {
      auto c = call_of(e, args_keys);
      if (!c) return {};
      out.push_back(std::move(*c));
    }
  } else if (auto c = call_of(j, args_keys)) {
    out.push_back(std::move(*c));
  }
  return out;
}

/// End of the JSON value (object or array) starting at text[i] == '{' / '[': the offset
/// after its closing bracket, strings and escapes respected; npos when unterminated.
size_t value_end(std::string_view text, size_t i) {
  int depth = 0;
  bool in_string = false;
  for (; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      ++depth;
    } else if (c == '}' || c == ']') {
      if (--depth == 0) return i + 1;
    }
  }
  return std::string_view::npos;
}

ParsedToolCalls parse_hermes(std::string_view text) {
  ParsedToolCalls out;
  std::string content;
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t start = text.find(kOpen, pos);
    if (start == std::string_view::npos) {
      content.append(text.substr(pos));
      break;
    }
    content.append(text.substr(pos, start - pos));
    const size_t body = start + kOpen.size();
    const size_t close = text.find(kClose, body);
    const size_t next = close == std::string_view::npos ? text.size() : close + kClose.size();
    const size_t body_end = close == std::string_view::npos ? text.size() : close;
    if (auto cs = calls_of(text.substr(body, body_end - body), {"arguments", "parameters"}); !cs.empty()) {
      for (auto& c : cs) out.calls.push_back(std::move(c));
    } else {
      content.append(text.substr(start, next - start));  // not a call: left as text
    }
    pos = next;
  }
  if (out.calls.empty()) {
    out.content = std::string(text);
  } else {
    out.content = std::string(trim(content));
  }
  return out;
}

ParsedToolCalls parse_llama3(std::string_view text) {
  ParsedToolCalls out;
  std::string_view t = trim(text);
  if (t.starts_with(kPythonTag)) t = trim(t.substr(kPythonTag.size()));
  size_t i = 0;
  while (i < t.size()) {
    if (t[i] != '{' && t[i] != '[') break;
    const size_t end = value_end(t, i);
    if (end == std::string_view::npos) break;
    auto cs = calls_of(t.substr(i, end - i), {"parameters", "arguments"});
    if (cs.empty()) break;
    for (auto& c : cs) out.calls.push_back(std::move(c));
    i = end;
    while (i < t.size() && (t[i] == ';' || t[i] == ' ' || t[i] == '\n' || t[i] == '\r' || t[i] == '\t')) ++i;
  }
  if (out.calls.empty() || i < t.size()) {  // anything else in the message: it is content
    out.calls.clear();
    out.content = std::string(text);
  }
  return out;
}

/// jinja2's `tojson` of a value (", " and ": " separators, as transformers renders it).
std::string tojson(const ojson& v) {
  static const jinja::Template t = jinja::Template::parse("{{ v | tojson }}");
  return t.render(ojson{{"v", v}});
}

std::string text_of(const ojson& m, size_t i) {
  const auto c = m.find("content");
  if (c == m.end() || c->is_null()) return {};
  if (c->is_string()) return c->get<std::string>();
  if (c->is_array()) {  // OpenAI's text parts
    std::string s;
    for (const auto& part : *c) {
      if (part.is_object() && part.contains("text") && part["text"].is_string()) s += part["text"].get<std::string>();
    }
    return s;
  }
  throw Error(ErrorCode::kInvalidArgument, fmt::format("messages[{}].content must be a string, parts or null", i));
}

}  // namespace

ToolPrompt tool_prompt_for_template(std::string_view src) {
  if (src.find(kOpen) != std::string_view::npos) return {ToolCallFormat::kHermes, true};
  if (src.find(kPythonTag) != std::string_view::npos ||
      (src.find("tools") != std::string_view::npos && src.find("\"parameters\"") != std::string_view::npos)) {
    return {ToolCallFormat::kLlama3, true};
  }
  return {ToolCallFormat::kHermes, false};
}

ParsedToolCalls parse_tool_calls(std::string_view text, ToolCallFormat format) {
  try {
    return format == ToolCallFormat::kLlama3 ? parse_llama3(text) : parse_hermes(text);
  } catch (const std::exception&) {  // e.g. no memory: no calls, the text as it is
    return ParsedToolCalls{std::string(text), {}};
  }
}

namespace {

/// The offset of a trailing partial "<tool_call>" that more text may complete, else text.size().
size_t partial_open_start(std::string_view text) {
  for (size_t n = std::min(text.size(), kOpen.size() - 1); n > 0; --n) {
    if (kOpen.starts_with(text.substr(text.size() - n))) return text.size() - n;
  }
  return text.size();
}

}  // namespace

size_t tool_call_start(std::string_view text, ToolCallFormat format) {
  if (format == ToolCallFormat::kLlama3) {
    const std::string_view t = trim(text);
    if (t.empty() || t.front() == '{' || t.front() == '[') return 0;
    if (kPythonTag.starts_with(t.substr(0, kPythonTag.size())) || t.starts_with(kPythonTag)) return 0;
    return text.size();
  }
  if (const size_t at = text.find(kOpen); at != std::string_view::npos) return at;
  return partial_open_start(text);
}

size_t unfinished_call_start(std::string_view text, ToolCallFormat format) {
  if (format == ToolCallFormat::kLlama3) return tool_call_start(text, format);
  for (size_t at = text.find(kOpen); at != std::string_view::npos; at = text.find(kOpen, at + kOpen.size())) {
    const size_t close = text.find(kClose, at + kOpen.size());
    if (close == std::string_view::npos) return at;
    at = close;
  }
  return partial_open_start(text);
}

ToolTemplateInput tool_template_input(const ToolPrompt& prompt, const ojson& messages, const ojson& tools) {
  if (prompt.template_renders_tools) return {messages, tools.is_array() && tools.empty() ? ojson() : tools};
  return {hermes_tool_messages(messages, tools.is_null() ? ojson::array() : tools), ojson()};
}

std::string forced_call_prefix(ToolCallFormat format, const std::optional<std::string>& name) {
  std::string p = format == ToolCallFormat::kLlama3 ? "{\"name\": \"" : "<tool_call>\n{\"name\": \"";
  if (name) {
    p += *name;
    p += format == ToolCallFormat::kLlama3 ? "\", \"parameters\": " : "\", \"arguments\": ";
  }
  return p;
}

ojson hermes_tool_messages(const ojson& messages, const ojson& tools) {
  if (!messages.is_array()) throw Error(ErrorCode::kInvalidArgument, "messages must be an array");
  std::string prompt;
  if (tools.is_array() && !tools.empty()) {
    prompt =
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
        "function signatures within <tools></tools> XML tags:\n<tools>";
    for (const auto& t : tools) prompt += "\n" + tojson(t);
    prompt +=
        "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
        "<args-json-object>}\n</tool_call>";
  }
  ojson out = ojson::array();
  for (size_t i = 0; i < messages.size(); ++i) {
    const ojson& m = messages[i];
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string()) {
      throw Error(ErrorCode::kInvalidArgument, fmt::format("messages[{}] must be an object with a string role", i));
    }
    const std::string role = m["role"].get<std::string>();
    std::string text = text_of(m, i);
    if (role == "tool") {
      const std::string block = "<tool_response>\n" + text + "\n</tool_response>";
      if (i > 0 && messages[i - 1].is_object() && messages[i - 1].value("role", "") == "tool") {
        out.back()["content"] = out.back()["content"].get<std::string>() + "\n" + block;
      } else {
        out.push_back({{"role", "user"}, {"content", block}});
      }
      continue;
    }
    if (role == "assistant" && m.contains("tool_calls") && m["tool_calls"].is_array()) {
      for (const auto& tc : m["tool_calls"]) {
        const ojson* fn = tc.is_object() && tc.contains("function") ? &tc["function"] : &tc;
        if (!fn->is_object() || !fn->contains("name") || !(*fn)["name"].is_string()) {
          throw Error(ErrorCode::kInvalidArgument,
                      fmt::format("messages[{}].tool_calls: a call needs a function name", i));
        }
        ojson args = ojson::object();
        if (const auto a = fn->find("arguments"); a != fn->end()) {
          args = a->is_string() ? ojson::parse(a->get<std::string>(), nullptr, false) : *a;
          if (args.is_discarded()) args = *a;  // not JSON text: rendered as the string it is
        }
        if (!text.empty()) text += "\n";
        text +=
            "<tool_call>\n{\"name\": " + tojson((*fn)["name"]) + ", \"arguments\": " + tojson(args) + "}\n</tool_call>";
      }
    }
    if (role == "system" && out.empty() && !prompt.empty()) {
      text += "\n\n" + prompt;
      prompt.clear();
    }
    out.push_back({{"role", role}, {"content", text}});
  }
  if (!prompt.empty()) out.insert(out.begin(), ojson{{"role", "system"}, {"content", prompt}});
  return out;
}

ojson forced_tool_call_schema(const ojson& tools, const std::optional<std::string>& name, bool parallel) {
  if (!tools.is_array() || tools.empty()) {
    throw Error(ErrorCode::kInvalidArgument, "tools must be a non-empty array of function tools");
  }
  ojson alternatives = ojson::array();
  for (const auto& t : tools) {
    const ojson* fn = t.is_object() && t.contains("function") ? &t["function"] : nullptr;
    if (!fn || !fn->is_object() || !fn->contains("name") || !(*fn)["name"].is_string()) {
      throw Error(ErrorCode::kInvalidArgument, "every tool must be {\"type\": \"function\", \"function\": {\"name\"}}");
    }
    const std::string n = (*fn)["name"].get<std::string>();
    if (name && n != *name) continue;
    ojson params = fn->contains("parameters") ? (*fn)["parameters"] : ojson{{"type", "object"}};
    alternatives.push_back({{"type", "object"},
                            {"properties", {{"name", {{"const", n}}}, {"arguments", std::move(params)}}},
                            {"required", {"name", "arguments"}},
                            {"additionalProperties", false}});
  }
  if (alternatives.empty()) {
    throw Error(ErrorCode::kInvalidArgument, fmt::format("tool_choice names '{}', which is not in tools", *name));
  }
  ojson call = alternatives.size() == 1 ? alternatives[0] : ojson{{"anyOf", std::move(alternatives)}};
  if (!parallel) return call;
  return {{"type", "array"}, {"items", std::move(call)}, {"minItems", 1}};
}

}  // namespace tandem
