// The Jinja evaluator: statements, expressions, scopes and limits (see jinja.hpp). The
// builtin filters, tests, methods and globals are in jinja_builtins.cpp.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "template/jinja_interp.hpp"

namespace tandem::jinja {

Interp::Interp(const RenderOptions& options) : opt_(options) {}

Interp::~Interp() {
  scope_.reset();
  for (auto& m : macros_) m->fn = nullptr;
  for (auto& n : namespaces_) n->attrs = Dict{};
}

std::shared_ptr<NamespaceObj> Interp::new_namespace() {
  charge(sizeof(NamespaceObj));
  namespaces_.push_back(std::make_shared<NamespaceObj>());
  return namespaces_.back();
}

void Interp::tick(size_t n) {
  steps_ += n;
  if (steps_ > opt_.limits.max_steps) {
    fail_limit(fmt::format("line {}: the template ran more than {} steps (RenderLimits::max_steps)", line_,
                           opt_.limits.max_steps));
  }
}

void Interp::charge(size_t bytes) {
  allocated_ += bytes;
  if (allocated_ > opt_.limits.max_alloc_bytes) {
    fail_limit(fmt::format("line {}: the template created more than {} bytes of values (RenderLimits::max_alloc_bytes)",
                           line_, opt_.limits.max_alloc_bytes));
  }
}

void Interp::enter() {
  if (++depth_ > opt_.limits.max_depth) {
    fail_limit(
        fmt::format("line {}: the template nests deeper than {} levels (RenderLimits::max_depth; a recursive "
                    "macro?)",
                    line_, opt_.limits.max_depth));
  }
}

Value Interp::str(std::string s) {
  charge(s.size());
  return Value::string(std::move(s));
}

Value Interp::list(ValueList items, bool tuple) {
  charge(items.size() * sizeof(Value));
  tick(items.size());
  return Value::from_list(std::move(items), tuple);
}

void Interp::write(std::string_view text) {
  if (out_->size() + text.size() > opt_.limits.max_output_bytes) {
    fail_limit(fmt::format("line {}: the output is over {} bytes (RenderLimits::max_output_bytes)", line_,
                           opt_.limits.max_output_bytes));
  }
  out_->append(text);
}

[[noreturn]] void Interp::error(const std::string& message) const {
  fail(line_, message);
}

const Value* Interp::lookup(const std::string& name) const {
  for (const Scope* s = scope_.get(); s != nullptr; s = s->parent.get()) {
    const auto it = s->vars.find(name);
    if (it != s->vars.end()) return &it->second;
  }
  return nullptr;
}

std::string Interp::capture(const Body& body, const std::shared_ptr<Scope>& scope) {
  std::string buf;
  std::string* saved_out = out_;
  auto saved_scope = scope_;
  out_ = &buf;
  scope_ = scope;
  try {
    exec_body(body);
  } catch (...) {
    out_ = saved_out;
    scope_ = saved_scope;
    throw;
  }
  out_ = saved_out;
  scope_ = saved_scope;
  charge(buf.size());
  return buf;
}

std::vector<Value> Interp::iterate(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined:
      return {};
    case Value::Kind::kList:
      tick(v.list->size());
      return *v.list;
    case Value::Kind::kDict: {
      std::vector<Value> keys;
      keys.reserve(v.dict->entries.size());
      for (const auto& e : v.dict->entries) keys.push_back(e.first);
      tick(keys.size());
      return keys;
    }
    case Value::Kind::kString: {
      std::vector<Value> chars;
      for (uint32_t cp : code_points(v.str())) {
        std::string c;
        append_utf8(c, cp);
        chars.push_back(Value::string(std::move(c)));
      }
      tick(chars.size());
      charge(chars.size() * sizeof(Value));
      return chars;
    }
    default:
      error(fmt::format("'{}' object is not iterable", type_name(v)));
  }
}

void Interp::assign(const std::vector<std::string>& targets, const Value& v) {
  if (targets.size() == 1) {
    scope_->vars[targets[0]] = v;
    return;
  }
  std::vector<Value> items = iterate(v);
  if (items.size() != targets.size()) {
    error(fmt::format("cannot unpack {} values into {} names", items.size(), targets.size()));
  }
  for (size_t i = 0; i < targets.size(); ++i) scope_->vars[targets[i]] = items[i];
}

Interp::Flow Interp::exec_body(const Body& body) {
  Depth d(*this);
  for (const StmtPtr& s : body) {
    const Flow f = exec(*s);
    if (f != Flow::kNormal) return f;
  }
  return Flow::kNormal;
}

Interp::Flow Interp::exec(const Stmt& s) {
  line_ = s.line;
  tick();
  switch (s.kind) {
    case Stmt::Kind::kText:
      write(s.text);
      return Flow::kNormal;
    case Stmt::Kind::kOutput: {
      const Value v = eval(*s.expr);
      line_ = s.line;
      if (v.is_string()) {
        write(v.str());
      } else {
        write(py_str(v));
      }
      return Flow::kNormal;
    }
    case Stmt::Kind::kIf:
      for (size_t i = 0; i < s.conds.size(); ++i) {
        if (truthy(eval(*s.conds[i]))) return exec_body(s.bodies[i]);
      }
      return exec_body(s.else_body);
    case Stmt::Kind::kFor:
      return exec_for(s);
    case Stmt::Kind::kSet: {
      Value v = eval(*s.expr);
      line_ = s.line;
      if (!s.attr.empty()) {
        const Value* ns = lookup(s.targets[0]);
        if (ns == nullptr || ns->kind != Value::Kind::kNamespace) {
          error(fmt::format("cannot assign attribute '{}' on '{}': it is not a namespace", s.attr, s.targets[0]));
        }
        ns->ns->attrs.set(Value::string(s.attr), std::move(v));
        return Flow::kNormal;
      }
      assign(s.targets, v);
      return Flow::kNormal;
    }
    case Stmt::Kind::kSetBlock: {
      auto inner = std::make_shared<Scope>();
      inner->parent = scope_;
      Value v = str(capture(s.body, inner));
      if (s.expr) v = apply_filter_chain(*s.expr, v);
      scope_->vars[s.targets[0]] = std::move(v);
      return Flow::kNormal;
    }
    case Stmt::Kind::kFilterBlock: {
      auto inner = std::make_shared<Scope>();
      inner->parent = scope_;
      const Value v = apply_filter_chain(*s.expr, str(capture(s.body, inner)));
      write(py_str(v));
      return Flow::kNormal;
    }
    case Stmt::Kind::kMacro:
      scope_->vars[s.name] = make_macro(s, s.name);
      return Flow::kNormal;
    case Stmt::Kind::kCallBlock: {
      const Expr& call = *s.expr;
      const Value callee = eval(*call.a);
      CallArgs args = eval_args(call.args);
      args.kw.emplace_back("caller", make_macro(s, "caller"));
      write(py_str(call_value(callee, args, call)));
      return Flow::kNormal;
    }
    case Stmt::Kind::kBreak:
      return Flow::kBreak;
    case Stmt::Kind::kContinue:
      return Flow::kContinue;
  }
  return Flow::kNormal;
}

Interp::Flow Interp::exec_for(const Stmt& s) {
  const Value seq = eval(*s.expr);
  line_ = s.line;
  // The items, shared with the list when the iterable is one (no copy).
  std::shared_ptr<const ValueList> items = seq.is_list() ? seq.list : std::make_shared<const ValueList>(iterate(seq));
  auto scope = std::make_shared<Scope>();
  scope->parent = scope_;
  auto saved = scope_;
  scope_ = scope;
  struct Restore {
    Interp& in;
    std::shared_ptr<Scope> saved;
    ~Restore() { in.scope_ = saved; }
  } restore{*this, saved};
  if (s.cond) {
    ValueList kept;
    for (const Value& v : *items) {
      tick();
      assign(s.targets, v);
      if (truthy(eval(*s.cond))) kept.push_back(v);
    }
    charge(kept.size() * sizeof(Value));
    items = std::make_shared<const ValueList>(std::move(kept));
  }
  const size_t n = items->size();
  // One loop object per loop, advanced in place as jinja2's LoopContext is.
  static const char* const kKeys[] = {"index",  "index0", "revindex", "revindex0", "first",    "last",
                                      "length", "depth",  "depth0",   "previtem",  "nextitem", "cycle"};
  auto loop = std::make_shared<Dict>();
  for (const char* k : kKeys) loop->set(Value::string(k), Value::none());
  auto position = std::make_shared<size_t>(0);
  auto cyc = std::make_shared<Callable>();
  cyc->name = "loop.cycle";
  cyc->fn = [position](Interp& in, CallArgs& a) -> Value {
    if (a.pos.empty()) in.error("loop.cycle() needs at least one argument");
    return a.pos[*position % a.pos.size()];
  };
  Value cycle_value;
  cycle_value.kind = Value::Kind::kCallable;
  cycle_value.fn = std::move(cyc);
  auto& e = loop->entries;
  e[6].second = Value::integer(int64_t(n));
  e[7].second = Value::integer(1);
  e[8].second = Value::integer(0);
  e[11].second = cycle_value;
  Value loop_value;
  loop_value.kind = Value::Kind::kDict;
  loop_value.depth = 1;
  loop_value.dict = loop;
  scope->vars["loop"] = loop_value;
  for (size_t i = 0; i < n; ++i) {
    tick();
    line_ = s.line;
    const Value& item = (*items)[i];
    assign(s.targets, item);
    *position = i;
    e[0].second = Value::integer(int64_t(i + 1));
    e[1].second = Value::integer(int64_t(i));
    e[2].second = Value::integer(int64_t(n - i));
    e[3].second = Value::integer(int64_t(n - i - 1));
    e[4].second = Value::boolean(i == 0);
    e[5].second = Value::boolean(i + 1 == n);
    e[9].second = i > 0 ? (*items)[i - 1] : Value::undefined("loop.previtem");
    e[10].second = i + 1 < n ? (*items)[i + 1] : Value::undefined("loop.nextitem");
    const Flow f = exec_body(s.body);
    if (f == Flow::kBreak) break;
  }
  // the loop object holds the items: let go of them with the loop
  e[9].second = Value();
  e[10].second = Value();
  e[11].second = Value();
  if (n == 0) {
    scope_ = saved;
    return exec_body(s.else_body);
  }
  return Flow::kNormal;
}

Value Interp::make_macro(const Stmt& s, const std::string& name) {
  auto c = std::make_shared<Callable>();
  c->name = name;
  macros_.push_back(c);
  charge(sizeof(Callable));
  const Stmt* node = &s;
  std::shared_ptr<Scope> closure = scope_;
  c->fn = [node, closure](Interp& in, CallArgs& args) -> Value {
    in.enter();
    in.enter();
    in.enter();
    struct Leave {
      Interp& in;
      ~Leave() { in.depth_ -= 3; }
    } leave{in};
    auto scope = std::make_shared<Scope>();
    scope->parent = closure;
    auto saved = in.scope_;
    in.scope_ = scope;
    struct Restore {
      Interp& in;
      std::shared_ptr<Scope> saved;
      ~Restore() { in.scope_ = saved; }
    } restore{in, saved};
    const auto& params = node->params;
    size_t p = 0;
    for (; p < params.size() && p < args.pos.size(); ++p) scope->vars[params[p].name] = args.pos[p];
    ValueList varargs(args.pos.begin() + std::ptrdiff_t(std::min(args.pos.size(), params.size())), args.pos.end());
    Dict kwargs;
    for (auto& [k, v] : args.kw) {
      bool is_param = false;
      for (size_t q = 0; q < params.size(); ++q) {
        if (params[q].name == k) {
          if (q < p) in.error(fmt::format("macro '{}' got multiple values for argument '{}'", node->name, k));
          scope->vars[k] = v;
          is_param = true;
        }
      }
      if (k == "caller" && node->kind == Stmt::Kind::kMacro) {
        scope->vars["caller"] = v;
      } else if (!is_param) {
        kwargs.set(Value::string(k), v);
      }
    }
    for (size_t q = p; q < params.size(); ++q) {
      if (scope->vars.count(params[q].name) != 0) continue;
      scope->vars[params[q].name] =
          params[q].default_value ? in.eval(*params[q].default_value) : Value::undefined(params[q].name);
    }
    scope->vars["varargs"] = Value::from_list(std::move(varargs), true);
    scope->vars["kwargs"] = Value::from_dict(std::move(kwargs));
    const int line = in.line_;
    std::string out = in.capture(node->body, scope);
    in.line_ = line;
    return Value::string(std::move(out));
  };
  Value v;
  v.kind = Value::Kind::kCallable;
  v.fn = std::move(c);
  return v;
}

CallArgs Interp::eval_args(const std::vector<Arg>& args) {
  CallArgs out;
  for (const Arg& a : args) {
    if (a.name.empty()) {
      if (!out.kw.empty()) error("a positional argument follows a keyword argument");
      out.pos.push_back(eval(*a.value));
    } else {
      out.kw.emplace_back(a.name, eval(*a.value));
    }
  }
  return out;
}

Value Interp::call_value(const Value& callee, CallArgs& args, const Expr& at) {
  line_ = at.line;
  if (callee.kind != Value::Kind::kCallable) {
    if (callee.is_undefined()) {
      error(fmt::format("'{}' is undefined", callee.s ? *callee.s : std::string("value")));
    }
    error(fmt::format("'{}' object is not callable", type_name(callee)));
  }
  tick();
  return callee.fn->fn(*this, args);
}

Value Interp::apply_filter_chain(const Expr& chain, Value input) {
  // chain: filter(filter(null, ...), ...): apply innermost first
  std::vector<const Expr*> filters;
  for (const Expr* e = &chain; e != nullptr; e = e->a.get()) filters.push_back(e);
  for (auto it = filters.rbegin(); it != filters.rend(); ++it) {
    CallArgs args = eval_args((*it)->args);
    input = apply_filter((*it)->name, input, args, **it);
  }
  return input;
}

Value Interp::eval(const Expr& e) {
  Depth d(*this);
  line_ = e.line;
  tick();
  switch (e.kind) {
    case Expr::Kind::kLiteral:
      return e.value;
    case Expr::Kind::kName: {
      const Value* v = lookup(e.name);
      return v != nullptr ? *v : Value::undefined(e.name);
    }
    case Expr::Kind::kList: {
      ValueList items;
      items.reserve(e.items.size());
      for (const ExprPtr& x : e.items) items.push_back(eval(*x));
      return list(std::move(items), e.value.tuple);
    }
    case Expr::Kind::kDict: {
      Dict dict;
      for (size_t i = 0; i + 1 < e.items.size(); i += 2) {
        Value k = eval(*e.items[i]);
        Value v = eval(*e.items[i + 1]);
        if (k.kind == Value::Kind::kList && !k.tuple) error("unhashable type: 'list'");
        if (k.is_dict()) error("unhashable type: 'dict'");
        dict.set(std::move(k), std::move(v));
      }
      charge(dict.entries.size() * 2 * sizeof(Value));
      return Value::from_dict(std::move(dict));
    }
    case Expr::Kind::kGetAttr: {
      const Value obj = eval(*e.a);
      line_ = e.line;
      return getattr(obj, e.name);
    }
    case Expr::Kind::kGetItem: {
      const Value obj = eval(*e.a);
      const Value key = eval(*e.b);
      line_ = e.line;
      return getitem(obj, key);
    }
    case Expr::Kind::kSlice: {
      const Value obj = eval(*e.a);
      Value parts[3];
      for (int i = 0; i < 3; ++i) {
        if (e.items[size_t(i)]) parts[i] = eval(*e.items[size_t(i)]);
      }
      line_ = e.line;
      return slice(obj, parts[0], parts[1], parts[2]);
    }
    case Expr::Kind::kCall: {
      const Value callee = eval(*e.a);
      CallArgs args = eval_args(e.args);
      return call_value(callee, args, e);
    }
    case Expr::Kind::kFilter: {
      const Value input = eval(*e.a);
      CallArgs args = eval_args(e.args);
      line_ = e.line;
      return apply_filter(e.name, input, args, e);
    }
    case Expr::Kind::kTest: {
      // `x is defined` must not fail on an undefined attribute chain's last step
      const Value input = eval(*e.a);
      CallArgs args = eval_args(e.args);
      line_ = e.line;
      const bool r = apply_test(e.name, input, args);
      return Value::boolean(e.negated ? !r : r);
    }
    case Expr::Kind::kUnary: {
      Value v = eval(*e.a);
      line_ = e.line;
      if (e.name == "not") return Value::boolean(!truthy(v));
      if (v.is_undefined()) error(fmt::format("'{}' is undefined", v.s ? *v.s : std::string("value")));
      if (e.name == "-") {
        if (v.kind == Value::Kind::kInt) {
          if (v.i == INT64_MIN) error("integer overflow (Tandem's Jinja integers are 64-bit)");
          return Value::integer(-v.i);
        }
        if (v.kind == Value::Kind::kBool) return Value::integer(v.b ? -1 : 0);
        if (v.kind == Value::Kind::kFloat) return Value::number(-v.f);
        error(fmt::format("bad operand type for unary -: '{}'", type_name(v)));
      }
      if (v.kind == Value::Kind::kBool) return Value::integer(v.b);
      if (!v.is_number()) error(fmt::format("bad operand type for unary +: '{}'", type_name(v)));
      return v;
    }
    case Expr::Kind::kBinary: {
      const Value a = eval(*e.a);
      const Value b = eval(*e.b);
      line_ = e.line;
      return binary(e.name, a, b);
    }
    case Expr::Kind::kCompare: {
      Value left = eval(*e.items[0]);
      for (size_t i = 0; i < e.ops.size(); ++i) {
        Value right = eval(*e.items[i + 1]);
        line_ = e.line;
        if (!compare(e.ops[i], left, right)) return Value::boolean(false);
        left = std::move(right);
      }
      return Value::boolean(true);
    }
    case Expr::Kind::kAnd: {
      Value a = eval(*e.a);
      if (!truthy(a)) return a;
      return eval(*e.b);
    }
    case Expr::Kind::kOr: {
      Value a = eval(*e.a);
      if (truthy(a)) return a;
      return eval(*e.b);
    }
    case Expr::Kind::kCond:
      if (truthy(eval(*e.a))) return eval(*e.items[0]);
      if (e.items[1]) return eval(*e.items[1]);
      return Value::undefined("the else branch of a conditional expression");
  }
  return Value::undefined();
}

namespace {

double as_double(const Value& v) {
  if (v.kind == Value::Kind::kFloat) return v.f;
  if (v.kind == Value::Kind::kInt) return double(v.i);
  return v.b ? 1.0 : 0.0;
}

int64_t as_int(const Value& v) {
  return v.kind == Value::Kind::kInt ? v.i : v.b ? 1 : 0;
}

bool is_intlike(const Value& v) {
  return v.kind == Value::Kind::kInt || v.kind == Value::Kind::kBool;
}

}  // namespace

[[noreturn]] void Interp::undefined_error(const Value& v) const {
  error(fmt::format("'{}' is undefined", v.s ? *v.s : std::string("value")));
}

Value Interp::binary(const std::string& op, const Value& a, const Value& b) {
  if (op == "~") {
    std::string sa = py_str(a), sb = py_str(b);
    charge(sa.size() + sb.size());
    return Value::string(sa + sb);
  }
  if (a.is_undefined()) undefined_error(a);
  if (b.is_undefined()) undefined_error(b);
  auto type_error = [&]() {
    error(fmt::format("unsupported operand type(s) for {}: '{}' and '{}'", op, type_name(a), type_name(b)));
  };
  const bool nums = a.is_number() && b.is_number();
  const bool ints = is_intlike(a) && is_intlike(b);
  if (op == "+") {
    if (ints) {
      int64_t r;
      if (__builtin_add_overflow(as_int(a), as_int(b), &r))
        error("integer overflow (Tandem's Jinja integers are 64-bit)");
      return Value::integer(r);
    }
    if (nums) return Value::number(as_double(a) + as_double(b));
    if (a.is_string() && b.is_string()) {
      charge(a.str().size() + b.str().size());
      return Value::string(a.str() + b.str());
    }
    if (a.is_list() && b.is_list() && a.tuple == b.tuple) {
      ValueList r = *a.list;
      r.insert(r.end(), b.list->begin(), b.list->end());
      return list(std::move(r), a.tuple);
    }
    type_error();
  }
  if (op == "-") {
    if (ints) {
      int64_t r;
      if (__builtin_sub_overflow(as_int(a), as_int(b), &r))
        error("integer overflow (Tandem's Jinja integers are 64-bit)");
      return Value::integer(r);
    }
    if (nums) return Value::number(as_double(a) - as_double(b));
    type_error();
  }
  if (op == "*") {
    if (ints) {
      int64_t r;
      if (__builtin_mul_overflow(as_int(a), as_int(b), &r))
        error("integer overflow (Tandem's Jinja integers are 64-bit)");
      return Value::integer(r);
    }
    if (nums) return Value::number(as_double(a) * as_double(b));
    const Value* seq = (a.is_string() || a.is_list()) ? &a : (b.is_string() || b.is_list()) ? &b : nullptr;
    const Value* count = seq == &a ? &b : &a;
    if (seq != nullptr && is_intlike(*count)) {
      const int64_t n = std::max<int64_t>(as_int(*count), 0);
      const size_t unit = seq->is_string() ? seq->str().size() : seq->list->size() * sizeof(Value);
      if (unit > 0 && uint64_t(n) > (opt_.limits.max_alloc_bytes - allocated_) / unit + 1) {
        charge(opt_.limits.max_alloc_bytes + 1);  // reports the limit
      }
      charge(unit * size_t(n));
      if (seq->is_string()) {
        std::string r;
        r.reserve(seq->str().size() * size_t(n));
        for (int64_t i = 0; i < n; ++i) r += seq->str();
        return Value::string(std::move(r));
      }
      ValueList r;
      for (int64_t i = 0; i < n; ++i) r.insert(r.end(), seq->list->begin(), seq->list->end());
      tick(r.size());
      return Value::from_list(std::move(r), seq->tuple);
    }
    type_error();
  }
  if (op == "/") {
    if (!nums) type_error();
    if (as_double(b) == 0.0) error("division by zero");
    return Value::number(as_double(a) / as_double(b));
  }
  if (op == "//" || op == "%") {
    if (a.is_string() && op == "%") return Value::string(percent_format(a.str(), b));
    if (!nums) type_error();
    if (ints) {
      const int64_t x = as_int(a), y = as_int(b);
      if (y == 0) error(op == "//" ? "integer division or modulo by zero" : "integer modulo by zero");
      if (x == INT64_MIN && y == -1) error("integer overflow (Tandem's Jinja integers are 64-bit)");
      int64_t q = x / y, r = x % y;
      if (r != 0 && ((r < 0) != (y < 0))) {
        --q;
        r += y;
      }
      return Value::integer(op == "//" ? q : r);
    }
    const double x = as_double(a), y = as_double(b);
    if (y == 0.0) error("float division by zero");
    double r = std::fmod(x, y);
    if (r != 0 && ((r < 0) != (y < 0))) r += y;
    if (op == "%") return Value::number(r);
    return Value::number(std::floor((x - r) / y + 0.0));
  }
  if (op == "**") {
    if (!nums) type_error();
    if (ints && as_int(b) >= 0) {
      int64_t base = as_int(a), e = as_int(b), r = 1;
      while (e > 0) {
        if (e & 1) {
          if (__builtin_mul_overflow(r, base, &r)) error("integer overflow (Tandem's Jinja integers are 64-bit)");
        }
        e >>= 1;
        if (e > 0 && __builtin_mul_overflow(base, base, &base)) {
          error("integer overflow (Tandem's Jinja integers are 64-bit)");
        }
      }
      return Value::integer(r);
    }
    if (as_double(a) == 0.0 && as_double(b) < 0) error("0.0 cannot be raised to a negative power");
    return Value::number(std::pow(as_double(a), as_double(b)));
  }
  error("unknown operator " + op);
}

int Interp::order(const Value& a, const Value& b, const char* op) {
  if (a.is_number() && b.is_number()) {
    if (is_intlike(a) && is_intlike(b)) return as_int(a) < as_int(b) ? -1 : as_int(a) > as_int(b) ? 1 : 0;
    const double x = as_double(a), y = as_double(b);
    return x < y ? -1 : x > y ? 1 : 0;
  }
  if (a.is_string() && b.is_string()) {
    const int c = a.str().compare(b.str());  // UTF-8 byte order is code point order
    return c < 0 ? -1 : c > 0 ? 1 : 0;
  }
  if (a.is_list() && b.is_list() && a.tuple == b.tuple) {
    const size_t n = std::min(a.list->size(), b.list->size());
    tick(n);
    for (size_t i = 0; i < n; ++i) {
      if (!py_equal((*a.list)[i], (*b.list)[i])) return order((*a.list)[i], (*b.list)[i], op);
    }
    return a.list->size() < b.list->size() ? -1 : a.list->size() > b.list->size() ? 1 : 0;
  }
  error(fmt::format("'{}' not supported between instances of '{}' and '{}'", op, type_name(a), type_name(b)));
}

bool Interp::contains(const Value& container, const Value& item) {
  switch (container.kind) {
    case Value::Kind::kString:
      if (!item.is_string()) {
        error(fmt::format("'in <string>' requires string as left operand, not {}", type_name(item)));
      }
      tick(container.str().size() / 64);
      return container.str().find(item.str()) != std::string::npos;
    case Value::Kind::kList:
      tick(container.list->size());
      for (const Value& v : *container.list) {
        if (py_equal(v, item)) return true;
      }
      return false;
    case Value::Kind::kDict:
      return container.dict->find(item) != nullptr;
    case Value::Kind::kUndefined:
      return false;
    default:
      error(fmt::format("argument of type '{}' is not iterable", type_name(container)));
  }
}

bool Interp::compare(const std::string& op, const Value& a, const Value& b) {
  if (op == "==") return py_equal(a, b);
  if (op == "!=") return !py_equal(a, b);
  if (op == "in") return contains(b, a);
  if (op == "not in") return !contains(b, a);
  const int c = order(a, b, op.c_str());
  if (op == "<") return c < 0;
  if (op == "<=") return c <= 0;
  if (op == ">") return c > 0;
  return c >= 0;
}

Value Interp::getitem(const Value& obj, const Value& key) {
  switch (obj.kind) {
    case Value::Kind::kUndefined:
      undefined_error(obj);
    case Value::Kind::kDict: {
      if (const Value* v = obj.dict->find(key)) return *v;
      if (key.is_string()) return getattr(obj, key.str());
      return Value::undefined("key");
    }
    case Value::Kind::kList:
    case Value::Kind::kString: {
      if (!is_intlike(key)) {
        if (key.is_string()) return getattr(obj, key.str());
        return Value::undefined("item");
      }
      int64_t i = as_int(key);
      if (obj.is_list()) {
        const int64_t n = int64_t(obj.list->size());
        if (i < 0) i += n;
        if (i < 0 || i >= n) return Value::undefined("list index out of range");
        return (*obj.list)[size_t(i)];
      }
      const std::vector<uint32_t> cps = code_points(obj.str());
      const int64_t n = int64_t(cps.size());
      if (i < 0) i += n;
      if (i < 0 || i >= n) return Value::undefined("string index out of range");
      std::string c;
      append_utf8(c, cps[size_t(i)]);
      return Value::string(std::move(c));
    }
    case Value::Kind::kNamespace:
      return key.is_string() ? getattr(obj, key.str()) : Value::undefined("item");
    default:
      if (key.is_string()) return getattr(obj, key.str());
      return Value::undefined("item");
  }
}

namespace {

// Python's slice.indices(len)
void slice_indices(int64_t len, const Value& start, const Value& stop, const Value& step, int64_t& b, int64_t& e,
                   int64_t& st, Interp& in) {
  auto given = [](const Value& v) { return !v.is_undefined() && !v.is_none(); };
  auto as_i = [&](const Value& v) -> int64_t {
    if (v.kind == Value::Kind::kInt) return v.i;
    if (v.kind == Value::Kind::kBool) return v.b;
    in.error("slice indices must be integers or None");
  };
  st = given(step) ? as_i(step) : 1;
  if (st == 0) in.error("slice step cannot be zero");
  const int64_t lo = st < 0 ? -1 : 0, hi = st < 0 ? len - 1 : len;
  auto adjust = [&](const Value& v, int64_t dflt) -> int64_t {
    if (!given(v)) return dflt;
    int64_t x = as_i(v);
    if (x < 0) {
      x += len;
      if (x < lo) x = lo;
    } else if (x > hi) {
      x = hi;
    }
    return x;
  };
  b = adjust(start, st < 0 ? hi : lo);
  e = adjust(stop, st < 0 ? lo : hi);
}

}  // namespace

Value Interp::slice(const Value& obj, const Value& start, const Value& stop, const Value& step) {
  if (obj.is_undefined()) undefined_error(obj);
  if (obj.is_list()) {
    int64_t b, e, st;
    slice_indices(int64_t(obj.list->size()), start, stop, step, b, e, st, *this);
    ValueList r;
    for (int64_t i = b; st > 0 ? i < e : i > e;) {
      r.push_back((*obj.list)[size_t(i)]);
      if (__builtin_add_overflow(i, st, &i)) break;
    }
    return list(std::move(r), obj.tuple);
  }
  if (obj.is_string()) {
    const std::vector<uint32_t> cps = code_points(obj.str());
    int64_t b, e, st;
    slice_indices(int64_t(cps.size()), start, stop, step, b, e, st, *this);
    std::string r;
    for (int64_t i = b; st > 0 ? i < e : i > e;) {
      append_utf8(r, cps[size_t(i)]);
      if (__builtin_add_overflow(i, st, &i)) break;
    }
    return str(std::move(r));
  }
  error(fmt::format("'{}' object is not subscriptable", type_name(obj)));
}

std::string Interp::run(const Program& program, const nlohmann::ordered_json& context) {
  auto globals = std::make_shared<Scope>();
  install_globals(*globals);
  auto top = std::make_shared<Scope>();
  top->parent = globals;
  if (!context.is_null()) {
    if (!context.is_object()) fail(0, "the render context must be a JSON object");
    for (const auto& [k, v] : context.items()) top->vars[k] = from_json(v);
  }
  scope_ = top;
  std::string out;
  out_ = &out;
  try {
    exec_body(program.body);
  } catch (const Error& e) {
    const std::string_view msg = e.what();
    if (msg.starts_with("jinja: line ") || e.code() != ErrorCode::kInvalidArgument) throw;
    std::string rest(msg.starts_with("jinja: ") ? msg.substr(7) : msg);
    throw Error(e.code(), fmt::format("jinja: line {}: {}", line_, rest));
  }
  return out;
}

Template Template::parse(std::string_view source) {
  return Template(parse_program(source));
}

std::string Template::render(const nlohmann::ordered_json& context, const RenderOptions& options) const {
  Interp interp(options);
  return interp.run(*program_, context);
}

}  // namespace tandem::jinja
