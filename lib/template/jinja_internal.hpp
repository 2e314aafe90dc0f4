// Internals of the Jinja interpreter (include/tandem/template/jinja.hpp): values, the syntax tree,
// the parser and the evaluator's entry point. Not part of the public API.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tandem/core/error.hpp"
#include "tandem/template/jinja.hpp"

namespace tandem::jinja {

class Interp;
struct Value;
struct Dict;
struct NamespaceObj;
struct Callable;

using ValueList = std::vector<Value>;

/// A Python value as templates see it. Strings, lists and dicts are immutable and shared
/// (the sandbox forbids mutating them); namespaces are mutable and shared by reference.
struct Value {
  enum class Kind : uint8_t { kUndefined, kNone, kBool, kInt, kFloat, kString, kList, kDict, kNamespace, kCallable };
  Kind kind = Kind::kUndefined;
  bool tuple = false;  ///< a list that is a Python tuple (repr with parentheses)
  uint32_t depth = 0;  ///< nesting of lists and dicts inside (bounded: kMaxValueDepth)
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::shared_ptr<const std::string> s;  ///< kString; kUndefined: the name (may be null)
  std::shared_ptr<const ValueList> list;
  std::shared_ptr<const Dict> dict;
  std::shared_ptr<NamespaceObj> ns;
  std::shared_ptr<const Callable> fn;

  static Value undefined(std::string name = {});
  static Value none();
  static Value boolean(bool v);
  static Value integer(int64_t v);
  static Value number(double v);
  static Value string(std::string v);
  static Value from_list(ValueList v, bool is_tuple = false);
  static Value from_dict(Dict d);

  bool is_undefined() const noexcept { return kind == Kind::kUndefined; }
  bool is_none() const noexcept { return kind == Kind::kNone; }
  bool is_string() const noexcept { return kind == Kind::kString; }
  bool is_list() const noexcept { return kind == Kind::kList; }
  bool is_dict() const noexcept { return kind == Kind::kDict; }
  bool is_number() const noexcept { return kind == Kind::kInt || kind == Kind::kFloat || kind == Kind::kBool; }
  const std::string& str() const noexcept { return *s; }
  const ValueList& items() const noexcept { return *list; }
};

/// Lists and dicts nest at most this deep (their destruction and printing recurse).
constexpr uint32_t kMaxValueDepth = 1000;

struct Dict {
  std::vector<std::pair<Value, Value>> entries;
  std::unordered_map<std::string, size_t> by_string;  ///< index of string keys
  const Value* find(const Value& key) const;
  const Value* find(std::string_view key) const;
  void set(Value key, Value value);
};

struct NamespaceObj {
  Dict attrs;
};

struct CallArgs {
  ValueList pos;
  std::vector<std::pair<std::string, Value>> kw;
  /// The keyword `name`, or positional `index`, or nullptr.
  const Value* get(size_t index, std::string_view name) const;
};

struct Callable {
  std::string name;
  std::function<Value(Interp&, CallArgs&)> fn;
};

// ---- value helpers (jinja_value.cpp) ----
const char* type_name(const Value& v);
bool truthy(const Value& v);
bool py_equal(const Value& a, const Value& b);
/// Python's str(v): the text {{ v }} prints (undefined prints "").
std::string py_str(const Value& v);
/// Python's repr(v).
std::string py_repr(const Value& v);
void py_repr_string(std::string_view s, std::string& out);
std::string py_float_repr(double d);
Value from_json(const nlohmann::ordered_json& j);
/// json.dumps with transformers' tojson arguments; indent: nullptr (None), int or string.
std::string json_dumps(const Value& v, bool ensure_ascii, const Value* indent, const Value* separators, bool sort_keys,
                       Interp* interp);
/// Code points of UTF-8 text (invalid bytes become U+FFFD, as Python's decoding with
/// errors='replace' would).
std::vector<uint32_t> code_points(std::string_view s);
void append_utf8(std::string& out, uint32_t cp);
bool py_isspace(uint32_t cp);

// ---- syntax tree ----
struct Expr;
struct Stmt;
using ExprPtr = std::unique_ptr<Expr>;
using StmtPtr = std::unique_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

struct Arg {
  std::string name;  ///< empty: positional
  ExprPtr value;
};

struct Expr {
  enum class Kind : uint8_t {
    kLiteral,  // value
    kName,     // name
    kList,     // items (tuple flag)
    kDict,     // items as key, value pairs
    kGetAttr,  // a . name
    kGetItem,  // a [ b ]
    kSlice,    // a [ items[0] : items[1] : items[2] ] (null items allowed)
    kCall,     // a ( args )
    kFilter,   // a | name ( args ); a null for a filter block's input
    kTest,     // a is name ( args ), negated
    kUnary,    // op a: "not", "-", "+"
    kBinary,   // a op b
    kCompare,  // a op b (chains are nested ands)
    kAnd,
    kOr,
    kCond,  // items[0] if a else items[1] (items[1] null: undefined)
  };
  Kind kind;
  int line = 0;
  int depth = 1;  // height of the subtree (bounded by Template::kMaxParseDepth)
  Value value;
  std::string name;  // name, attribute, filter/test name or operator
  bool negated = false;
  ExprPtr a, b;
  std::vector<ExprPtr> items;
  std::vector<Arg> args;
  std::vector<std::string> ops;  // kCompare's operators
};

struct MacroParam {
  std::string name;
  ExprPtr default_value;  // null: required
};

struct Stmt {
  enum class Kind : uint8_t {
    kText,       // text
    kOutput,     // expr
    kIf,         // conds[i] -> bodies[i]; else_body
    kFor,        // targets in expr [if cond] body else_body
    kSet,        // targets (or ns.attr) = expr
    kSetBlock,   // target = rendered body | filter
    kMacro,      // name(params) body
    kCallBlock,  // call(params) expr body
    kFilterBlock,
    kBreak,
    kContinue,
  };
  Kind kind;
  int line = 0;
  std::string text;
  ExprPtr expr;  // output, for-iterable, set value, call expression, set-block/filter-block filter chain
  ExprPtr cond;  // for's loop filter
  std::vector<std::string> targets;
  std::string attr;  // set ns.attr: targets[0] is the namespace name
  std::vector<ExprPtr> conds;
  std::vector<Body> bodies;
  Body body, else_body;
  std::vector<MacroParam> params;
  std::string name;
};

struct Program {
  Body body;
};

std::shared_ptr<const Program> parse_program(std::string_view source);
/// Names the parser accepts after | and is (jinja2 refuses unknown ones when compiling).
bool is_known_filter(std::string_view name);
bool is_known_test(std::string_view name);

[[noreturn]] void fail(int line, const std::string& message);
[[noreturn]] void fail_limit(const std::string& message);

}  // namespace tandem::jinja
