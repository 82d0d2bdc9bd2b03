#include "template/jinja.h"

#include "template/jinja_ast.h"
#include "template/jinja_interp.h"
#include "template/jinja_lexer.h"
#include "template/jinja_parser.h"

namespace kestrel::jinja {

TemplateError::TemplateError(Kind kind, const std::string& message, int line, int column)
    : kestrel::Error(message), kind_(kind), line_(line), column_(column) {}

Template Template::parse(std::string_view source) {
  LexResult lexed = lex(source);
  auto body = std::make_shared<detail::TemplateBody>();
  body->statements = parse_template(lexed);
  body->source = std::move(lexed.source);
  Template t;
  t.body_ = std::move(body);
  return t;
}

namespace {

template <class Json>
std::string render_json(const detail::TemplateBody& body, const Json& context, const RenderOptions& options) {
  if (!context.is_null() && !context.is_object()) {
    throw TemplateError(TemplateError::Kind::Runtime, "the template context must be a JSON object");
  }
  const Value ctx = context.is_null() ? Value::dict({}) : from_json(context);
  Interp interp(options);
  return interp.render(body.statements, ctx);
}

}  // namespace

std::string Template::render(const nlohmann::json& context, const RenderOptions& options) const {
  return render_json(*body_, context, options);
}

std::string Template::render(const nlohmann::ordered_json& context, const RenderOptions& options) const {
  return render_json(*body_, context, options);
}

}  // namespace kestrel::jinja
