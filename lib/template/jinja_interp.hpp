// The Jinja evaluator's state (jinja_eval.cpp, jinja_builtins.cpp). Not part of the API.
#pragma once

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "template/jinja_internal.hpp"

namespace tandem::jinja {

struct Scope {
  std::shared_ptr<Scope> parent;
  std::unordered_map<std::string, Value> vars;
};

class Interp {
 public:
  explicit Interp(const RenderOptions& options);
  /// Breaks the reference cycles a render can make (a macro held by the scope it closes
  /// over, a namespace holding itself), so that nothing outlives the render.
  ~Interp();
  Interp(const Interp&) = delete;
  Interp& operator=(const Interp&) = delete;
  /// A new namespace object, owned by this render.
  std::shared_ptr<NamespaceObj> new_namespace();
  std::string run(const Program& program, const nlohmann::ordered_json& context);

  // limits
  void tick(size_t n = 1);
  void charge(size_t bytes);
  void enter();
  void leave() { --depth_; }
  struct Depth {
    explicit Depth(Interp& in) : in_(in) { in_.enter(); }
    ~Depth() { in_.leave(); }
    Depth(const Depth&) = delete;
    Depth& operator=(const Depth&) = delete;
    Interp& in_;
  };

  // values
  Value str(std::string s);
  Value list(ValueList items, bool tuple = false);
  [[noreturn]] void error(const std::string& message) const;
  [[noreturn]] void undefined_error(const Value& v) const;
  std::vector<Value> iterate(const Value& v);
  Value getattr(const Value& obj, const std::string& name);
  Value getitem(const Value& obj, const Value& key);
  Value slice(const Value& obj, const Value& start, const Value& stop, const Value& step);
  Value binary(const std::string& op, const Value& a, const Value& b);
  bool compare(const std::string& op, const Value& a, const Value& b);
  int order(const Value& a, const Value& b, const char* op);
  bool contains(const Value& container, const Value& item);
  Value call_value(const Value& callee, CallArgs& args, const Expr& at);
  Value eval(const Expr& e);

  // builtins (jinja_builtins.cpp)
  Value apply_filter(const std::string& name, const Value& input, CallArgs& args, const Expr& at);
  bool apply_test(const std::string& name, const Value& input, CallArgs& args);
  void install_globals(Scope& globals);
  std::string percent_format(const std::string& fmt, const Value& args);

  const RenderOptions& options() const noexcept { return opt_; }
  int line() const noexcept { return line_; }

 private:
  enum class Flow { kNormal, kBreak, kContinue };
  Flow exec_body(const Body& body);
  Flow exec(const Stmt& s);
  Flow exec_for(const Stmt& s);
  void assign(const std::vector<std::string>& targets, const Value& v);
  void write(std::string_view text);
  const Value* lookup(const std::string& name) const;
  std::string capture(const Body& body, const std::shared_ptr<Scope>& scope);
  Value make_macro(const Stmt& s, const std::string& name);
  CallArgs eval_args(const std::vector<Arg>& args);
  Value apply_filter_chain(const Expr& chain, Value input);
  Value method(const Value& obj, const std::string& name);

  const RenderOptions& opt_;
  std::vector<std::shared_ptr<NamespaceObj>> namespaces_;
  std::vector<std::shared_ptr<Callable>> macros_;
  std::shared_ptr<Scope> scope_;
  std::string* out_ = nullptr;
  size_t steps_ = 0;
  size_t allocated_ = 0;
  int32_t depth_ = 0;
  int line_ = 0;
};

}  // namespace tandem::jinja
