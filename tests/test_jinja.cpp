// The Jinja interpreter (tandem/jinja.hpp): rendering as jinja2 does (the byte-for-byte
// comparison with Python's jinja2 is tests/jinja_oracle/), errors with line numbers, and
// hostile templates -- deep nesting, huge loops, recursive macros, huge strings, mutated
// sources -- that must end in a tandem::Error, never a crash, a hang or unbounded memory.
#include <catch2/catch.hpp>
#include <chrono>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tandem/core/error.hpp"
#include "tandem/template/jinja.hpp"

using tandem::ErrorCode;
using tandem::jinja::RenderOptions;
using tandem::jinja::Template;
using Json = nlohmann::ordered_json;

namespace {

std::string render(const std::string& src, const Json& ctx = Json::object(), const RenderOptions& opt = {}) {
  return Template::parse(src).render(ctx, opt);
}

// The code of the tandem::Error the render throws (kOk: none), and its message.
ErrorCode error_of(const std::string& src, std::string* message = nullptr, const RenderOptions& opt = {},
                   const Json& ctx = Json::object()) {
  try {
    (void)render(src, ctx, opt);
  } catch (const tandem::Error& e) {
    if (message != nullptr) *message = e.what();
    return e.code();
  }
  return ErrorCode::kOk;
}

const char* kChatML =
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

}  // namespace

TEST_CASE("jinja: renders chat templates and prints values as Python", "[jinja]") {
  const Json ctx = {{"messages", Json::array({{{"role", "user"}, {"content", "hi"}}})},
                    {"add_generation_prompt", true}};
  CHECK(render(kChatML, ctx) ==
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
  CHECK(render("{{ x }}|{{ y }}|{{ z }}|{{ n }}|{{ f }}", {{"x", Json::array({{{"type", "text"}, {"text", "hi"}}})},
                                                           {"y", nullptr},
                                                           {"z", true},
                                                           {"n", 3},
                                                           {"f", 2.0}}) ==
        "[{'type': 'text', 'text': 'hi'}]|None|True|3|2.0");
  CHECK(render("{{ m|tojson }}", {{"m", {{"b", 1}, {"a", "é"}}}}) == "{\"b\": 1, \"a\": \"é\"}");
  CHECK(render("{{ m|tojson(indent=2) }}", {{"m", {{"k", Json::array({1, 2})}}}}) ==
        "{\n  \"k\": [\n    1,\n    2\n  ]\n}");
  // trim_blocks + lstrip_blocks, and one trailing newline dropped as jinja2 does
  CHECK(render("  {% if true %}\n  x\n  {% endif %}\n") == "  x\n");
  CHECK(render("{% set ns = namespace(n=0) %}{% for i in range(4) if i is odd %}{% set ns.n = ns.n + i %}{% endfor %}"
               "{{ ns.n }}") == "4");
  CHECK(render("{% macro m(a, b='B') %}{{ a }}{{ b }}{{ caller() if caller is defined }}{% endmacro %}"
               "{% call m('A') %}!{% endcall %}") == "AB!");
  CHECK(render("{{ 'abc'[::-1] }}{{ [1, 2, 3][1:] }}{{ 7 // 2 }}{{ 2 ** 3 }}{{ 'a' ~ 1 }}") == "cba[2, 3]38a1");
  RenderOptions at;
  at.now = 0;  // strftime_now formats local time; the year is 1970 or 1969 around the epoch
  const std::string year = render("{{ strftime_now('%Y') }}", Json::object(), at);
  CHECK((year == "1970" || year == "1969"));
  CHECK(tandem::jinja::python_json_dumps(Json::parse(R"({"a": [1.5, null, "\u00e9\n"]})")) ==
        "{\"a\": [1.5, null, \"\u00e9\\n\"]}");
  CHECK(tandem::jinja::python_json_dumps(Json::parse(R"({"a": "\u00e9"})"), true) == "{\"a\": \"\\u00e9\"}");
}

TEST_CASE("jinja: syntax and runtime errors name the line", "[jinja]") {
  std::string msg;
  CHECK(error_of("line1\n{% if x %}\nno end", &msg) == ErrorCode::kInvalidArgument);
  CHECK(msg.find("jinja: line") == 0);
  CHECK(error_of("a\nb\n{{ x | nope }}", &msg) == ErrorCode::kInvalidArgument);
  CHECK(msg.find("line 3") != std::string::npos);
  CHECK(msg.find("no filter named 'nope'") != std::string::npos);
  CHECK(error_of("{% include 'x' %}") == ErrorCode::kInvalidArgument);
  CHECK(error_of("{% extends 'x' %}") == ErrorCode::kInvalidArgument);
  CHECK(error_of("\n\n{{ raise_exception('Only user and assistant roles') }}", &msg) == ErrorCode::kInvalidArgument);
  CHECK(msg == "jinja: line 3: raise_exception: Only user and assistant roles");
  CHECK(error_of("{{ 1 + 'a' }}") == ErrorCode::kInvalidArgument);
  CHECK(error_of("{{ x.y }}", &msg) == ErrorCode::kInvalidArgument);
  CHECK(msg.find("'x' is undefined") != std::string::npos);
  CHECK(error_of("{{ 2 ** 64 }}", &msg) == ErrorCode::kInvalidArgument);
  CHECK(msg.find("overflow") != std::string::npos);
  CHECK(error_of("{{ [].append(1) }}", &msg) == ErrorCode::kInvalidArgument);
  CHECK(msg.find("unsafe") != std::string::npos);
  CHECK(error_of("{{ 99999999999999999999 }}") == ErrorCode::kInvalidArgument);
}

TEST_CASE("jinja: hostile templates end in a clear error, quickly", "[jinja][hostile]") {
  RenderOptions small;
  small.limits.max_steps = 2'000'000;
  const auto t0 = std::chrono::steady_clock::now();
  std::string msg;
  // jinja2's sandbox refuses ranges over 100000 items
  CHECK(error_of("{% for i in range(10**9) %}{{ i }}{% endfor %}", &msg) == ErrorCode::kInvalidArgument);
  CHECK(msg.find("Range too big") != std::string::npos);
  // 10^10 iterations in nested loops: the step limit
  CHECK(error_of("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", &msg, small) ==
        ErrorCode::kOutOfMemory);
  CHECK(msg.find("max_steps") != std::string::npos);
  // recursion without end: the depth limit
  CHECK(error_of("{% macro r(n) %}{{ r(n + 1) }}{% endmacro %}{{ r(0) }}", &msg) == ErrorCode::kOutOfMemory);
  CHECK(msg.find("max_depth") != std::string::npos);
  CHECK(error_of("{% macro a() %}{% call a() %}{% endcall %}{% endmacro %}{{ a() }}") == ErrorCode::kOutOfMemory);
  // huge strings and lists: the bytes-created limit, before allocating
  CHECK(error_of("{{ 'a' * 10**12 }}", &msg) == ErrorCode::kOutOfMemory);
  CHECK(msg.find("max_alloc_bytes") != std::string::npos);
  CHECK(error_of("{{ [1, 2] * 10**15 }}") == ErrorCode::kOutOfMemory);
  CHECK(error_of("{% set ns = namespace(s='ab') %}{% for i in range(100) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}") ==
        ErrorCode::kOutOfMemory);
  CHECK(error_of("{% set ns = namespace(l=[1]) %}{% for i in range(100) %}{% set ns.l = ns.l + ns.l %}{% endfor %}") ==
        ErrorCode::kOutOfMemory);
  CHECK(error_of("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s|replace('x', 'xx') %}"
                 "{% endfor %}") == ErrorCode::kOutOfMemory);
  // output: the output limit
  RenderOptions out_limit;
  out_limit.limits.max_output_bytes = 1 << 20;
  CHECK(error_of("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", &msg, out_limit) ==
        ErrorCode::kOutOfMemory);
  CHECK(msg.find("max_output_bytes") != std::string::npos);
  // a self-referencing namespace printed or dumped
  CHECK(error_of("{% set ns = namespace() %}{% set ns.me = ns %}{{ ns }}") == ErrorCode::kOutOfMemory);
  CHECK(error_of("{% set ns = namespace(d={}) %}{% for i in range(1000) %}{% set ns.d = {'x': ns.d} %}{% endfor %}"
                 "{{ ns.d|tojson }}") == ErrorCode::kOutOfMemory);
  // deep nesting in the source: a parse error
  CHECK(error_of("{{ " + std::string(100000, '(') + "1" + std::string(100000, ')') + " }}", &msg) ==
        ErrorCode::kInvalidArgument);
  CHECK(msg.find("nests deeper") != std::string::npos);
  std::string ifs;
  for (int i = 0; i < 5000; ++i) ifs += "{% if true %}";
  CHECK(error_of(ifs) == ErrorCode::kInvalidArgument);
  CHECK(error_of("{{ " + std::string(50000, '[') + " }}") == ErrorCode::kInvalidArgument);
  CHECK(error_of("{{ " + std::string(50000, '-') + "1 }}") == ErrorCode::kInvalidArgument);
  std::string nots = "{{ ";
  for (int i = 0; i < 50000; ++i) nots += "not ";
  CHECK(error_of(nots + "1 }}") == ErrorCode::kInvalidArgument);
  std::string filters = "{{ 'x'";
  for (int i = 0; i < 100000; ++i) filters += "|upper";
  CHECK(error_of(filters + " }}") == ErrorCode::kInvalidArgument);  // a chain as deep as nesting
  std::string sum = "{{ 1";
  for (int i = 0; i < 100000; ++i) sum += " + 1";
  CHECK(error_of(sum + " }}") == ErrorCode::kInvalidArgument);
  std::string attrs = "{{ x";
  for (int i = 0; i < 100000; ++i) attrs += ".a";
  CHECK(error_of(attrs + " }}") == ErrorCode::kInvalidArgument);
  // values nested without end: the value depth limit
  CHECK(error_of("{% set ns = namespace(l=[]) %}{% for i in range(5000) %}{% set ns.l = [ns.l] %}{% endfor %}") ==
        ErrorCode::kOutOfMemory);
  // a source over the size limit
  CHECK(error_of(std::string(Template::kMaxSourceBytes + 1, 'x')) == ErrorCode::kInvalidArgument);
  // extreme slices and ranges do not overflow
  CHECK(render("{{ [1, 2, 3][1::9223372036854775807] }}{{ 'abc'[::-9223372036854775807] }}") == "[2]c");
  CHECK(render("{{ range(5, 10, 9223372036854775807)|list }}") == "[5]");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  INFO("hostile cases took " << seconds << " s");
  CHECK(seconds < 60);
}

TEST_CASE("jinja: mutated templates parse and render or fail cleanly", "[jinja][hostile]") {
  const std::vector<std::string> seeds = {
      kChatML,
      "{%- set ns = namespace(x=1) %}{%- for m in messages[::-1] if m.role != 'tool' %}{{ loop.index ~ m.content|trim "
      "}}"
      "{%- if m.tool_calls is defined %}{{ m.tool_calls|tojson(indent=2) }}{% endif %}{% endfor %}",
      "{% macro f(a, b=[1, {'k': (1, 2)}]) %}{{ a|default('x')|upper }}{{ b[1].k[0] * 2 }}{% endmacro %}"
      "{% call f(messages|length) %}{{ 'c' }}{% endcall %}{{ '%s-%d'|format('a', 1) }}",
      "{% filter indent(2, true) %}{% raw %}{{ x }}{% endraw %}\n{{ 'a,b'.split(',')|join(' ') }}{% endfilter %}"};
  const std::vector<std::string> alphabet = {"{",  "}",  "{{", "}}", "{%", "%}", "-",   "(",    ")",    "[",    "]",
                                             "'",  "\"", "|",  ".",  ",",  ":",  "**",  " if ", " in ", "not ", "~",
                                             "\\", "\n", "0",  "9",  "x",  "%",  "end", "for ", "set ", "=",    "*"};
  const Json ctx = {{"messages", Json::array({{{"role", "user"}, {"content", " hi "}},
                                              {{"role", "assistant"}, {"content", "yo"}, {"tool_calls", {1, 2}}}})},
                    {"add_generation_prompt", true}};
  RenderOptions opt;
  opt.limits.max_steps = 200000;
  opt.limits.max_output_bytes = 1 << 20;
  opt.limits.max_alloc_bytes = 16 << 20;
  std::mt19937 rng(12345);
  int rendered = 0, refused = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    std::string s = seeds[size_t(iter) % seeds.size()];
    const int edits = 1 + int(rng() % 4);
    for (int k = 0; k < edits && !s.empty(); ++k) {
      const size_t pos = rng() % s.size();
      switch (rng() % 3) {
        case 0:
          s.erase(pos, 1 + rng() % 3);
          break;
        case 1:
          s.insert(pos, alphabet[rng() % alphabet.size()]);
          break;
        default:
          s.insert(pos, s.substr(rng() % s.size(), rng() % 16));
      }
    }
    try {
      (void)Template::parse(s).render(ctx, opt);
      ++rendered;
    } catch (const tandem::Error&) {
      ++refused;
    } catch (const std::exception& e) {
      FAIL("a non-tandem exception for template " << s << ": " << e.what());
    }
  }
  CHECK(rendered + refused == 3000);
  CHECK(rendered > 100);
  CHECK(refused > 100);
}

TEST_CASE("jinja: one parsed template renders on many threads", "[jinja]") {
  const Template t = Template::parse(kChatML);
  std::vector<std::thread> threads;
  std::vector<std::string> out(8);
  for (size_t i = 0; i < out.size(); ++i) {
    threads.emplace_back([&, i] {
      const Json ctx = {{"messages", Json::array({{{"role", "user"}, {"content", std::to_string(i)}}})},
                        {"add_generation_prompt", false}};
      for (int k = 0; k < 200; ++k) out[i] = t.render(ctx);
    });
  }
  for (auto& th : threads) th.join();
  for (size_t i = 0; i < out.size(); ++i)
    CHECK(out[i].find("user\n" + std::to_string(i) + "<|im_end|>") != std::string::npos);
}
