#include "template/jinja_interp.h"

#include <algorithm>
#include <cmath>

#include "template/jinja_text.h"

namespace kestrel::jinja {

namespace {

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

// ---- Interp: values and expressions ----

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
    default: fail(std::string("'") + v.type_name() + "' object is not iterable");
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
  // Appended piece by piece: GCC 12 warns (-Wrestrict, a false positive) on the + chain here.
  std::string hint = "'";
  hint += obj.type_name();
  hint += " object' has no attribute '";
  hint += name;
  hint += '\'';
  return Value::undefined(std::move(hint));
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
        return Value::undefined(std::string("'") + obj.type_name() + "' object is not subscriptable");
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
  std::string hint = "'";  // appended, not a + chain: see get_attr
  hint += obj.type_name();
  hint += " object' has no item ";
  hint += to_repr(key, scratch);
  return Value::undefined(std::move(hint));
}

Value Interp::call(const Value& fn, CallArgs& args) {
  if (fn.is_undefined()) fail_undefined(fn);
  if (fn.is_object() && fn.object().callable()) return fn.object().call(*this, args);
  fail(std::string("'") + fn.type_name() + "' object is not callable");
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
                               : std::string("'") + self.type_name() + " object' has no attribute '" + callee.name + "'");
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
    return Value::undefined(std::string("'") + obj.type_name() + "' object is not subscriptable");
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
