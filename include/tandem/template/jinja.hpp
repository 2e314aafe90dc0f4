// A Jinja template interpreter for chat templates (the GGUF key tokenizer.chat_template).
//
// It renders what Hugging Face transformers renders: jinja2's ImmutableSandboxedEnvironment
// with trim_blocks and lstrip_blocks, the loopcontrols extension (break/continue), the
// `generation` block of transformers' AssistantTracker (rendered as its body), the globals
// `raise_exception(msg)` and `strftime_now(fmt)`, and `tojson` as transformers defines it
// (json.dumps(x, ensure_ascii=False, indent=..., separators=..., sort_keys=...)). Values
// print as Python's str() prints them (None, True, [{'a': 1}], 1.0). Python's jinja2 is the
// oracle: tests/jinja_oracle/ compares renders byte for byte.
//
// Supported: {{ }}, {% %}, {# #}, whitespace control (- and +), raw; statements if/elif/
// else, for (else, loop filters, tuple unpacking, loop.* variables, break/continue), set
// (targets, tuples, namespace attributes, block set with filters), macro (defaults,
// varargs, kwargs, caller), call blocks, filter blocks; every operator of jinja2 (and, or,
// not, in, not in, is, comparisons, + - * / // % ** ~, ternaries, slices, attribute and
// subscript, comparison chains); list, tuple and dict literals; the builtin tests and the
// filters and str/dict/list methods chat templates call. Not supported (a parse error, on
// which ChatTemplate falls back to its matcher, or a render error): extends, block,
// include, import, the `do` extension, i18n, recursive for loops, loop.changed, str.format,
// *args/**kwargs in calls, the filters groupby, slice, pprint, urlencode, wordwrap, xmlattr,
// striptags, filesizeformat and random. Differences: integers are 64-bit (Python's are
// unbounded: overflow is an error here, and a context integer above 2^63-1 arrives as a
// float: 12345678901234567890 prints 1.2345678901234567e+19); upper/lower/title/capitalize
// change ASCII letters only; map/select/reject/reverse/unique give lists where jinja2 gives
// generators (the same when iterated, joined or piped to list, which is how templates use
// them). max_alloc_bytes counts every list a template builds, so a template that grows a
// list by concatenation in a loop (Mistral Small 3.1's `filtered_messages + [message]`)
// reaches the default bound near 1,500 messages, where jinja2 still renders.
//
// Errors: Template::parse throws tandem::Error(kInvalidArgument) "jinja: line N: ..." for a
// syntax error or an unsupported construct. render throws tandem::Error(kInvalidArgument)
// for a runtime error (type errors, calling an undefined name, raise_exception: "jinja:
// raise_exception: <msg>") and tandem::Error(kOutOfMemory) when a RenderLimits bound is
// reached (output bytes, steps, nesting depth, bytes created). A hostile template ends in
// one of these errors, never in a crash, a hang or unbounded memory.
//
// Thread-safety: a parsed Template is immutable; render() is const and may run on many
// threads at once (each call has its own state).
#pragma once

#include <cstddef>
#include <cstdint>
#include <ctime>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

namespace tandem::jinja {

struct Program;

/// Bounds of one render; reaching one is tandem::Error(kOutOfMemory) naming it.
struct RenderLimits {
  size_t max_output_bytes = size_t(16) << 20;  ///< the rendered text
  size_t max_steps = 5'000'000;                ///< statements, expressions, loop iterations, calls
  int32_t max_depth = 400;                     ///< nesting of expressions, blocks and macro calls
  size_t max_alloc_bytes = size_t(128) << 20;  ///< bytes of strings and lists created, in total
};

struct RenderOptions {
  RenderLimits limits;
  /// The time strftime_now() formats (local time); unset: the current time.
  std::optional<std::time_t> now;
};

class Template {
 public:
  /// Bounds on parsing: a source over max_source_bytes or nested deeper than max_depth
  /// (blocks, parentheses) is tandem::Error(kInvalidArgument).
  static constexpr size_t kMaxSourceBytes = size_t(1) << 20;
  static constexpr int32_t kMaxParseDepth = 200;

  /// Parses `source` (trim_blocks, lstrip_blocks and keep_trailing_newline=False, as
  /// transformers). Throws tandem::Error(kInvalidArgument) "jinja: line N: ...".
  static Template parse(std::string_view source);

  /// Renders with `context` (a JSON object: its keys become variables; key order is kept,
  /// as Python dicts keep it, hence ordered_json). Errors: see the file comment.
  std::string render(const nlohmann::ordered_json& context, const RenderOptions& options = {}) const;

 private:
  explicit Template(std::shared_ptr<const Program> program) : program_(std::move(program)) {}
  std::shared_ptr<const Program> program_;
};

/// Python's json.dumps(value, ensure_ascii, indent, separators, sort_keys) for JSON values
/// (indent < 0: None). Exposed for tests.
std::string python_json_dumps(const nlohmann::ordered_json& value, bool ensure_ascii = false, int indent = -1);

}  // namespace tandem::jinja
