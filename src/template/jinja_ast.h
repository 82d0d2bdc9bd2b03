// The parsed template: expression and statement trees. Every node knows its line and column for
// error messages. Trees are at most kMaxAstDepth deep (the parser refuses deeper ones), so the
// recursive evaluator and the destructors stay within the stack.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "template/jinja_value.h"

namespace kestrel::jinja {

inline constexpr int kMaxAstDepth = 200;

struct Expr;
struct Stmt;
using ExprPtr = std::unique_ptr<Expr>;
using StmtPtr = std::unique_ptr<Stmt>;
using StmtList = std::vector<StmtPtr>;

enum class ExprKind : uint8_t {
  Literal,   // value
  Name,      // name
  List,      // args
  Tuple,     // args
  Dict,      // args: key, value, key, value, ...
  GetAttr,   // a.name (a["x"] is GetItem)
  GetItem,   // a[b]
  Slice,     // a[args[0]:args[1]:args[2]] (null parts omitted)
  Call,      // a(args, kwargs)
  Filter,    // a|name(args, kwargs); a is null inside {% filter %} blocks
  Test,      // a is [not] name(args, kwargs)
  Not,       // not a
  Neg,       // -a
  Pos,       // +a
  Binary,    // a op b (op: + - * / // % **)
  Compare,   // args[0] ops[0] args[1] ops[1] args[2] ...
  And,       // a and b
  Or,        // a or b
  Cond,      // a if b else c (c may be null)
  Concat,    // args[0] ~ args[1] ~ ...
};

enum class BinOp : uint8_t { Add, Sub, Mul, Div, FloorDiv, Mod, Pow };
enum class CmpOp : uint8_t { Eq, Ne, Lt, Le, Gt, Ge, In, NotIn };

struct Expr {
  ExprKind kind;
  int line = 0;
  int column = 0;
  int depth = 1;  // 1 + the deepest child's depth
  bool negated = false;  // Test: "is not"
  BinOp bin_op = BinOp::Add;
  Value value;       // Literal
  std::string name;  // Name, GetAttr, Filter, Test
  ExprPtr a, b, c;
  std::vector<ExprPtr> args;  // null entries only in Slice
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  std::vector<CmpOp> ops;
};

enum class StmtKind : uint8_t {
  Text,         // text
  Output,       // {{ expr }}
  If,           // branches (cond, body); else_body
  For,          // targets in expr [if cond] body [else else_body]
  Set,          // targets = expr, or ns_name.attr = expr
  SetBlock,     // {% set name [| filters] %}body{% endset %}
  Macro,        // name(params) body
  CallBlock,    // {% call [(params)] expr %}body{% endcall %}
  FilterBlock,  // {% filter filters %}body{% endfilter %}
  With,         // {% with targets = values %}body{% endwith %}
  Break,
  Continue,
  Scope,        // {% generation %}body{% endgeneration %}: body rendered as is
};

struct Param {
  std::string name;
  ExprPtr default_value;  // null: none given
};

struct Stmt {
  StmtKind kind;
  int line = 0;
  int column = 0;
  std::string text;                  // Text
  ExprPtr expr;                      // Output, For iterable, Set value, CallBlock call
  ExprPtr cond;                      // For's "if" filter
  std::vector<std::pair<ExprPtr, StmtList>> branches;  // If
  StmtList body;
  StmtList else_body;
  std::vector<std::string> targets;  // For, Set, SetBlock (one name), With
  std::vector<ExprPtr> values;       // With
  std::string attr;                  // Set on a namespace: targets[0].attr
  std::string name;                  // Macro
  std::vector<Param> params;         // Macro, CallBlock
  std::vector<ExprPtr> filters;      // SetBlock, FilterBlock: Filter nodes without a subject
};

}  // namespace kestrel::jinja

namespace kestrel::jinja::detail {

struct TemplateBody {
  std::string source;  // normalised
  StmtList statements;
};

}  // namespace kestrel::jinja::detail
