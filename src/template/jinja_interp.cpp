#include "template/jinja_interp.h"

#include <algorithm>
#include <cmath>

#include "template/jinja_text.h"

namespace kestrel::jinja {

namespace {

// Nested eval/exec calls at once (expressions, blocks and macro calls together): bounds the
// native stack whatever the template does.
constexpr int kMaxEvalDepth = 500;

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

class BoundMethod : public Object {
 public:
  BoundMethod(Value self, std::string name) : self_(std::move(self)), name_(std::move(name)) {}
  std::string type_name() const override { return "builtin_function_or_method"; }
  bool callable() const override { return true; }
  bool may_hold_namespace() const override { return self_.has_namespace(); }
  Value call(Interp& in, CallArgs& args) const override { return call_method(in, self_, name_, args); }
  void append_repr(std::string& out, Budget&, int) const override {
    out += "<built-in method " + name_ + " of " + self_.type_name() + " object>";
  }

 private:
  Value self_;
  std::string name_;
};

std::string type_error_operands(const char* op, const Value& a, const Value& b) {
  return std::string("unsupported operand type(s) for ") + op + ": '" + a.type_name() + "' and '" + b.type_name() + "'";
}

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

// ---- ArgBinder ----

ArgBinder::ArgBinder(Interp& in, std::string_view fn, const CallArgs& args, std::initializer_list<std::string_view> params)
    : bound_(params.size(), nullptr) {
  if (args.pos.size() > params.size()) {
    in.fail(std::string(fn) + "() takes at most " + std::to_string(params.size()) + " argument" +
            (params.size() == 1 ? "" : "s") + " (" + std::to_string(args.pos.size()) + " given)");
  }
  for (size_t i = 0; i < args.pos.size(); ++i) bound_[i] = &args.pos[i];
  for (const auto& [key, value] : args.kw) {
    const auto it = std::find(params.begin(), params.end(), key);
    if (it == params.end()) in.fail(std::string(fn) + "() got an unexpected keyword argument '" + key + "'");
    const auto i = static_cast<size_t>(it - params.begin());
    if (bound_[i] != nullptr) in.fail(std::string(fn) + "() got multiple values for argument '" + key + "'");
    bound_[i] = &value;
  }
}

// ---- Interp ----

struct Interp::DepthGuard {
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

Value Interp::make_list(std::vector<Value> items, bool tuple) {
  budget_.check_items(items.size());
  budget_.charge(items.size());
  return Value::list(std::move(items), tuple);
}

Value Interp::make_seq(std::vector<Value> items, SeqFlavor flavor) {
  budget_.check_items(items.size());
  budget_.charge(items.size());
  return Value::sequence(std::move(items), flavor);
}

Value Interp::make_string(std::string s) {
  budget_.check_bytes(s.size());
  budget_.charge_bytes(s.size());
  return Value(std::move(s));
}

Value Interp::lookup(const std::string& name) const {
  if (const Value* v = frame_->find(name)) return *v;
  return Value::undefined("'" + name + "' is undefined");
}

std::vector<Value> Interp::iterate(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::Undefined: return {};
    case Value::Kind::List:
      budget_.charge(v.items().size());
      return v.items();
    case Value::Kind::Dict: {
      std::vector<Value> keys;
      keys.reserve(v.dict_obj().items.size());
      for (const auto& kv : v.dict_obj().items) keys.push_back(kv.first);
      budget_.charge(keys.size());
      return keys;
    }
    case Value::Kind::String: {
      std::vector<Value> chars;
      for (std::string_view c : utf8_chars(v.str())) chars.emplace_back(c);
      budget_.charge(chars.size() * 2);
      return chars;
    }
    default: fail("'" + v.type_name() + "' object is not iterable");
  }
}

Value Interp::get_attr(const Value& obj, std::string_view name) {
  switch (obj.kind()) {
    case Value::Kind::Undefined: return obj;  // lenient: undefined.attr is undefined
    case Value::Kind::Dict:
      if (has_method(obj, name)) return Value::object(std::make_shared<BoundMethod>(obj, std::string(name)));
      if (const Value* v = obj.dict_obj().find(name)) return *v;
      break;
    case Value::Kind::Object: return obj.object().attr(name);
    default:
      if (has_method(obj, name)) return Value::object(std::make_shared<BoundMethod>(obj, std::string(name)));
  }
  return Value::undefined("'" + obj.type_name() + " object' has no attribute '" + std::string(name) + "'");
}

Value Interp::get_item(const Value& obj, const Value& key) {
  switch (obj.kind()) {
    case Value::Kind::Undefined: return obj;
    case Value::Kind::Dict: {
      budget_.charge(obj.dict_obj().index.empty() ? obj.dict_obj().items.size() / 4 + 1 : 1);
      if (const Value* v = obj.dict_obj().find(key)) return *v;
      if (key.is_string() && has_method(obj, key.str())) return get_attr(obj, key.str());
      if (key.is_string()) {
        return Value::undefined("'dict object' has no attribute '" + key.str() + "'");
      }
      Budget scratch;
      return Value::undefined("'dict object' has no item " + to_repr(key, scratch));
    }
    case Value::Kind::List:
    case Value::Kind::String: {
      if (key.is_string()) return get_attr(obj, key.str());
      if (!key.is_int() && !key.is_bool()) break;
      if (obj.is_list() && !obj.is_indexable()) {
        return Value::undefined("'" + obj.type_name() + "' object is not subscriptable");
      }
      int64_t i = key.as_int();
      if (obj.is_list()) {
        const auto n = static_cast<int64_t>(obj.items().size());
        if (i < 0) i += n;
        if (i < 0 || i >= n) return Value::undefined(obj.type_name() + " index out of range");
        return obj.items()[static_cast<size_t>(i)];
      }
      const std::string& s = obj.str();
      bool ascii = true;
      for (char c : s) ascii = ascii && static_cast<unsigned char>(c) < 0x80;
      budget_.charge_bytes(s.size());
      if (ascii) {
        const auto n = static_cast<int64_t>(s.size());
        if (i < 0) i += n;
        if (i < 0 || i >= n) return Value::undefined("string index out of range");
        return Value(s.substr(static_cast<size_t>(i), 1));
      }
      const std::vector<std::string_view> chars = utf8_chars(s);
      const auto n = static_cast<int64_t>(chars.size());
      if (i < 0) i += n;
      if (i < 0 || i >= n) return Value::undefined("string index out of range");
      return Value(chars[static_cast<size_t>(i)]);
    }
    case Value::Kind::Object:
      if (key.is_string()) return obj.object().attr(key.str());
      break;
    default: break;
  }
  Budget scratch;
  return Value::undefined("'" + obj.type_name() + " object' has no item " + to_repr(key, scratch));
}

Value Interp::call(const Value& fn, CallArgs& args) {
  if (fn.is_undefined()) fail_undefined(fn);
  if (fn.is_object() && fn.object().callable()) return fn.object().call(*this, args);
  fail("'" + fn.type_name() + "' object is not callable");
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

// ---- expressions ----

CallArgs Interp::eval_args(const Expr& e) {
  CallArgs args;
  args.pos.reserve(e.args.size());
  for (const ExprPtr& a : e.args) args.pos.push_back(eval(*a));
  for (const auto& [k, v] : e.kwargs) args.kw.emplace_back(k, eval(*v));
  return args;
}

Value Interp::eval_call(const Expr& e) {
  const Expr& callee = *e.a;
  if (callee.kind == ExprKind::GetAttr) {
    const Value self = eval(*callee.a);
    if (!self.is_object() && has_method(self, callee.name)) {
      CallArgs args = eval_args(e);
      set_position(e);
      return call_method(*this, self, callee.name, args);
    }
    const Value fn = get_attr(self, callee.name);
    CallArgs args = eval_args(e);
    set_position(e);
    if (fn.is_undefined()) {
      fail(self.is_undefined() ? (self.undefined_hint().empty() ? "value is undefined" : self.undefined_hint())
                               : "'" + self.type_name() + " object' has no attribute '" + callee.name + "'");
    }
    return call(fn, args);
  }
  const Value fn = eval(callee);
  CallArgs args = eval_args(e);
  set_position(e);
  return call(fn, args);
}

Value Interp::eval_slice(const Expr& e, const Value& obj) {
  std::optional<int64_t> parts[3];
  for (int k = 0; k < 3; ++k) {
    if (!e.args[static_cast<size_t>(k)]) continue;
    const Value v = eval(*e.args[static_cast<size_t>(k)]);
    if (v.is_none() || v.is_undefined()) continue;
    if (!v.is_int() && !v.is_bool()) {
      set_position(e);
      fail("slice indices must be integers or None, not " + v.type_name());
    }
    parts[k] = v.as_int();
  }
  set_position(e);
  if (obj.is_undefined()) return obj;
  if (!obj.is_indexable() && !obj.is_string()) {
    return Value::undefined("'" + obj.type_name() + "' object is not subscriptable");
  }
  const int64_t step = parts[2].value_or(1);
  if (step == 0) fail("slice step cannot be zero");
  std::vector<std::string_view> chars;
  if (obj.is_string()) {
    budget_.charge_bytes(obj.str().size());
    chars = utf8_chars(obj.str());
  }
  const auto n = static_cast<int64_t>(obj.is_list() ? obj.items().size() : chars.size());
  // Python's slice.indices().
  auto clamp = [&](std::optional<int64_t> x, int64_t dflt) {
    if (!x) return dflt;
    int64_t v = *x;
    if (v < 0) {
      v += n;
      if (v < 0) v = step < 0 ? -1 : 0;
    } else if (v >= n) {
      v = step < 0 ? n - 1 : n;
    }
    return v;
  };
  const int64_t start = clamp(parts[0], step < 0 ? n - 1 : 0);
  const int64_t stop = clamp(parts[1], step < 0 ? -1 : n);
  std::vector<size_t> picks;
  for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) picks.push_back(static_cast<size_t>(i));
  budget_.charge(picks.size());
  if (obj.is_list()) {
    std::vector<Value> out;
    out.reserve(picks.size());
    for (size_t i : picks) out.push_back(obj.items()[i]);
    return make_list(std::move(out), obj.is_tuple());
  }
  std::string s;
  for (size_t i : picks) s += chars[i];
  return make_string(std::move(s));
}

namespace {

bool add_overflow(int64_t a, int64_t b, int64_t* r) { return __builtin_add_overflow(a, b, r); }
bool sub_overflow(int64_t a, int64_t b, int64_t* r) { return __builtin_sub_overflow(a, b, r); }
bool mul_overflow(int64_t a, int64_t b, int64_t* r) { return __builtin_mul_overflow(a, b, r); }

int64_t floor_div(int64_t a, int64_t b) {
  int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}

int64_t floor_mod(int64_t a, int64_t b) {
  int64_t r = a % b;
  if (r != 0 && ((r < 0) != (b < 0))) r += b;
  return r;
}

}  // namespace

Value Interp::eval_binary(const Expr& e, const Value& a, const Value& b) {
  set_position(e);
  require_defined(a);
  require_defined(b);
  const bool nums = a.is_number() && b.is_number();
  const bool ints = nums && !a.is_float() && !b.is_float();
  int64_t r = 0;
  switch (e.bin_op) {
    case BinOp::Add:
      if (ints) {
        if (add_overflow(a.as_int(), b.as_int(), &r)) fail("integer overflow");
        return Value(r);
      }
      if (nums) return Value(a.as_double() + b.as_double());
      if (a.is_string() && b.is_string()) {
        budget_.check_bytes(a.str().size() + b.str().size());
        return make_string(a.str() + b.str());
      }
      if (a.is_indexable() && b.is_indexable() && a.is_tuple() == b.is_tuple()) {
        budget_.check_items(a.items().size() + b.items().size());
        std::vector<Value> items = a.items();
        items.insert(items.end(), b.items().begin(), b.items().end());
        return make_list(std::move(items), a.is_tuple());
      }
      fail(type_error_operands("+", a, b));
    case BinOp::Sub:
      if (ints) {
        if (sub_overflow(a.as_int(), b.as_int(), &r)) fail("integer overflow");
        return Value(r);
      }
      if (nums) return Value(a.as_double() - b.as_double());
      fail(type_error_operands("-", a, b));
    case BinOp::Mul: {
      if (ints) {
        if (mul_overflow(a.as_int(), b.as_int(), &r)) fail("integer overflow");
        return Value(r);
      }
      if (nums) return Value(a.as_double() * b.as_double());
      const Value& seq = a.is_number() ? b : a;
      const Value& count = a.is_number() ? a : b;
      if (count.is_number() && !count.is_float() && (seq.is_string() || seq.is_indexable())) {
        const int64_t n = std::max<int64_t>(0, count.as_int());
        if (seq.is_string()) {
          if (n > 0 && seq.str().size() > budget_.max_bytes / static_cast<size_t>(n)) budget_.fail_bytes();
          std::string s;
          s.reserve(seq.str().size() * static_cast<size_t>(n));
          for (int64_t i = 0; i < n; ++i) s += seq.str();
          return make_string(std::move(s));
        }
        if (n > 0 && seq.items().size() > budget_.max_items / static_cast<size_t>(n)) budget_.fail_items();
        std::vector<Value> items;
        for (int64_t i = 0; i < n; ++i) items.insert(items.end(), seq.items().begin(), seq.items().end());
        return make_list(std::move(items), seq.is_tuple());
      }
      fail(type_error_operands("*", a, b));
    }
    case BinOp::Div:
      if (!nums) fail(type_error_operands("/", a, b));
      if (b.as_double() == 0.0) fail("division by zero");
      return Value(a.as_double() / b.as_double());
    case BinOp::FloorDiv:
      if (!nums) fail(type_error_operands("//", a, b));
      if (b.as_double() == 0.0) fail("integer division or modulo by zero");
      if (ints) {
        if (a.as_int() == INT64_MIN && b.as_int() == -1) fail("integer overflow");
        return Value(floor_div(a.as_int(), b.as_int()));
      }
      return Value(std::floor(a.as_double() / b.as_double()));
    case BinOp::Mod:
      if (a.is_string()) return make_string(percent_format(*this, a.str(), b));
      if (!nums) fail(type_error_operands("%", a, b));
      if (b.as_double() == 0.0) fail("integer division or modulo by zero");
      if (ints) {
        if (b.as_int() == -1) return Value(int64_t{0});
        return Value(floor_mod(a.as_int(), b.as_int()));
      } else {
        const double x = a.as_double(), y = b.as_double();
        double m = std::fmod(x, y);
        if (m != 0.0 && ((m < 0) != (y < 0))) m += y;
        return Value(m);
      }
    case BinOp::Pow:
      if (!nums) fail(type_error_operands("**", a, b));
      if (ints && b.as_int() >= 0) {
        int64_t base = a.as_int(), exp = b.as_int(), acc = 1;
        while (exp > 0) {
          if (exp & 1) {
            if (mul_overflow(acc, base, &acc)) fail("integer overflow");
          }
          exp >>= 1;
          if (exp > 0 && mul_overflow(base, base, &base)) fail("integer overflow");
        }
        return Value(acc);
      }
      if (a.as_double() == 0.0 && b.as_double() < 0) fail("0.0 cannot be raised to a negative power");
      return Value(std::pow(a.as_double(), b.as_double()));
  }
  fail("unknown operator");
}

bool Interp::eval_compare(CmpOp op, const Value& a, const Value& b) {
  switch (op) {
    case CmpOp::Eq: return equals(a, b, budget_);
    case CmpOp::Ne: return !equals(a, b, budget_);
    case CmpOp::In:
    case CmpOp::NotIn: {
      bool found = false;
      if (b.is_string()) {
        if (!a.is_string()) fail("'in <string>' requires string as left operand, not " + a.type_name());
        budget_.charge_bytes(b.str().size());
        found = b.str().find(a.str()) != std::string::npos;
      } else if (b.is_list()) {
        for (const Value& x : b.items()) {
          if (equals(a, x, budget_)) {
            found = true;
            break;
          }
        }
      } else if (b.is_dict()) {
        if (a.is_dict() || (a.is_list() && a.flavor() == SeqFlavor::List)) fail("unhashable type: '" + a.type_name() + "'");
        budget_.charge(b.dict_obj().index.empty() ? b.dict_obj().items.size() : 1);
        found = b.dict_obj().find(a) != nullptr;
      } else if (!b.is_undefined()) {
        fail("argument of type '" + b.type_name() + "' is not iterable");
      }
      return op == CmpOp::In ? found : !found;
    }
    default: break;
  }
  require_defined(a);
  require_defined(b);
  const std::optional<int> c = compare(a, b, budget_);
  if (!c) {
    static const char* names[] = {"==", "!=", "<", "<=", ">", ">="};
    fail(std::string("'") + names[static_cast<int>(op)] + "' not supported between instances of '" + a.type_name() +
         "' and '" + b.type_name() + "'");
  }
  if (*c == 2) return false;  // NaN
  switch (op) {
    case CmpOp::Lt: return *c < 0;
    case CmpOp::Le: return *c <= 0;
    case CmpOp::Gt: return *c > 0;
    case CmpOp::Ge: return *c >= 0;
    default: return false;
  }
}

Value Interp::eval(const Expr& e) {
  DepthGuard guard(*this);
  budget_.charge(1);
  switch (e.kind) {
    case ExprKind::Literal: return e.value;
    case ExprKind::Name: return lookup(e.name);
    case ExprKind::List:
    case ExprKind::Tuple: {
      std::vector<Value> items;
      items.reserve(e.args.size());
      for (const ExprPtr& a : e.args) items.push_back(eval(*a));
      set_position(e);
      return make_list(std::move(items), e.kind == ExprKind::Tuple);
    }
    case ExprKind::Dict: {
      std::vector<std::pair<Value, Value>> items;
      for (size_t i = 0; i + 1 < e.args.size(); i += 2) items.emplace_back(eval(*e.args[i]), eval(*e.args[i + 1]));
      set_position(e);
      for (const auto& kv : items) {
        if (kv.first.is_list() && !kv.first.is_tuple()) fail("unhashable type: 'list'");
        if (kv.first.is_dict()) fail("unhashable type: 'dict'");
      }
      budget_.charge(items.size());
      return Value::dict(std::move(items));
    }
    case ExprKind::GetAttr: {
      const Value obj = eval(*e.a);
      set_position(e);
      return get_attr(obj, e.name);
    }
    case ExprKind::GetItem: {
      const Value obj = eval(*e.a);
      const Value key = eval(*e.b);
      set_position(e);
      return get_item(obj, key);
    }
    case ExprKind::Slice: return eval_slice(e, eval(*e.a));
    case ExprKind::Call: return eval_call(e);
    case ExprKind::Filter: {
      const Value v = eval(*e.a);
      CallArgs args = eval_args(e);
      set_position(e);
      return apply_filter(*this, e.name, v, args);
    }
    case ExprKind::Test: {
      const Value v = eval(*e.a);
      CallArgs args = eval_args(e);
      set_position(e);
      return Value(apply_test(*this, e.name, v, args) != e.negated);
    }
    case ExprKind::Not: return Value(!eval(*e.a).truthy());
    case ExprKind::Neg:
    case ExprKind::Pos: {
      const Value v = eval(*e.a);
      set_position(e);
      require_defined(v);
      if (!v.is_number()) fail(std::string("bad operand type for unary ") + (e.kind == ExprKind::Neg ? "-" : "+") + ": '" + v.type_name() + "'");
      if (e.kind == ExprKind::Pos) return v.is_float() ? v : Value(v.as_int());
      if (v.is_float()) return Value(-v.as_double());
      if (v.as_int() == INT64_MIN) fail("integer overflow");
      return Value(-v.as_int());
    }
    case ExprKind::Binary: {
      const Value a = eval(*e.a);
      const Value b = eval(*e.b);
      return eval_binary(e, a, b);
    }
    case ExprKind::Compare: {
      Value left = eval(*e.args[0]);
      for (size_t i = 0; i < e.ops.size(); ++i) {
        Value right = eval(*e.args[i + 1]);
        set_position(e);
        if (!eval_compare(e.ops[i], left, right)) return Value(false);
        left = std::move(right);
      }
      return Value(true);
    }
    case ExprKind::And: {
      Value a = eval(*e.a);
      return a.truthy() ? eval(*e.b) : a;
    }
    case ExprKind::Or: {
      Value a = eval(*e.a);
      return a.truthy() ? a : eval(*e.b);
    }
    case ExprKind::Cond:
      if (eval(*e.b).truthy()) return eval(*e.a);
      return e.c ? eval(*e.c) : Value::undefined("the condition was false and there is no else");
    case ExprKind::Concat: {
      std::string s;
      for (const ExprPtr& a : e.args) {
        const Value v = eval(*a);
        append_str(s, v, budget_);
      }
      return make_string(std::move(s));
    }
  }
  return Value();
}

}  // namespace kestrel::jinja
