// The statements of the interpreter: scopes (Frame), for loops and their loop object, macros and
// call blocks, set / with / filter blocks, and the render entry point.
#include <algorithm>

#include "template/jinja_interp.h"
#include "template/jinja_text.h"

namespace kestrel::jinja {

namespace {

class LoopObj : public Object {
 public:
  explicit LoopObj(std::shared_ptr<const std::vector<Value>> items) : items_(std::move(items)) {}
  std::string type_name() const override { return "LoopContext"; }
  bool may_hold_namespace() const override { return true; }
  void set_index(size_t i) { index_ = i; }

  Value attr(std::string_view name) const override {
    const auto n = static_cast<int64_t>(items_->size());
    const auto i = static_cast<int64_t>(index_);
    if (name == "index") return Value(i + 1);
    if (name == "index0") return Value(i);
    if (name == "revindex") return Value(n - i);
    if (name == "revindex0") return Value(n - i - 1);
    if (name == "first") return Value(i == 0);
    if (name == "last") return Value(i == n - 1);
    if (name == "length") return Value(n);
    if (name == "depth") return Value(int64_t{1});
    if (name == "depth0") return Value(int64_t{0});
    if (name == "previtem") return i > 0 ? (*items_)[index_ - 1] : Value::undefined("there is no previous item");
    if (name == "nextitem") return i + 1 < n ? (*items_)[index_ + 1] : Value::undefined("there is no next item");
    if (name == "cycle") return Value::object(std::make_shared<CycleFn>(index_));
    return Object::attr(name);
  }

 private:
  // loop.cycle(a, b, ...): the argument at this iteration's index, round robin.
  class CycleFn : public Object {
   public:
    explicit CycleFn(size_t index) : index_(index) {}
    std::string type_name() const override { return "function"; }
    bool callable() const override { return true; }
    Value call(Interp& in, CallArgs& args) const override {
      if (args.pos.empty()) in.fail("loop.cycle() needs at least one argument");
      return args.pos[index_ % args.pos.size()];
    }

   private:
    size_t index_;
  };

  std::shared_ptr<const std::vector<Value>> items_;
  size_t index_ = 0;
};

class MacroObj : public Object {
 public:
  MacroObj(const Stmt* def, const StmtList* body, std::weak_ptr<Frame> closure, std::string name)
      : def_(def), body_(body), closure_(std::move(closure)), name_(std::move(name)) {}
  std::string type_name() const override { return "Macro"; }
  bool callable() const override { return true; }
  Value call(Interp& in, CallArgs& args) const override {
    return in.call_macro(*def_, closure_, args, nullptr, *body_);
  }
  void append_repr(std::string& out, Budget&, int) const override { out += "<Macro '" + name_ + "'>"; }
  // Calls with `caller` bound (the body of a {% call %} block).
  Value call_with_caller(Interp& in, CallArgs& args, const Value& caller) const {
    return in.call_macro(*def_, closure_, args, &caller, *body_);
  }

 private:
  const Stmt* def_;
  const StmtList* body_;
  std::weak_ptr<Frame> closure_;  // weak: the frame holds the macro, and cycles would leak
  std::string name_;
};

}  // namespace

// ---- Frame, namespace ----

const Value* Frame::find(std::string_view name) const {
  for (const Frame* f = this; f != nullptr; f = f->parent.get()) {
    for (const auto& [k, v] : f->vars) {
      if (k == name) return &v;
    }
  }
  return nullptr;
}

void Frame::set(const std::string& name, Value v) {
  for (auto& [k, old] : vars) {
    if (k == name) {
      old = std::move(v);
      return;
    }
  }
  vars.emplace_back(name, std::move(v));
}

Value NamespaceObj::attr(std::string_view name) const {
  for (const auto& [k, v] : attrs_) {
    if (k == name) return v;
  }
  return Object::attr(name);
}

void NamespaceObj::set(const std::string& name, Value v) {
  for (auto& [k, old] : attrs_) {
    if (k == name) {
      old = std::move(v);
      return;
    }
  }
  attrs_.emplace_back(name, std::move(v));
}

void NamespaceObj::append_repr(std::string& out, Budget& b, int depth) const {
  out += "<Namespace {";
  bool first = true;
  for (const auto& [k, v] : attrs_) {
    if (!first) out += ", ";
    first = false;
    append_py_string_repr(out, k);
    out += ": ";
    jinja::append_repr(out, v, b, depth + 1);
  }
  out += "}>";
}

// ---- Interp ----

Interp::Interp(const RenderOptions& options) : options_(options) {
  budget_.max_work = options.limits.max_work;
  budget_.max_bytes = options.limits.max_output_bytes;
  budget_.max_items = options.limits.max_list_items;
}

std::chrono::system_clock::time_point Interp::now() const {
  return options_.now ? *options_.now : std::chrono::system_clock::now();
}

void Interp::fail(const std::string& msg) const {
  throw TemplateError(TemplateError::Kind::Runtime,
                      "template error at line " + std::to_string(line_) + ", column " + std::to_string(column_) + ": " + msg,
                      line_, column_);
}

void Interp::fail_undefined(const Value& v) const {
  std::string hint = v.undefined_hint();
  fail(hint.empty() ? "value is undefined" : hint);
}

std::string Interp::render(const StmtList& body, const Value& context) {
  root_ = std::make_shared<Frame>();
  add_globals(*root_);
  if (context.is_dict()) {
    for (const auto& [k, v] : context.dict_obj().items) {
      if (k.is_string()) root_->set(k.str(), v);
    }
  }
  frame_ = root_;
  std::string out;
  try {
    exec(body, out);
  } catch (const TemplateError& e) {
    // Errors raised below the interpreter (values, JSON, the budget) get the current position.
    if (e.line() != 0 || e.kind() == TemplateError::Kind::Raised) throw;
    throw TemplateError(e.kind(),
                        "template error at line " + std::to_string(line_) + ", column " + std::to_string(column_) + ": " + e.what(),
                        line_, column_);
  }
  return out;
}

Value Interp::call_macro(const Stmt& def, const std::weak_ptr<Frame>& closure, CallArgs& args, const Value* caller,
                         const StmtList& body) {
  if (call_depth_ >= options_.limits.max_call_depth) {
    throw TemplateError(TemplateError::Kind::Limit,
                        "macro calls nested deeper than " + std::to_string(options_.limits.max_call_depth) +
                            " at line " + std::to_string(line_) + ", column " + std::to_string(column_),
                        line_, column_);
  }
  auto frame = std::make_shared<Frame>();
  frame->parent = closure.lock();
  if (!frame->parent) frame->parent = root_;
  std::vector<bool> used_kw(args.kw.size(), false);
  const std::shared_ptr<Frame> saved = frame_;
  frame_ = frame;
  ++call_depth_;
  for (size_t i = 0; i < def.params.size(); ++i) {
    const Param& p = def.params[i];
    Value v;
    bool given = false;
    if (i < args.pos.size()) {
      v = args.pos[i];
      given = true;
    }
    for (size_t k = 0; k < args.kw.size(); ++k) {
      if (args.kw[k].first != p.name) continue;
      if (given) fail("macro '" + def.name + "' got multiple values for argument '" + p.name + "'");
      v = args.kw[k].second;
      used_kw[k] = true;
      given = true;
    }
    if (!given) {
      v = p.default_value ? eval(*p.default_value) : Value::undefined("parameter '" + p.name + "' was not provided");
    }
    frame->set(p.name, std::move(v));
  }
  std::vector<Value> varargs;
  for (size_t i = def.params.size(); i < args.pos.size(); ++i) varargs.push_back(args.pos[i]);
  std::vector<std::pair<Value, Value>> kwargs;
  for (size_t k = 0; k < args.kw.size(); ++k) {
    if (!used_kw[k]) kwargs.emplace_back(Value(args.kw[k].first), args.kw[k].second);
  }
  if (empty_tuple_.is_undefined()) {
    empty_tuple_ = Value::list({}, true);
    empty_dict_ = Value::dict({});
  }
  frame->set("varargs", varargs.empty() ? empty_tuple_ : make_list(std::move(varargs), true));
  frame->set("kwargs", kwargs.empty() ? empty_dict_ : Value::dict(std::move(kwargs)));
  if (caller != nullptr) frame->set("caller", *caller);
  std::string out;
  exec(body, out);
  --call_depth_;
  frame_ = saved;
  return Value(std::move(out));
}

// ---- statements ----

Interp::Flow Interp::exec(const StmtList& body, std::string& out) {
  for (const StmtPtr& s : body) {
    const Flow f = exec_stmt(*s, out);
    if (f != Flow::Normal) return f;
  }
  return Flow::Normal;
}

void Interp::assign(const std::vector<std::string>& targets, const Value& v, Frame& frame) {
  if (targets.size() == 1) {
    frame.set(targets[0], v);
    return;
  }
  require_defined(v);
  const std::vector<Value> parts = iterate(v);
  if (parts.size() != targets.size()) {
    fail(parts.size() > targets.size()
             ? "too many values to unpack (expected " + std::to_string(targets.size()) + ")"
             : "not enough values to unpack (expected " + std::to_string(targets.size()) + ", got " +
                   std::to_string(parts.size()) + ")");
  }
  for (size_t i = 0; i < targets.size(); ++i) frame.set(targets[i], parts[i]);
}

Value Interp::apply_filters(const std::vector<ExprPtr>& filters, Value v) {
  for (const ExprPtr& f : filters) {
    CallArgs args = eval_args(*f);
    set_position(*f);
    v = apply_filter(*this, f->name, v, args);
  }
  return v;
}

Interp::Flow Interp::exec_stmt(const Stmt& s, std::string& out) {
  DepthGuard guard(*this);
  set_position(s);
  budget_.charge(1);
  switch (s.kind) {
    case StmtKind::Text:
      budget_.charge_bytes(s.text.size());
      out += s.text;
      budget_.check_bytes(out.size());
      return Flow::Normal;
    case StmtKind::Output: {
      const Value v = eval(*s.expr);
      append_str(out, v, budget_);
      return Flow::Normal;
    }
    case StmtKind::If:
      for (const auto& [cond, body] : s.branches) {
        if (eval(*cond).truthy()) return exec(body, out);
      }
      return exec(s.else_body, out);
    case StmtKind::For: return exec_for(s, out);
    case StmtKind::Set: {
      Value v = eval(*s.expr);
      set_position(s);
      if (s.attr.empty()) {
        assign(s.targets, v, *frame_);
        return Flow::Normal;
      }
      const Value ns = lookup(s.targets[0]);
      auto* obj = ns.is_object() ? dynamic_cast<NamespaceObj*>(&ns.object()) : nullptr;
      if (obj == nullptr) fail("cannot assign attribute '" + s.attr + "' on non-namespace object '" + s.targets[0] + "'");
      if (v.has_namespace()) fail("a namespace cannot hold a namespace or loop object");
      obj->set(s.attr, std::move(v));
      return Flow::Normal;
    }
    case StmtKind::SetBlock: {
      std::string text;
      exec(s.body, text);
      frame_->set(s.targets[0], apply_filters(s.filters, make_string(std::move(text))));
      return Flow::Normal;
    }
    case StmtKind::Macro:
      frame_->set(s.name, Value::object(std::make_shared<MacroObj>(&s, &s.body, frame_, s.name)));
      return Flow::Normal;
    case StmtKind::CallBlock: {
      const Expr& call_expr = *s.expr;
      const Value fn = eval(*call_expr.a);
      CallArgs args = eval_args(call_expr);
      const Value caller = Value::object(std::make_shared<MacroObj>(&s, &s.body, frame_, "caller"));
      set_position(s);
      const auto* macro = fn.is_object() ? dynamic_cast<const MacroObj*>(&fn.object()) : nullptr;
      if (macro == nullptr) fail("{% call %} needs a macro");
      append_str(out, macro->call_with_caller(*this, args, caller), budget_);
      return Flow::Normal;
    }
    case StmtKind::FilterBlock: {
      std::string text;
      const Flow f = exec(s.body, text);
      append_str(out, apply_filters(s.filters, make_string(std::move(text))), budget_);
      return f;
    }
    case StmtKind::With: {
      auto frame = std::make_shared<Frame>();
      frame->parent = frame_;
      for (size_t i = 0; i < s.targets.size(); ++i) frame->set(s.targets[i], eval(*s.values[i]));
      const std::shared_ptr<Frame> saved = frame_;
      frame_ = frame;
      const Flow f = exec(s.body, out);
      frame_ = saved;
      return f;
    }
    case StmtKind::Break: return Flow::Break;
    case StmtKind::Continue: return Flow::Continue;
    case StmtKind::Scope: return exec(s.body, out);
  }
  return Flow::Normal;
}

Interp::Flow Interp::exec_for(const Stmt& s, std::string& out) {
  const Value iterable = eval(*s.expr);
  set_position(s);
  if (iterable.is_none()) fail("'NoneType' object is not iterable");
  std::vector<Value> items = iterate(iterable);
  const std::shared_ptr<Frame> saved = frame_;
  if (s.cond) {  // "for x in xs if cond": filtered first, so loop.length counts what is visited
    std::vector<Value> kept;
    for (Value& item : items) {
      budget_.charge(1);
      auto frame = std::make_shared<Frame>();
      frame->parent = saved;
      assign(s.targets, item, *frame);
      frame_ = frame;
      const bool keep = eval(*s.cond).truthy();
      frame_ = saved;
      if (keep) kept.push_back(std::move(item));
    }
    items = std::move(kept);
  }
  if (items.empty()) {
    exec(s.else_body, out);
    return Flow::Normal;
  }
  const auto shared_items = std::make_shared<const std::vector<Value>>(std::move(items));
  const auto loop = std::make_shared<LoopObj>(shared_items);
  const Value loop_value = Value::object(loop);
  // One scope for the loop, emptied at each iteration (Jinja gives each iteration a fresh one).
  auto frame = std::make_shared<Frame>();
  frame->parent = saved;
  for (size_t i = 0; i < shared_items->size(); ++i) {
    budget_.charge(1);
    set_position(s);
    frame->vars.clear();
    assign(s.targets, (*shared_items)[i], *frame);
    frame->set("loop", loop_value);
    loop->set_index(i);
    frame_ = frame;
    const Flow f = exec(s.body, out);
    frame_ = saved;
    if (f == Flow::Break) break;
  }
  return Flow::Normal;
}

}  // namespace kestrel::jinja
