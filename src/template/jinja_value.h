// Values of the Jinja engine: Python's None, bool, int, float, str, list, tuple and dict, Jinja's
// Undefined, and objects (namespace, loop, functions and macros).
//
// Strings, lists and dicts are immutable and shared (the sandbox transformers renders with forbids
// changing them); only namespace objects change. Ints are 64-bit (overflow is an error where
// Python would grow the number). Strings are UTF-8; lengths and indices count code points.
#pragma once

#include <cstdint>
#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

namespace kestrel::jinja {

class Interp;
class Value;
struct CallArgs;
struct Budget;

// Lists and dicts deeper than this cannot be built (freeing and printing them recurse).
inline constexpr int kMaxValueDepth = 256;

// What a sequence is in Python terms: printing, truthiness, indexing and JSON differ.
enum class SeqFlavor : uint8_t {
  List,
  Tuple,
  Generator,   // what select/map/unique/batch/items/reverse give: always true, no len(), no [i]
  DictKeys,    // dict.keys() / values() / items() views: no [i], not JSON
  DictValues,
  DictItems,
};

struct ListObj {
  std::vector<Value> items;
  SeqFlavor flavor = SeqFlavor::List;
  int depth = 1;               // 1 + the deepest element's depth
  bool has_namespace = false;  // some element is or holds a namespace object
};

struct DictObj {
  std::vector<std::pair<Value, Value>> items;  // insertion order, keys unique
  int depth = 1;
  bool has_namespace = false;
  // String keys -> position, built for larger dicts (views into the keys, which never change).
  std::unordered_map<std::string_view, size_t> index;

  const Value* find(const Value& key) const;
  const Value* find(std::string_view key) const;
};

// Anything that is not plain data: namespace(), the loop variable, functions and macros.
class Object {
 public:
  virtual ~Object() = default;
  virtual std::string type_name() const = 0;  // as error messages name it
  virtual Value attr(std::string_view name) const;  // undefined unless overridden
  virtual bool callable() const { return false; }
  virtual Value call(Interp& in, CallArgs& args) const;  // fails unless overridden
  virtual void append_repr(std::string& out, Budget& b, int depth) const;
  virtual bool truthy() const { return true; }
  // Whether the object holds values that may contain namespaces (namespaces, loops): such
  // values cannot be stored in a namespace, so shared pointers never form a cycle.
  virtual bool may_hold_namespace() const { return false; }
};

class Value {
 public:
  enum class Kind : uint8_t { Undefined, None, Bool, Int, Float, String, List, Dict, Object };

  Value() = default;  // undefined
  Value(bool b) : kind_(Kind::Bool), b_(b) {}
  Value(int v) : Value(static_cast<int64_t>(v)) {}
  Value(int64_t i) : kind_(Kind::Int), i_(i) {}
  Value(double f) : kind_(Kind::Float), f_(f) {}
  Value(std::string s);
  Value(const char* s) : Value(std::string(s)) {}
  Value(std::string_view s) : Value(std::string(s)) {}

  // `hint` says what was undefined ("'foo' is undefined"), for the error when it is used.
  static Value undefined(std::string hint);
  static Value none();
  // Errors: TemplateError (Limit) when deeper than kMaxValueDepth.
  static Value list(std::vector<Value> items, bool tuple = false);
  static Value sequence(std::vector<Value> items, SeqFlavor flavor);
  // Later duplicates of a key replace the earlier value (in the earlier place), as in Python.
  static Value dict(std::vector<std::pair<Value, Value>> items);
  static Value object(std::shared_ptr<Object> o);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::Undefined; }
  bool is_none() const { return kind_ == Kind::None; }
  bool is_bool() const { return kind_ == Kind::Bool; }
  bool is_int() const { return kind_ == Kind::Int; }
  bool is_float() const { return kind_ == Kind::Float; }
  bool is_number() const { return kind_ == Kind::Int || kind_ == Kind::Float || kind_ == Kind::Bool; }
  bool is_string() const { return kind_ == Kind::String; }
  bool is_list() const { return kind_ == Kind::List; }  // every sequence flavor
  bool is_tuple() const { return kind_ == Kind::List && list_obj().flavor == SeqFlavor::Tuple; }
  SeqFlavor flavor() const { return list_obj().flavor; }
  // A list or tuple (indexable, sliceable, JSON); not a generator or a dict view.
  bool is_indexable() const {
    return kind_ == Kind::List && (list_obj().flavor == SeqFlavor::List || list_obj().flavor == SeqFlavor::Tuple);
  }
  bool is_dict() const { return kind_ == Kind::Dict; }
  bool is_object() const { return kind_ == Kind::Object; }

  bool as_bool() const { return b_; }
  int64_t as_int() const { return kind_ == Kind::Bool ? int64_t{b_} : i_; }  // bools are ints
  double as_double() const;  // ints, bools and floats
  const std::string& str() const { return *std::get<StrPtr>(ptr_); }
  const ListObj& list_obj() const { return *std::get<ListPtr>(ptr_); }
  const std::vector<Value>& items() const { return list_obj().items; }
  const DictObj& dict_obj() const { return *std::get<DictPtr>(ptr_); }
  Object& object() const { return *std::get<ObjPtr>(ptr_); }
  const std::shared_ptr<Object>& object_ptr() const { return std::get<ObjPtr>(ptr_); }
  // For undefined values: why it is undefined ("'x' is undefined"), maybe empty.
  std::string undefined_hint() const;

  int depth() const;            // 0 for scalars
  bool has_namespace() const;   // is or holds a namespace object

  // Python truthiness (undefined, None, 0, "", [] and {} are false).
  bool truthy() const;
  // Python's type name for messages: 'str', 'int', 'list', 'dict', 'NoneType', 'undefined', ...
  std::string type_name() const;

 private:
  using StrPtr = std::shared_ptr<const std::string>;
  using ListPtr = std::shared_ptr<const ListObj>;
  using DictPtr = std::shared_ptr<const DictObj>;
  using ObjPtr = std::shared_ptr<Object>;

  Kind kind_ = Kind::Undefined;
  union {
    bool b_;
    int64_t i_ = 0;
    double f_;
  };
  std::variant<std::monostate, StrPtr, ListPtr, DictPtr, ObjPtr> ptr_;
};

// The work and size bounds of one render (RenderLimits), charged by everything that loops over
// values or builds strings, so that no operation on shared (aliased) values runs away.
struct Budget {
  uint64_t work = 0;
  uint64_t max_work = UINT64_MAX;
  size_t max_bytes = SIZE_MAX;  // any string built
  size_t max_items = SIZE_MAX;  // any list or dict built

  // Errors: TemplateError (Limit).
  void charge(uint64_t units) {
    work += units;
    if (work > max_work) fail_work();
  }
  void charge_bytes(size_t n) { charge(n / 64 + 1); }
  void check_bytes(size_t n) const {
    if (n > max_bytes) fail_bytes();
  }
  void check_items(size_t n) const {
    if (n > max_items) fail_items();
  }
  [[noreturn]] void fail_work() const;
  [[noreturn]] void fail_bytes() const;
  [[noreturn]] void fail_items() const;
};

// str(v) as Jinja prints it: undefined -> "", None -> "None", True/False, floats as Python's
// repr, containers as Python's repr. Appends; checks the size of `out` against the budget.
void append_str(std::string& out, const Value& v, Budget& b);
std::string to_str(const Value& v, Budget& b);
// Python's repr(v) (strings quoted).
void append_repr(std::string& out, const Value& v, Budget& b, int depth = 0);
std::string to_repr(const Value& v, Budget& b);

// Python's ==: 1 == 1.0 == True, lists and tuples never equal each other, dicts ignore order,
// undefined equals only undefined.
bool equals(const Value& a, const Value& b, Budget& budget, int depth = 0);
// Python's <, <=, >, >= as a three-way result (-1, 0, 1); nullopt when the types cannot be ordered.
std::optional<int> compare(const Value& a, const Value& b, Budget& budget, int depth = 0);

// JSON -> Value (Json is nlohmann::json or nlohmann::ordered_json). Errors: TemplateError (Limit)
// past kMaxValueDepth, (Runtime) for binary values.
template <class Json>
Value from_json(const Json& j, int depth = 0);

struct JsonFormat {
  std::optional<std::string> indent;  // one level's indent; nullopt: everything on one line
  std::string item_separator = ", ";  // Python's defaults: ", " on one line, "," when indented
  std::string key_separator = ": ";
  bool sort_keys = false;
  bool ensure_ascii = false;  // transformers' tojson default
};
// Python's json.dumps. Errors: TemplateError (Runtime) for undefined values and objects.
void append_json(std::string& out, const Value& v, const JsonFormat& fmt, Budget& b, int depth = 0);

// Python float repr: shortest round-trip digits, fixed notation for 1e-4 <= |x| < 1e16.
std::string float_repr(double x);

}  // namespace kestrel::jinja
