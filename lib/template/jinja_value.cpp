// Values of the Jinja interpreter as Python sees them: truth, equality, str(), repr(),
// float repr, json.dumps and the conversion from JSON (see jinja_internal.hpp).
#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>

#include "template/jinja_internal.hpp"
#include "tokenizer/tokenizer_internal.hpp"

namespace tandem::jinja {

Value Value::undefined(std::string name) {
  Value v;
  v.kind = Kind::kUndefined;
  if (!name.empty()) v.s = std::make_shared<const std::string>(std::move(name));
  return v;
}
Value Value::none() {
  Value v;
  v.kind = Kind::kNone;
  return v;
}
Value Value::boolean(bool x) {
  Value v;
  v.kind = Kind::kBool;
  v.b = x;
  return v;
}
Value Value::integer(int64_t x) {
  Value v;
  v.kind = Kind::kInt;
  v.i = x;
  return v;
}
Value Value::number(double x) {
  Value v;
  v.kind = Kind::kFloat;
  v.f = x;
  return v;
}
Value Value::string(std::string x) {
  Value v;
  v.kind = Kind::kString;
  v.s = std::make_shared<const std::string>(std::move(x));
  return v;
}
namespace {

uint32_t nested_depth(uint32_t d) {
  if (d + 1 > kMaxValueDepth)
    fail_limit("a list or dict nests deeper than " + std::to_string(kMaxValueDepth) + " levels");
  return d + 1;
}

}  // namespace

Value Value::from_list(ValueList x, bool is_tuple) {
  Value v;
  uint32_t d = 0;
  for (const Value& e : x) d = std::max(d, e.depth);
  v.depth = nested_depth(d);
  v.kind = Kind::kList;
  v.tuple = is_tuple;
  v.list = std::make_shared<const ValueList>(std::move(x));
  return v;
}
Value Value::from_dict(Dict d) {
  Value v;
  uint32_t depth = 0;
  for (const auto& [k, e] : d.entries) depth = std::max(depth, std::max(k.depth, e.depth));
  v.depth = nested_depth(depth);
  v.kind = Kind::kDict;
  v.dict = std::make_shared<const Dict>(std::move(d));
  return v;
}

namespace {

// Python hashes 1, 1.0 and True alike: numeric keys compare by value.
bool key_equal(const Value& a, const Value& b) {
  return py_equal(a, b);
}

}  // namespace

const Value* Dict::find(std::string_view key) const {
  const auto it = by_string.find(std::string(key));
  return it == by_string.end() ? nullptr : &entries[it->second].second;
}

const Value* Dict::find(const Value& key) const {
  if (key.is_string()) return find(std::string_view(key.str()));
  for (const auto& [k, v] : entries) {
    if (!k.is_string() && key_equal(k, key)) return &v;
  }
  return nullptr;
}

void Dict::set(Value key, Value value) {
  if (key.is_string()) {
    const auto it = by_string.find(key.str());
    if (it != by_string.end()) {
      entries[it->second].second = std::move(value);
      return;
    }
    by_string.emplace(key.str(), entries.size());
    entries.emplace_back(std::move(key), std::move(value));
    return;
  }
  for (auto& [k, v] : entries) {
    if (!k.is_string() && key_equal(k, key)) {
      v = std::move(value);
      return;
    }
  }
  entries.emplace_back(std::move(key), std::move(value));
}

const Value* CallArgs::get(size_t index, std::string_view name) const {
  for (const auto& [k, v] : kw) {
    if (k == name) return &v;
  }
  return index < pos.size() ? &pos[index] : nullptr;
}

const char* type_name(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined:
      return "Undefined";
    case Value::Kind::kNone:
      return "NoneType";
    case Value::Kind::kBool:
      return "bool";
    case Value::Kind::kInt:
      return "int";
    case Value::Kind::kFloat:
      return "float";
    case Value::Kind::kString:
      return "str";
    case Value::Kind::kList:
      return v.tuple ? "tuple" : "list";
    case Value::Kind::kDict:
      return "dict";
    case Value::Kind::kNamespace:
      return "Namespace";
    case Value::Kind::kCallable:
      return "function";
  }
  return "object";
}

bool truthy(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      return false;
    case Value::Kind::kBool:
      return v.b;
    case Value::Kind::kInt:
      return v.i != 0;
    case Value::Kind::kFloat:
      return v.f != 0.0;
    case Value::Kind::kString:
      return !v.s->empty();
    case Value::Kind::kList:
      return !v.list->empty();
    case Value::Kind::kDict:
      return !v.dict->entries.empty();
    case Value::Kind::kNamespace:
    case Value::Kind::kCallable:
      return true;
  }
  return false;
}

bool py_equal(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.kind == Value::Kind::kFloat || b.kind == Value::Kind::kFloat) {
      const double x = a.kind == Value::Kind::kFloat ? a.f : a.kind == Value::Kind::kInt ? double(a.i) : a.b;
      const double y = b.kind == Value::Kind::kFloat ? b.f : b.kind == Value::Kind::kInt ? double(b.i) : b.b;
      return x == y;
    }
    const int64_t x = a.kind == Value::Kind::kInt ? a.i : a.b;
    const int64_t y = b.kind == Value::Kind::kInt ? b.i : b.b;
    return x == y;
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      return true;
    case Value::Kind::kString:
      return a.s == b.s || *a.s == *b.s;
    case Value::Kind::kList: {
      if (a.tuple != b.tuple || a.list->size() != b.list->size()) return false;
      for (size_t i = 0; i < a.list->size(); ++i) {
        if (!py_equal((*a.list)[i], (*b.list)[i])) return false;
      }
      return true;
    }
    case Value::Kind::kDict: {
      if (a.dict->entries.size() != b.dict->entries.size()) return false;
      for (const auto& [k, v] : a.dict->entries) {
        const Value* o = b.dict->find(k);
        if (o == nullptr || !py_equal(v, *o)) return false;
      }
      return true;
    }
    case Value::Kind::kNamespace:
      return a.ns == b.ns;
    case Value::Kind::kCallable:
      return a.fn == b.fn;
    default:
      return false;
  }
}

std::vector<uint32_t> code_points(std::string_view s) {
  std::vector<uint32_t> out;
  out.reserve(s.size());
  detail::utf8_decode_lax(s, out);
  return out;
}

void append_utf8(std::string& out, uint32_t cp) {
  detail::utf8_append(out, cp);
}

bool py_isspace(uint32_t cp) {
  return (cp >= 0x1C && cp <= 0x1F) || detail::unicode_is_whitespace(cp);
}

namespace {

bool py_isprintable(uint32_t cp) {
  if (cp == 0x20) return true;
  const auto cat = detail::unicode_category(cp);
  return cat != detail::kCatOther && cat != detail::kCatUnassigned && cat != detail::kCatSeparator;
}

}  // namespace

std::string py_float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  std::string sci(buf, r.ptr);  // [-]d[.ddd]e[+-]xx, shortest round-trip digits
  std::string sign;
  if (sci[0] == '-') {
    sign = "-";
    sci.erase(0, 1);
  }
  const size_t e = sci.find('e');
  std::string digits;
  for (size_t i = 0; i < e; ++i) {
    if (sci[i] != '.') digits += sci[i];
  }
  const int exp10 = std::stoi(sci.substr(e + 1));
  while (digits.size() > 1 && digits.back() == '0') digits.pop_back();
  const int decpt = exp10 + 1;  // digits d1 d2 ... = 0.d1d2... x 10^decpt
  std::string out;
  if (decpt > -4 && decpt <= 16) {
    if (decpt <= 0) {
      out = "0." + std::string(size_t(-decpt), '0') + digits;
    } else if (size_t(decpt) >= digits.size()) {
      out = digits + std::string(size_t(decpt) - digits.size(), '0') + ".0";
    } else {
      out = digits.substr(0, size_t(decpt)) + "." + digits.substr(size_t(decpt));
    }
  } else {
    out = digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    const int x = decpt - 1;
    out += fmt::format("e{}{:02d}", x < 0 ? '-' : '+', x < 0 ? -x : x);
  }
  return sign + out;
}

void py_repr_string(std::string_view s, std::string& out) {
  const bool has_single = s.find('\'') != std::string_view::npos;
  const bool has_double = s.find('"') != std::string_view::npos;
  const char q = has_single && !has_double ? '"' : '\'';
  out += q;
  for (uint32_t cp : code_points(s)) {
    if (cp == uint32_t(q) || cp == '\\') {
      out += '\\';
      out += char(cp);
    } else if (cp == '\t') {
      out += "\\t";
    } else if (cp == '\n') {
      out += "\\n";
    } else if (cp == '\r') {
      out += "\\r";
    } else if (cp >= 0x20 && cp < 0x7F) {
      out += char(cp);
    } else if (py_isprintable(cp)) {
      append_utf8(out, cp);
    } else if (cp <= 0xFF) {
      out += fmt::format("\\x{:02x}", cp);
    } else if (cp <= 0xFFFF) {
      out += fmt::format("\\u{:04x}", cp);
    } else {
      out += fmt::format("\\U{:08x}", cp);
    }
  }
  out += q;
}

namespace {

void repr_into(const Value& v, std::string& out, int depth) {
  if (depth > 500) fail_limit("a value nests deeper than 500 levels");
  switch (v.kind) {
    case Value::Kind::kUndefined:
      out += "Undefined";
      return;
    case Value::Kind::kNone:
      out += "None";
      return;
    case Value::Kind::kBool:
      out += v.b ? "True" : "False";
      return;
    case Value::Kind::kInt:
      out += std::to_string(v.i);
      return;
    case Value::Kind::kFloat:
      out += py_float_repr(v.f);
      return;
    case Value::Kind::kString:
      py_repr_string(*v.s, out);
      return;
    case Value::Kind::kList: {
      out += v.tuple ? '(' : '[';
      for (size_t i = 0; i < v.list->size(); ++i) {
        if (i > 0) out += ", ";
        repr_into((*v.list)[i], out, depth + 1);
      }
      if (v.tuple && v.list->size() == 1) out += ',';
      out += v.tuple ? ')' : ']';
      return;
    }
    case Value::Kind::kDict: {
      out += '{';
      bool first = true;
      for (const auto& [k, x] : v.dict->entries) {
        if (!first) out += ", ";
        first = false;
        repr_into(k, out, depth + 1);
        out += ": ";
        repr_into(x, out, depth + 1);
      }
      out += '}';
      return;
    }
    case Value::Kind::kNamespace: {
      out += "<Namespace {";
      bool first = true;
      for (const auto& [k, x] : v.ns->attrs.entries) {
        if (!first) out += ", ";
        first = false;
        repr_into(k, out, depth + 1);
        out += ": ";
        repr_into(x, out, depth + 1);
      }
      out += "}>";
      return;
    }
    case Value::Kind::kCallable:
      out += "<function " + v.fn->name + ">";
      return;
  }
}

}  // namespace

std::string py_repr(const Value& v) {
  std::string out;
  repr_into(v, out, 0);
  return out;
}

std::string py_str(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined:
      return {};
    case Value::Kind::kString:
      return *v.s;
    default:
      return py_repr(v);
  }
}

Value from_json(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null:
      return Value::none();
    case nlohmann::ordered_json::value_t::boolean:
      return Value::boolean(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
      return Value::integer(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      const auto u = j.get<uint64_t>();
      if (u > uint64_t(INT64_MAX)) return Value::number(double(u));
      return Value::integer(int64_t(u));
    }
    case nlohmann::ordered_json::value_t::number_float:
      return Value::number(j.get<double>());
    case nlohmann::ordered_json::value_t::string:
      return Value::string(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      ValueList items;
      items.reserve(j.size());
      for (const auto& x : j) items.push_back(from_json(x));
      return Value::from_list(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      Dict d;
      for (const auto& [k, x] : j.items()) d.set(Value::string(k), from_json(x));
      return Value::from_dict(std::move(d));
    }
    default:
      return Value::none();
  }
}

namespace {

void json_string(std::string_view s, bool ensure_ascii, std::string& out) {
  out += '"';
  for (uint32_t cp : code_points(s)) {
    switch (cp) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (cp < 0x20) {
          out += fmt::format("\\u{:04x}", cp);
        } else if (ensure_ascii && cp > 0x7E) {
          if (cp >= 0x10000) {
            const uint32_t v = cp - 0x10000;
            out += fmt::format("\\u{:04x}\\u{:04x}", 0xD800 + (v >> 10), 0xDC00 + (v & 0x3FF));
          } else {
            out += fmt::format("\\u{:04x}", cp);
          }
        } else {
          append_utf8(out, cp);
        }
    }
  }
  out += '"';
}

struct Dumper {
  bool ensure_ascii;
  bool has_indent;
  std::string indent;
  std::string item_sep, key_sep;
  bool sort_keys;
  size_t budget;  // bytes left before the output is refused

  void check(const std::string& out) const {
    if (out.size() > budget) fail_limit(fmt::format("tojson output over {} bytes", budget));
  }

  std::string float_text(double d) const {
    if (std::isnan(d)) return "NaN";
    if (std::isinf(d)) return d < 0 ? "-Infinity" : "Infinity";
    return py_float_repr(d);
  }

  std::string key_text(const Value& k, int line) const {
    switch (k.kind) {
      case Value::Kind::kString:
        return k.str();
      case Value::Kind::kInt:
        return std::to_string(k.i);
      case Value::Kind::kFloat:
        return float_text(k.f);
      case Value::Kind::kBool:
        return k.b ? "true" : "false";
      case Value::Kind::kNone:
        return "null";
      default:
        fail(line, fmt::format("tojson: keys must be str, int, float, bool or None, not {}", type_name(k)));
    }
  }

  void newline(std::string& out, int level) const {
    if (!has_indent) return;
    out += '\n';
    for (int i = 0; i < level; ++i) out += indent;
  }

  void dump(const Value& v, std::string& out, int level) {
    if (level > 500) fail_limit("tojson: a value nests deeper than 500 levels");
    check(out);
    switch (v.kind) {
      case Value::Kind::kNone:
        out += "null";
        return;
      case Value::Kind::kBool:
        out += v.b ? "true" : "false";
        return;
      case Value::Kind::kInt:
        out += std::to_string(v.i);
        return;
      case Value::Kind::kFloat:
        out += float_text(v.f);
        return;
      case Value::Kind::kString:
        json_string(v.str(), ensure_ascii, out);
        return;
      case Value::Kind::kList: {
        if (v.list->empty()) {
          out += "[]";
          return;
        }
        out += '[';
        for (size_t i = 0; i < v.list->size(); ++i) {
          if (i > 0) out += item_sep;
          newline(out, level + 1);
          dump((*v.list)[i], out, level + 1);
        }
        newline(out, level);
        out += ']';
        return;
      }
      case Value::Kind::kDict: {
        if (v.dict->entries.empty()) {
          out += "{}";
          return;
        }
        std::vector<const std::pair<Value, Value>*> entries;
        for (const auto& e : v.dict->entries) entries.push_back(&e);
        if (sort_keys) {
          for (const auto* e : entries) {
            if (!e->first.is_string()) fail(0, "tojson: sort_keys with keys that are not all strings");
          }
          std::stable_sort(entries.begin(), entries.end(),
                           [](const auto* a, const auto* b) { return a->first.str() < b->first.str(); });
        }
        out += '{';
        bool first = true;
        for (const auto* e : entries) {
          if (!first) out += item_sep;
          first = false;
          newline(out, level + 1);
          json_string(key_text(e->first, 0), ensure_ascii, out);
          out += key_sep;
          dump(e->second, out, level + 1);
        }
        newline(out, level);
        out += '}';
        return;
      }
      default:
        fail(0, fmt::format("tojson: Object of type {} is not JSON serializable", type_name(v)));
    }
  }
};

}  // namespace

std::string json_dumps(const Value& v, bool ensure_ascii, const Value* indent, const Value* separators, bool sort_keys,
                       Interp* interp) {
  (void)interp;
  Dumper d{ensure_ascii, false, {}, ", ", ": ", sort_keys, size_t(64) << 20};
  if (indent != nullptr && !indent->is_none() && !indent->is_undefined()) {
    d.has_indent = true;
    d.item_sep = ",";
    if (indent->kind == Value::Kind::kInt || indent->kind == Value::Kind::kBool) {
      const int64_t n = indent->kind == Value::Kind::kInt ? indent->i : indent->b;
      if (n > 64) fail(0, "tojson: indent over 64 is not supported");
      d.indent = std::string(size_t(std::max<int64_t>(n, 0)), ' ');
    } else if (indent->is_string()) {
      if (indent->str().size() > 64) fail(0, "tojson: an indent string over 64 bytes is not supported");
      d.indent = indent->str();
    } else {
      fail(0, fmt::format("tojson: indent must be an int or a str, not {}", type_name(*indent)));
    }
  }
  if (separators != nullptr && !separators->is_none() && !separators->is_undefined()) {
    if (!separators->is_list() || separators->list->size() != 2 || !(*separators->list)[0].is_string() ||
        !(*separators->list)[1].is_string()) {
      fail(0, "tojson: separators must be a pair of strings");
    }
    d.item_sep = (*separators->list)[0].str();
    d.key_sep = (*separators->list)[1].str();
  }
  std::string out;
  d.dump(v, out, 0);
  return out;
}

std::string python_json_dumps(const nlohmann::ordered_json& value, bool ensure_ascii, int indent) {
  const Value v = from_json(value);
  const Value ind = Value::integer(indent);
  return json_dumps(v, ensure_ascii, indent < 0 ? nullptr : &ind, nullptr, false, nullptr);
}

}  // namespace tandem::jinja
