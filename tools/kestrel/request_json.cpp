// The request body's JSON parser (a SAX handler that enforces JsonLimits while it reads) and the
// short form of a JSON value that error messages quote.
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "openai_request.h"

namespace kestrel::cli {

using json = RequestJson;

namespace {

// A SAX handler for nlohmann::basic_json::sax_parse that enforces JsonLimits as the events arrive
// and builds the value in time linear in the text: objects of J = ordered_json append their keys
// (a hash index per open object finds a repeated key) instead of ordered_map's scan of every key.
// A repeated key keeps its first place and its last value, as nlohmann's own parser does.
template <typename J>
class BoundedBuilder {
 public:
  using string_t = typename J::string_t;
  using number_integer_t = typename J::number_integer_t;
  using number_unsigned_t = typename J::number_unsigned_t;
  using number_float_t = typename J::number_float_t;
  using binary_t = typename J::binary_t;
  static constexpr bool kOrdered = std::is_same_v<J, nlohmann::ordered_json>;

  BoundedBuilder(const JsonLimits& limits, std::string subject, std::string param)
      : limits_(limits), subject_(std::move(subject)), param_(std::move(param)) {}

  J& result() { return root_; }
  // The parser's own message when the text is not JSON; empty when it is.
  const std::string& syntax_error() const { return syntax_error_; }

  bool null() { return put(J(nullptr)); }
  bool boolean(bool v) { return put(J(v)); }
  bool number_integer(number_integer_t v) { return put(J(v)); }
  bool number_unsigned(number_unsigned_t v) { return put(J(v)); }
  bool number_float(number_float_t v, const string_t&) { return put(J(v)); }
  bool string(string_t& v) { return put(J(std::move(v))); }
  bool binary(binary_t& v) { return put(J::binary(std::move(v))); }
  bool start_object(std::size_t) { return open(J::object()); }
  bool start_array(std::size_t) { return open(J::array()); }
  bool end_object() {
    if constexpr (kOrdered) key_index_.pop_back();
    open_.pop_back();
    return true;
  }
  bool end_array() {
    open_.pop_back();
    return true;
  }
  bool key(string_t& k) {
    if (++n_keys_ > limits_.max_keys)
      fail(" has more than " + std::to_string(limits_.max_keys) + " object keys (the key limit)");
    auto& obj = open_.back()->template get_ref<typename J::object_t&>();
    if constexpr (kOrdered) {
      const auto [it, added] = key_index_.back().try_emplace(k, obj.size());
      if (added) obj.emplace_back(std::move(k), J());  // the vector's append: no scan for the key
      slot_ = &(obj.begin() + static_cast<std::ptrdiff_t>(it->second))->second;
    } else {
      slot_ = &obj[std::move(k)];  // std::map: O(log n); a repeated key's last value wins
    }
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) {
    syntax_error_ = e.what();
    return false;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const { throw RequestError(param_, subject_ + what); }

  void count_value() {
    if (++n_values_ > limits_.max_values)
      fail(" has more than " + std::to_string(limits_.max_values) + " JSON values (the value limit)");
  }

  // Places v where the text puts it: the root, the next array element, or the last key's value.
  J* place(J&& v) {
    if (open_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    J& parent = *open_.back();
    if (parent.is_array()) {
      auto& items = parent.template get_ref<typename J::array_t&>();
      items.push_back(std::move(v));
      return &items.back();
    }
    *slot_ = std::move(v);
    return slot_;
  }

  bool put(J&& v) {
    count_value();
    place(std::move(v));
    return true;
  }

  bool open(J&& container) {
    if (open_.size() >= static_cast<size_t>(limits_.max_depth))
      fail(" nests arrays and objects deeper than " + std::to_string(limits_.max_depth) +
           " levels (the nesting limit)");
    count_value();
    const bool is_object = container.is_object();
    open_.push_back(place(std::move(container)));
    if constexpr (kOrdered)
      if (is_object) key_index_.emplace_back();
    return true;
  }

  const JsonLimits& limits_;
  std::string subject_, param_;
  J root_;
  std::vector<J*> open_;  // the containers being filled, outermost first
  J* slot_ = nullptr;     // the value of the key just read
  std::vector<std::unordered_map<std::string, size_t>> key_index_;  // ordered: key -> place, per open object
  size_t n_keys_ = 0, n_values_ = 0;
  std::string syntax_error_;
};
}  // namespace

std::string shown(const json& v) {
  constexpr size_t kMax = 60;
  // Strings longer than this cannot change the first kMax characters of the result.
  constexpr size_t kStringCut = kMax + 4;
  std::string s;
  const auto put_string = [&s](const std::string& str) {
    s += json(str.substr(0, kStringCut)).dump(-1, ' ', false, json::error_handler_t::replace);
  };
  // An explicit stack of the containers being written, so depth costs heap, not call stack, and
  // writing stops once the text is long enough to be cut.
  struct Frame {
    const json* container;
    json::const_iterator next;
  };
  std::vector<Frame> open;
  const auto put = [&](const json& x) {
    if (x.is_object() || x.is_array()) {
      s += x.is_object() ? '{' : '[';
      open.push_back({&x, x.cbegin()});
    } else if (x.is_string()) {
      put_string(x.get_ref<const std::string&>());
    } else {
      s += x.dump();
    }
  };
  put(v);
  while (!open.empty() && s.size() <= kMax) {
    Frame& f = open.back();
    if (f.next == f.container->cend()) {
      s += f.container->is_object() ? '}' : ']';
      open.pop_back();
      continue;
    }
    if (f.next != f.container->cbegin()) s += ',';
    const json& item = *f.next;
    if (f.container->is_object()) {
      put_string(f.next.key());
      s += ':';
    }
    ++f.next;
    put(item);  // may grow `open`: f is not used after this
  }
  if (s.size() > kMax) {
    size_t n = kMax - 3;
    while (n > 0 && (static_cast<unsigned char>(s[n]) & 0xC0) == 0x80) --n;
    s = s.substr(0, n) + "...";
  }
  return s;
}

RequestJson parse_request_body(std::string_view body, const JsonLimits& limits) {
  // nlohmann's lexer takes a NUL byte for the end of input, which would drop whatever follows it;
  // JSON text has no raw NUL anywhere (inside strings it must be escaped).
  if (const size_t nul = body.find('\0'); nul != std::string_view::npos)
    throw RequestError("", "invalid JSON body: a NUL byte at offset " + std::to_string(nul));
  BoundedBuilder<RequestJson> builder(limits, "the request body", "");
  // Rejects invalid UTF-8 and unpaired surrogates too.
  if (!RequestJson::sax_parse(body.begin(), body.end(), &builder))
    throw RequestError("", "invalid JSON body: " + builder.syntax_error());
  return std::move(builder.result());
}

std::optional<Json> parse_ordered_json(std::string_view text, const std::string& param, const std::string& subject,
                                       const JsonLimits& limits) {
  if (text.find('\0') != std::string_view::npos) return std::nullopt;  // see parse_request_body
  BoundedBuilder<Json> builder(limits, subject, param);
  if (!Json::sax_parse(text.begin(), text.end(), &builder)) return std::nullopt;
  return std::move(builder.result());
}

}  // namespace kestrel::cli
