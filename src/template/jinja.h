// A Jinja template engine for chat templates (tokenizer.chat_template in GGUF metadata,
// "chat_template" in tokenizer_config.json).
//
// The language is Jinja2's as Hugging Face transformers renders chat templates: an immutable
// sandbox (lists and dicts cannot be changed; namespace() objects can), trim_blocks and
// lstrip_blocks on, the loopcontrols extension ({% break %}, {% continue %}) and transformers'
// {% generation %} block, undefined variables printing as "" (Jinja's default Undefined; reading
// an attribute of an undefined value gives undefined instead of failing), no autoescape.
// Semantics follow the Jinja2 documentation and Python's behaviour for the values involved
// (str, int, float, list, dict, tuple). What is not supported is listed in docs/jinja.md.
//
// Templates are untrusted input: parsing and rendering never crash, recursion is bounded, and
// output size, value size and the amount of work per render are limited (RenderLimits); every
// failure is a TemplateError.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace kestrel::jinja {

class TemplateError : public kestrel::Error {
 public:
  enum class Kind {
    Syntax,   // the template does not parse
    Runtime,  // type errors, undefined functions or methods, bad arguments
    Raised,   // the template called raise_exception(message): what() is exactly that message
    Limit,    // a RenderLimits bound was reached
  };
  // line and column are 1-based (columns count characters); 0 when unknown.
  TemplateError(Kind kind, const std::string& message, int line = 0, int column = 0);

  Kind kind() const { return kind_; }
  int line() const { return line_; }
  int column() const { return column_; }

 private:
  Kind kind_;
  int line_;
  int column_;
};

// Bounds for one render. The defaults are far above what real chat templates need.
struct RenderLimits {
  size_t max_output_bytes = size_t{64} << 20;  // the rendered text; also any one string value
  size_t max_list_items = size_t{1} << 20;     // any one list or dict
  int max_call_depth = 64;                     // nested macro calls
  // Work units: one per node evaluated, statement run or loop iteration, plus one per 64 bytes
  // or per element of every string or list built or scanned. Real chat templates need about
  // 100 units per message; 5e7 units are about a second of CPU (measured: a tree of macro calls
  // with no output runs 4e7 units per second on one core).
  uint64_t max_work = 50'000'000;
};

struct RenderOptions {
  RenderLimits limits;
  // The time strftime_now() formats (local time zone); the current time when unset.
  std::optional<std::chrono::system_clock::time_point> now;
};

namespace detail {
struct TemplateBody;  // the parsed statements (jinja_ast.h)
}

// Immutable once parsed: copies share the parsed body, and renders may run on several threads.
class Template {
 public:
  // Parses once. Errors: TemplateError (Syntax) with line and column.
  static Template parse(std::string_view source);

  // Renders with the given variables (a JSON object; null means no variables). Objects keep their
  // key order with ordered_json (Python dicts are ordered: tojson and items() follow it); with
  // json they come sorted. Globals available besides the context: range, namespace, dict,
  // raise_exception, strftime_now. Errors: TemplateError (Runtime, Raised or Limit).
  std::string render(const nlohmann::json& context, const RenderOptions& options = {}) const;
  std::string render(const nlohmann::ordered_json& context, const RenderOptions& options = {}) const;

 private:
  Template() = default;  // only parse() makes one: a Template always holds a parsed body
  std::shared_ptr<const detail::TemplateBody> body_;
};

}  // namespace kestrel::jinja
