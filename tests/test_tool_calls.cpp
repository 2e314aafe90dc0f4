// Tool calls: the parsers on hand-written model outputs, the streaming hold-back offset,
// template format detection on the vendors' templates, the Hermes rewrite for a template
// without tools, and the forced call's JSON schema.
#include <catch2/catch.hpp>

#include <fstream>
#include <sstream>

#include "tandem/core/error.hpp"
#include "tandem/template/tool_calls.hpp"

using namespace tandem;
using ojson = nlohmann::ordered_json;

namespace {

std::string read_template(const std::string& name) {
  std::ifstream f(std::string(TANDEM_SOURCE_DIR) + "/tests/data/chat_templates/" + name, std::ios::binary);
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

}  // namespace

TEST_CASE("Hermes tool calls: blocks parsed, content kept, malformed left as text", "[tool_calls]") {
  const auto r = parse_tool_calls(
      "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2}}\n"
      "</tool_call>\n<tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call>",
      ToolCallFormat::kHermes);
  REQUIRE(r.calls.size() == 2);
  CHECK(r.content == "Let me check.");
  CHECK(r.calls[0].name == "get_weather");
  CHECK(r.calls[0].arguments == "{\"city\":\"Paris\",\"days\":2}");
  CHECK(r.calls[1].name == "get_time");
  CHECK(r.calls[1].arguments == "{}");

  // Cut short by a stop string at </tool_call>: still a whole call.
  const auto cut =
      parse_tool_calls("<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": [1, \"}\"]}}\n", ToolCallFormat::kHermes);
  REQUIRE(cut.calls.size() == 1);
  CHECK(cut.calls[0].arguments == "{\"x\":[1,\"}\"]}");
  CHECK(cut.content.empty());

  // Arguments given as a JSON string pass through as that string.
  const auto str = parse_tool_calls("<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}</tool_call>",
                                    ToolCallFormat::kHermes);
  REQUIRE(str.calls.size() == 1);
  CHECK(str.calls[0].arguments == "{\"a\": 1}");

  // Broken JSON, no name, or no block at all: no calls, the text unchanged.
  for (const std::string t : {"<tool_call>{\"name\": \"f\", \"arguments\": {</tool_call>",
                              "<tool_call>{\"arguments\": {}}</tool_call>", "  just text  ", ""}) {
    const auto p = parse_tool_calls(t, ToolCallFormat::kHermes);
    CHECK(p.calls.empty());
    CHECK(p.content == t);
  }
  // An array of calls in one block (forced_tool_call_schema's parallel shape).
  const auto arr = parse_tool_calls("<tool_call>[{\"name\": \"a\", \"arguments\": {\"x\": 1}}, {\"name\": \"b\"}]",
                                    ToolCallFormat::kHermes);
  REQUIRE(arr.calls.size() == 2);
  CHECK(arr.calls[0].arguments == "{\"x\":1}");
  CHECK(arr.calls[1].name == "b");
  CHECK(parse_tool_calls("<tool_call>[{\"name\": \"a\"}, 3]</tool_call>", ToolCallFormat::kHermes).calls.empty());
  // One good call, one broken: the broken block stays in the content.
  const auto mixed =
      parse_tool_calls("<tool_call>{\"name\": \"a\"}</tool_call> <tool_call>oops</tool_call>", ToolCallFormat::kHermes);
  REQUIRE(mixed.calls.size() == 1);
  CHECK(mixed.calls[0].name == "a");
  CHECK(mixed.content == "<tool_call>oops</tool_call>");
}

TEST_CASE("Llama 3 JSON tool calls: the whole message, python_tag, ';'-separated", "[tool_calls]") {
  const auto r = parse_tool_calls(
      "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}; {\"name\": \"noop\", "
      "\"parameters\": {}}",
      ToolCallFormat::kLlama3);
  REQUIRE(r.calls.size() == 2);
  CHECK(r.calls[0].name == "get_weather");
  CHECK(r.calls[0].arguments == "{\"city\":\"Oslo\"}");
  CHECK(r.calls[1].name == "noop");
  CHECK(r.content.empty());
  const auto one = parse_tool_calls("\n {\"name\": \"f\", \"arguments\": {\"q\": \"a;b}\"}} ", ToolCallFormat::kLlama3);
  REQUIRE(one.calls.size() == 1);
  CHECK(one.calls[0].arguments == "{\"q\":\"a;b}\"}");
  const auto arr = parse_tool_calls("[{\"name\": \"a\", \"parameters\": {}}, {\"name\": \"b\", \"parameters\": {}}]",
                                    ToolCallFormat::kLlama3);
  REQUIRE(arr.calls.size() == 2);
  CHECK(arr.calls[1].name == "b");
  for (const std::string t : {"The answer is {\"name\": \"f\"}", "{\"name\": \"f\"} trailing words", "{\"city\": 1}",
                              "{\"name\": \"f\", \"parameters\": {"}) {
    const auto p = parse_tool_calls(t, ToolCallFormat::kLlama3);
    CHECK(p.calls.empty());
    CHECK(p.content == t);
  }
}

TEST_CASE("tool_call_start: where a streamer must start holding text back", "[tool_calls]") {
  CHECK(tool_call_start("Hello there", ToolCallFormat::kHermes) == 11);
  CHECK(tool_call_start("Hello <tool_call>{", ToolCallFormat::kHermes) == 6);
  CHECK(tool_call_start("Hello <tool_", ToolCallFormat::kHermes) == 6);
  CHECK(tool_call_start("Hello <", ToolCallFormat::kHermes) == 6);
  CHECK(tool_call_start("a < b", ToolCallFormat::kHermes) == 5);
  CHECK(tool_call_start("", ToolCallFormat::kHermes) == 0);
  CHECK(tool_call_start("  ", ToolCallFormat::kLlama3) == 0);
  CHECK(tool_call_start(" {\"na", ToolCallFormat::kLlama3) == 0);
  CHECK(tool_call_start("[{", ToolCallFormat::kLlama3) == 0);
  CHECK(tool_call_start("<|python", ToolCallFormat::kLlama3) == 0);
  CHECK(tool_call_start("Sure", ToolCallFormat::kLlama3) == 4);
}

TEST_CASE("unfinished_call_start: only a call left open is cut from an output cut short", "[tool_calls]") {
  const auto H = ToolCallFormat::kHermes;
  // A closed block that did not parse (no name) and the text after it stay content.
  const std::string closed = "<tool_call>{\"arguments\": {}}</tool_call>\nThe weather in Paris is";
  CHECK(unfinished_call_start(closed, H) == closed.size());
  CHECK(unfinished_call_start("Sure. <tool_call>{\"name\": \"f\", \"argu", H) == 6);
  CHECK(unfinished_call_start("<tool_call>{}</tool_call> and <tool_call>{\"na", H) == 30);
  CHECK(unfinished_call_start("<tool_call>x</tool_call> then <tool_", H) == 30);
  CHECK(unfinished_call_start("a < b", H) == 5);
  CHECK(unfinished_call_start("", H) == 0);
  CHECK(unfinished_call_start(" {\"na", ToolCallFormat::kLlama3) == 0);
  CHECK(unfinished_call_start("Sure", ToolCallFormat::kLlama3) == 4);
}

TEST_CASE("tool formats of the vendors' templates", "[tool_calls]") {
  const auto qwen = tool_prompt_for_template(read_template("Qwen-Qwen2.5-7B-Instruct.jinja"));
  CHECK(qwen.format == ToolCallFormat::kHermes);
  CHECK(qwen.template_renders_tools);
  const auto hermes = tool_prompt_for_template(read_template("NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja"));
  CHECK(hermes.format == ToolCallFormat::kHermes);
  CHECK(hermes.template_renders_tools);
  for (const char* f : {"meta-llama-Llama-3.1-8B-Instruct.jinja", "meta-llama-Llama-3.2-3B-Instruct.jinja"}) {
    INFO(f);
    const auto l = tool_prompt_for_template(read_template(f));
    CHECK(l.format == ToolCallFormat::kLlama3);
    CHECK(l.template_renders_tools);
  }
  const auto smol = tool_prompt_for_template(read_template("smollm2.jinja"));
  CHECK(smol.format == ToolCallFormat::kHermes);
  CHECK_FALSE(smol.template_renders_tools);
}

TEST_CASE("hermes_tool_messages: the tool prompt, calls and responses as plain messages", "[tool_calls]") {
  const ojson tools =
      ojson::parse(R"([{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}])");
  const ojson msgs = ojson::parse(R"([
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
      "function": {"name": "w", "arguments": "{\"city\":\"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "20C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "sunny"}])");
  const ojson out = hermes_tool_messages(msgs, tools);
  REQUIRE(out.size() == 4);
  CHECK(out[0]["role"] == "system");
  CHECK(out[0]["content"] ==
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
        "function signatures within <tools></tools> XML tags:\n<tools>\n{\"type\": \"function\", \"function\": "
        "{\"name\": \"w\", \"parameters\": {\"type\": \"object\"}}}\n</tools>\n\nFor each function call, return a "
        "json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>");
  CHECK(out[1] == ojson({{"role", "user"}, {"content", "Weather?"}}));
  CHECK(out[2]["content"] == "<tool_call>\n{\"name\": \"w\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>");
  CHECK(out[3] ==
        ojson({{"role", "user"},
               {"content", "<tool_response>\n20C\n</tool_response>\n<tool_response>\nsunny\n</tool_response>"}}));
  // A system message keeps its text first.
  const ojson with_sys = hermes_tool_messages(ojson::parse(R"([{"role": "system", "content": "Be brief."}])"), tools);
  REQUIRE(with_sys.size() == 1);
  CHECK(with_sys[0]["content"].get<std::string>().starts_with("Be brief.\n\n# Tools\n"));
  CHECK_THROWS_AS(hermes_tool_messages(ojson::parse(R"([{"content": "x"}])"), tools), Error);
}

TEST_CASE("forced_tool_call_schema: the named tool, any tool, parallel calls", "[tool_calls]") {
  const ojson tools = ojson::parse(R"([
    {"type": "function", "function": {"name": "a", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "b"}}])");
  const ojson named = forced_tool_call_schema(tools, "a", false);
  CHECK(named == ojson::parse(R"({"type": "object", "properties": {"name": {"const": "a"}, "arguments":
    {"type": "object", "properties": {"x": {"type": "integer"}}}}, "required": ["name", "arguments"],
    "additionalProperties": false})"));
  const ojson any = forced_tool_call_schema(tools, std::nullopt, true);
  CHECK(any["type"] == "array");
  CHECK(any["minItems"] == 1);
  REQUIRE(any["items"]["anyOf"].size() == 2);
  CHECK(any["items"]["anyOf"][1]["properties"]["arguments"] == ojson{{"type", "object"}});
  CHECK_THROWS_AS(forced_tool_call_schema(tools, "missing", false), Error);
  CHECK_THROWS_AS(forced_tool_call_schema(ojson::array(), std::nullopt, false), Error);
}

TEST_CASE("forced_call_prefix opens a call the parser completes", "[tool_calls]") {
  const std::string h = forced_call_prefix(ToolCallFormat::kHermes, "w") + "{\"city\": \"Rome\"}}\n</tool_call>";
  const auto r = parse_tool_calls(h, ToolCallFormat::kHermes);
  REQUIRE(r.calls.size() == 1);
  CHECK(r.calls[0].name == "w");
  CHECK(r.calls[0].arguments == "{\"city\":\"Rome\"}");
  const std::string l = forced_call_prefix(ToolCallFormat::kLlama3, std::nullopt) + "w\", \"parameters\": {}}";
  const auto q = parse_tool_calls(l, ToolCallFormat::kLlama3);
  REQUIRE(q.calls.size() == 1);
  CHECK(q.calls[0].name == "w");
}
