// Python methods of str, list and dict that templates call (the non-mutating ones: the sandbox
// transformers uses forbids the others), string formatting (% and str.format), and the globals:
// range, namespace, dict, joiner, raise_exception, strftime_now.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>

#include "template/jinja_interp.h"
#include "template/jinja_text.h"

namespace kestrel::jinja {

namespace {

std::string str_of(Interp& in, const Value& v) { return to_str(v, in.budget()); }

const std::string& need_str(Interp& in, const Value& v, const std::string& what) {
  if (!v.is_string()) in.fail(what + " must be a str, not " + v.type_name());
  return v.str();
}

int64_t need_int(Interp& in, const Value& v, const std::string& what) {
  if (!v.is_int() && !v.is_bool()) in.fail(what + " must be an integer, not " + v.type_name());
  return v.as_int();
}

std::optional<std::string> opt_str(Interp& in, const Value* v, const std::string& what) {
  if (v == nullptr || v->is_none()) return std::nullopt;
  return need_str(in, *v, what);
}

Value str_list(Interp& in, const std::vector<std::string>& parts) {
  std::vector<Value> items;
  items.reserve(parts.size());
  for (const std::string& p : parts) items.emplace_back(p);
  return in.make_list(std::move(items));
}

bool all_chars(const std::string& s, bool (*pred)(uint32_t)) {
  if (s.empty()) return false;
  for (size_t i = 0; i < s.size();) {
    if (!pred(utf8_next(s, i))) return false;
  }
  return true;
}

// startswith / endswith: a prefix or a tuple of prefixes.
bool affix_match(Interp& in, const std::string& s, const Value& what, bool prefix) {
  auto one = [&](const Value& p) {
    const std::string& a = need_str(in, p, prefix ? "startswith argument" : "endswith argument");
    if (a.size() > s.size()) return false;
    return prefix ? s.compare(0, a.size(), a) == 0 : s.compare(s.size() - a.size(), a.size(), a) == 0;
  };
  if (what.is_list()) {
    for (const Value& p : what.items()) {
      if (one(p)) return true;
    }
    return false;
  }
  return one(what);
}

size_t count_substr(const std::string& s, const std::string& sub) {
  if (sub.empty()) return utf8_length(s) + 1;
  size_t n = 0;
  for (size_t p = s.find(sub); p != std::string::npos; p = s.find(sub, p + sub.size())) ++n;
  return n;
}

// Byte offset -> character index (Python indices count characters).
int64_t char_index(const std::string& s, size_t byte_pos) {
  if (byte_pos == std::string::npos) return -1;
  return static_cast<int64_t>(utf8_length(std::string_view(s).substr(0, byte_pos)));
}

Value call_str_method(Interp& in, const std::string& s, std::string_view name, CallArgs& args) {
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    ArgBinder a(in, name, args, {"chars"});
    return in.make_string(py_strip(s, opt_str(in, a.get(0), "strip chars"), name != "rstrip", name != "lstrip"));
  }
  if (name == "split" || name == "rsplit") {
    ArgBinder a(in, name, args, {"sep", "maxsplit"});
    const std::optional<std::string> sep = opt_str(in, a.get(0), "split separator");
    if (sep && sep->empty()) in.fail("empty separator");
    const int64_t maxsplit = a.has(1) ? need_int(in, *a.get(1), "maxsplit") : -1;
    in.budget().charge_bytes(s.size());
    return str_list(in, name == "split" ? py_split(s, sep, maxsplit) : py_rsplit(s, sep, maxsplit));
  }
  if (name == "splitlines") {
    ArgBinder a(in, name, args, {});
    return str_list(in, py_splitlines(s));
  }
  if (name == "startswith" || name == "endswith") {
    ArgBinder a(in, name, args, {"prefix"});
    if (!a.has(0)) in.fail(std::string(name) + "() takes one argument");
    return Value(affix_match(in, s, *a.get(0), name == "startswith"));
  }
  if (name == "upper" || name == "lower" || name == "title" || name == "capitalize") {
    ArgBinder a(in, name, args, {});
    if (name == "upper") return in.make_string(py_upper(s));
    if (name == "lower") return in.make_string(py_lower(s));
    if (name == "title") return in.make_string(py_title(s));
    return in.make_string(py_capitalize(s));
  }
  if (name == "replace") {
    ArgBinder a(in, name, args, {"old", "new", "count"});
    if (!a.has(0) || !a.has(1)) in.fail("replace() needs old and new strings");
    const int64_t count = a.has(2) ? need_int(in, *a.get(2), "replace count") : -1;
    std::string out;
    if (!py_replace(s, need_str(in, *a.get(0), "replace old"), need_str(in, *a.get(1), "replace new"), count,
                    in.budget().max_bytes, out)) {
      in.budget().fail_bytes();
    }
    return in.make_string(std::move(out));
  }
  if (name == "format") return in.make_string(str_format(in, s, args));
  if (name == "join") {
    ArgBinder a(in, name, args, {"iterable"});
    if (!a.has(0)) in.fail("join() takes one argument");
    std::string out;
    bool first = true;
    for (const Value& item : in.iterate(*a.get(0))) {
      if (!first) out += s;
      first = false;
      out += need_str(in, item, "join item");
      in.budget().check_bytes(out.size());
    }
    return in.make_string(std::move(out));
  }
  if (name == "find" || name == "rfind" || name == "count" || name == "index" || name == "rindex") {
    ArgBinder a(in, name, args, {"sub"});
    if (!a.has(0)) in.fail(std::string(name) + "() takes one argument");
    const std::string& sub = need_str(in, *a.get(0), std::string(name) + " argument");
    in.budget().charge_bytes(s.size());
    if (name == "count") return Value(static_cast<int64_t>(count_substr(s, sub)));
    const size_t pos = (name == "find" || name == "index") ? s.find(sub) : s.rfind(sub);
    if (pos == std::string::npos && (name == "index" || name == "rindex")) in.fail("substring not found");
    return Value(char_index(s, pos));
  }
  ArgBinder a(in, name, args, {});
  if (name == "isdigit") return Value(all_chars(s, [](uint32_t c) { return c >= '0' && c <= '9'; }));
  if (name == "isalpha") return Value(all_chars(s, [](uint32_t c) { return is_alnum_cp(c) && !(c >= '0' && c <= '9'); }));
  if (name == "isalnum") return Value(all_chars(s, is_alnum_cp));
  if (name == "isspace") return Value(all_chars(s, is_py_space));
  if (name == "islower" || name == "isupper") {
    bool cased = false;
    for (size_t i = 0; i < s.size();) {
      const uint32_t cp = utf8_next(s, i);
      if (name == "islower" ? is_upper_cp(cp) : is_lower_cp(cp)) return Value(false);
      cased = cased || is_cased(cp);
    }
    return Value(cased);
  }
  in.fail("'str object' has no attribute '" + std::string(name) + "'");
}

constexpr std::string_view kStrMethods[] = {"strip", "lstrip", "rstrip", "split", "rsplit", "splitlines", "startswith",
                                            "endswith", "upper", "lower", "title", "capitalize", "replace", "format",
                                            "join", "find", "rfind", "count", "index", "rindex", "isdigit", "isalpha",
                                            "isalnum", "isspace", "islower", "isupper"};
constexpr std::string_view kListMethods[] = {"index", "count", "append", "extend", "insert", "pop", "remove", "clear",
                                             "sort", "reverse"};
constexpr std::string_view kDictMethods[] = {"items", "keys", "values", "get", "copy", "update", "pop", "popitem",
                                             "setdefault", "clear"};

template <size_t N>
bool in_list(const std::string_view (&names)[N], std::string_view name) {
  return std::find(std::begin(names), std::end(names), name) != std::end(names);
}

[[noreturn]] void immutable(Interp& in, const Value& self, std::string_view name) {
  in.fail("access to '" + std::string(name) + "' of a " + self.type_name() +
          " is not allowed: lists and dicts cannot be changed in chat templates (use namespace())");
}

// ---- globals ----

class Builtin : public Object {
 public:
  using Fn = Value (*)(Interp&, CallArgs&);
  Builtin(std::string name, Fn fn) : name_(std::move(name)), fn_(fn) {}
  std::string type_name() const override { return "builtin_function_or_method"; }
  bool callable() const override { return true; }
  Value call(Interp& in, CallArgs& args) const override { return fn_(in, args); }
  void append_repr(std::string& out, Budget&, int) const override { out += "<built-in function " + name_ + ">"; }

 private:
  std::string name_;
  Fn fn_;
};

Value g_range(Interp& in, CallArgs& args) {
  if (!args.kw.empty()) in.fail("range() takes no keyword arguments");
  if (args.pos.empty() || args.pos.size() > 3) in.fail("range expected 1 to 3 arguments, got " + std::to_string(args.pos.size()));
  int64_t start = 0, stop = 0, step = 1;
  if (args.pos.size() == 1) {
    stop = need_int(in, args.pos[0], "range() argument");
  } else {
    start = need_int(in, args.pos[0], "range() argument");
    stop = need_int(in, args.pos[1], "range() argument");
    if (args.pos.size() == 3) step = need_int(in, args.pos[2], "range() argument");
  }
  if (step == 0) in.fail("range() arg 3 must not be zero");
  // As the sandbox transformers renders with: at most 100000 items.
  constexpr int64_t kMaxRange = 100000;
  const long double n = step > 0 ? std::ceil(static_cast<long double>(stop - static_cast<long double>(start)) / step)
                                  : std::ceil(static_cast<long double>(start - static_cast<long double>(stop)) / -static_cast<long double>(step));
  if (n > kMaxRange) in.fail("range too big: the sandbox allows at most " + std::to_string(kMaxRange) + " items");
  std::vector<Value> items;
  for (int64_t i = start, k = 0; k < static_cast<int64_t>(std::max<long double>(0, n)); i += step, ++k) items.emplace_back(i);
  return in.make_list(std::move(items));
}

Value g_namespace(Interp& in, CallArgs& args) {
  auto ns = std::make_shared<NamespaceObj>();
  for (const Value& p : args.pos) {
    if (!p.is_dict()) in.fail("namespace() takes a dict or keyword arguments, not " + p.type_name());
    for (const auto& [k, v] : p.dict_obj().items) {
      if (!k.is_string()) in.fail("namespace() keys must be strings");
      if (v.has_namespace()) in.fail("a namespace cannot hold a namespace or loop object");
      ns->set(k.str(), v);
    }
  }
  for (const auto& [k, v] : args.kw) {
    if (v.has_namespace()) in.fail("a namespace cannot hold a namespace or loop object");
    ns->set(k, v);
  }
  return Value::object(ns);
}

Value g_dict(Interp& in, CallArgs& args) {
  std::vector<std::pair<Value, Value>> items;
  for (const Value& p : args.pos) {
    if (!p.is_dict()) in.fail("dict() takes a dict or keyword arguments, not " + p.type_name());
    items.insert(items.end(), p.dict_obj().items.begin(), p.dict_obj().items.end());
  }
  for (const auto& [k, v] : args.kw) items.emplace_back(Value(k), v);
  in.budget().charge(items.size());
  return Value::dict(std::move(items));
}

class Joiner : public Object {
 public:
  explicit Joiner(std::string sep) : sep_(std::move(sep)) {}
  std::string type_name() const override { return "Joiner"; }
  bool callable() const override { return true; }
  Value call(Interp&, CallArgs&) const override {
    if (first_) {
      first_ = false;
      return Value("");
    }
    return Value(sep_);
  }

 private:
  std::string sep_;
  mutable bool first_ = true;
};

Value g_joiner(Interp& in, CallArgs& args) {
  ArgBinder a(in, "joiner", args, {"sep"});
  return Value::object(std::make_shared<Joiner>(a.has(0) ? str_of(in, *a.get(0)) : ", "));
}

Value g_raise_exception(Interp& in, CallArgs& args) {
  ArgBinder a(in, "raise_exception", args, {"message"});
  throw TemplateError(TemplateError::Kind::Raised, a.has(0) ? str_of(in, *a.get(0)) : std::string("raise_exception() called"));
}

Value g_strftime_now(Interp& in, CallArgs& args) {
  ArgBinder a(in, "strftime_now", args, {"format"});
  if (!a.has(0)) in.fail("strftime_now() needs a format");
  const std::string& fmt = need_str(in, *a.get(0), "strftime_now format");
  if (fmt.size() > 1024) in.fail("strftime_now format too long");
  const std::time_t t = std::chrono::system_clock::to_time_t(in.now());
  std::tm tm{};
  localtime_r(&t, &tm);
  if (fmt.empty()) return Value("");
  std::string buf(256, '\0');
  while (true) {
    const size_t n = std::strftime(buf.data(), buf.size(), fmt.c_str(), &tm);
    if (n > 0) return in.make_string(buf.substr(0, n));
    if (buf.size() > 65536) return Value("");  // only empty results are this long, or absurd formats
    buf.resize(buf.size() * 4);
  }
}

// ---- formatting ----

// Python's format-spec mini language for one value: [[fill]align][sign][#][0][width][,][.prec][type].
std::string format_one(Interp& in, const Value& v, const std::string& spec) {
  size_t i = 0;
  std::string fill = " ";
  char align = '\0';
  auto is_align = [](char c) { return c == '<' || c == '>' || c == '^' || c == '='; };
  {
    size_t j = 0;
    const uint32_t cp = spec.empty() ? 0 : utf8_next(spec, j);
    if (!spec.empty() && j < spec.size() && is_align(spec[j])) {
      fill.clear();
      utf8_append(fill, cp);
      align = spec[j];
      i = j + 1;
    } else if (!spec.empty() && is_align(spec[0])) {
      align = spec[0];
      i = 1;
    }
  }
  char sign = '-';
  if (i < spec.size() && (spec[i] == '+' || spec[i] == '-' || spec[i] == ' ')) sign = spec[i++];
  bool alt = false;
  if (i < spec.size() && spec[i] == '#') alt = true, ++i;
  if (i < spec.size() && spec[i] == '0' && align == '\0') {
    fill = "0";
    align = '=';
    ++i;
  }
  int64_t width = 0;
  while (i < spec.size() && spec[i] >= '0' && spec[i] <= '9' && width < 100000) width = width * 10 + (spec[i++] - '0');
  bool grouping = false;
  if (i < spec.size() && spec[i] == ',') grouping = true, ++i;
  int64_t precision = -1;
  if (i < spec.size() && spec[i] == '.') {
    ++i;
    precision = 0;
    while (i < spec.size() && spec[i] >= '0' && spec[i] <= '9' && precision < 1000) precision = precision * 10 + (spec[i++] - '0');
  }
  char type = '\0';
  if (i < spec.size()) type = spec[i++];
  if (i != spec.size()) in.fail("invalid format specifier '" + spec + "'");
  in.budget().check_bytes(static_cast<size_t>(width));

  std::string body;
  bool numeric = false;
  if (v.is_number() && !(v.is_bool() && type == '\0')) {
    numeric = true;
    char buf[512];
    const bool as_float = v.is_float() || type == 'f' || type == 'F' || type == 'e' || type == 'E' || type == 'g' || type == 'G' || type == '%';
    if (as_float) {
      double d = v.as_double();
      char t = type == '\0' ? 'r' : type;
      if (t == '%') d *= 100.0;
      if (t == 'r') {
        body = precision >= 0 ? (std::snprintf(buf, sizeof(buf), "%.*g", static_cast<int>(precision), std::fabs(d)), std::string(buf))
                              : float_repr(std::fabs(d));
      } else {
        const char conv = t == '%' ? 'f' : t;
        const std::string f = std::string("%.*") + conv;
        std::snprintf(buf, sizeof(buf), f.c_str(), static_cast<int>(precision < 0 ? 6 : precision), std::fabs(d));
        body = buf;
        if (t == '%') body += '%';
      }
      if (std::signbit(d) && !std::isnan(d)) body = "-" + body;
    } else {
      const int64_t n = v.as_int();
      const uint64_t mag = n < 0 ? 0 - static_cast<uint64_t>(n) : static_cast<uint64_t>(n);
      const char t = type == '\0' ? 'd' : type;
      if (t == 'd' || t == 'n') std::snprintf(buf, sizeof(buf), "%llu", static_cast<unsigned long long>(mag));
      else if (t == 'x') std::snprintf(buf, sizeof(buf), alt ? "0x%llx" : "%llx", static_cast<unsigned long long>(mag));
      else if (t == 'X') std::snprintf(buf, sizeof(buf), alt ? "0X%llX" : "%llX", static_cast<unsigned long long>(mag));
      else if (t == 'o') std::snprintf(buf, sizeof(buf), alt ? "0o%llo" : "%llo", static_cast<unsigned long long>(mag));
      else if (t == 'b') {
        std::string bits;
        for (uint64_t m = mag; m > 0; m >>= 1) bits.insert(bits.begin(), static_cast<char>('0' + (m & 1)));
        if (bits.empty()) bits = "0";
        std::snprintf(buf, sizeof(buf), "%s%s", alt ? "0b" : "", bits.c_str());
      } else if (t == 'c') {
        std::string ch;
        utf8_append(ch, static_cast<uint32_t>(mag & 0x1FFFFF));
        std::snprintf(buf, sizeof(buf), "%s", ch.c_str());
      } else {
        in.fail(std::string("unknown format code '") + t + "' for int");
      }
      body = buf;
      if (grouping && (t == 'd' || t == 'n')) {
        std::string g;
        for (size_t k = 0; k < body.size(); ++k) {
          if (k > 0 && (body.size() - k) % 3 == 0) g += ',';
          g += body[k];
        }
        body = g;
      }
      if (n < 0) body = "-" + body;
    }
    if (body[0] != '-' && sign != '-') body = std::string(1, sign) + body;
  } else {
    if (type != '\0' && type != 's') in.fail(std::string("unknown format code '") + type + "' for " + v.type_name());
    body = str_of(in, v);
    if (precision >= 0) {
      const std::vector<std::string_view> chars = utf8_chars(body);
      std::string cut;
      for (int64_t k = 0; k < precision && k < static_cast<int64_t>(chars.size()); ++k) cut += chars[static_cast<size_t>(k)];
      body = cut;
    }
  }
  const auto len = static_cast<int64_t>(utf8_length(body));
  if (width <= len) return body;
  const auto pad = static_cast<size_t>(width - len);
  auto repeat = [&](size_t n) {
    std::string s;
    for (size_t k = 0; k < n; ++k) s += fill;
    return s;
  };
  if (align == '\0') align = numeric ? '>' : '<';
  switch (align) {
    case '<': return body + repeat(pad);
    case '^': return repeat(pad / 2) + body + repeat(pad - pad / 2);
    case '=': {
      size_t sign_len = (!body.empty() && (body[0] == '-' || body[0] == '+' || body[0] == ' ')) ? 1 : 0;
      return body.substr(0, sign_len) + repeat(pad) + body.substr(sign_len);
    }
    default: return repeat(pad) + body;
  }
}

}  // namespace

std::string str_format(Interp& in, const std::string& fmt, const CallArgs& args) {
  std::string out;
  size_t auto_index = 0;
  for (size_t i = 0; i < fmt.size();) {
    const char c = fmt[i];
    if (c == '}') {
      if (i + 1 < fmt.size() && fmt[i + 1] == '}') {
        out += '}';
        i += 2;
        continue;
      }
      in.fail("Single '}' encountered in format string");
    }
    if (c != '{') {
      out += c;
      ++i;
      continue;
    }
    if (i + 1 < fmt.size() && fmt[i + 1] == '{') {
      out += '{';
      i += 2;
      continue;
    }
    const size_t close = fmt.find('}', i + 1);
    if (close == std::string::npos) in.fail("Single '{' encountered in format string");
    std::string field = fmt.substr(i + 1, close - i - 1);
    i = close + 1;
    std::string spec, conv;
    if (const size_t colon = field.find(':'); colon != std::string::npos) {
      spec = field.substr(colon + 1);
      field.resize(colon);
    }
    if (const size_t bang = field.find('!'); bang != std::string::npos) {
      conv = field.substr(bang + 1);
      field.resize(bang);
    }
    Value v;
    if (field.empty()) {
      if (auto_index >= args.pos.size()) in.fail("Replacement index " + std::to_string(auto_index) + " out of range for positional args tuple");
      v = args.pos[auto_index++];
    } else if (std::all_of(field.begin(), field.end(), [](char ch) { return ch >= '0' && ch <= '9'; })) {
      const size_t k = field.size() < 10 ? std::stoul(field) : SIZE_MAX;
      if (k >= args.pos.size()) in.fail("Replacement index " + field + " out of range for positional args tuple");
      v = args.pos[k];
    } else {
      const auto it = std::find_if(args.kw.begin(), args.kw.end(), [&](const auto& kv) { return kv.first == field; });
      if (it == args.kw.end()) in.fail("format(): missing keyword argument '" + field + "'");
      v = it->second;
    }
    if (conv == "r" || conv == "a") v = Value(to_repr(v, in.budget()));
    else if (conv == "s") v = Value(str_of(in, v));
    else if (!conv.empty()) in.fail("Unknown conversion specifier " + conv);
    out += format_one(in, v, spec);
    in.budget().check_bytes(out.size());
  }
  return out;
}

std::string percent_format(Interp& in, const std::string& fmt, const Value& args) {
  std::vector<Value> pos;
  const Value* mapping = nullptr;
  if (args.is_tuple()) pos = args.items();
  else if (args.is_dict()) mapping = &args;
  if (!args.is_tuple()) pos.push_back(args);
  size_t next = 0;
  bool used_mapping = false;
  std::string out;
  for (size_t i = 0; i < fmt.size();) {
    if (fmt[i] != '%') {
      out += fmt[i++];
      continue;
    }
    ++i;
    if (i >= fmt.size()) in.fail("incomplete format");
    Value v;
    bool have = false;
    if (fmt[i] == '(') {
      const size_t close = fmt.find(')', i);
      if (close == std::string::npos) in.fail("incomplete format key");
      if (mapping == nullptr) in.fail("format requires a mapping");
      const Value* found = mapping->dict_obj().find(std::string_view(fmt).substr(i + 1, close - i - 1));
      if (found == nullptr) in.fail("KeyError: '" + fmt.substr(i + 1, close - i - 1) + "'");
      v = *found;
      have = true;
      used_mapping = true;
      i = close + 1;
    }
    std::string flags;
    while (i < fmt.size() && std::string_view("-+ #0").find(fmt[i]) != std::string_view::npos) flags += fmt[i++];
    std::string width, precision;
    auto star = [&]() {
      if (next >= pos.size()) in.fail("not enough arguments for format string");
      return std::to_string(need_int(in, pos[next++], "* width"));
    };
    if (i < fmt.size() && fmt[i] == '*') width = star(), ++i;
    while (i < fmt.size() && fmt[i] >= '0' && fmt[i] <= '9' && width.size() < 6) width += fmt[i++];
    if (i < fmt.size() && fmt[i] == '.') {
      ++i;
      precision = "0";
      if (i < fmt.size() && fmt[i] == '*') precision = star(), ++i;
      else {
        precision.clear();
        while (i < fmt.size() && fmt[i] >= '0' && fmt[i] <= '9' && precision.size() < 4) precision += fmt[i++];
        if (precision.empty()) precision = "0";
      }
    }
    while (i < fmt.size() && (fmt[i] == 'h' || fmt[i] == 'l' || fmt[i] == 'L')) ++i;
    if (i >= fmt.size()) in.fail("incomplete format");
    const char conv = fmt[i++];
    if (conv == '%') {
      out += '%';
      continue;
    }
    if (!have) {
      if (next >= pos.size()) in.fail("not enough arguments for format string");
      v = pos[next++];
    }
    const int64_t w = width.empty() ? 0 : std::stoll(width);
    in.budget().check_bytes(static_cast<size_t>(std::llabs(w)));
    std::string spec;  // the same request in format-spec terms
    const bool left = flags.find('-') != std::string::npos;
    if (flags.find('0') != std::string::npos && !left && conv != 's' && conv != 'r' && conv != 'a') spec += "0";
    std::string piece;
    switch (conv) {
      case 's': piece = str_of(in, v); break;
      case 'r':
      case 'a': piece = to_repr(v, in.budget()); break;
      case 'd':
      case 'i':
      case 'u':
      case 'x':
      case 'X':
      case 'o':
      case 'c':
      case 'f':
      case 'F':
      case 'e':
      case 'E':
      case 'g':
      case 'G': {
        in.require_defined(v);
        if (!v.is_number()) in.fail(std::string("%") + conv + " format: a number is required, not " + v.type_name());
        Value num = v;
        std::string t(1, conv);
        if (conv == 'd' || conv == 'i' || conv == 'u') {
          t = "d";
          if (v.is_float()) {
            const double d = std::trunc(v.as_double());
            if (!(d >= -9.2e18 && d <= 9.2e18)) in.fail("cannot convert float to integer");
            num = Value(static_cast<int64_t>(d));
          }
        } else if ((conv == 'x' || conv == 'X' || conv == 'o' || conv == 'c') && v.is_float()) {
          in.fail(std::string("%") + conv + " format: an integer is required, not float");
        }
        std::string s = flags.find('+') != std::string::npos ? "+" : (flags.find(' ') != std::string::npos ? " " : "");
        s += flags.find('#') != std::string::npos ? "#" : "";
        s += spec;
        if (!precision.empty() && t != "d" && t != "x" && t != "X" && t != "o" && t != "c") s += "." + precision;
        s += t;
        if (!num.is_float() && (t == "f" || t == "F" || t == "e" || t == "E" || t == "g" || t == "G")) num = Value(num.as_double());
        piece = format_one(in, num, s);
        break;
      }
      default: in.fail(std::string("unsupported format character '") + conv + "'");
    }
    if ((conv == 's' || conv == 'r' || conv == 'a') && !precision.empty()) {
      const std::vector<std::string_view> chars = utf8_chars(piece);
      std::string cut;
      for (size_t k = 0; k < chars.size() && k < std::stoul(precision); ++k) cut += chars[k];
      piece = cut;
    }
    const auto len = static_cast<int64_t>(utf8_length(piece));
    if (w > len) {
      const std::string pad(static_cast<size_t>(w - len), spec == "0" && conv != 's' ? '0' : ' ');
      if (left) piece += std::string(static_cast<size_t>(w - len), ' ');
      else if (pad[0] == '0') {
        const size_t sign_len = (!piece.empty() && (piece[0] == '-' || piece[0] == '+' || piece[0] == ' ')) ? 1 : 0;
        piece = piece.substr(0, sign_len) + pad + piece.substr(sign_len);
      } else {
        piece = pad + piece;
      }
    }
    out += piece;
    in.budget().check_bytes(out.size());
  }
  // Python only checks that a tuple (or a lone non-container value) was used up.
  const bool container = args.is_dict() || (args.is_list() && !args.is_tuple());
  if (!used_mapping && !container && next < pos.size()) in.fail("not all arguments converted during string formatting");
  return out;
}

bool has_method(const Value& self, std::string_view name) {
  switch (self.kind()) {
    case Value::Kind::String: return in_list(kStrMethods, name);
    case Value::Kind::List:
      if (self.flavor() == SeqFlavor::List) return in_list(kListMethods, name);
      return self.is_tuple() && (name == "index" || name == "count");
    case Value::Kind::Dict: return in_list(kDictMethods, name);
    default: return false;
  }
}

Value call_method(Interp& in, const Value& self, std::string_view name, CallArgs& args) {
  if (self.is_string()) return call_str_method(in, self.str(), name, args);
  if (self.is_list()) {
    if (name == "index" || name == "count") {
      ArgBinder a(in, name, args, {"value"});
      if (!a.has(0)) in.fail(std::string(name) + "() takes one argument");
      int64_t n = 0;
      for (size_t i = 0; i < self.items().size(); ++i) {
        if (!equals(self.items()[i], *a.get(0), in.budget())) continue;
        if (name == "index") return Value(static_cast<int64_t>(i));
        ++n;
      }
      if (name == "index") in.fail("value is not in list");
      return Value(n);
    }
    immutable(in, self, name);
  }
  if (self.is_dict()) {
    const DictObj& d = self.dict_obj();
    if (name == "items" || name == "keys" || name == "values") {
      ArgBinder a(in, name, args, {});
      std::vector<Value> out;
      out.reserve(d.items.size());
      for (const auto& [k, v] : d.items) {
        if (name == "items") out.push_back(Value::list({k, v}, true));
        else out.push_back(name == "keys" ? k : v);
      }
      return in.make_seq(std::move(out), name == "items"  ? SeqFlavor::DictItems
                                         : name == "keys" ? SeqFlavor::DictKeys
                                                          : SeqFlavor::DictValues);
    }
    if (name == "get") {
      ArgBinder a(in, name, args, {"key", "default"});
      if (!a.has(0)) in.fail("get() takes at least one argument");
      const Value* v = d.find(*a.get(0));
      return v != nullptr ? *v : a.value_or(1, Value::none());
    }
    if (name == "copy") {
      ArgBinder a(in, name, args, {});
      return self;
    }
    immutable(in, self, name);
  }
  in.fail("'" + self.type_name() + " object' has no attribute '" + std::string(name) + "'");
}

void add_globals(Frame& root) {
  auto add = [&](const char* name, Builtin::Fn fn) { root.set(name, Value::object(std::make_shared<Builtin>(name, fn))); };
  add("range", g_range);
  add("namespace", g_namespace);
  add("dict", g_dict);
  add("joiner", g_joiner);
  add("raise_exception", g_raise_exception);
  add("strftime_now", g_strftime_now);
}

}  // namespace kestrel::jinja
