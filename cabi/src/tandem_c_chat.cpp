// Chat templates and GGUF metadata of the C ABI (cabi/include/tandem.h).
#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "capi_internal.hpp"
#include "tandem/gguf/gguf.hpp"
#include "tandem/template/chat_template.hpp"
#include "tandem/template/tool_calls.hpp"

using namespace tandem;
using namespace tandem::capi;

namespace {

std::string_view value_type_name(GgufValueType t) {
  switch (t) {
    case GgufValueType::kUint8:
      return "uint8";
    case GgufValueType::kInt8:
      return "int8";
    case GgufValueType::kUint16:
      return "uint16";
    case GgufValueType::kInt16:
      return "int16";
    case GgufValueType::kUint32:
      return "uint32";
    case GgufValueType::kInt32:
      return "int32";
    case GgufValueType::kFloat32:
      return "float32";
    case GgufValueType::kBool:
      return "bool";
    case GgufValueType::kString:
      return "string";
    case GgufValueType::kArray:
      return "array";
    case GgufValueType::kUint64:
      return "uint64";
    case GgufValueType::kInt64:
      return "int64";
    case GgufValueType::kFloat64:
      return "float64";
  }
  return "unknown";
}

std::string value_text(const GgufValue& v) {
  if (const auto* u = std::get_if<uint64_t>(&v.value)) return std::to_string(*u);
  if (const auto* i = std::get_if<int64_t>(&v.value)) return std::to_string(*i);
  if (const auto* d = std::get_if<double>(&v.value)) {
    return v.type == GgufValueType::kFloat32 ? fmt::format("{}", float(*d)) : fmt::format("{}", *d);
  }
  if (const auto* b = std::get_if<bool>(&v.value)) return *b ? "true" : "false";
  if (const auto* s = std::get_if<std::string>(&v.value)) return *s;
  const auto& a = std::get<GgufArray>(v.value);
  return fmt::format("[{} {}]", a.size(), value_type_name(a.elem_type()));
}

std::vector<ChatMessage> read_messages(const char* const* roles, const char* const* contents, size_t n,
                                       const char* fn) {
  if (n > 0 && (roles == nullptr || contents == nullptr)) {
    fail(TANDEM_E_INVALID_ARG, fmt::format("{}: roles or contents is NULL but n_messages is {}", fn, n));
  }
  std::vector<ChatMessage> messages(n);
  for (size_t i = 0; i < n; ++i) {
    if (roles[i] == nullptr || contents[i] == nullptr) {
      fail(TANDEM_E_INVALID_ARG, fmt::format("{}: roles[{}] or contents[{}] is NULL", fn, i, i));
    }
    messages[i].role = roles[i];
    messages[i].content = contents[i];
    for (const std::string* text : {&messages[i].role, &messages[i].content}) {
      const size_t bad = utf8_invalid_at(*text);
      if (bad != std::string::npos) {
        fail(TANDEM_E_INVALID_ARG, fmt::format("{}: message {} is not valid UTF-8 (byte {})", fn, i, bad));
      }
    }
  }
  return messages;
}

// An OpenAI chat request body: its messages, tools, add_generation_prompt (default true)
// and chat_template_kwargs. Keys keep their order (tojson prints them as sent).
// NOLINTNEXTLINE(bugprone-exception-escape): its implicit move is nlohmann::json's, noexcept
struct ChatRequest {
  nlohmann::ordered_json messages, tools, kwargs;
  bool add_generation_prompt = true;
};

ChatRequest read_request(const char* request_json, const char* fn) {
  require(request_json, fn, "request_json");
  nlohmann::ordered_json body;
  try {
    body = nlohmann::ordered_json::parse(request_json);
  } catch (const nlohmann::json::exception& e) {
    fail(TANDEM_E_INVALID_ARG, fmt::format("{}: request_json is not JSON: {}", fn, e.what()));
  }
  if (!body.is_object() || !body.contains("messages") || !body["messages"].is_array()) {
    fail(TANDEM_E_INVALID_ARG, fmt::format("{}: request_json needs a \"messages\" array", fn));
  }
  ChatRequest r;
  r.messages = std::move(body["messages"]);
  if (body.contains("tools")) r.tools = std::move(body["tools"]);
  if (body.contains("chat_template_kwargs")) r.kwargs = std::move(body["chat_template_kwargs"]);
  if (body.contains("add_generation_prompt")) {
    if (!body["add_generation_prompt"].is_boolean()) {
      fail(TANDEM_E_INVALID_ARG, fmt::format("{}: add_generation_prompt must be a boolean", fn));
    }
    r.add_generation_prompt = body["add_generation_prompt"].get<bool>();
  }
  return r;
}

ChatTemplate pick_template(const ModelObj& model, const char* name) {
  return name == nullptr ? model.template_in_use() : ChatTemplate::by_name(name);
}

}  // namespace

extern "C" {

tandem_status tandem_model_meta_count(const tandem_model* model, size_t* out_n) {
  static constexpr const char* fn = "tandem_model_meta_count";
  return guard([&] {
    auto m = get_model(model, fn);
    require(out_n, fn, "out_n");
    *out_n = m->model->gguf().metadata().size();
  });
}

tandem_status tandem_model_meta_key_by_index(const tandem_model* model, size_t index, char* buf, size_t capacity,
                                             size_t* out_len) {
  static constexpr const char* fn = "tandem_model_meta_key_by_index";
  return guard([&] {
    auto m = get_model(model, fn);
    require(out_len, fn, "out_len");
    const auto& kv = m->model->gguf().metadata();
    if (index >= kv.size()) {
      fail(TANDEM_E_INVALID_ARG,
           fmt::format("{}: index {} is out of range (the file has {} keys)", fn, index, kv.size()));
    }
    write_text(kv[index].key, buf, capacity, out_len, fn);
  });
}

tandem_status tandem_model_meta_value(const tandem_model* model, const char* key, char* buf, size_t capacity,
                                      size_t* out_len) {
  static constexpr const char* fn = "tandem_model_meta_value";
  return guard([&] {
    auto m = get_model(model, fn);
    require(key, fn, "key");
    require(out_len, fn, "out_len");
    const GgufValue* v = m->model->gguf().find(key);
    if (v == nullptr) fail(TANDEM_E_INVALID_ARG, fmt::format("{}: the model has no metadata key \"{}\"", fn, key));
    write_text(value_text(*v), buf, capacity, out_len, fn);
  });
}

tandem_status tandem_chat_render(const tandem_model* model, const char* template_name, const char* const* roles,
                                 const char* const* contents, size_t n_messages, int32_t add_assistant, char* buf,
                                 size_t capacity, size_t* out_len) {
  static constexpr const char* fn = "tandem_chat_render";
  return guard([&] {
    auto m = get_model(model, fn);
    require(out_len, fn, "out_len");
    const auto messages = read_messages(roles, contents, n_messages, fn);
    const std::string text = pick_template(*m, template_name).render(messages, add_assistant != 0);
    write_text(text, buf, capacity, out_len, fn);
  });
}

tandem_status tandem_chat_tokenize(const tandem_model* model, const char* template_name, const char* const* roles,
                                   const char* const* contents, size_t n_messages, int32_t add_assistant,
                                   int32_t* tokens, size_t capacity, size_t* out_n_tokens) {
  static constexpr const char* fn = "tandem_chat_tokenize";
  return guard([&] {
    auto m = get_model(model, fn);
    require(out_n_tokens, fn, "out_n_tokens");
    const auto messages = read_messages(roles, contents, n_messages, fn);
    const auto ids = pick_template(*m, template_name).tokenize(m->model->tokenizer(), messages, add_assistant != 0);
    *out_n_tokens = ids.size();
    if (check_capacity(tokens, capacity, ids.size(), fn, "tokens")) std::copy(ids.begin(), ids.end(), tokens);
  });
}

tandem_status tandem_chat_apply_template(const tandem_model* model, const char* request_json, char* buf,
                                         size_t capacity, size_t* out_len) {
  static constexpr const char* fn = "tandem_chat_apply_template";
  return guard([&] {
    auto m = get_model(model, fn);
    require(out_len, fn, "out_len");
    const ChatRequest r = read_request(request_json, fn);
    const std::string text = m->template_in_use().render_json(r.messages, r.add_generation_prompt, r.tools, r.kwargs);
    write_text(text, buf, capacity, out_len, fn);
  });
}

tandem_status tandem_chat_apply_template_tokens(const tandem_model* model, const char* request_json, int32_t* tokens,
                                                size_t capacity, size_t* out_n_tokens) {
  static constexpr const char* fn = "tandem_chat_apply_template_tokens";
  return guard([&] {
    auto m = get_model(model, fn);
    require(out_n_tokens, fn, "out_n_tokens");
    const ChatRequest r = read_request(request_json, fn);
    const auto ids = m->template_in_use().tokenize_json(m->model->tokenizer(), r.messages, r.add_generation_prompt,
                                                        r.tools, r.kwargs);
    *out_n_tokens = ids.size();
    if (check_capacity(tokens, capacity, ids.size(), fn, "tokens")) std::copy(ids.begin(), ids.end(), tokens);
  });
}

tandem_status tandem_chat_parse_tool_calls(const tandem_model* model, const char* text, char* buf, size_t capacity,
                                           size_t* out_len) {
  static constexpr const char* fn = "tandem_chat_parse_tool_calls";
  return guard([&] {
    auto m = get_model(model, fn);
    require(text, fn, "text");
    require(out_len, fn, "out_len");
    const ToolPrompt tp = tool_prompt_for_template(m->template_in_use().source());
    const ParsedToolCalls p = parse_tool_calls(text, tp.format);
    nlohmann::ordered_json calls = nlohmann::ordered_json::array();
    for (const auto& c : p.calls) calls.push_back({{"name", c.name}, {"arguments", c.arguments}});
    const nlohmann::ordered_json out = {
        {"content", p.content.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(p.content)},
        {"tool_calls", std::move(calls)}};
    write_text(out.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace), buf, capacity, out_len, fn);
  });
}

}  // extern "C"
