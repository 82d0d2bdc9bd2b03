#include "template/jinja_parser.h"

#include <algorithm>
#include <initializer_list>

#include "template/jinja.h"

namespace kestrel::jinja {

namespace {

// Nesting of parentheses, brackets, unary operators and blocks the recursive parser follows.
constexpr int kMaxParseNesting = 64;

class Parser {
 public:
  explicit Parser(const LexResult& lexed) : toks_(lexed.tokens), map_(lexed.source) {}

  StmtList parse_all() {
    StmtList body = parse_body({}, nullptr);
    return body;
  }

 private:
  const std::vector<Token>& toks_;
  SourceMap map_;
  size_t pos_ = 0;
  int nesting_ = 0;
  int loop_depth_ = 0;  // for break/continue
  // Open blocks, innermost last, for "expected 'endif'" messages: (tag, offset).
  std::vector<std::pair<std::string, size_t>> open_blocks_;

  struct NestGuard {
    Parser& p;
    NestGuard(Parser& parser, const Token& at) : p(parser) {
      if (++p.nesting_ > kMaxParseNesting) p.fail(at, "template nested too deeply (more than " + std::to_string(kMaxParseNesting) + " levels)");
    }
    ~NestGuard() { --p.nesting_; }
  };

  // ---- tokens ----

  const Token& peek(size_t k = 0) const { return toks_[std::min(pos_ + k, toks_.size() - 1)]; }
  const Token& next() {
    const Token& t = toks_[pos_];
    if (pos_ + 1 < toks_.size()) ++pos_;
    return t;
  }
  bool at_op(std::string_view op, size_t k = 0) const {
    const Token& t = peek(k);
    return t.type == TokenType::Op && t.text == op;
  }
  bool at_name(std::string_view name, size_t k = 0) const {
    const Token& t = peek(k);
    return t.type == TokenType::Name && t.text == name;
  }
  bool skip_op(std::string_view op) {
    if (!at_op(op)) return false;
    next();
    return true;
  }
  bool skip_name(std::string_view name) {
    if (!at_name(name)) return false;
    next();
    return true;
  }

  static std::string describe(const Token& t) {
    switch (t.type) {
      case TokenType::Text: return "template text";
      case TokenType::VarBegin: return "'{{'";
      case TokenType::VarEnd: return "'}}'";
      case TokenType::BlockBegin: return "'{%'";
      case TokenType::BlockEnd: return "'%}'";
      case TokenType::Name: return "'" + t.text + "'";
      case TokenType::String: return "string literal";
      case TokenType::Int: return "integer literal";
      case TokenType::Float: return "float literal";
      case TokenType::Op: return "'" + t.text + "'";
      case TokenType::End: return "end of template";
    }
    return "?";
  }

  [[noreturn]] void fail(const Token& at, const std::string& msg) const { fail_at(at.offset, msg); }
  [[noreturn]] void fail_at(size_t offset, const std::string& msg) const {
    int line = 0, col = 0;
    map_.locate(offset, &line, &col);
    throw TemplateError(TemplateError::Kind::Syntax,
                        "template syntax error at line " + std::to_string(line) + ", column " + std::to_string(col) + ": " + msg,
                        line, col);
  }

  void expect_op(std::string_view op) {
    if (!at_op(op)) fail(peek(), "expected '" + std::string(op) + "', got " + describe(peek()));
    next();
  }
  std::string expect_name(const char* what) {
    if (peek().type != TokenType::Name) fail(peek(), std::string("expected ") + what + ", got " + describe(peek()));
    return next().text;
  }
  void expect_block_end() {
    if (peek().type != TokenType::BlockEnd) fail(peek(), "expected '%}', got " + describe(peek()));
    next();
  }

  // ---- nodes ----

  ExprPtr node(ExprKind kind, const Token& at) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    map_.locate(at.offset, &e->line, &e->column);
    return e;
  }
  // Sets the depth from the children; refuses trees deeper than kMaxAstDepth.
  ExprPtr finish(ExprPtr e) {
    int d = 0;
    for (const ExprPtr* c : {&e->a, &e->b, &e->c}) {
      if (*c) d = std::max(d, (*c)->depth);
    }
    for (const ExprPtr& c : e->args) {
      if (c) d = std::max(d, c->depth);
    }
    for (const auto& kv : e->kwargs) d = std::max(d, kv.second->depth);
    e->depth = d + 1;
    if (e->depth > kMaxAstDepth) {
      throw TemplateError(TemplateError::Kind::Syntax,
                          "template syntax error at line " + std::to_string(e->line) + ", column " +
                              std::to_string(e->column) + ": expression nested too deeply (more than " +
                              std::to_string(kMaxAstDepth) + " levels)",
                          e->line, e->column);
    }
    return e;
  }

  StmtPtr stmt(StmtKind kind, const Token& at) {
    auto s = std::make_unique<Stmt>();
    s->kind = kind;
    map_.locate(at.offset, &s->line, &s->column);
    return s;
  }

  // ---- statements ----

  // Statements until one of end_tags opens a block tag; that tag's name is consumed and stored in
  // *which (the rest of its tag is left to the caller). With no end tags, until the end.
  StmtList parse_body(std::initializer_list<std::string_view> end_tags, std::string* which) {
    StmtList out;
    while (true) {
      const Token& t = peek();
      switch (t.type) {
        case TokenType::End:
          if (end_tags.size() == 0) return out;
          {
            std::string want;
            for (std::string_view e : end_tags) want += (want.empty() ? "'" : " or '") + std::string(e) + "'";
            int line = 0, col = 0;
            map_.locate(open_blocks_.back().second, &line, &col);
            fail(t, "unexpected end of template: expected " + want + " to close the '" + open_blocks_.back().first +
                        "' at line " + std::to_string(line) + ", column " + std::to_string(col));
          }
        case TokenType::Text: {
          auto s = stmt(StmtKind::Text, t);
          s->text = t.text;
          out.push_back(std::move(s));
          next();
          break;
        }
        case TokenType::VarBegin: {
          next();
          auto s = stmt(StmtKind::Output, t);
          s->expr = parse_tuple(true);
          if (peek().type != TokenType::VarEnd) fail(peek(), "expected '}}', got " + describe(peek()));
          next();
          out.push_back(std::move(s));
          break;
        }
        case TokenType::BlockBegin: {
          const Token& tag = peek(1);
          if (tag.type == TokenType::Name &&
              std::find(end_tags.begin(), end_tags.end(), tag.text) != end_tags.end()) {
            next();
            *which = next().text;
            return out;
          }
          next();
          out.push_back(parse_statement(t));
          break;
        }
        default: fail(t, "unexpected " + describe(t));
      }
    }
  }

  StmtList parse_block(const Token& at, const std::string& tag, std::initializer_list<std::string_view> ends,
                       std::string* which) {
    NestGuard guard(*this, at);
    open_blocks_.emplace_back(tag, at.offset);
    StmtList body = parse_body(ends, which);
    open_blocks_.pop_back();
    return body;
  }

  StmtPtr parse_statement(const Token& begin) {
    const Token& tag = peek();
    if (tag.type != TokenType::Name) fail(tag, "expected a tag name, got " + describe(tag));
    const std::string name = next().text;
    if (name == "if") return parse_if(begin);
    if (name == "for") return parse_for(begin);
    if (name == "set") return parse_set(begin);
    if (name == "macro") return parse_macro(begin);
    if (name == "call") return parse_call_block(begin);
    if (name == "filter") return parse_filter_block(begin);
    if (name == "with") return parse_with(begin);
    if (name == "break" || name == "continue") {
      if (loop_depth_ == 0) fail(tag, "'" + name + "' outside of a loop");
      expect_block_end();
      return stmt(name == "break" ? StmtKind::Break : StmtKind::Continue, begin);
    }
    if (name == "generation" || name == "block") {
      auto s = stmt(StmtKind::Scope, begin);
      if (name == "block") expect_name("a block name");
      expect_block_end();
      std::string which;
      const std::string end = "end" + name;
      s->body = parse_block(begin, name, {end}, &which);
      if (name == "block" && peek().type == TokenType::Name) next();  // {% endblock name %}
      expect_block_end();
      return s;
    }
    if (name == "extends" || name == "include" || name == "import" || name == "from") {
      fail(tag, "'" + name + "' is not supported: chat templates are rendered on their own");
    }
    if (name.rfind("end", 0) == 0 || name == "elif" || name == "else") {
      fail(tag, "unexpected '" + name + "'" +
                    (open_blocks_.empty() ? std::string() : " (the innermost open block is '" + open_blocks_.back().first + "')"));
    }
    fail(tag, "unknown tag '" + name + "'");
  }

  StmtPtr parse_if(const Token& begin) {
    auto s = stmt(StmtKind::If, begin);
    ExprPtr cond = parse_tuple(false);
    expect_block_end();
    while (true) {
      std::string which;
      StmtList body = parse_block(begin, "if", {"elif", "else", "endif"}, &which);
      s->branches.emplace_back(std::move(cond), std::move(body));
      if (which == "elif") {
        cond = parse_tuple(false);
        expect_block_end();
        continue;
      }
      if (which == "else") {
        expect_block_end();
        s->else_body = parse_block(begin, "if", {"endif"}, &which);
      }
      expect_block_end();
      return s;
    }
  }

  // Names for "for a, b in" / "set a, b =" / "with a =": one name or a tuple of names.
  std::vector<std::string> parse_targets(bool allow_tuple) {
    std::vector<std::string> names;
    const bool paren = allow_tuple && skip_op("(");
    names.push_back(expect_name("a variable name"));
    while (allow_tuple && at_op(",")) {
      next();
      if (peek().type != TokenType::Name) break;
      names.push_back(next().text);
    }
    if (paren) expect_op(")");
    for (const std::string& n : names) {
      if (n == "true" || n == "false" || n == "none" || n == "True" || n == "False" || n == "None") {
        fail(peek(), "cannot assign to '" + n + "'");
      }
    }
    return names;
  }

  StmtPtr parse_for(const Token& begin) {
    auto s = stmt(StmtKind::For, begin);
    s->targets = parse_targets(true);
    if (!skip_name("in")) fail(peek(), "expected 'in' in the for tag, got " + describe(peek()));
    s->expr = parse_tuple(false);
    if (skip_name("if")) s->cond = parse_expression(true);
    if (at_name("recursive")) fail(peek(), "recursive for loops are not supported");
    expect_block_end();
    std::string which;
    ++loop_depth_;
    s->body = parse_block(begin, "for", {"else", "endfor"}, &which);
    --loop_depth_;
    if (which == "else") {
      expect_block_end();
      const int saved = loop_depth_;
      loop_depth_ = 0;  // break in the else block would leave an outer loop: Jinja refuses it
      s->else_body = parse_block(begin, "for", {"endfor"}, &which);
      loop_depth_ = saved;
    }
    expect_block_end();
    return s;
  }

  StmtPtr parse_set(const Token& begin) {
    const Token& at = peek();
    if (at.type == TokenType::Name && at_op(".", 1)) {
      auto s = stmt(StmtKind::Set, begin);
      s->targets.push_back(next().text);
      next();
      s->attr = expect_name("an attribute name");
      expect_op("=");
      s->expr = parse_tuple(true);
      expect_block_end();
      return s;
    }
    std::vector<std::string> targets = parse_targets(true);
    if (skip_op("=")) {
      auto s = stmt(StmtKind::Set, begin);
      s->targets = std::move(targets);
      s->expr = parse_tuple(true);
      expect_block_end();
      return s;
    }
    if (targets.size() != 1) fail(peek(), "a block set assigns one name");
    auto s = stmt(StmtKind::SetBlock, begin);
    s->targets = std::move(targets);
    if (skip_op("|")) s->filters = parse_filter_chain();
    expect_block_end();
    std::string which;
    s->body = parse_block(begin, "set", {"endset"}, &which);
    expect_block_end();
    return s;
  }

  std::vector<Param> parse_params() {
    std::vector<Param> params;
    expect_op("(");
    while (!at_op(")")) {
      Param p;
      p.name = expect_name("a parameter name");
      if (skip_op("=")) p.default_value = parse_expression(true);
      params.push_back(std::move(p));
      if (!skip_op(",")) break;
    }
    expect_op(")");
    return params;
  }

  StmtPtr parse_macro(const Token& begin) {
    auto s = stmt(StmtKind::Macro, begin);
    s->name = expect_name("a macro name");
    s->params = parse_params();
    expect_block_end();
    std::string which;
    const int saved = loop_depth_;
    loop_depth_ = 0;
    s->body = parse_block(begin, "macro", {"endmacro"}, &which);
    loop_depth_ = saved;
    if (peek().type == TokenType::Name) next();  // {% endmacro name %}
    expect_block_end();
    return s;
  }

  StmtPtr parse_call_block(const Token& begin) {
    auto s = stmt(StmtKind::CallBlock, begin);
    if (at_op("(")) s->params = parse_params();
    s->expr = parse_expression(true);
    if (s->expr->kind != ExprKind::Call) fail(begin, "expected a call in the call tag");
    expect_block_end();
    std::string which;
    const int saved = loop_depth_;
    loop_depth_ = 0;
    s->body = parse_block(begin, "call", {"endcall"}, &which);
    loop_depth_ = saved;
    expect_block_end();
    return s;
  }

  StmtPtr parse_filter_block(const Token& begin) {
    auto s = stmt(StmtKind::FilterBlock, begin);
    s->filters = parse_filter_chain();
    expect_block_end();
    std::string which;
    s->body = parse_block(begin, "filter", {"endfilter"}, &which);
    expect_block_end();
    return s;
  }

  StmtPtr parse_with(const Token& begin) {
    auto s = stmt(StmtKind::With, begin);
    while (peek().type != TokenType::BlockEnd) {
      if (!s->targets.empty()) expect_op(",");
      s->targets.push_back(expect_name("a variable name"));
      expect_op("=");
      s->values.push_back(parse_expression(true));
    }
    expect_block_end();
    std::string which;
    s->body = parse_block(begin, "with", {"endwith"}, &which);
    expect_block_end();
    return s;
  }

  // "f1(args) | f2 | ..." after the first "|" (or at a filter block's start).
  std::vector<ExprPtr> parse_filter_chain() {
    std::vector<ExprPtr> out;
    do {
      out.push_back(parse_filter(nullptr));
    } while (skip_op("|"));
    return out;
  }

  // ---- expressions ----

  // Can the current token start an expression? (for trailing commas)
  bool at_expression_start() const {
    const Token& t = peek();
    switch (t.type) {
      case TokenType::Name:
      case TokenType::String:
      case TokenType::Int:
      case TokenType::Float: return true;
      case TokenType::Op: return t.text == "(" || t.text == "[" || t.text == "{" || t.text == "-" || t.text == "+";
      default: return false;
    }
  }

  ExprPtr parse_tuple(bool with_cond) {
    const Token& at = peek();
    ExprPtr first = parse_expression(with_cond);
    if (!at_op(",")) return first;
    auto t = node(ExprKind::Tuple, at);
    t->args.push_back(std::move(first));
    while (skip_op(",")) {
      if (!at_expression_start()) break;
      t->args.push_back(parse_expression(with_cond));
    }
    return finish(std::move(t));
  }

  ExprPtr parse_expression(bool with_cond) {
    const Token& at = peek();
    NestGuard guard(*this, at);
    ExprPtr e = parse_or();
    if (!with_cond) return e;
    while (at_name("if")) {
      next();
      auto c = node(ExprKind::Cond, at);
      c->a = std::move(e);
      c->b = parse_or();
      if (skip_name("else")) c->c = parse_expression(true);
      e = finish(std::move(c));
    }
    return e;
  }

  ExprPtr binary_node(ExprKind kind, const Token& at, ExprPtr a, ExprPtr b) {
    auto e = node(kind, at);
    e->a = std::move(a);
    e->b = std::move(b);
    return finish(std::move(e));
  }

  ExprPtr parse_or() {
    const Token& at = peek();
    ExprPtr e = parse_and();
    while (skip_name("or")) e = binary_node(ExprKind::Or, at, std::move(e), parse_and());
    return e;
  }

  ExprPtr parse_and() {
    const Token& at = peek();
    ExprPtr e = parse_not();
    while (skip_name("and")) e = binary_node(ExprKind::And, at, std::move(e), parse_not());
    return e;
  }

  ExprPtr parse_not() {
    const Token& at = peek();
    if (at_name("not")) {
      NestGuard guard(*this, at);
      next();
      auto e = node(ExprKind::Not, at);
      e->a = parse_not();
      return finish(std::move(e));
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
    const Token& at = peek();
    ExprPtr first = parse_math1();
    std::unique_ptr<Expr> cmp;
    while (true) {
      CmpOp op;
      if (at_op("==")) op = CmpOp::Eq;
      else if (at_op("!=")) op = CmpOp::Ne;
      else if (at_op("<")) op = CmpOp::Lt;
      else if (at_op("<=")) op = CmpOp::Le;
      else if (at_op(">")) op = CmpOp::Gt;
      else if (at_op(">=")) op = CmpOp::Ge;
      else if (at_name("in")) op = CmpOp::In;
      else if (at_name("not") && at_name("in", 1)) {
        next();
        op = CmpOp::NotIn;
      } else {
        break;
      }
      next();
      if (!cmp) {
        cmp = node(ExprKind::Compare, at);
        cmp->args.push_back(std::move(first));
      }
      cmp->ops.push_back(op);
      cmp->args.push_back(parse_math1());
    }
    return cmp ? finish(std::move(cmp)) : std::move(first);
  }

  ExprPtr arith(const Token& at, BinOp op, ExprPtr a, ExprPtr b) {
    auto e = node(ExprKind::Binary, at);
    e->bin_op = op;
    e->a = std::move(a);
    e->b = std::move(b);
    return finish(std::move(e));
  }

  ExprPtr parse_math1() {
    const Token& at = peek();
    ExprPtr e = parse_concat();
    while (at_op("+") || at_op("-")) {
      const BinOp op = next().text == "+" ? BinOp::Add : BinOp::Sub;
      e = arith(at, op, std::move(e), parse_concat());
    }
    return e;
  }

  ExprPtr parse_concat() {
    const Token& at = peek();
    ExprPtr first = parse_math2();
    if (!at_op("~")) return first;
    auto c = node(ExprKind::Concat, at);
    c->args.push_back(std::move(first));
    while (skip_op("~")) c->args.push_back(parse_math2());
    return finish(std::move(c));
  }

  ExprPtr parse_math2() {
    const Token& at = peek();
    ExprPtr e = parse_pow();
    while (at_op("*") || at_op("/") || at_op("//") || at_op("%")) {
      const std::string op = next().text;
      const BinOp b = op == "*" ? BinOp::Mul : op == "/" ? BinOp::Div : op == "//" ? BinOp::FloorDiv : BinOp::Mod;
      e = arith(at, b, std::move(e), parse_pow());
    }
    return e;
  }

  ExprPtr parse_pow() {
    const Token& at = peek();
    ExprPtr e = parse_unary(true);
    while (skip_op("**")) e = arith(at, BinOp::Pow, std::move(e), parse_unary(true));
    return e;
  }

  ExprPtr parse_unary(bool with_filter) {
    const Token& at = peek();
    ExprPtr e;
    if (at_op("-") || at_op("+")) {
      NestGuard guard(*this, at);
      const bool neg = next().text == "-";
      e = node(neg ? ExprKind::Neg : ExprKind::Pos, at);
      e->a = parse_unary(false);
      e = finish(std::move(e));
    } else {
      e = parse_primary();
    }
    e = parse_postfix(std::move(e));
    if (with_filter) e = parse_filter_expr(std::move(e));
    return e;
  }

  ExprPtr literal(const Token& at, Value v) {
    auto e = node(ExprKind::Literal, at);
    e->value = std::move(v);
    return e;
  }

  ExprPtr parse_primary() {
    const Token& t = peek();
    switch (t.type) {
      case TokenType::Name: {
        next();
        if (t.text == "true" || t.text == "True") return literal(t, Value(true));
        if (t.text == "false" || t.text == "False") return literal(t, Value(false));
        if (t.text == "none" || t.text == "None") return literal(t, Value::none());
        auto e = node(ExprKind::Name, t);
        e->name = t.text;
        return e;
      }
      case TokenType::String: {
        std::string s;
        while (peek().type == TokenType::String) s += next().text;  // 'a' 'b' is 'ab'
        return literal(t, Value(std::move(s)));
      }
      case TokenType::Int: next(); return literal(t, Value(t.int_value));
      case TokenType::Float: next(); return literal(t, Value(t.float_value));
      case TokenType::Op:
        if (t.text == "(") {
          next();
          if (skip_op(")")) {
            auto e = node(ExprKind::Tuple, t);
            return finish(std::move(e));
          }
          ExprPtr inner = parse_tuple(true);
          expect_op(")");
          return inner;
        }
        if (t.text == "[") {
          next();
          auto e = node(ExprKind::List, t);
          while (!at_op("]")) {
            e->args.push_back(parse_expression(true));
            if (!skip_op(",")) break;
          }
          expect_op("]");
          return finish(std::move(e));
        }
        if (t.text == "{") {
          next();
          auto e = node(ExprKind::Dict, t);
          while (!at_op("}")) {
            e->args.push_back(parse_expression(true));
            expect_op(":");
            e->args.push_back(parse_expression(true));
            if (!skip_op(",")) break;
          }
          expect_op("}");
          return finish(std::move(e));
        }
        break;
      default: break;
    }
    fail(t, "unexpected " + describe(t) + (t.type == TokenType::VarEnd || t.type == TokenType::BlockEnd ? ": expected an expression" : ""));
  }

  ExprPtr parse_postfix(ExprPtr e) {
    while (true) {
      const Token& at = peek();
      if (at_op(".")) {
        next();
        const Token& n = peek();
        if (n.type == TokenType::Name) {
          auto g = node(ExprKind::GetAttr, at);
          g->name = next().text;
          g->a = std::move(e);
          e = finish(std::move(g));
        } else if (n.type == TokenType::Int) {
          auto g = node(ExprKind::GetItem, at);
          g->a = std::move(e);
          g->b = literal(n, Value(next().int_value));
          e = finish(std::move(g));
        } else {
          fail(n, "expected an attribute name after '.', got " + describe(n));
        }
      } else if (at_op("[")) {
        next();
        e = parse_subscript(at, std::move(e));
      } else if (at_op("(")) {
        e = parse_call(std::move(e));
      } else {
        return e;
      }
    }
  }

  ExprPtr parse_subscript(const Token& at, ExprPtr subject) {
    NestGuard guard(*this, at);
    ExprPtr parts[3];
    int n_colons = 0;
    if (!at_op(":")) parts[0] = parse_expression(true);
    if (at_op(":")) {
      while (n_colons < 2 && skip_op(":")) {
        ++n_colons;
        if (!at_op(":") && !at_op("]")) parts[n_colons] = parse_expression(true);
      }
    }
    expect_op("]");
    if (n_colons == 0) {
      if (!parts[0]) fail(at, "empty subscript");
      auto g = node(ExprKind::GetItem, at);
      g->a = std::move(subject);
      g->b = std::move(parts[0]);
      return finish(std::move(g));
    }
    auto s = node(ExprKind::Slice, at);
    s->a = std::move(subject);
    for (ExprPtr& p : parts) s->args.push_back(std::move(p));
    return finish(std::move(s));
  }

  void parse_call_args(Expr& e) {
    expect_op("(");
    while (!at_op(")")) {
      if (at_op("*") || at_op("**")) fail(peek(), "*args and **kwargs in calls are not supported");
      if (peek().type == TokenType::Name && at_op("=", 1)) {
        std::string key = next().text;
        next();
        e.kwargs.emplace_back(std::move(key), parse_expression(true));
      } else {
        if (!e.kwargs.empty()) fail(peek(), "positional argument after keyword argument");
        e.args.push_back(parse_expression(true));
      }
      if (!skip_op(",")) break;
    }
    expect_op(")");
  }

  ExprPtr parse_call(ExprPtr callee) {
    const Token& at = peek();
    NestGuard guard(*this, at);
    auto c = node(ExprKind::Call, at);
    c->a = std::move(callee);
    parse_call_args(*c);
    return finish(std::move(c));
  }

  ExprPtr parse_filter(ExprPtr subject) {
    const Token& at = peek();
    std::string name = expect_name("a filter name");
    while (at_op(".") && peek(1).type == TokenType::Name) {
      next();
      name += "." + next().text;
    }
    if (!is_known_filter(name)) fail(at, "no filter named '" + name + "'");
    auto f = node(ExprKind::Filter, at);
    f->name = std::move(name);
    f->a = std::move(subject);
    if (at_op("(")) parse_call_args(*f);
    return finish(std::move(f));
  }

  ExprPtr parse_filter_expr(ExprPtr e) {
    while (true) {
      if (skip_op("|")) {
        e = parse_filter(std::move(e));
      } else if (at_name("is")) {
        const Token& at = next();
        auto t = node(ExprKind::Test, at);
        t->negated = skip_name("not");
        const Token& name_tok = peek();
        std::string name;
        if (name_tok.type != TokenType::Name) fail(name_tok, "expected a test name after 'is', got " + describe(name_tok));
        name = next().text;
        if (!is_known_test(name)) fail(name_tok, "no test named '" + name + "'");
        t->name = std::move(name);
        t->a = std::move(e);
        if (at_op("(")) {
          parse_call_args(*t);
        } else if (test_arg_follows()) {
          const Token& arg_at = peek();
          NestGuard guard(*this, arg_at);
          t->args.push_back(parse_postfix(parse_primary()));
        }
        e = finish(std::move(t));
      } else {
        return e;
      }
    }
  }

  // "x is divisibleby 3": one argument without parentheses.
  bool test_arg_follows() const {
    const Token& t = peek();
    switch (t.type) {
      case TokenType::Name: return t.text != "else" && t.text != "or" && t.text != "and" && t.text != "if" && t.text != "in" && t.text != "not" && t.text != "is";
      case TokenType::String:
      case TokenType::Int:
      case TokenType::Float: return true;
      case TokenType::Op: return t.text == "[" || t.text == "{";
      default: return false;
    }
  }
};

}  // namespace

StmtList parse_template(const LexResult& lexed) { return Parser(lexed).parse_all(); }

}  // namespace kestrel::jinja
