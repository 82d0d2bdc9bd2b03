#include "template/jinja_value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

#include <nlohmann/json.hpp>

#include "template/jinja.h"
#include "template/jinja_text.h"

namespace kestrel::jinja {

namespace {

// Plain lists and dicts nest at most kMaxValueDepth; a namespace inside one holds values of that
// depth again (namespaces never hold namespaces), so real nesting stays far below this.
constexpr int kMaxRecursion = 4 * kMaxValueDepth;
// Dicts above this many entries get a hash index of their string keys.
constexpr size_t kIndexThreshold = 8;

[[noreturn]] void fail_limit(const std::string& msg) {
  throw TemplateError(TemplateError::Kind::Limit, msg);
}

void check_recursion(int depth) {
  if (depth > kMaxRecursion) fail_limit("value nested too deeply");
}

int cmp_numbers(const Value& a, const Value& b);

// Python dict keys: 1, 1.0 and True are one key; strings, None and tuples by value.
bool same_key(const Value& a, const Value& b) {
  if (a.is_string() || b.is_string()) return a.is_string() && b.is_string() && a.str() == b.str();
  if (a.is_number() && b.is_number()) return cmp_numbers(a, b) == 0;
  if (a.is_none() || b.is_none()) return a.is_none() && b.is_none();
  if (a.is_tuple() && b.is_tuple()) {
    Budget unlimited;
    return equals(a, b, unlimited);
  }
  return false;
}

}  // namespace

void Budget::fail_work() const {
  fail_limit("template needs too much work (more than " + std::to_string(max_work) +
             " steps; loop or recursion too long?)");
}
void Budget::fail_bytes() const {
  fail_limit("template output or a string in it exceeds " + std::to_string(max_bytes) + " bytes");
}
void Budget::fail_items() const {
  fail_limit("a list or dict in the template exceeds " + std::to_string(max_items) + " items");
}

// ---- Objects ----

Value Object::attr(std::string_view name) const {
  return Value::undefined("'" + type_name() + "' object has no attribute '" + std::string(name) + "'");
}

Value Object::call(Interp&, CallArgs&) const {
  throw TemplateError(TemplateError::Kind::Runtime, "'" + type_name() + "' object is not callable");
}

void Object::append_repr(std::string& out, Budget&, int) const { out += "<" + type_name() + " object>"; }

// ---- Value ----

Value::Value(std::string s) : kind_(Kind::String), ptr_(std::make_shared<const std::string>(std::move(s))) {}

Value Value::undefined(std::string hint) {
  Value v;
  if (!hint.empty()) v.ptr_ = std::make_shared<const std::string>(std::move(hint));
  return v;
}

Value Value::none() {
  Value v;
  v.kind_ = Kind::None;
  return v;
}

Value Value::list(std::vector<Value> items, bool tuple) {
  return sequence(std::move(items), tuple ? SeqFlavor::Tuple : SeqFlavor::List);
}

Value Value::sequence(std::vector<Value> items, SeqFlavor flavor) {
  auto obj = std::make_shared<ListObj>();
  int depth = 0;
  bool ns = false;
  for (const Value& v : items) {
    depth = std::max(depth, v.depth());
    ns = ns || v.has_namespace();
  }
  if (depth + 1 > kMaxValueDepth) fail_limit("list nested deeper than " + std::to_string(kMaxValueDepth));
  obj->items = std::move(items);
  obj->flavor = flavor;
  obj->depth = depth + 1;
  obj->has_namespace = ns;
  Value v;
  v.kind_ = Kind::List;
  v.ptr_ = ListPtr(std::move(obj));
  return v;
}

Value Value::dict(std::vector<std::pair<Value, Value>> items) {
  auto obj = std::make_shared<DictObj>();
  int depth = 0;
  bool ns = false;
  const bool indexed = items.size() > kIndexThreshold;
  obj->items.reserve(items.size());
  for (auto& [k, v] : items) {
    depth = std::max({depth, k.depth(), v.depth()});
    ns = ns || v.has_namespace() || k.has_namespace();
    // Python keys: equal keys (1, 1.0, True) are one key; the first position, the last value.
    Value* existing = nullptr;
    if (k.is_string() && indexed) {
      auto it = obj->index.find(k.str());
      if (it != obj->index.end()) existing = &obj->items[it->second].second;
    } else {
      for (auto& [ek, ev] : obj->items) {
        if (same_key(ek, k)) {
          existing = &ev;
          break;
        }
      }
    }
    if (existing != nullptr) {
      *existing = std::move(v);
      continue;
    }
    obj->items.emplace_back(std::move(k), std::move(v));
    if (indexed && obj->items.back().first.is_string()) {
      obj->index.emplace(obj->items.back().first.str(), obj->items.size() - 1);
    }
  }
  if (depth + 1 > kMaxValueDepth) fail_limit("dict nested deeper than " + std::to_string(kMaxValueDepth));
  obj->depth = depth + 1;
  obj->has_namespace = ns;
  Value v;
  v.kind_ = Kind::Dict;
  v.ptr_ = DictPtr(std::move(obj));
  return v;
}

Value Value::object(std::shared_ptr<Object> o) {
  Value v;
  v.kind_ = Kind::Object;
  v.ptr_ = std::move(o);
  return v;
}

double Value::as_double() const {
  switch (kind_) {
    case Kind::Bool: return b_ ? 1.0 : 0.0;
    case Kind::Int: return static_cast<double>(i_);
    case Kind::Float: return f_;
    default: return 0.0;
  }
}

std::string Value::undefined_hint() const {
  if (kind_ != Kind::Undefined) return {};
  if (const auto* p = std::get_if<StrPtr>(&ptr_)) return **p;
  return {};
}

int Value::depth() const {
  if (kind_ == Kind::List) return list_obj().depth;
  if (kind_ == Kind::Dict) return dict_obj().depth;
  return 0;
}

bool Value::has_namespace() const {
  if (kind_ == Kind::List) return list_obj().has_namespace;
  if (kind_ == Kind::Dict) return dict_obj().has_namespace;
  if (kind_ == Kind::Object) return object().may_hold_namespace();
  return false;
}

bool Value::truthy() const {
  switch (kind_) {
    case Kind::Undefined:
    case Kind::None: return false;
    case Kind::Bool: return b_;
    case Kind::Int: return i_ != 0;
    case Kind::Float: return f_ != 0.0;
    case Kind::String: return !str().empty();
    case Kind::List: return list_obj().flavor == SeqFlavor::Generator || !items().empty();
    case Kind::Dict: return !dict_obj().items.empty();
    case Kind::Object: return object().truthy();
  }
  return false;
}

std::string Value::type_name() const {
  switch (kind_) {
    case Kind::Undefined: return "undefined";
    case Kind::None: return "NoneType";
    case Kind::Bool: return "bool";
    case Kind::Int: return "int";
    case Kind::Float: return "float";
    case Kind::String: return "str";
    case Kind::List:
      switch (list_obj().flavor) {
        case SeqFlavor::List: return "list";
        case SeqFlavor::Tuple: return "tuple";
        case SeqFlavor::Generator: return "generator";
        case SeqFlavor::DictKeys: return "dict_keys";
        case SeqFlavor::DictValues: return "dict_values";
        case SeqFlavor::DictItems: return "dict_items";
      }
      return "list";
    case Kind::Dict: return "dict";
    case Kind::Object: return object().type_name();
  }
  return "?";
}

const Value* DictObj::find(std::string_view key) const {
  if (!index.empty()) {
    auto it = index.find(key);
    return it == index.end() ? nullptr : &items[it->second].second;
  }
  for (const auto& [k, v] : items) {
    if (k.is_string() && k.str() == key) return &v;
  }
  return nullptr;
}

const Value* DictObj::find(const Value& key) const {
  if (key.is_string()) return find(std::string_view(key.str()));
  for (const auto& [k, v] : items) {
    if (same_key(k, key)) return &v;
  }
  return nullptr;
}

// ---- Printing ----

std::string float_repr(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  char buf[64];
  const auto res = std::to_chars(buf, buf + sizeof(buf), x, std::chars_format::scientific);
  std::string_view sci(buf, static_cast<size_t>(res.ptr - buf));  // [-]d[.ddd]e(+|-)dd
  std::string out;
  if (sci.front() == '-') {
    out += '-';
    sci.remove_prefix(1);
  }
  const size_t e = sci.find('e');
  std::string digits;
  for (char c : sci.substr(0, e)) {
    if (c != '.') digits += c;
  }
  int exp = 0;
  std::from_chars(sci.data() + e + 1 + (sci[e + 1] == '+' ? 1 : 0), sci.data() + sci.size(), exp);
  if (exp >= -4 && exp < 16) {
    if (exp >= 0) {
      const size_t int_len = static_cast<size_t>(exp) + 1;
      if (digits.size() <= int_len) {
        out += digits;
        out.append(int_len - digits.size(), '0');
        out += ".0";
      } else {
        out += digits.substr(0, int_len);
        out += '.';
        out += digits.substr(int_len);
      }
    } else {
      out += "0.";
      out.append(static_cast<size_t>(-exp - 1), '0');
      out += digits;
    }
    return out;
  }
  out += digits[0];
  if (digits.size() > 1) {
    out += '.';
    out += digits.substr(1);
  }
  char ebuf[16];
  std::snprintf(ebuf, sizeof(ebuf), "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
  out += ebuf;
  return out;
}

namespace {

void append_scalar(std::string& out, const Value& v) {
  switch (v.kind()) {
    case Value::Kind::None: out += "None"; break;
    case Value::Kind::Bool: out += v.as_bool() ? "True" : "False"; break;
    case Value::Kind::Int: out += std::to_string(v.as_int()); break;
    case Value::Kind::Float: out += float_repr(v.as_double()); break;
    default: break;
  }
}

}  // namespace

void append_repr(std::string& out, const Value& v, Budget& b, int depth) {
  check_recursion(depth);
  b.charge(1);
  switch (v.kind()) {
    case Value::Kind::Undefined: out += "Undefined"; break;
    case Value::Kind::String:
      b.charge_bytes(v.str().size());
      append_py_string_repr(out, v.str());
      break;
    case Value::Kind::List: {
      const SeqFlavor flavor = v.flavor();
      if (flavor == SeqFlavor::Generator) {
        out += "<generator object>";
        break;
      }
      if (flavor != SeqFlavor::List && flavor != SeqFlavor::Tuple) out += v.type_name() + "(";
      const bool tuple = flavor == SeqFlavor::Tuple;
      out += tuple ? '(' : '[';
      const auto& items = v.items();
      for (size_t i = 0; i < items.size(); ++i) {
        if (i > 0) out += ", ";
        append_repr(out, items[i], b, depth + 1);
        b.check_bytes(out.size());
      }
      if (tuple && items.size() == 1) out += ',';
      out += tuple ? ')' : ']';
      if (flavor != SeqFlavor::List && flavor != SeqFlavor::Tuple) out += ')';
      break;
    }
    case Value::Kind::Dict: {
      out += '{';
      bool first = true;
      for (const auto& [k, val] : v.dict_obj().items) {
        if (!first) out += ", ";
        first = false;
        append_repr(out, k, b, depth + 1);
        out += ": ";
        append_repr(out, val, b, depth + 1);
        b.check_bytes(out.size());
      }
      out += '}';
      break;
    }
    case Value::Kind::Object: v.object().append_repr(out, b, depth + 1); break;
    default: append_scalar(out, v);
  }
  b.check_bytes(out.size());
}

void append_str(std::string& out, const Value& v, Budget& b) {
  switch (v.kind()) {
    case Value::Kind::Undefined: return;
    case Value::Kind::String:
      b.charge_bytes(v.str().size());
      out += v.str();
      b.check_bytes(out.size());
      return;
    case Value::Kind::List:
    case Value::Kind::Dict:
    case Value::Kind::Object: append_repr(out, v, b); return;
    default: append_scalar(out, v);
  }
}

std::string to_str(const Value& v, Budget& b) {
  if (v.is_string()) return v.str();
  std::string out;
  append_str(out, v, b);
  return out;
}

std::string to_repr(const Value& v, Budget& b) {
  std::string out;
  append_repr(out, v, b);
  return out;
}

// ---- Comparison ----

namespace {

int cmp_numbers(const Value& a, const Value& b) {
  if (!a.is_float() && !b.is_float()) {
    const int64_t x = a.as_int(), y = b.as_int();
    return x < y ? -1 : (x > y ? 1 : 0);
  }
  // long double holds every int64 exactly, so int/float comparisons are exact as in Python.
  const long double x = a.is_float() ? static_cast<long double>(a.as_double()) : static_cast<long double>(a.as_int());
  const long double y = b.is_float() ? static_cast<long double>(b.as_double()) : static_cast<long double>(b.as_int());
  if (x < y) return -1;
  if (x > y) return 1;
  if (x == y) return 0;
  return 2;  // NaN: unordered and unequal
}

}  // namespace

bool equals(const Value& a, const Value& b, Budget& budget, int depth) {
  check_recursion(depth);
  budget.charge(1);
  if (a.is_number() && b.is_number()) return cmp_numbers(a, b) == 0;
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case Value::Kind::Undefined:
    case Value::Kind::None: return true;
    case Value::Kind::String:
      if (&a.str() == &b.str()) return true;
      budget.charge_bytes(std::min(a.str().size(), b.str().size()));
      return a.str() == b.str();
    case Value::Kind::List: {
      if (&a.list_obj() == &b.list_obj()) return true;
      if (a.flavor() != b.flavor() || a.flavor() == SeqFlavor::Generator) return false;
      if (a.items().size() != b.items().size()) return false;
      for (size_t i = 0; i < a.items().size(); ++i) {
        if (!equals(a.items()[i], b.items()[i], budget, depth + 1)) return false;
      }
      return true;
    }
    case Value::Kind::Dict: {
      const DictObj& x = a.dict_obj();
      const DictObj& y = b.dict_obj();
      if (&x == &y) return true;
      if (x.items.size() != y.items.size()) return false;
      for (const auto& [k, v] : x.items) {
        budget.charge(y.index.empty() ? y.items.size() : 1);
        const Value* other = y.find(k);
        if (other == nullptr || !equals(v, *other, budget, depth + 1)) return false;
      }
      return true;
    }
    case Value::Kind::Object: return a.object_ptr() == b.object_ptr();
    default: return false;
  }
}

std::optional<int> compare(const Value& a, const Value& b, Budget& budget, int depth) {
  check_recursion(depth);
  budget.charge(1);
  if (a.is_number() && b.is_number()) {
    const int c = cmp_numbers(a, b);
    if (c == 2) return 2;  // NaN: every ordering test is false (callers check for 2)
    return c;
  }
  if (a.is_string() && b.is_string()) {
    budget.charge_bytes(std::min(a.str().size(), b.str().size()));
    const int c = a.str().compare(b.str());
    return c < 0 ? -1 : (c > 0 ? 1 : 0);
  }
  if (a.is_indexable() && b.is_indexable() && a.is_tuple() == b.is_tuple()) {
    const auto& x = a.items();
    const auto& y = b.items();
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (equals(x[i], y[i], budget, depth + 1)) continue;
      return compare(x[i], y[i], budget, depth + 1);
    }
    return x.size() < y.size() ? -1 : (x.size() > y.size() ? 1 : 0);
  }
  return std::nullopt;
}

// ---- JSON ----

template <class Json>
Value from_json(const Json& j, int depth) {
  if (depth > kMaxValueDepth) fail_limit("JSON input nested deeper than " + std::to_string(kMaxValueDepth));
  switch (j.type()) {
    case nlohmann::json::value_t::null: return Value::none();
    case nlohmann::json::value_t::boolean: return Value(j.template get<bool>());
    case nlohmann::json::value_t::number_integer: return Value(j.template get<int64_t>());
    case nlohmann::json::value_t::number_unsigned: {
      const auto u = j.template get<uint64_t>();
      if (u <= static_cast<uint64_t>(INT64_MAX)) return Value(static_cast<int64_t>(u));
      return Value(static_cast<double>(u));
    }
    case nlohmann::json::value_t::number_float: return Value(j.template get<double>());
    case nlohmann::json::value_t::string: return Value(j.template get<std::string>());
    case nlohmann::json::value_t::array: {
      std::vector<Value> items;
      items.reserve(j.size());
      for (const auto& e : j) items.push_back(from_json(e, depth + 1));
      return Value::list(std::move(items));
    }
    case nlohmann::json::value_t::object: {
      std::vector<std::pair<Value, Value>> items;
      items.reserve(j.size());
      for (auto it = j.begin(); it != j.end(); ++it) items.emplace_back(Value(it.key()), from_json(it.value(), depth + 1));
      return Value::dict(std::move(items));
    }
    default:
      throw TemplateError(TemplateError::Kind::Runtime, "JSON binary values are not supported in templates");
  }
}

template Value from_json<nlohmann::json>(const nlohmann::json&, int);
template Value from_json<nlohmann::ordered_json>(const nlohmann::ordered_json&, int);

namespace {

void append_json_string(std::string& out, std::string_view s, bool ensure_ascii) {
  static const char* hex = "0123456789abcdef";
  auto u_escape = [&](uint32_t u) {
    out += "\\u";
    for (int shift = 12; shift >= 0; shift -= 4) out += hex[(u >> shift) & 0xF];
  };
  out += '"';
  for (size_t i = 0; i < s.size();) {
    const size_t start = i;
    const uint32_t cp = utf8_next(s, i);
    switch (cp) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (cp < 0x20) {
          u_escape(cp);
        } else if (ensure_ascii && cp >= 0x80) {
          if (cp >= 0x10000) {
            const uint32_t v = cp - 0x10000;
            u_escape(0xD800 | (v >> 10));
            u_escape(0xDC00 | (v & 0x3FF));
          } else {
            u_escape(cp);
          }
        } else {
          out.append(s.substr(start, i - start));
        }
    }
  }
  out += '"';
}

void append_json_number(std::string& out, const Value& v) {
  if (v.is_bool()) {
    out += v.as_bool() ? "true" : "false";
  } else if (v.is_int()) {
    out += std::to_string(v.as_int());
  } else {
    const double d = v.as_double();
    if (std::isnan(d)) out += "NaN";
    else if (std::isinf(d)) out += d > 0 ? "Infinity" : "-Infinity";
    else out += float_repr(d);
  }
}

void newline_indent(std::string& out, const JsonFormat& fmt, int level) {
  out += '\n';
  for (int i = 0; i < level; ++i) out += *fmt.indent;
}

}  // namespace

void append_json(std::string& out, const Value& v, const JsonFormat& fmt, Budget& b, int depth) {
  check_recursion(depth);
  b.charge(1);
  switch (v.kind()) {
    case Value::Kind::None: out += "null"; break;
    case Value::Kind::Bool:
    case Value::Kind::Int:
    case Value::Kind::Float: append_json_number(out, v); break;
    case Value::Kind::String:
      b.charge_bytes(v.str().size());
      append_json_string(out, v.str(), fmt.ensure_ascii);
      break;
    case Value::Kind::List: {
      if (!v.is_indexable()) {
        throw TemplateError(TemplateError::Kind::Runtime, "Object of type " + v.type_name() + " is not JSON serializable");
      }
      const auto& items = v.items();
      if (items.empty()) {
        out += "[]";
        break;
      }
      out += '[';
      for (size_t i = 0; i < items.size(); ++i) {
        if (i > 0) out += fmt.item_separator;
        if (fmt.indent) newline_indent(out, fmt, depth + 1);
        append_json(out, items[i], fmt, b, depth + 1);
        b.check_bytes(out.size());
      }
      if (fmt.indent) newline_indent(out, fmt, depth);
      out += ']';
      break;
    }
    case Value::Kind::Dict: {
      const auto& items = v.dict_obj().items;
      if (items.empty()) {
        out += "{}";
        break;
      }
      // Keys as Python's json turns them into strings.
      std::vector<std::pair<std::string, const Value*>> entries;
      entries.reserve(items.size());
      for (const auto& [k, val] : items) {
        std::string key;
        if (k.is_string()) key = k.str();
        else if (k.is_none()) key = "null";
        else if (k.is_number()) append_json_number(key, k);
        else throw TemplateError(TemplateError::Kind::Runtime, "tojson: keys must be str, int, float, bool or None, not " + k.type_name());
        entries.emplace_back(std::move(key), &val);
      }
      if (fmt.sort_keys) {
        b.charge(entries.size() * 8);
        std::stable_sort(entries.begin(), entries.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
      }
      out += '{';
      for (size_t i = 0; i < entries.size(); ++i) {
        if (i > 0) out += fmt.item_separator;
        if (fmt.indent) newline_indent(out, fmt, depth + 1);
        append_json_string(out, entries[i].first, fmt.ensure_ascii);
        out += fmt.key_separator;
        append_json(out, *entries[i].second, fmt, b, depth + 1);
        b.check_bytes(out.size());
      }
      if (fmt.indent) newline_indent(out, fmt, depth);
      out += '}';
      break;
    }
    case Value::Kind::Undefined:
      throw TemplateError(TemplateError::Kind::Runtime, "Object of type Undefined is not JSON serializable");
    case Value::Kind::Object:
      throw TemplateError(TemplateError::Kind::Runtime,
                          "Object of type " + v.object().type_name() + " is not JSON serializable");
  }
  b.check_bytes(out.size());
}

}  // namespace kestrel::jinja
