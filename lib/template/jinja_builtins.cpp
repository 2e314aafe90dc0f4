// Builtins of the Jinja interpreter: attribute lookup and the str/dict/list methods,
// jinja2's filters and tests (transformers' tojson), and the globals range, dict,
// namespace, joiner, raise_exception and strftime_now.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <ctime>
#include <set>

#include "template/jinja_interp.hpp"
#include "tokenizer/tokenizer_internal.hpp"

namespace tandem::jinja {

namespace {

const std::set<std::string, std::less<>> kStrMethods = {
    "strip",        "lstrip",    "rstrip",     "split",      "rsplit",   "splitlines", "startswith", "endswith",
    "upper",        "lower",     "title",      "capitalize", "replace",  "find",       "rfind",      "index",
    "rindex",       "count",     "join",       "isdigit",    "isalpha",  "isalnum",    "isspace",    "islower",
    "isupper",      "isnumeric", "isdecimal",  "center",     "ljust",    "rjust",      "zfill",      "removeprefix",
    "removesuffix", "partition", "rpartition", "swapcase",   "casefold", "istitle"};
const std::set<std::string, std::less<>> kDictMethods = {"items", "keys", "values", "get", "copy"};
const std::set<std::string, std::less<>> kDictUnsafe = {"pop", "popitem", "setdefault", "update", "clear"};
const std::set<std::string, std::less<>> kListMethods = {"index", "count", "copy"};
const std::set<std::string, std::less<>> kListUnsafe = {"append", "extend", "insert",  "pop",
                                                        "remove", "sort",   "reverse", "clear"};

bool is_int(const Value& v) {
  return v.kind == Value::Kind::kInt || v.kind == Value::Kind::kBool;
}
int64_t to_int(const Value& v) {
  return v.kind == Value::Kind::kInt ? v.i : v.b ? 1 : 0;
}

bool ascii_upper(uint32_t c) {
  return c >= 'A' && c <= 'Z';
}
bool ascii_lower(uint32_t c) {
  return c >= 'a' && c <= 'z';
}
uint32_t to_upper(uint32_t c) {
  return ascii_lower(c) ? c - 32 : c;
}
uint32_t to_lower(uint32_t c) {
  return ascii_upper(c) ? c + 32 : c;
}
bool is_cased(uint32_t c) {
  return ascii_upper(c) || ascii_lower(c) || (c > 0x7F && detail::unicode_category(c) == detail::kCatLetter);
}

std::string map_cps(std::string_view s, uint32_t (*f)(uint32_t)) {
  std::string out;
  out.reserve(s.size());
  for (uint32_t c : code_points(s)) append_utf8(out, f(c));
  return out;
}

std::string encode(const std::vector<uint32_t>& cps, size_t b, size_t e) {
  std::string out;
  for (size_t i = b; i < e && i < cps.size(); ++i) append_utf8(out, cps[i]);
  return out;
}

std::string py_title(std::string_view s) {
  std::string out;
  bool prev_cased = false;
  for (uint32_t c : code_points(s)) {
    append_utf8(out, prev_cased ? to_lower(c) : to_upper(c));
    prev_cased = is_cased(c);
  }
  return out;
}

std::string py_capitalize(std::string_view s) {
  std::string out;
  bool first = true;
  for (uint32_t c : code_points(s)) {
    append_utf8(out, first ? to_upper(c) : to_lower(c));
    first = false;
  }
  return out;
}

// Python's str.strip family; chars null: whitespace.
std::string py_strip(std::string_view s, const Value* chars, bool left, bool right) {
  const std::vector<uint32_t> cps = code_points(s);
  std::vector<uint32_t> set;
  const bool ws = chars == nullptr || chars->is_none() || chars->is_undefined();
  if (!ws) set = code_points(chars->str());
  auto strip_it = [&](uint32_t c) { return ws ? py_isspace(c) : std::find(set.begin(), set.end(), c) != set.end(); };
  size_t b = 0, e = cps.size();
  if (left) {
    while (b < e && strip_it(cps[b])) ++b;
  }
  if (right) {
    while (e > b && strip_it(cps[e - 1])) --e;
  }
  return encode(cps, b, e);
}

std::vector<std::string> py_split(std::string_view s, const Value* sep, int64_t maxsplit, bool from_right) {
  std::vector<std::string> parts;
  if (sep == nullptr || sep->is_none() || sep->is_undefined()) {
    const std::vector<uint32_t> cps = code_points(s);
    std::vector<std::pair<size_t, size_t>> words;
    if (!from_right) {
      size_t i = 0;
      while (i < cps.size()) {
        while (i < cps.size() && py_isspace(cps[i])) ++i;
        if (i >= cps.size()) break;
        if (maxsplit >= 0 && int64_t(words.size()) == maxsplit) {
          size_t e = cps.size();
          while (e > i && py_isspace(cps[e - 1])) --e;
          words.emplace_back(i, e);
          break;
        }
        size_t j = i;
        while (j < cps.size() && !py_isspace(cps[j])) ++j;
        words.emplace_back(i, j);
        i = j;
      }
    } else {
      size_t i = cps.size();
      while (i > 0) {
        while (i > 0 && py_isspace(cps[i - 1])) --i;
        if (i == 0) break;
        if (maxsplit >= 0 && int64_t(words.size()) == maxsplit) {
          size_t b = 0;
          while (b < i && py_isspace(cps[b])) ++b;
          words.emplace_back(b, i);
          break;
        }
        size_t j = i;
        while (j > 0 && !py_isspace(cps[j - 1])) --j;
        words.emplace_back(j, i);
        i = j;
      }
      std::reverse(words.begin(), words.end());
    }
    for (auto [b, e] : words) parts.push_back(encode(cps, b, e));
    return parts;
  }
  const std::string& d = sep->str();
  if (d.empty()) throw Error(ErrorCode::kInvalidArgument, "jinja: empty separator");
  if (!from_right) {
    size_t pos = 0;
    while (true) {
      if (maxsplit >= 0 && int64_t(parts.size()) == maxsplit) break;
      const size_t f = s.find(d, pos);
      if (f == std::string_view::npos) break;
      parts.emplace_back(s.substr(pos, f - pos));
      pos = f + d.size();
    }
    parts.emplace_back(s.substr(pos));
    return parts;
  }
  size_t end = s.size();
  std::vector<std::string> rev;
  while (true) {
    if (maxsplit >= 0 && int64_t(rev.size()) == maxsplit) break;
    if (end < d.size()) break;
    const size_t f = s.rfind(d, end - d.size());
    if (f == std::string_view::npos) break;
    rev.emplace_back(s.substr(f + d.size(), end - f - d.size()));
    end = f;
  }
  rev.emplace_back(s.substr(0, end));
  return {rev.rbegin(), rev.rend()};
}

bool is_line_break(uint32_t c) {
  return c == '\n' || c == '\r' || c == 0x0B || c == 0x0C || c == 0x1C || c == 0x1D || c == 0x1E || c == 0x85 ||
         c == 0x2028 || c == 0x2029;
}

std::vector<std::string> py_splitlines(std::string_view s, bool keepends) {
  const std::vector<uint32_t> cps = code_points(s);
  std::vector<std::string> out;
  size_t b = 0, i = 0;
  while (i < cps.size()) {
    if (is_line_break(cps[i])) {
      size_t e = i + 1;
      if (cps[i] == '\r' && e < cps.size() && cps[e] == '\n') ++e;
      out.push_back(encode(cps, b, keepends ? e : i));
      b = i = e;
    } else {
      ++i;
    }
  }
  if (b < cps.size()) out.push_back(encode(cps, b, cps.size()));
  return out;
}

std::string py_replace(std::string_view s, std::string_view old, std::string_view repl, int64_t count, Interp& in) {
  std::string out;
  if (old.empty()) {
    const std::vector<uint32_t> cps = code_points(s);
    int64_t n = 0;
    for (size_t i = 0; i <= cps.size(); ++i) {
      if (count < 0 || n < count) {
        out += repl;
        ++n;
      }
      if (i < cps.size()) append_utf8(out, cps[i]);
      in.charge(repl.size());
    }
    return out;
  }
  size_t pos = 0;
  int64_t n = 0;
  while (count < 0 || n < count) {
    const size_t f = s.find(old, pos);
    if (f == std::string_view::npos) break;
    out.append(s.substr(pos, f - pos));
    out.append(repl);
    in.charge(repl.size());
    pos = f + old.size();
    ++n;
  }
  out.append(s.substr(pos));
  return out;
}

std::string html_escape(std::string_view s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

Value make_callable(std::string name, std::function<Value(Interp&, CallArgs&)> fn) {
  auto c = std::make_shared<Callable>();
  c->name = std::move(name);
  c->fn = std::move(fn);
  Value v;
  v.kind = Value::Kind::kCallable;
  v.fn = std::move(c);
  return v;
}

const Value* arg(const CallArgs& a, size_t i, std::string_view name) {
  return a.get(i, name);
}

bool arg_bool(const CallArgs& a, size_t i, std::string_view name, bool dflt) {
  const Value* v = a.get(i, name);
  return v == nullptr ? dflt : truthy(*v);
}

std::string arg_str(Interp& in, const CallArgs& a, size_t i, std::string_view name, std::string dflt) {
  const Value* v = a.get(i, name);
  if (v == nullptr) return dflt;
  if (!v->is_string()) in.error(fmt::format("argument '{}' must be a string, not {}", name, type_name(*v)));
  return v->str();
}

int64_t arg_int(Interp& in, const CallArgs& a, size_t i, std::string_view name, int64_t dflt) {
  const Value* v = a.get(i, name);
  if (v == nullptr || v->is_none()) return dflt;
  if (!is_int(*v)) in.error(fmt::format("argument '{}' must be an integer, not {}", name, type_name(*v)));
  return to_int(*v);
}

std::string need_str(Interp& in, const Value& v, const char* what) {
  if (!v.is_string()) in.error(fmt::format("{} needs a string, not {}", what, type_name(v)));
  return v.str();
}

// jinja2's make_attrgetter: "a.b.0" looked up with getitem, part by part.
Value attr_path(Interp& in, Value item, const std::string& path) {
  size_t b = 0;
  while (true) {
    const size_t e = path.find('.', b);
    const std::string part = path.substr(b, e == std::string::npos ? std::string::npos : e - b);
    const bool digits =
        !part.empty() && std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; });
    item = in.getitem(item, digits ? Value::integer(std::stoll(part)) : Value::string(part));
    if (e == std::string::npos) return item;
    b = e + 1;
  }
}

Value lower_key(const Value& v, bool case_sensitive) {
  if (!case_sensitive && v.is_string()) return Value::string(map_cps(v.str(), to_lower));
  return v;
}

std::string strftime_text(const std::string& f, std::time_t t) {
  std::tm tm{};
  localtime_r(&t, &tm);
  if (f.empty()) return {};
  std::string buf(256 + f.size() * 16, '\0');
  const size_t n = std::strftime(buf.data(), buf.size(), f.c_str(), &tm);
  buf.resize(n);
  return buf;
}

}  // namespace

Value Interp::getattr(const Value& obj, const std::string& name) {
  switch (obj.kind) {
    case Value::Kind::kUndefined:
      undefined_error(obj);
    case Value::Kind::kDict:
      if (kDictMethods.count(name) != 0 || kDictUnsafe.count(name) != 0) return method(obj, name);
      if (const Value* v = obj.dict->find(std::string_view(name))) return *v;
      return Value::undefined(fmt::format("dict object has no attribute '{}'", name));
    case Value::Kind::kString:
      if (kStrMethods.count(name) != 0) return method(obj, name);
      return Value::undefined(fmt::format("str object has no attribute '{}'", name));
    case Value::Kind::kList:
      if (kListMethods.count(name) != 0 || kListUnsafe.count(name) != 0) return method(obj, name);
      return Value::undefined(fmt::format("list object has no attribute '{}'", name));
    case Value::Kind::kNamespace:
      if (const Value* v = obj.ns->attrs.find(std::string_view(name))) return *v;
      return Value::undefined(fmt::format("namespace has no attribute '{}'", name));
    default:
      return Value::undefined(fmt::format("{} object has no attribute '{}'", type_name(obj), name));
  }
}

Value Interp::method(const Value& obj, const std::string& name) {
  return make_callable(name, [obj, name](Interp& in, CallArgs& a) -> Value {
    if (obj.is_dict()) {
      const Dict& d = *obj.dict;
      if (kDictUnsafe.count(name) != 0)
        in.error(fmt::format("access to attribute '{}' of 'dict' object is unsafe", name));
      if (name == "items") {
        ValueList out;
        for (const auto& [k, v] : d.entries) out.push_back(Value::from_list({k, v}, true));
        return in.list(std::move(out));
      }
      if (name == "keys" || name == "values") {
        ValueList out;
        for (const auto& [k, v] : d.entries) out.push_back(name == "keys" ? k : v);
        return in.list(std::move(out));
      }
      if (name == "copy") return obj;
      // get
      const Value* key = arg(a, 0, "key");
      if (key == nullptr) in.error("get() needs a key");
      if (const Value* v = d.find(*key)) return *v;
      const Value* dflt = arg(a, 1, "default");
      return dflt != nullptr ? *dflt : Value::none();
    }
    if (obj.is_list()) {
      if (kListUnsafe.count(name) != 0) {
        in.error(fmt::format("access to attribute '{}' of '{}' object is unsafe", name, type_name(obj)));
      }
      if (name == "copy") return obj;
      const Value* x = arg(a, 0, "value");
      if (x == nullptr) in.error(name + "() takes exactly one argument");
      in.tick(obj.list->size());
      int64_t n = 0;
      for (size_t i = 0; i < obj.list->size(); ++i) {
        if (py_equal((*obj.list)[i], *x)) {
          if (name == "index") return Value::integer(int64_t(i));
          ++n;
        }
      }
      if (name == "index") in.error(fmt::format("{} is not in list", py_repr(*x)));
      return Value::integer(n);
    }
    const std::string& s = obj.str();
    in.tick(s.size() / 64);
    if (name == "strip" || name == "lstrip" || name == "rstrip") {
      const Value* chars = arg(a, 0, "chars");
      if (chars != nullptr && !chars->is_none() && !chars->is_string()) in.error(name + " arg must be None or str");
      return in.str(py_strip(s, chars, name != "rstrip", name != "lstrip"));
    }
    if (name == "split" || name == "rsplit") {
      const Value* sep = arg(a, 0, "sep");
      if (sep != nullptr && !sep->is_none() && !sep->is_string()) in.error("must be str or None");
      const int64_t maxsplit = arg_int(in, a, 1, "maxsplit", -1);
      ValueList out;
      for (auto& p : py_split(s, sep, maxsplit, name == "rsplit")) out.push_back(in.str(std::move(p)));
      return in.list(std::move(out));
    }
    if (name == "splitlines") {
      ValueList out;
      for (auto& p : py_splitlines(s, arg_bool(a, 0, "keepends", false))) out.push_back(in.str(std::move(p)));
      return in.list(std::move(out));
    }
    if (name == "startswith" || name == "endswith") {
      const Value* x = arg(a, 0, "prefix");
      if (x == nullptr) in.error(name + "() takes at least 1 argument");
      std::vector<std::string> options;
      if (x->is_string()) {
        options.push_back(x->str());
      } else if (x->is_list() && x->tuple) {
        for (const Value& o : *x->list) options.push_back(need_str(in, o, name.c_str()));
      } else {
        in.error(fmt::format("{} first arg must be str or a tuple of str, not {}", name, type_name(*x)));
      }
      for (const std::string& o : options) {
        if (name == "startswith" ? std::string_view(s).starts_with(o) : std::string_view(s).ends_with(o)) {
          return Value::boolean(true);
        }
      }
      return Value::boolean(false);
    }
    if (name == "upper") return in.str(map_cps(s, to_upper));
    if (name == "lower" || name == "casefold") return in.str(map_cps(s, to_lower));
    if (name == "swapcase") {
      return in.str(map_cps(s, [](uint32_t c) { return ascii_lower(c) ? to_upper(c) : to_lower(c); }));
    }
    if (name == "title") return in.str(py_title(s));
    if (name == "capitalize") return in.str(py_capitalize(s));
    if (name == "replace") {
      const Value* o = arg(a, 0, "old");
      const Value* r = arg(a, 1, "new");
      if (o == nullptr || r == nullptr || !o->is_string() || !r->is_string()) in.error("replace() needs two strings");
      return in.str(py_replace(s, o->str(), r->str(), arg_int(in, a, 2, "count", -1), in));
    }
    if (name == "find" || name == "rfind" || name == "index" || name == "rindex" || name == "count") {
      const Value* x = arg(a, 0, "sub");
      if (x == nullptr || !x->is_string()) in.error(name + "() needs a string argument");
      const std::string& sub = x->str();
      if (name == "count") {
        if (sub.empty()) return Value::integer(int64_t(code_points(s).size()) + 1);
        int64_t n = 0;
        for (size_t p = s.find(sub); p != std::string::npos; p = s.find(sub, p + sub.size())) ++n;
        return Value::integer(n);
      }
      const size_t p = (name == "find" || name == "index") ? s.find(sub) : s.rfind(sub);
      if (p == std::string::npos) {
        if (name == "index" || name == "rindex") in.error("substring not found");
        return Value::integer(-1);
      }
      return Value::integer(int64_t(code_points(std::string_view(s).substr(0, p)).size()));
    }
    if (name == "join") {
      const Value* x = arg(a, 0, "iterable");
      if (x == nullptr) in.error("join() takes exactly one argument");
      std::string out;
      bool first = true;
      for (const Value& v : in.iterate(*x)) {
        if (!v.is_string()) in.error(fmt::format("sequence item: expected str instance, {} found", type_name(v)));
        if (!first) out += s;
        first = false;
        out += v.str();
        in.charge(v.str().size() + s.size());
      }
      return Value::string(std::move(out));
    }
    if (name == "removeprefix" || name == "removesuffix") {
      const std::string x = need_str(in, a.pos.empty() ? Value() : a.pos[0], name.c_str());
      if (name == "removeprefix" && std::string_view(s).starts_with(x)) return in.str(s.substr(x.size()));
      if (name == "removesuffix" && !x.empty() && std::string_view(s).ends_with(x)) {
        return in.str(s.substr(0, s.size() - x.size()));
      }
      return obj;
    }
    if (name == "partition" || name == "rpartition") {
      const std::string x = need_str(in, a.pos.empty() ? Value() : a.pos[0], name.c_str());
      if (x.empty()) in.error("empty separator");
      const size_t p = name == "partition" ? s.find(x) : s.rfind(x);
      if (p == std::string::npos) {
        if (name == "partition") return in.list({obj, Value::string(""), Value::string("")}, true);
        return in.list({Value::string(""), Value::string(""), obj}, true);
      }
      return in.list({in.str(s.substr(0, p)), Value::string(x), in.str(s.substr(p + x.size()))}, true);
    }
    if (name == "center" || name == "ljust" || name == "rjust" || name == "zfill") {
      const int64_t width = arg_int(in, a, 0, "width", 0);
      const size_t len = code_points(s).size();
      if (width <= int64_t(len)) return obj;
      const size_t pad = size_t(width) - len;
      if (pad > (size_t(1) << 24)) in.error("width too large");
      std::string fill = name == "zfill" ? "0" : arg_str(in, a, 1, "fillchar", " ");
      auto rep = [&](size_t n) {
        std::string r;
        for (size_t i = 0; i < n; ++i) r += fill;
        return r;
      };
      in.charge(pad * fill.size());
      if (name == "ljust") return Value::string(s + rep(pad));
      if (name == "rjust") return Value::string(rep(pad) + s);
      if (name == "zfill") {
        if (!s.empty() && (s[0] == '-' || s[0] == '+')) return Value::string(s.substr(0, 1) + rep(pad) + s.substr(1));
        return Value::string(rep(pad) + s);
      }
      // Python's center: left = pad/2 + (pad & width & 1)
      const size_t left = pad / 2 + (pad & size_t(width) & 1);
      return Value::string(rep(left) + s + rep(pad - left));
    }
    // is* predicates
    const std::vector<uint32_t> cps = code_points(s);
    if (name == "isspace") {
      return Value::boolean(!cps.empty() && std::all_of(cps.begin(), cps.end(), py_isspace));
    }
    if (name == "isdigit" || name == "isnumeric" || name == "isdecimal") {
      return Value::boolean(!cps.empty() && std::all_of(cps.begin(), cps.end(), [&](uint32_t c) {
        return (c >= '0' && c <= '9') ||
               (name != "isdecimal" && c > 0x7F && detail::unicode_category(c) == detail::kCatNumber);
      }));
    }
    if (name == "isalpha") {
      return Value::boolean(!cps.empty() && std::all_of(cps.begin(), cps.end(), [](uint32_t c) {
        return detail::unicode_category(c) == detail::kCatLetter;
      }));
    }
    if (name == "isalnum") {
      return Value::boolean(!cps.empty() && std::all_of(cps.begin(), cps.end(), [](uint32_t c) {
        const auto cat = detail::unicode_category(c);
        return cat == detail::kCatLetter || cat == detail::kCatNumber;
      }));
    }
    if (name == "islower" || name == "isupper") {
      bool any = false;
      for (uint32_t c : cps) {
        if (name == "islower" ? ascii_upper(c) : ascii_lower(c)) return Value::boolean(false);
        any = any || ascii_upper(c) || ascii_lower(c);
      }
      return Value::boolean(any);
    }
    if (name == "istitle") return Value::boolean(s == py_title(s) && std::any_of(cps.begin(), cps.end(), is_cased));
    in.error(fmt::format("str.{} is not supported", name));
  });
}

std::string Interp::percent_format(const std::string& f, const Value& args) {
  ValueList items;
  if (args.is_list() && args.tuple) {
    items = *args.list;
  } else {
    items.push_back(args);
  }
  size_t next = 0;
  std::string out;
  for (size_t i = 0; i < f.size(); ++i) {
    if (f[i] != '%') {
      out += f[i];
      continue;
    }
    if (++i >= f.size()) error("incomplete format");
    if (f[i] == '%') {
      out += '%';
      continue;
    }
    std::string spec = "%";
    while (i < f.size() && std::string_view("-+ #0123456789.").find(f[i]) != std::string_view::npos) spec += f[i++];
    if (i >= f.size()) error("incomplete format");
    const char conv = f[i];
    if (next >= items.size()) error("not enough arguments for format string");
    const Value& v = items[next++];
    std::string s;
    char buf[512];
    if (spec.size() > 16) error("format spec too long");
    if (conv == 's' || conv == 'r') {
      s = conv == 's' ? py_str(v) : py_repr(v);
      std::snprintf(buf, sizeof buf, (spec + "s").c_str(), "");  // validate
      int width = 0;
      bool left = spec.find('-') != std::string::npos;
      const size_t dot = spec.find('.');
      std::string w = spec.substr(1, dot == std::string::npos ? std::string::npos : dot - 1);
      w.erase(std::remove_if(w.begin(), w.end(), [](char c) { return !(c >= '0' && c <= '9'); }), w.end());
      if (!w.empty()) width = std::min(std::stoi(w.substr(0, 6)), 4096);
      if (dot != std::string::npos) {
        const std::string p = spec.substr(dot + 1);
        if (!p.empty()) s = encode(code_points(s), 0, size_t(std::stoi(p.substr(0, 6))));
      }
      const size_t len = code_points(s).size();
      if (int(len) < width) s.insert(left ? s.size() : 0, size_t(width) - len, ' ');
    } else if (conv == 'd' || conv == 'i') {
      if (!v.is_number()) error(fmt::format("%d format: a number is required, not {}", type_name(v)));
      const long long x = v.kind == Value::Kind::kFloat ? (long long)v.f : (long long)to_int(v);
      std::snprintf(buf, sizeof buf, (spec + "lld").c_str(), x);
      s = buf;
    } else if (conv == 'f' || conv == 'F' || conv == 'e' || conv == 'g') {
      if (!v.is_number()) error(fmt::format("%{} format: a number is required, not {}", conv, type_name(v)));
      const double x = v.kind == Value::Kind::kFloat ? v.f : double(to_int(v));
      std::snprintf(buf, sizeof buf, (spec + conv).c_str(), x);
      s = buf;
    } else {
      error(fmt::format("unsupported format character '{}'", conv));
    }
    out += s;
  }
  if (next < items.size()) error("not all arguments converted during string formatting");
  charge(out.size());
  return out;
}

bool Interp::apply_test(const std::string& name, const Value& v, CallArgs& a) {
  const Value* x = arg(a, 0, "other");
  auto need = [&]() -> const Value& {
    if (x == nullptr) error(fmt::format("test '{}' needs an argument", name));
    return *x;
  };
  if (name == "defined") return !v.is_undefined();
  if (name == "undefined") return v.is_undefined();
  if (name == "none") return v.is_none();
  if (name == "boolean") return v.kind == Value::Kind::kBool;
  if (name == "false") return v.kind == Value::Kind::kBool && !v.b;
  if (name == "true") return v.kind == Value::Kind::kBool && v.b;
  if (name == "integer") return v.kind == Value::Kind::kInt;
  if (name == "float") return v.kind == Value::Kind::kFloat;
  if (name == "number") return v.is_number();
  if (name == "string") return v.is_string();
  if (name == "mapping") return v.is_dict();
  if (name == "iterable") return v.is_string() || v.is_list() || v.is_dict() || v.is_undefined();
  if (name == "sequence") return v.is_string() || v.is_list() || v.is_dict() || v.is_undefined();
  if (name == "callable") return v.kind == Value::Kind::kCallable;
  if (name == "escaped") return false;
  if (name == "lower" || name == "upper") {
    if (!v.is_string()) return false;
    bool any = false;
    for (uint32_t c : code_points(v.str())) {
      if (name == "lower" ? ascii_upper(c) : ascii_lower(c)) return false;
      any = any || ascii_upper(c) || ascii_lower(c);
    }
    return any;
  }
  if (name == "even" || name == "odd") {
    if (!is_int(v)) error(fmt::format("test '{}' needs an integer, not {}", name, type_name(v)));
    return (to_int(v) % 2 == 0) == (name == "even");
  }
  if (name == "divisibleby") {
    const Value& d = need();
    if (!is_int(v) || !is_int(d)) error("divisibleby needs integers");
    if (to_int(d) == 0) error("integer modulo by zero");
    return to_int(v) % to_int(d) == 0;
  }
  if (name == "eq" || name == "equalto" || name == "==") return py_equal(v, need());
  if (name == "ne" || name == "!=") return !py_equal(v, need());
  if (name == "lt" || name == "lessthan" || name == "<") return order(v, need(), "<") < 0;
  if (name == "le" || name == "<=") return order(v, need(), "<=") <= 0;
  if (name == "gt" || name == "greaterthan" || name == ">") return order(v, need(), ">") > 0;
  if (name == "ge" || name == ">=") return order(v, need(), ">=") >= 0;
  if (name == "in") return contains(need(), v);
  if (name == "sameas") {
    const Value& o = need();
    if (v.kind != o.kind) return false;
    switch (v.kind) {
      case Value::Kind::kNone:
      case Value::Kind::kUndefined:
        return true;
      case Value::Kind::kBool:
        return v.b == o.b;
      case Value::Kind::kInt:
        return v.i == o.i && v.i >= -5 && v.i <= 256;
      case Value::Kind::kString:
        return v.s == o.s;
      case Value::Kind::kList:
        return v.list == o.list;
      case Value::Kind::kDict:
        return v.dict == o.dict;
      case Value::Kind::kNamespace:
        return v.ns == o.ns;
      case Value::Kind::kCallable:
        return v.fn == o.fn;
      default:
        return false;
    }
  }
  if (name == "filter") return need().is_string() && is_known_filter(need().str());
  if (name == "test") return need().is_string() && is_known_test(need().str());
  error(fmt::format("no test named '{}'", name));
}

namespace {

const std::set<std::string, std::less<>> kTests = {
    "defined", "undefined",   "none",     "boolean",  "false",   "true",  "integer",  "float",  "number", "string",
    "mapping", "iterable",    "sequence", "callable", "escaped", "lower", "upper",    "even",   "odd",    "divisibleby",
    "eq",      "equalto",     "==",       "ne",       "!=",      "lt",    "lessthan", "<",      "le",     "<=",
    "gt",      "greaterthan", ">",        "ge",       ">=",      "in",    "sameas",   "filter", "test"};
const std::set<std::string, std::less<>> kFilters = {
    "abs",        "attr",    "batch",   "capitalize", "center",      "count",  "d",          "default",  "dictsort",
    "e",          "escape",  "first",   "float",      "forceescape", "format", "indent",     "int",      "items",
    "join",       "last",    "length",  "list",       "lower",       "map",    "max",        "min",      "reject",
    "rejectattr", "replace", "reverse", "round",      "safe",        "select", "selectattr", "sort",     "string",
    "sum",        "title",   "tojson",  "trim",       "truncate",    "unique", "upper",      "wordcount"};

}  // namespace

bool is_known_filter(std::string_view name) {
  return kFilters.count(name) != 0;
}
bool is_known_test(std::string_view name) {
  return kTests.count(name) != 0;
}

Value Interp::apply_filter(const std::string& name, const Value& v, CallArgs& a, const Expr& at) {
  tick();
  auto seq = [&]() { return iterate(v); };
  if (name == "safe") return v;
  if (name == "string") return v.is_string() ? v : str(py_str(v));
  if (name == "tojson") {
    const bool ensure_ascii = arg_bool(a, 0, "ensure_ascii", false);
    std::string s = json_dumps(v, ensure_ascii, arg(a, 1, "indent"), arg(a, 2, "separators"),
                               arg_bool(a, 3, "sort_keys", false), this);
    return str(std::move(s));
  }
  if (name == "trim") {
    const Value* chars = arg(a, 0, "chars");
    return str(py_strip(py_str(v), chars, true, true));
  }
  if (name == "upper") return str(map_cps(py_str(v), to_upper));
  if (name == "lower") return str(map_cps(py_str(v), to_lower));
  if (name == "capitalize") return str(py_capitalize(py_str(v)));
  if (name == "title") {
    // jinja2's do_title: words begin after -, whitespace, (, {, [ or <
    const std::vector<uint32_t> cps = code_points(py_str(v));
    std::string out;
    bool begin = true;
    for (uint32_t c : cps) {
      const bool sep = c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || py_isspace(c);
      if (sep) {
        append_utf8(out, c);
        begin = true;
      } else {
        append_utf8(out, begin ? to_upper(c) : to_lower(c));
        begin = false;
      }
    }
    return str(std::move(out));
  }
  if (name == "length" || name == "count") {
    switch (v.kind) {
      case Value::Kind::kUndefined:
        return Value::integer(0);
      case Value::Kind::kString:
        return Value::integer(int64_t(code_points(v.str()).size()));
      case Value::Kind::kList:
        return Value::integer(int64_t(v.list->size()));
      case Value::Kind::kDict:
        return Value::integer(int64_t(v.dict->entries.size()));
      case Value::Kind::kNamespace:
        return Value::integer(int64_t(v.ns->attrs.entries.size()));
      default:
        error(fmt::format("object of type '{}' has no len()", type_name(v)));
    }
  }
  if (name == "default" || name == "d") {
    const Value* dflt = arg(a, 0, "default_value");
    if (v.is_undefined() || (arg_bool(a, 1, "boolean", false) && !truthy(v))) {
      return dflt != nullptr ? *dflt : Value::string("");
    }
    return v;
  }
  if (name == "first") {
    if (v.is_list()) return v.list->empty() ? Value::undefined("first item") : v.list->front();
    std::vector<Value> items = seq();
    return items.empty() ? Value::undefined("first item") : items.front();
  }
  if (name == "last") {
    if (v.is_list()) return v.list->empty() ? Value::undefined("last item") : v.list->back();
    std::vector<Value> items = seq();
    return items.empty() ? Value::undefined("last item") : items.back();
  }
  if (name == "list") return v.is_list() && !v.tuple ? v : list(seq());
  if (name == "items") {
    if (v.is_undefined()) return list({});
    if (!v.is_dict()) error(fmt::format("can only get item pairs from a mapping, not {}", type_name(v)));
    ValueList out;
    for (const auto& [k, x] : v.dict->entries) out.push_back(Value::from_list({k, x}, true));
    return list(std::move(out));
  }
  if (name == "join") {
    const std::string sep = arg_str(*this, a, 0, "d", "");
    const Value* attribute = arg(a, 1, "attribute");
    std::string out;
    bool first = true;
    for (const Value& item : seq()) {
      if (!first) out += sep;
      first = false;
      const Value x = attribute != nullptr && !attribute->is_none() ? attr_path(*this, item, py_str(*attribute)) : item;
      out += py_str(x);
      charge(sep.size() + (x.is_string() ? x.str().size() : 16));
    }
    return Value::string(std::move(out));
  }
  if (name == "replace") {
    const Value* o = arg(a, 0, "old");
    const Value* r = arg(a, 1, "new");
    if (o == nullptr || r == nullptr) error("replace needs two arguments");
    return str(py_replace(py_str(v), py_str(*o), py_str(*r), arg_int(*this, a, 2, "count", -1), *this));
  }
  if (name == "int") {
    const Value* dflt = arg(a, 0, "default");
    Value fallback = dflt != nullptr ? *dflt : Value::integer(0);
    const int base = int(arg_int(*this, a, 1, "base", 10));
    if (v.kind == Value::Kind::kInt) return v;
    if (v.kind == Value::Kind::kBool) return Value::integer(v.b);
    if (v.kind == Value::Kind::kFloat) {
      if (!std::isfinite(v.f) || std::fabs(v.f) >= 9.2e18) return fallback;
      return Value::integer(int64_t(v.f));
    }
    if (v.is_string()) {
      std::string s = py_strip(v.str(), nullptr, true, true);
      s.erase(std::remove(s.begin(), s.end(), '_'), s.end());
      if (!s.empty()) {
        errno = 0;
        char* end = nullptr;
        const long long x = std::strtoll(s.c_str(), &end, base);
        if (errno == 0 && end != nullptr && *end == '\0') return Value::integer(x);
        end = nullptr;
        const double d = std::strtod(s.c_str(), &end);
        if (end != nullptr && *end == '\0' && std::isfinite(d) && std::fabs(d) < 9.2e18) {
          return Value::integer(int64_t(d));
        }
      }
    }
    return fallback;
  }
  if (name == "float") {
    const Value* dflt = arg(a, 0, "default");
    Value fallback = dflt != nullptr ? *dflt : Value::number(0.0);
    if (v.is_number()) return Value::number(v.kind == Value::Kind::kFloat ? v.f : double(to_int(v)));
    if (v.is_string()) {
      const std::string s = py_strip(v.str(), nullptr, true, true);
      char* end = nullptr;
      const double d = std::strtod(s.c_str(), &end);
      if (!s.empty() && end != nullptr && *end == '\0') return Value::number(d);
    }
    return fallback;
  }
  if (name == "abs") {
    if (v.kind == Value::Kind::kFloat) return Value::number(std::fabs(v.f));
    if (!is_int(v)) error(fmt::format("bad operand type for abs(): '{}'", type_name(v)));
    if (to_int(v) == INT64_MIN) error("integer overflow");
    return Value::integer(std::llabs(to_int(v)));
  }
  if (name == "round") {
    const int64_t precision = arg_int(*this, a, 0, "precision", 0);
    const std::string method = arg_str(*this, a, 1, "method", "common");
    if (!v.is_number()) error(fmt::format("round needs a number, not {}", type_name(v)));
    double x = v.kind == Value::Kind::kFloat ? v.f : double(to_int(v));
    const double m = std::pow(10.0, double(precision));
    if (method == "common") {
      if (is_int(v) && precision >= 0) return Value::integer(to_int(v));
      if (precision >= 0 && precision <= 300 && std::isfinite(x)) {
        // Python rounds the exact binary value, ties to even: as printf's %.Nf does
        std::vector<char> buf(size_t(precision) + 340);  // 309 integer digits at most
        std::snprintf(buf.data(), buf.size(), "%.*f", int(precision), x);
        return Value::number(std::strtod(buf.data(), nullptr));
      }
      x = std::nearbyint(x * m) / m;
    } else if (method == "floor") {
      x = std::floor(x * m) / m;
    } else if (method == "ceil") {
      x = std::ceil(x * m) / m;
    } else {
      error("method must be common, ceil or floor");
    }
    return Value::number(x);
  }
  if (name == "reverse") {
    if (v.is_string()) {
      std::vector<uint32_t> cps = code_points(v.str());
      std::reverse(cps.begin(), cps.end());
      return str(encode(cps, 0, cps.size()));
    }
    std::vector<Value> items = seq();
    std::reverse(items.begin(), items.end());
    return list(std::move(items));
  }
  if (name == "sort" || name == "unique" || name == "max" || name == "min") {
    const bool reverse = name == "sort" && arg_bool(a, 0, "reverse", false);
    const bool cs = arg_bool(a, name == "sort" ? 1 : 0, "case_sensitive", false);
    const Value* attribute = arg(a, name == "sort" ? 2 : 1, "attribute");
    std::vector<Value> items = seq();
    auto key = [&](const Value& x) {
      return lower_key(attribute != nullptr && !attribute->is_none() ? attr_path(*this, x, py_str(*attribute)) : x, cs);
    };
    tick(items.size() * 8);
    if (name == "unique") {
      ValueList out, seen;
      for (const Value& x : items) {
        const Value k = key(x);
        if (std::none_of(seen.begin(), seen.end(), [&](const Value& s) { return py_equal(s, k); })) {
          seen.push_back(k);
          out.push_back(x);
        }
        tick(seen.size());
      }
      return list(std::move(out));
    }
    if (name == "max" || name == "min") {
      if (items.empty()) return Value::undefined("max/min of an empty sequence");
      size_t best = 0;
      for (size_t i = 1; i < items.size(); ++i) {
        const int c = order(key(items[i]), key(items[best]), "<");
        if (name == "max" ? c > 0 : c < 0) best = i;
      }
      return items[best];
    }
    std::vector<std::pair<Value, Value>> keyed;
    keyed.reserve(items.size());
    for (const Value& x : items) keyed.emplace_back(key(x), x);
    std::stable_sort(keyed.begin(), keyed.end(), [&](const auto& p, const auto& q) {
      return reverse ? order(q.first, p.first, "<") < 0 : order(p.first, q.first, "<") < 0;
    });
    ValueList out;
    for (auto& p : keyed) out.push_back(std::move(p.second));
    return list(std::move(out));
  }
  if (name == "dictsort") {
    if (!v.is_dict()) error("dictsort needs a mapping");
    const bool cs = arg_bool(a, 0, "case_sensitive", false);
    const std::string by = arg_str(*this, a, 1, "by", "key");
    const bool reverse = arg_bool(a, 2, "reverse", false);
    const size_t pos = by == "key" ? 0 : by == "value" ? 1 : 2;
    if (pos == 2) error("You can only sort by either 'key' or 'value'");
    ValueList out;
    for (const auto& [k, x] : v.dict->entries) out.push_back(Value::from_list({k, x}, true));
    tick(out.size() * 8);
    std::stable_sort(out.begin(), out.end(), [&](const Value& p, const Value& q) {
      const Value kp = lower_key((*p.list)[pos], cs), kq = lower_key((*q.list)[pos], cs);
      return reverse ? order(kq, kp, "<") < 0 : order(kp, kq, "<") < 0;
    });
    return list(std::move(out));
  }
  if (name == "sum") {
    const Value* attribute = arg(a, 0, "attribute");
    const Value* start = arg(a, 1, "start");
    Value total = start != nullptr ? *start : Value::integer(0);
    for (const Value& x : seq()) {
      total = binary("+", total,
                     attribute != nullptr && !attribute->is_none() ? attr_path(*this, x, py_str(*attribute)) : x);
    }
    return total;
  }
  if (name == "map" || name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
    std::vector<Value> items = seq();
    ValueList out;
    if (name == "map") {
      const Value* attribute = nullptr;
      const Value* dflt = nullptr;
      for (const auto& [k, x] : a.kw) {
        if (k == "attribute") attribute = &x;
        if (k == "default") dflt = &x;
      }
      if (attribute != nullptr) {
        for (const Value& x : items) {
          Value r = attr_path(*this, x, py_str(*attribute));
          if (r.is_undefined() && dflt != nullptr) r = *dflt;
          out.push_back(std::move(r));
        }
        return list(std::move(out));
      }
      if (a.pos.empty() || !a.pos[0].is_string()) error("map needs a filter name or attribute=");
      const std::string filter = a.pos[0].str();
      CallArgs rest;
      rest.pos.assign(a.pos.begin() + 1, a.pos.end());
      rest.kw = a.kw;
      for (const Value& x : items) {
        CallArgs copy = rest;
        out.push_back(apply_filter(filter, x, copy, at));
      }
      return list(std::move(out));
    }
    const bool by_attr = name == "selectattr" || name == "rejectattr";
    const bool keep_if = name == "select" || name == "selectattr";
    size_t first = 0;
    std::string attribute;
    if (by_attr) {
      if (a.pos.empty()) error(name + " needs an attribute name");
      attribute = py_str(a.pos[0]);
      first = 1;
    }
    std::string test;
    CallArgs targs;
    if (a.pos.size() > first) {
      test = need_str(*this, a.pos[first], name.c_str());
      targs.pos.assign(a.pos.begin() + std::ptrdiff_t(first) + 1, a.pos.end());
      targs.kw = a.kw;
    }
    for (const Value& x : items) {
      const Value subject = by_attr ? attr_path(*this, x, attribute) : x;
      CallArgs copy = targs;
      const bool r = test.empty() ? truthy(subject) : apply_test(test, subject, copy);
      if (r == keep_if) out.push_back(x);
    }
    return list(std::move(out));
  }
  if (name == "indent") {
    const Value* w = arg(a, 0, "width");
    std::string ind = "    ";
    if (w != nullptr) {
      if (w->is_string()) {
        ind = w->str();
      } else if (is_int(*w)) {
        if (to_int(*w) > 1024) error("indent width over 1024");
        ind = std::string(size_t(std::max<int64_t>(to_int(*w), 0)), ' ');
      } else {
        error("indent width must be an int or a str");
      }
    }
    const bool first = arg_bool(a, 1, "first", false);
    const bool blank = arg_bool(a, 2, "blank", false);
    const std::vector<std::string> lines = py_splitlines(py_str(v) + "\n", false);
    std::string out;
    for (size_t i = 0; i < lines.size(); ++i) {
      if (i > 0) {
        out += '\n';
        if (blank || !lines[i].empty()) out += ind;
      }
      out += lines[i];
      charge(lines[i].size() + ind.size() + 1);
    }
    if (first) out = ind + out;
    return Value::string(std::move(out));
  }
  if (name == "escape" || name == "e" || name == "forceescape") return str(html_escape(py_str(v)));
  if (name == "center") {
    CallArgs c;
    c.pos.push_back(Value::integer(arg_int(*this, a, 0, "width", 80)));
    return method(Value::string(py_str(v)), "center").fn->fn(*this, c);
  }
  if (name == "wordcount") {
    int64_t n = 0;
    bool in_word = false;
    for (uint32_t c : code_points(py_str(v))) {
      const auto cat = detail::unicode_category(c);
      const bool w = c == '_' || cat == detail::kCatLetter || cat == detail::kCatNumber || cat == detail::kCatMark;
      if (w && !in_word) ++n;
      in_word = w;
    }
    return Value::integer(n);
  }
  if (name == "truncate") {
    const std::string s = py_str(v);
    const std::vector<uint32_t> cps = code_points(s);
    const int64_t length = arg_int(*this, a, 0, "length", 255);
    const bool killwords = arg_bool(a, 1, "killwords", false);
    const std::string end = arg_str(*this, a, 2, "end", "...");
    const int64_t leeway = arg_int(*this, a, 3, "leeway", 5);
    const int64_t end_len = int64_t(code_points(end).size());
    if (length < end_len) error("expected length >= len(end)");
    if (int64_t(cps.size()) <= length + leeway) return Value::string(s);
    std::string head = encode(cps, 0, size_t(length - end_len));
    if (killwords) return str(head + end);
    const size_t sp = head.rfind(' ');
    if (sp != std::string::npos) head.resize(sp);
    return str(head + end);
  }
  if (name == "attr") {
    const std::string n = arg_str(*this, a, 0, "name", "");
    if (v.is_dict()) {
      return (kDictMethods.count(n) != 0) ? getattr(v, n) : Value::undefined(n);
    }
    return getattr(v, n);
  }
  if (name == "batch") {
    const int64_t n = arg_int(*this, a, 0, "linecount", 1);
    if (n <= 0) error("batch size must be positive");
    const Value* fill = arg(a, 1, "fill_with");
    ValueList out, cur;
    for (const Value& x : seq()) {
      cur.push_back(x);
      if (int64_t(cur.size()) == n) {
        out.push_back(list(std::move(cur)));
        cur.clear();
      }
    }
    if (!cur.empty()) {
      if (fill != nullptr && !fill->is_none()) {
        while (int64_t(cur.size()) < n) cur.push_back(*fill);
      }
      out.push_back(list(std::move(cur)));
    }
    return list(std::move(out));
  }
  if (name == "format") {
    Value args = Value::from_list(a.pos, true);
    return str(percent_format(need_str(*this, v, "format"), args));
  }
  error(fmt::format("no filter named '{}'", name));
}

void Interp::install_globals(Scope& g) {
  g.vars["range"] = make_callable("range", [](Interp& in, CallArgs& a) -> Value {
    if (a.pos.empty() || a.pos.size() > 3 || !a.kw.empty()) in.error("range expected 1 to 3 integer arguments");
    for (const Value& x : a.pos) {
      if (!is_int(x)) in.error(fmt::format("'{}' object cannot be interpreted as an integer", type_name(x)));
    }
    int64_t start = 0, stop, step = 1;
    if (a.pos.size() == 1) {
      stop = to_int(a.pos[0]);
    } else {
      start = to_int(a.pos[0]);
      stop = to_int(a.pos[1]);
      if (a.pos.size() == 3) step = to_int(a.pos[2]);
    }
    if (step == 0) in.error("range() arg 3 must not be zero");
    const long double n = step > 0 ? (static_cast<long double>(stop) - start + step - 1) / step
                                   : (static_cast<long double>(start) - stop - step - 1) / -step;
    constexpr int64_t kMaxRange = 100000;  // jinja2's sandbox MAX_RANGE
    if (n > kMaxRange) {
      in.error(fmt::format("Range too big. The sandbox blocks ranges larger than MAX_RANGE ({}).", kMaxRange));
    }
    ValueList out;
    for (int64_t x = start; step > 0 ? x < stop : x > stop;) {
      out.push_back(Value::integer(x));
      if (__builtin_add_overflow(x, step, &x)) break;
    }
    return in.list(std::move(out));
  });
  g.vars["dict"] = make_callable("dict", [](Interp& in, CallArgs& a) -> Value {
    Dict d;
    if (!a.pos.empty()) {
      if (a.pos.size() > 1) in.error("dict expected at most 1 argument");
      if (a.pos[0].is_dict()) {
        d = *a.pos[0].dict;
      } else {
        for (const Value& p : in.iterate(a.pos[0])) {
          const std::vector<Value> kv = in.iterate(p);
          if (kv.size() != 2) in.error("dictionary update sequence element has the wrong length");
          d.set(kv[0], kv[1]);
        }
      }
    }
    for (auto& [k, v] : a.kw) d.set(Value::string(k), v);
    return Value::from_dict(std::move(d));
  });
  g.vars["namespace"] = make_callable("namespace", [](Interp& in, CallArgs& a) -> Value {
    Value v;
    v.kind = Value::Kind::kNamespace;
    v.ns = in.new_namespace();
    if (!a.pos.empty()) {
      if (a.pos.size() > 1 || !a.pos[0].is_dict()) in.error("namespace() takes a mapping and keyword arguments");
      v.ns->attrs = *a.pos[0].dict;
    }
    for (auto& [k, x] : a.kw) v.ns->attrs.set(Value::string(k), x);
    return v;
  });
  g.vars["joiner"] = make_callable("joiner", [](Interp& in, CallArgs& a) -> Value {
    const std::string sep = arg_str(in, a, 0, "sep", ", ");
    auto used = std::make_shared<bool>(false);
    return make_callable("joiner", [sep, used](Interp&, CallArgs&) -> Value {
      if (!*used) {
        *used = true;
        return Value::string("");
      }
      return Value::string(sep);
    });
  });
  g.vars["raise_exception"] = make_callable("raise_exception", [](Interp& in, CallArgs& a) -> Value {
    const Value* m = arg(a, 0, "message");
    in.error("raise_exception: " + (m != nullptr ? py_str(*m) : std::string()));
  });
  g.vars["strftime_now"] = make_callable("strftime_now", [](Interp& in, CallArgs& a) -> Value {
    const std::string f = arg_str(in, a, 0, "format", "");
    const std::time_t t = in.options().now ? *in.options().now : std::time(nullptr);
    return in.str(strftime_text(f, t));
  });
}

}  // namespace tandem::jinja
