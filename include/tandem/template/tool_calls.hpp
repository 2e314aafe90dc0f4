// Tool calls (OpenAI `tools`): which text format a chat template asks the model to call
// tools in, the text of generated calls parsed back into calls, the tool prompt for a
// template that has none, and the JSON schema of a forced call.
//
// Formats (the ones the models Tandem loads are trained on):
//   kHermes  <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>, one block per
//            call, content may come before (Qwen2/2.5/3, Hermes 2/3, SmolLM2-Instruct's
//            training format). vLLM's "hermes" parser, llama.cpp's Hermes 2 Pro format.
//   kLlama3  the whole message is {"name": "f", "parameters": {...}} (or "arguments"),
//            optionally after <|python_tag|>; several calls separated by ';'. vLLM's
//            "llama3_json" parser.
// A template that mentions neither gets kHermes with the tools described in the system
// message by hermes_tool_messages() (tool_prompt_for_template() says which).
//
// A call's JSON may also be an array of calls (what forced_tool_call_schema's parallel
// schema generates). Parsing is lenient as vLLM's parsers are: a call whose JSON does not parse, or lacks a
// string "name", is left in the content as text; a Hermes block the generation cut short
// (no </tool_call>: a stop string or the end of the output) is parsed if its JSON is whole.
//
// Thread-safety: pure functions.
#pragma once

#include <nlohmann/json.hpp>

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace tandem {

enum class ToolCallFormat {
  kHermes,  ///< <tool_call>{"name", "arguments"}</tool_call>
  kLlama3,  ///< {"name", "parameters"} as the whole message, <|python_tag|> optional
};

/// The format a Jinja chat template's source asks for, and whether the template renders
/// `tools` itself (false: the caller renders hermes_tool_messages() instead).
struct ToolPrompt {
  ToolCallFormat format = ToolCallFormat::kHermes;
  bool template_renders_tools = false;
};
/// Looks for the template's own markers: "<tool_call>" -> Hermes; "<|python_tag|>" or a
/// "parameters" call format with `tools` -> Llama 3; otherwise Hermes, not rendered.
ToolPrompt tool_prompt_for_template(std::string_view jinja_source);

/// One parsed call. `arguments` is the arguments object as compact JSON text ("{}" when the
/// model gave none), as OpenAI's `function.arguments` string.
struct ToolCall {
  std::string name;
  std::string arguments;
};

struct ParsedToolCalls {
  std::string content;  ///< the text outside the calls, whitespace-trimmed at both ends
  std::vector<ToolCall> calls;
};

/// Split generated text into content and calls (see the file comment). Never throws for
/// any input; text with no well-formed call comes back whole (untrimmed) as content.
ParsedToolCalls parse_tool_calls(std::string_view text, ToolCallFormat format);

/// Where, in streamed text, the tool-call part may begin: the offset of the first call
/// marker (Hermes "<tool_call>"; Llama 3 a message whose first non-space character is '{' or '['
/// or that starts "<|python_tag|>": offset 0), or of a trailing partial marker that more
/// text may complete; text.size() when everything so far is content. A streamer sends
/// text[0, offset) as content and holds the rest until the output ends.
size_t tool_call_start(std::string_view text, ToolCallFormat format);

/// Where, in a finished output cut short (max_tokens, a timeout), the unfinished call
/// begins: Hermes, the first "<tool_call>" with no "</tool_call>" after it, or a trailing
/// partial marker; Llama 3, as tool_call_start (its call is the whole message). text.size()
/// when no call was left open: a closed block that did not parse, and the text after it,
/// stay content.
size_t unfinished_call_start(std::string_view text, ToolCallFormat format);

/// The text that opens a forced call in `format`, appended to the prompt after the
/// generation prompt so that the model continues inside a call: Hermes
/// "<tool_call>\n{\"name\": \"" (+ name + "\", \"arguments\": " when `name` is given),
/// Llama 3 "{\"name\": \"" (+ name + "\", \"parameters\": "). The generated text is this
/// prefix + the output.
std::string forced_call_prefix(ToolCallFormat format, const std::optional<std::string>& name);

/// The conversation rewritten for a template that does not render tools (ToolPrompt::
/// template_renders_tools false), in the Hermes format with Qwen2.5's tool prompt: the
/// tool list (each tool as jinja2's `tojson` prints it) after the system message's text (a
/// system message is added when there is none); an assistant message's `tool_calls` as
/// <tool_call> blocks after its content; a `tool` message as a user message holding
/// <tool_response>\n...\n</tool_response> (consecutive ones in one message). Roles and
/// contents only, as any template renders them. Throws Error(kInvalidArgument) naming a
/// malformed message (not an object, content neither string nor null, a tool call without
/// a function name).
nlohmann::ordered_json hermes_tool_messages(const nlohmann::ordered_json& messages,
                                            const nlohmann::ordered_json& tools);

/// Whether an OpenAI chat request body takes the tool path: it names tools (a non-empty
/// array), tool_choice or parallel_tool_calls, or a message is a tool result or carries
/// tool_calls. For nlohmann::json and nlohmann::ordered_json bodies.
template <class Json>
bool chat_request_uses_tools(const Json& request) {
  if (!request.is_object()) return false;
  if (const auto t = request.find("tools"); t != request.end() && !t->is_null() && !(t->is_array() && t->empty()))
    return true;
  if (request.contains("tool_choice") || request.contains("parallel_tool_calls")) return true;
  const auto msgs = request.find("messages");
  if (msgs == request.end() || !msgs->is_array()) return false;
  for (const auto& m : *msgs) {
    if (!m.is_object()) continue;
    const auto role = m.find("role");
    if ((role != m.end() && role->is_string() && *role == "tool") || m.contains("tool_calls")) return true;
  }
  return false;
}

/// What a chat template renders for a conversation on the tool path (a chat endpoint, and
/// llama-server's /apply-template, alike): with a template that renders tools itself
/// (`prompt.template_renders_tools`) the messages as given and `tools` (null when empty);
/// otherwise the messages with Hermes' tool prompt and tool turns written in
/// (hermes_tool_messages) and no tools. Errors: hermes_tool_messages'.
struct ToolTemplateInput {
  nlohmann::ordered_json messages;
  nlohmann::ordered_json tools;
};
ToolTemplateInput tool_template_input(const ToolPrompt& prompt, const nlohmann::ordered_json& messages,
                                      const nlohmann::ordered_json& tools);

/// The JSON schema a forced call must satisfy, for a grammar engine to enforce
/// `tool_choice: "required"` or a named function: an object {"name": const, "arguments":
/// the tool's `function.parameters` ({"type": "object"} when absent)}, required both,
/// additionalProperties false; for "required" (`name` empty) the anyOf over every tool;
/// with `parallel` an array of such objects, minItems 1. Throws Error(kInvalidArgument) when
/// `name` names no tool or `tools` is not an array of function tools.
nlohmann::ordered_json forced_tool_call_schema(const nlohmann::ordered_json& tools,
                                               const std::optional<std::string>& name, bool parallel);

}  // namespace tandem
