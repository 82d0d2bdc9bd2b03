// The Jinja tree-walking interpreter and what the builtins (filters, tests, methods, globals) need
// from it. One Interp renders one template once; it owns the scopes, the budget and the position
// used in error messages.
#pragma once

#include <chrono>
#include <initializer_list>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "template/jinja.h"
#include "template/jinja_ast.h"
#include "template/jinja_value.h"

namespace kestrel::jinja {

struct CallArgs {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
};

// One scope: a template, a loop iteration, a macro call or a with block.
struct Frame {
  std::shared_ptr<Frame> parent;
  std::vector<std::pair<std::string, Value>> vars;

  const Value* find(std::string_view name) const;
  void set(const std::string& name, Value v);
};

// Nested eval/exec calls at once (expressions, blocks and macro calls together): bounds the
// native stack whatever the template does.
inline constexpr int kMaxEvalDepth = 500;

class Interp {
 public:
  explicit Interp(const RenderOptions& options);

  std::string render(const StmtList& body, const Value& context);

  Budget& budget() { return budget_; }
  const RenderLimits& limits() const { return options_.limits; }
  std::chrono::system_clock::time_point now() const;

  // Errors at the current position. Runtime errors name the line and column.
  [[noreturn]] void fail(const std::string& msg) const;
  // Using an undefined value where a value is needed: Jinja's "'x' is undefined".
  [[noreturn]] void fail_undefined(const Value& v) const;
  void require_defined(const Value& v) const {
    if (v.is_undefined()) fail_undefined(v);
  }

  Value eval(const Expr& e);
  Value call(const Value& fn, CallArgs& args);
  Value get_attr(const Value& obj, std::string_view name);
  Value get_item(const Value& obj, const Value& key);
  // The values a for loop visits: list items, dict keys, string characters; undefined is empty.
  std::vector<Value> iterate(const Value& v);
  // Builds a list or string result, checking the size limits.
  Value make_list(std::vector<Value> items, bool tuple = false);
  Value make_seq(std::vector<Value> items, SeqFlavor flavor);
  Value make_string(std::string s);

  // Macros (and call-block bodies): renders def's body with args bound to its params.
  Value call_macro(const Stmt& def, const std::weak_ptr<Frame>& closure, CallArgs& args, const Value* caller,
                   const StmtList& body);

 private:
  enum class Flow { Normal, Break, Continue };
  struct DepthGuard {
    Interp& in;
    explicit DepthGuard(Interp& interp) : in(interp) {
      if (++in.eval_depth_ > kMaxEvalDepth) {
        throw TemplateError(TemplateError::Kind::Limit,
                            "template recursion too deep at line " + std::to_string(in.line_) + ", column " +
                                std::to_string(in.column_),
                            in.line_, in.column_);
      }
    }
    ~DepthGuard() { --in.eval_depth_; }
  };

  Flow exec(const StmtList& body, std::string& out);
  Flow exec_stmt(const Stmt& s, std::string& out);
  Flow exec_for(const Stmt& s, std::string& out);
  void assign(const std::vector<std::string>& targets, const Value& v, Frame& frame);
  Value eval_call(const Expr& e);
  CallArgs eval_args(const Expr& e);
  Value eval_binary(const Expr& e, const Value& a, const Value& b);
  bool eval_compare(CmpOp op, const Value& a, const Value& b);
  Value eval_slice(const Expr& e, const Value& obj);
  Value lookup(const std::string& name) const;
  Value apply_filters(const std::vector<ExprPtr>& filters, Value v);
  void set_position(const Expr& e) {
    line_ = e.line;
    column_ = e.column;
  }
  void set_position(const Stmt& s) {
    line_ = s.line;
    column_ = s.column;
  }

  RenderOptions options_;
  Budget budget_;
  std::shared_ptr<Frame> root_;
  std::shared_ptr<Frame> frame_;
  int line_ = 0;
  int column_ = 0;
  int call_depth_ = 0;
  int eval_depth_ = 0;
  Value empty_tuple_;  // varargs and kwargs of macro calls without extra arguments
  Value empty_dict_;
};

// Python-style argument binding for builtins: get(i) is the i-th parameter given by position or
// by name, or null. Errors: too many positional arguments, unknown or repeated keywords.
class ArgBinder {
 public:
  ArgBinder(Interp& in, std::string_view fn, const CallArgs& args, std::initializer_list<std::string_view> params);
  const Value* get(size_t i) const { return i < bound_.size() ? bound_[i] : nullptr; }
  bool has(size_t i) const { return get(i) != nullptr; }
  Value value_or(size_t i, Value fallback) const { return has(i) ? *get(i) : std::move(fallback); }

 private:
  std::vector<const Value*> bound_;
};

// ---- builtins (jinja_filters.cpp, jinja_methods.cpp) ----

Value apply_filter(Interp& in, std::string_view name, const Value& v, CallArgs& args);
bool apply_test(Interp& in, std::string_view name, const Value& v, CallArgs& args);
bool has_method(const Value& self, std::string_view name);
Value call_method(Interp& in, const Value& self, std::string_view name, CallArgs& args);
// range, namespace, dict, joiner, cycler, raise_exception, strftime_now.
void add_globals(Frame& root);
// Python's "s % args" (printf-style formatting) and str.format.
std::string percent_format(Interp& in, const std::string& fmt, const Value& args);
std::string str_format(Interp& in, const std::string& fmt, const CallArgs& args);

// The namespace() object: the one value a template can change ({% set ns.x = ... %}).
class NamespaceObj : public Object {
 public:
  std::string type_name() const override { return "Namespace"; }
  Value attr(std::string_view name) const override;
  void append_repr(std::string& out, Budget& b, int depth) const override;
  bool may_hold_namespace() const override { return true; }
  void set(const std::string& name, Value v);

 private:
  std::vector<std::pair<std::string, Value>> attrs_;
};

}  // namespace kestrel::jinja
