// Jinja semantics, case by case: each template renders to exactly the string Python's jinja2
// (3.1.6) gives with the settings transformers renders chat templates with (trim_blocks,
// lstrip_blocks, loopcontrols, a {% generation %} block, ChainableUndefined-style undefined
// attributes, json.dumps as tojson) and the variables of kContext.
//
// The expected strings were computed with jinja2. To check them again after editing a case:
//   KESTREL_JINJA_DUMP_CASES=/tmp/cases.jsonl build/tests/kestrel_tests --gtest_filter='Jinja.*'
//   python3 tests/golden/chat_templates/check_cases.py /tmp/cases.jsonl
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/env.h"
#include "template/jinja.h"

namespace kestrel::jinja {
namespace {

struct Case {
  const char* tmpl;
  const char* expected;
};

// 2023-11-14 12:00:00 UTC: strftime_now gives the same date in time zones from UTC-11 to UTC+11.
constexpr int64_t kNow = 1699963200;

const char* const kContext = R"({
  "messages": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "What is 2+2?"}
  ],
  "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
             "properties": {"city": {"type": "string"}}, "required": ["city"]}}}],
  "add_generation_prompt": true,
  "bos_token": "<s>",
  "eos_token": "</s>"
})";

RenderOptions fixed_clock() {
  RenderOptions o;
  o.now = std::chrono::system_clock::from_time_t(kNow);
  return o;
}

// With KESTREL_JINJA_DUMP_CASES=path, every case is appended to path as a JSON line
// {"template", "context", "expected"} for check_cases.py.
void dump_case(const Case& c) {
  const auto path = env_var(EnvVar::JinjaDumpCases);
  if (!path) return;
  std::ofstream out(*path, std::ios::app);
  nlohmann::ordered_json line;
  line["template"] = c.tmpl;
  line["context"] = nlohmann::ordered_json::parse(kContext);
  line["expected"] = c.expected;
  out << line.dump() << "\n";
}

template <size_t N>
void check_cases(const Case (&cases)[N]) {
  const auto context = nlohmann::ordered_json::parse(kContext);
  for (const Case& c : cases) {
    SCOPED_TRACE(c.tmpl);
    dump_case(c);
    try {
      EXPECT_EQ(Template::parse(c.tmpl).render(context, fixed_clock()), c.expected);
    } catch (const TemplateError& e) {
      ADD_FAILURE() << "TemplateError: " << e.what();
    }
  }
}

TEST(Jinja, Whitespace) {
  const Case cases[] = {
      {R"(  {% if true %}
  x
  {% endif %}
)",
       R"(  x
)"},
      {R"(a
{% for i in [1,2] %}
  - {{ i }}
{% endfor %}
b
)",
       R"(a
  - 1
  - 2
b)"},
      {R"(a
    {%- if true %}
x{% endif -%}
   
  b)",
       R"(axb)"},
      {R"({{- '  a  ' -}}  |  {{- 'b' }})",
       R"(  a  |b)"},
      {R"(x  {{- 1 -}}  y)",
       R"(x1y)"},
      {R"(x  {%+ if true %}y{% endif +%}
z)",
       R"(x  y
z)"},
      {R"({% raw %}{{ not rendered }}{% endraw %})",
       R"({{ not rendered }})"},
      {R"(a {%- raw -%}  {{ x }}  {%- endraw -%}  b)",
       R"(a{{ x }}b)"},
      {R"({# comment #}x
{#- c2 -#}  y
  {# c3 #}
z)",
       R"(xy
z)"},
      {"line1\r\nline2\r\n{% if true %}\r\nl3\r\n{% endif %}\r\n",
       R"(line1
line2
l3
)"},
      {R"(trailing newline

)",
       R"(trailing newline
)"},
      {R"({{ 'a' }}
{{ 'b' }}
)",
       R"(a
b)"},
      {R"({% set x = 5 %}
{{ x }}
)",
       R"(5)"},
      {R"(  {{ 'v' }}  
  {% set y = 1 %}  
end)",
       R"(  v  
  
end)"},
      {R"({%- for m in messages -%}
<{{ m.role }}>
{%- endfor %})",
       R"(<system><user><assistant><user>)"},
      {R"(a
  {% if true %}
  b
  {% endif %}
  c
)",
       R"(a
  b
  c)"},
      {R"(a {# c #}
b
  {# d #}
e)",
       R"(a b
e)"},
      {R"({% if true %}  {% if true %}x{% endif %}{% endif %})",
       R"(  x)"},
      {R"(		{% if true %}tab{% endif %}
)",
       R"(tab)"},
  };
  check_cases(cases);
}

TEST(Jinja, Literals) {
  const Case cases[] = {
      {R"({{ 'a' 'b' }})",
       R"(ab)"},
      {R"({{ "it's" }})",
       R"(it's)"},
      {R"({{ 'tab\there' }})",
       R"(tab	here)"},
      {R"({{ '\u00e9\x41\101' }})",
       R"(éAA)"},
      {R"({{ 'back\\slash' }})",
       R"(back\slash)"},
      {R"({{ 'unk\qx' }})",
       R"(unk\qx)"},
      {R"({{ [1, 2, 3,] }})",
       R"([1, 2, 3])"},
      {R"({{ {'a': 1,} }})",
       R"({'a': 1})"},
      {R"({{ (1, 2,) }})",
       R"((1, 2))"},
      {R"({{ () }})",
       R"(())"},
      {R"({{ [] }})",
       R"([])"},
      {R"({{ {} }})",
       R"({})"},
      {R"({{ (1,) }})",
       R"((1,))"},
      {R"({{ 1, 2 }})",
       R"((1, 2))"},
      {R"({{ 1_000 }})",
       R"(1000)"},
      {R"({{ 0x1f }}|{{ 0o17 }}|{{ 0b101 }})",
       R"(31|15|5)"},
      {R"({{ 1.5e3 }}|{{ 2E-3 }})",
       R"(1500.0|0.002)"},
      {R"({{ true }}|{{ True }}|{{ false }}|{{ none }}|{{ None }})",
       R"(True|True|False|None|None)"},
      {R"({{ [1, 'a', none, true, 1.5] }})",
       R"([1, 'a', None, True, 1.5])"},
      {R"({{ {'k': "it's"} }})",
       R"({'k': "it's"})"},
      {R"({{ ['it\'s', "q\""] }})",
       R"(["it's", 'q"'])"},
      {R"({{ ['\n'] }})",
       R"(['\n'])"},
      {R"({{ {'a': {'b': [1, {'c': none}]}} }})",
       R"({'a': {'b': [1, {'c': None}]}})"},
      {R"({{ [1.0, -0.5, 1e100] }})",
       R"([1.0, -0.5, 1e+100])"},
  };
  check_cases(cases);
}

TEST(Jinja, Numbers) {
  const Case cases[] = {
      {R"({{ 1 + 2 * 3 }})",
       R"(7)"},
      {R"({{ (1 + 2) * 3 }})",
       R"(9)"},
      {R"({{ 2 ** 3 ** 2 }})",
       R"(64)"},
      {R"({{ 10 - 2 - 3 }})",
       R"(5)"},
      {R"({{ -2 ** 2 }})",
       R"(4)"},
      {R"({{ -1 }}|{{ - 1 + 2 }})",
       R"(-1|1)"},
      {R"({{ 7 // 2 }}|{{ -7 // 2 }}|{{ -7 % 3 }}|{{ 7 % -3 }}|{{ -7 // -2 }})",
       R"(3|-4|2|-2|3)"},
      {R"({{ 7 / 2 }}|{{ 10 / 4 }}|{{ 7.0 / 2 }})",
       R"(3.5|2.5|3.5)"},
      {R"({{ 2 ** -1 }}|{{ 2 ** 0.5 }}|{{ 2 ** 10 }})",
       R"(0.5|1.4142135623730951|1024)"},
      {R"({{ 7.5 // 2 }}|{{ -7.5 % 2 }})",
       R"(3.0|0.5)"},
      {R"({{ 1 + 1.5 }}|{{ true + 1 }})",
       R"(2.5|2)"},
      {R"({{ 1e16 }}|{{ 1e15 }}|{{ 0.00001 }}|{{ 1e-5 }}|{{ 1.5e16 }})",
       R"(1e+16|1000000000000000.0|1e-05|1e-05|1.5e+16)"},
      {R"({{ 0.1 + 0.2 }}|{{ 1 / 3 }}|{{ 100.0 }}|{{ 123456789.123 }}|{{ -0.0 }})",
       R"(0.30000000000000004|0.3333333333333333|100.0|123456789.123|-0.0)"},
      {R"({{ 1e300 * 1e10 }})",
       R"(inf)"},
      {R"({{ 9223372036854775807 }})",
       R"(9223372036854775807)"},
      {R"({{ 1 == 1.0 }}|{{ true == 1 }}|{{ none == none }}|{{ 'a' != 'b' }})",
       R"(True|True|True|True)"},
      {R"({{ [1, 2] == [1, 2] }}|{{ (1, 2) == [1, 2] }}|{{ {'a': 1, 'b': 2} == {'b': 2, 'a': 1} }})",
       R"(True|False|True)"},
      {R"({{ [1, 2] < [1, 3] }}|{{ 'abc' < 'abd' }}|{{ 1 < 2 < 3 }}|{{ 3 > 2 > 2 }}|{{ 2 >= 2 }}|{{ 1.5 <= 1 }})",
       R"(True|True|True|False|True|False)"},
  };
  check_cases(cases);
}

TEST(Jinja, Operators) {
  const Case cases[] = {
      {R"({{ 1 if true }}|{{ 1 if false }}|{{ 'a' if 0 else 'b' }})",
       R"(1||b)"},
      {R"({{ 'abc' if 1 > 2 else 'def' if 2 > 1 else 'ghi' }})",
       R"(def)"},
      {R"({{ 0 or 'x' }}|{{ 1 and 'y' }}|{{ '' and 'z' }}|{{ none or none }})",
       R"(x|y||None)"},
      {R"({{ not 0 }}|{{ not true or true }}|{{ not (true or true) }})",
       R"(True|True|False)"},
      {R"({{ 'a' in 'cat' }}|{{ 2 not in [1, 3] }}|{{ 'k' in {'k': 1} }}|{{ 'a' in ['a', 'b'] and 'c' not in 'abc' }})",
       R"(True|True|True|False)"},
      {R"({{ 'a' ~ 1 ~ none ~ true ~ undefined_var }})",
       R"(a1NoneTrue)"},
      {R"({{ 'ab' * 3 }}|{{ 3 * 'ab' }}|{{ 'x' * 0 }}|{{ 'x' * -1 }})",
       R"(ababab|ababab||)"},
      {R"({{ [1] * 3 }}|{{ [1, 2] * 2 }})",
       R"([1, 1, 1]|[1, 2, 1, 2])"},
      {R"({{ 'a' + 'b' }}|{{ [1] + [2] }}|{{ (1,) + (2,) }})",
       R"(ab|[1, 2]|(1, 2))"},
      {R"({{ x is not defined }}|{{ messages is not string }}|{{ not messages is string }})",
       R"(True|True|True)"},
      {R"({{ '%s and %s' % ('a', 'b') }}|{{ '%(a)s' % {'a': 1} }}|{{ '%s' % none }}|{{ '%d%%' % 50 }})",
       R"(a and b|1|None|50%)"},
      {R"({{ '%5s|%-5s|%05d|%+d|%x|%o|%e|%g|%c' % ('a', 'b', 42, 3, 255, 8, 12345.678, 0.0001, 65) }})",
       R"(    a|b    |00042|+3|ff|10|1.234568e+04|0.0001|A)"},
      {R"({{ '%s-%d-%05.2f|%r' % ('a', 3, 2.5, 'q') }})",
       R"(a-3-02.50|'q')"},
  };
  check_cases(cases);
}

TEST(Jinja, Subscripts) {
  const Case cases[] = {
      {R"({{ messages[0].role }}|{{ messages[0]['role'] }}|{{ messages[-1]['content'] }}|{{ messages.0.role }})",
       R"(system|system|What is 2+2?|system)"},
      {R"({{ 'abcdef'[1:3] }}|{{ 'abcdef'[::-1] }}|{{ 'abcdef'[1:5:2] }}|{{ 'abc'[5:] }}|{{ 'abc'[-10:2] }}|{{ 'abc'[none:2] }})",
       R"(bc|fedcba|bd||ab|ab)"},
      {R"({{ [1, 2, 3, 4][1:] }}|{{ [1, 2, 3, 4][-2:] }}|{{ [1, 2, 3, 4][::2] }}|{{ [1, 2, 3][::-2] }}|{{ [1, 2, 3][10:0:-1] }})",
       R"([2, 3, 4]|[3, 4]|[1, 3]|[3, 1]|[3, 2])"},
      {R"({{ messages[1:]|length }}|{{ messages[:-1]|map(attribute='role')|join(',') }}|{{ (1, 2, 3)[1:] }})",
       R"(3|system,user,assistant|(2, 3))"},
      {R"({{ 'héllo'[1] }}|{{ 'héllo'|length }}|{{ '日本語'[1] }}|{{ '日本語'[::-1] }}|{{ '日本語'[-1] }})",
       R"(é|5|本|語本日|語)"},
      {R"({{ [1, 2, 3][5] }}|{{ {'a': 1}['b'] }}|{{ messages[0].missing }}|{{ (1, 2)[5] }})",
       R"(|||)"},
      {R"({{ undefined_var.attr }}|{{ undefined_var['x'].y }}|{{ none.x }}|{{ 'abc'.x }}|{{ [1].x }}|{{ undefined_var.attr is defined }})",
       R"(|||||False)"},
      {R"({{ messages[0].get('role') }}|{{ messages[0].get('nope', 'dflt') }}|{{ messages[0].get('nope') }})",
       R"(system|dflt|None)"},
      {R"({{ {'items': 1}.items()|list }}|{{ {'a': 1}['items'] is defined }})",
       R"([('items', 1)]|True)"},
  };
  check_cases(cases);
}

TEST(Jinja, Statements) {
  const Case cases[] = {
      {R"({% if false %}a{% elif messages|length > 3 %}b{% elif true %}c{% else %}d{% endif %})",
       R"(b)"},
      {R"({% if messages %}y{% endif %}|{% if [] %}y{% else %}n{% endif %}|{% if {} %}y{% else %}n{% endif %}|{% if 0.0 %}y{% else %}n{% endif %}|{% if '0' %}y{% endif %})",
       R"(y|n|n|n|y)"},
      {R"({% set a, b = 1, 2 %}{{ a }}{{ b }}|{% set t = (1, 2) %}{{ t }})",
       R"(12|(1, 2))"},
      {R"({% with a = 1, b = 2 %}{{ a + b }}{% endwith %}{{ a }})",
       R"(3)"},
      {R"({% filter upper %}abc{{ 'd' }}{% endfilter %}|{% filter replace('a', 'b')|upper %}aaa{% endfilter %})",
       R"(ABCD|BBB)"},
      {R"({% set content %}{% for m in messages %}{{ m.content }};{% endfor %}{% endset %}{{ content|length }}:{{ content }})",
       R"(39:Be brief.;Hi there;Hello!;What is 2+2?;)"},
      {R"({% set x | upper %}abc{% endset %}{{ x }})",
       R"(ABC)"},
      {R"({% set x %}  hi {{ 1 }}
{% endset %}[{{ x }}])",
       R"([  hi 1
])"},
      {R"({% set x = 1 %}{% if true %}{% set x = 2 %}{% endif %}{{ x }})",
       R"(2)"},
      {R"({% for i in range(3) %}{% set x = i %}{% endfor %}{{ x }}|{% set y = 1 %}{% for i in range(3) %}{% set y = y + i %}{{ y }}{% endfor %}{{ y }})",
       R"(|1231)"},
      {R"({% for i in [1, 2] %}{{ z|default('u') }}{% set z = i %}{% endfor %}|{{ z|default('after') }})",
       R"(uu|after)"},
      {R"({% set ns = namespace(x=0, y='a') %}{% for i in range(3) %}{% set ns.x = ns.x + i %}{% endfor %}{{ ns.x }}{{ ns.y }})",
       R"(3a)"},
      {R"({% set ns = namespace(found=false) %}{% for m in messages %}{% if m.role == 'assistant' %}{% set ns.found = true %}{% endif %}{% endfor %}{{ ns.found }})",
       R"(True)"},
      {R"({{ namespace(a=1) }}|{{ namespace({'q': 2}, r=3).q }}|{{ dict(a=1, b='x') }}|{{ dict(a=1).items()|list }})",
       R"(<Namespace {'a': 1}>|2|{'a': 1, 'b': 'x'}|[('a', 1)])"},
      {R"({% set j = joiner('|') %}{% for x in [1, 2, 3] %}{{ j() }}{{ x }}{% endfor %})",
       R"(1|2|3)"},
      {R"({% generation %}gen {{ 1 }}{% endgeneration %})",
       R"(gen 1)"},
      {R"({{ range(5)|list }}|{{ range(1, 10, 3)|list }}|{{ range(5, 0, -2)|list }}|{{ range(0)|list }}|{{ range(-3)|list }})",
       R"([0, 1, 2, 3, 4]|[1, 4, 7]|[5, 3, 1]|[]|[])"},
  };
  check_cases(cases);
}

TEST(Jinja, Loops) {
  const Case cases[] = {
      {R"({% for k, v in {'a': 1, 'b': 2}.items() %}{{ k }}={{ v }};{% endfor %})",
       R"(a=1;b=2;)"},
      {R"({% for x in [] %}x{% else %}empty{% endfor %})",
       R"(empty)"},
      {R"({% for x in [1, 2, 3, 4] if x is even %}{{ loop.index }}/{{ loop.length }} {% endfor %})",
       R"(1/2 2/2 )"},
      {R"({% for x in [1, 2, 3] %}{{ loop.previtem|default('-') }}{{ x }}{{ loop.nextitem|default('-') }}{{ loop.cycle('a', 'b') }} {% endfor %})",
       R"(-12a 123b 23-a )"},
      {R"({% for x in [1, 2, 3] %}{% if x == 2 %}{% continue %}{% endif %}{{ x }}{% endfor %}|{% for x in [1, 2, 3] %}{% if x == 2 %}{% break %}{% endif %}{{ x }}{% endfor %})",
       R"(13|1)"},
      {R"({% for x in 'abc' %}{{ loop.revindex }}{{ loop.revindex0 }}{{ x }}{% endfor %}|{% for k in {'a': 1, 'b': 2} %}{{ k }}{% endfor %})",
       R"(32a21b10c|ab)"},
      {R"({% for x in [1, 2] %}{% for y in [3, 4] %}{{ loop.index }}{{ x }}{{ y }} {% endfor %}{{ loop.index }}|{% endfor %})",
       R"(113 214 1|123 224 2|)"},
      {R"({% for x in [1, 2, 3] %}{{ loop.first }}{{ loop.last }}{{ loop.index0 }}{{ loop.depth }} {% endfor %})",
       R"(TrueFalse01 FalseFalse11 FalseTrue21 )"},
      {R"({% for a, b in [[1, 2], [3, 4]] %}{{ a + b }},{% endfor %}|{% for a, b in ['xy'] %}{{ b }}{{ a }}{% endfor %}|{% for (a, b) in [(5, 6)] %}{{ a * b }}{% endfor %})",
       R"(3,7,|yx|30)"},
      {R"({% for m in messages|reverse %}{{ m.role[0] }}{% endfor %}|{% for i in range(messages|length - 1, -1, -1) %}{{ i }}{% endfor %})",
       R"(uaus|3210)"},
      {R"({% for m in messages if m.role != 'system' %}{{ loop.index }}{{ m.role[0] }}{% if loop.last %}!{% endif %}{% endfor %})",
       R"(1u2a3u!)"},
      {R"({% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}{{ m.content[:3] }}{% if loop.index >= 3 %}{% break %}{% endif %},{% endfor %})",
       R"(Hi ,Hel)"},
      {R"({% for x in undefined_var %}{{ x }}{% else %}none{% endfor %})",
       R"(none)"},
      {R"({% for i in range(3) %}{% for j in range(i) %}{{ j }}{% endfor %};{% endfor %})",
       R"(;0;01;)"},
  };
  check_cases(cases);
}

TEST(Jinja, Macros) {
  const Case cases[] = {
      {R"({% macro greet(name, greeting='Hi') %}{{ greeting }}, {{ name }}!{% endmacro %}{{ greet('Bob') }} {{ greet('Al', greeting='Yo') }} {{ greet(greeting='Hey', name='X') }})",
       R"(Hi, Bob! Yo, Al! Hey, X!)"},
      {R"({% macro m(a) %}[{{ a }}|{{ varargs }}|{{ kwargs }}]{% endmacro %}{{ m(1, 2, 3, z=4) }})",
       R"([1|(2, 3)|{'z': 4}])"},
      {R"({% macro m(x, y=x * 2) %}{{ x }},{{ y }}{% endmacro %}{{ m(1) }}|{{ m(1, 5) }}|{{ m(y=3, x=2) }})",
       R"(1,2|1,5|2,3)"},
      {R"({% macro fact(n) %}{% if n <= 1 %}1{% else %}{{ n * fact(n - 1)|int }}{% endif %}{% endmacro %}{{ fact(10) }})",
       R"(3628800)"},
      {R"({% set x = 1 %}{% macro m() %}{{ x }}{% endmacro %}{% set x = 2 %}{{ m() }})",
       R"(2)"},
      {R"({% macro m() %}{{ y }}{% endmacro %}{% set y = 5 %}{{ m() }})",
       R"(5)"},
      {R"({% macro outer() %}[{{ caller() }}]{% endmacro %}{% call outer() %}inside{% endcall %})",
       R"([inside])"},
      {R"({% macro list_items(items) %}{% for i in items %}{{ caller(i) }}{% endfor %}{% endmacro %}{% call(item) list_items([1, 2]) %}<{{ item }}>{% endcall %})",
       R"(<1><2>)"},
      {R"({% macro render(m) -%}
[{{ m.role|upper }}] {{ m.content }}
{%- endmacro %}
{% for m in messages %}{{ render(m) }}
{% endfor %})",
       R"([SYSTEM] Be brief.
[USER] Hi there
[ASSISTANT] Hello!
[USER] What is 2+2?
)"},
      {R"({% macro m() %}{% set inner = 1 %}{{ inner }}{% endmacro %}{{ m() }}{{ inner|default('-') }})",
       R"(1-)"},
  };
  check_cases(cases);
}

TEST(Jinja, StringFilters) {
  const Case cases[] = {
      {R"({{ 'Hello'|lower }}|{{ 'hello'|upper }}|{{ 'hELLO wORLD'|capitalize }}|{{ 'a b'|title }}|{{ 'hello-world (foo)'|title }})",
       R"(hello|HELLO|Hello world|A B|Hello-World (Foo))"},
      {R"({{ '  x  '|trim }}|{{ 'xxaxx'|trim('x') }}|{{ '  '|trim == '' }})",
       R"(x|a|True)"},
      {R"({{ 'aaa'|replace('a', 'b', 2) }}|{{ 'abc'|replace('', '-') }}|{{ 'aaa'|replace('a', '') }})",
       R"(bba|-a-b-c-|)"},
      {R"({{ 'abc'|reverse }}|{{ 'abc'|list }}|{{ 'abc'|first }}|{{ 'abc'|last }}|{{ ''|first }}|{{ 'abc'|length }}|{{ 'abc'|count }})",
       R"(cba|['a', 'b', 'c']|a|c||3|3)"},
      {R"({{ 'x'|center(4) }}|{{ 'x'|center(5) }}|{{ 'ab'|center(5) }}|{{ 'hello'|center(11) }})",
       R"( x  |  x  |  ab |   hello   )"},
      {R"({{ 'hello world foo bar'|truncate(9) }}|{{ 'hello world foo bar'|truncate(9, true) }}|{{ 'abc'|truncate(2, end='') }}|{{ 'one two three four five six'|truncate(12, leeway=0) }})",
       R"(hello...|hello ...|abc|one two...)"},
      {R"({{ '  a\n b\n\n c'|indent }}|{{ 'a\nb'|indent(2, true) }}|{{ 'a\n\nb\n'|indent(2, blank=true) }}|{{ 'a\nb'|indent('> ') }}|{{ ''|indent }})",
       R"(  a
     b

     c|  a
  b|a
  
  b
  |a
> b|)"},
      {R"({{ 'a\tb'|e }}|{{ '<a href="x">&\''|e }}|{{ '<b>'|escape }}|{{ '<b>'|safe }})",
       R"(a	b|&lt;a href=&#34;x&#34;&gt;&amp;&#39;|&lt;b&gt;|<b>)"},
      {R"({{ 'Hello World'|wordcount }}|{{ 'don\'t stop-me now_x'|wordcount }})",
       R"(2|5)"},
      {R"({{ 'x=%s'|format(5) }}|{{ '%.3f'|format(3.14159) }}|{{ '%(n)s!'|format(n='hi') }})",
       R"(x=5|3.142|hi!)"},
      {R"({{ none|string }}|{{ [1, 'a']|string }}|{{ 42|string ~ '!' }})",
       R"(None|[1, 'a']|42!)"},
      {R"({{ 'ß'|upper }}|{{ 'ÉCOLE'|lower }}|{{ 'привет'|upper }}|{{ 'héllo wörld'|title }}|{{ 'ünïcode'|capitalize }})",
       R"(SS|école|ПРИВЕТ|Héllo Wörld|Ünïcode)"},
      {R"({{ '日本語'|length }}|{{ '日本語'|list }}|{{ ['日本']|string }})",
       R"(3|['日', '本', '語']|['日本'])"},
  };
  check_cases(cases);
}

TEST(Jinja, SequenceFilters) {
  const Case cases[] = {
      {R"({{ [1, 2, 3]|first }}{{ [1, 2, 3]|last }}|{{ []|first }}|{{ {'a': 1, 'b': 2}|first }}|{{ undefined_var|first }})",
       R"(13||a|)"},
      {R"({{ [3, 1, 2]|sort }}|{{ ['b', 'A', 'a', 'B']|sort }}|{{ [3, 1, 2]|sort(reverse=true) }}|{{ ['b', 'a', 'C']|sort(case_sensitive=true)|join }})",
       R"([1, 2, 3]|['A', 'a', 'b', 'B']|[3, 2, 1]|Cab)"},
      {R"({{ [{'a': 2}, {'a': 1}]|sort(attribute='a') }}|{{ [{'n': 'b', 'a': 1}, {'n': 'a', 'a': 2}]|sort(attribute='n')|map(attribute='a')|join }})",
       R"([{'a': 1}, {'a': 2}]|21)"},
      {R"({{ [{'a': {'b': 1}}, {'a': {'b': 0}}]|sort(attribute='a.b')|map(attribute='a.b')|list }}|{{ [[3, 'x'], [1, 'y']]|sort(attribute='0')|map(attribute='1')|join }})",
       R"([0, 1]|yx)"},
      {R"({{ {'b': 1, 'A': 2}|dictsort }}|{{ {'b': 2, 'a': 1}|dictsort(by='value') }}|{{ {'b': 2, 'a': 1}|dictsort(reverse=true) }})",
       R"([('A', 2), ('b', 1)]|[('a', 1), ('b', 2)]|[('b', 2), ('a', 1)])"},
      {R"({{ ['b', 'A', 'a', 'B']|unique|list }}|{{ [1, 2, 2, 3, 1]|unique|list }}|{{ ['A', 'a', 'b']|unique(case_sensitive=true)|list }}|{{ [{'x': 1}, {'x': 1}, {'x': 2}]|unique(attribute='x')|list }})",
       R"(['b', 'A']|[1, 2, 3]|['A', 'a', 'b']|[{'x': 1}, {'x': 2}])"},
      {R"({{ [1, 2, 3]|sum }}|{{ [1.5, 2]|sum }}|{{ [{'a': 1}, {'a': 2}]|sum(attribute='a') }}|{{ [1, 2, 3]|sum(start=10) }}|{{ []|sum }}|{{ [0.1, 0.2]|sum }})",
       R"(6|3.5|3|16|0|0.30000000000000004)"},
      {R"({{ []|max }}|{{ [1, 3, 2]|max }}|{{ [1, 2, 3]|min }}|{{ ['B', 'a', 'c']|max }}|{{ ['B', 'a', 'c']|min(case_sensitive=true) }}|{{ ['b', 'A']|max }})",
       R"(|3|1|c|B|b)"},
      {R"({{ [1, 2, 3, 4, 5]|batch(2)|list }}|{{ [1, 2, 3]|batch(2, 0)|list }})",
       R"([[1, 2], [3, 4], [5]]|[[1, 2], [3, 0]])"},
      {R"({{ ['a', 'b']|join(', ') }}|{{ [1, 2]|join }}|{{ [{'n': 'x'}, {'n': 'y'}]|join(',', attribute='n') }}|{{ [none]|join(',') }}|{{ [1, [2]]|join }})",
       R"(a, b|12|x,y|None|1[2])"},
      {R"({{ [1, 2, 3]|map('string')|join('-') }}|{{ [{'a': 1}, {}]|map(attribute='a', default=0)|list }}|{{ ['a', 'B']|map('upper')|list }}|{{ [[1, 2], [3]]|map('length')|list }})",
       R"(1-2-3|[1, 0]|['A', 'B']|[2, 1])"},
      {R"({{ [1, 2]|map('default', 'x')|list }}|{{ [none]|map('default', 'x', true)|list }}|{{ messages|map('tojson')|join(',') }})",
       R"([1, 2]|['x']|{"role": "system", "content": "Be brief."},{"role": "user", "content": "Hi there"},{"role": "assistant", "content": "Hello!"},{"role": "user", "content": "What is 2+2?"})"},
      {R"({{ [1, 2, 3, 4]|select('odd')|list }}|{{ [1, 2, 3, 4]|reject('even')|list }}|{{ [1, 2, 3]|select('>', 1)|list }}|{{ [1, none, 2]|select|list }}|{{ [0, 1, '', 'a']|reject|list }})",
       R"([1, 3]|[1, 3]|[2, 3]|[1, 2]|[0, ''])"},
      {R"({{ [{'r': 'u'}, {'r': 'a'}]|selectattr('r', 'equalto', 'u')|list }}|{{ [{'r': 1}, {}]|selectattr('r')|list }}|{{ [{'r': 1}, {}]|rejectattr('r')|list }})",
       R"([{'r': 'u'}]|[{'r': 1}]|[{}])"},
      {R"({{ [1, 5, 3]|select('gt', 2)|list }}|{{ [1, 5, 3]|select('lessthan', 4)|list }}|{{ ['a', 'b']|select('in', 'abc')|list }}|{{ [1, 'a', none]|select('number')|list }}|{{ [1, 'a', none]|reject('none')|list }})",
       R"([5, 3]|[1, 3]|['a', 'b']|[1]|[1, 'a'])"},
      {R"({{ messages|selectattr('role', 'equalto', 'user')|map(attribute='content')|join(' / ') }}|{{ messages|rejectattr('role', 'in', ['system'])|list|length }})",
       R"(Hi there / What is 2+2?|3)"},
      {R"({{ [1, 2]|reverse|list }}|{{ (1, 2)|list }}|{{ {'a': 1}|list }}|{{ {'a': 1}|items|list }}|{{ undefined_var|items|list }}|{{ undefined_var|list }})",
       R"([2, 1]|[1, 2]|['a']|[('a', 1)]|[]|[])"},
      {R"({{ messages|length }}|{{ {'a': 1}|length }}|{{ undefined_var|length }}|{{ (messages|last).role }})",
       R"(4|1|0|user)"},
  };
  check_cases(cases);
}

TEST(Jinja, NumberFilters) {
  const Case cases[] = {
      {R"({{ -3|abs }}|{{ -2.5|abs }})",
       R"(3|2.5)"},
      {R"({{ 2.567|round(1) }}|{{ 2.1|round(0, 'ceil') }}|{{ 2.9|round(method='floor') }}|{{ 3.7|round }}|{{ 3|round(2) }})",
       R"(2.6|3.0|2.0|4.0|3)"},
      {R"({{ 2.5|round }}|{{ 3.5|round }}|{{ 2.675|round(2) }}|{{ -2.5|round }}|{{ 0.5|round }}|{{ 1.5|round }}|{{ 1.005|round(2) }}|{{ 1234.5678|round(-2) }})",
       R"(2.0|4.0|2.67|-2.0|0.0|2.0|1.0|1200.0)"},
      {R"({{ none|int }}|{{ '12'|int }}|{{ ' 12 '|int }}|{{ '1.9'|int }}|{{ 'a'|int(5) }}|{{ 2.9|int }}|{{ true|int }}|{{ '0x1A'|int(0, 16) }}|{{ '1_000'|int }}|{{ '-3'|int }}|{{ '1e3'|int }})",
       R"(0|12|12|1|5|2|1|26|1000|-3|1000)"},
      {R"({{ '1.5'|float }}|{{ 'abc'|float }}|{{ 3|float }}|{{ ' 2e3 '|float }}|{{ 'inf'|float }}|{{ none|float }})",
       R"(1.5|0.0|3.0|2000.0|inf|0.0)"},
      {R"({{ '1'|int + 1 }}|{{ '3' ~ 4 }})",
       R"(2|34)"},
  };
  check_cases(cases);
}

TEST(Jinja, Tests) {
  const Case cases[] = {
      {R"({{ undefined_var is defined }}|{{ undefined_var is undefined }}|{{ messages is defined }}|{{ none is none }}|{{ none is defined }})",
       R"(False|True|True|True|True)"},
      {R"({{ undefined_var is iterable }}|{{ undefined_var is sequence }}|{{ true is number }}|{{ true is integer }}|{{ 1.0 is integer }}|{{ {} is mapping }}|{{ 'a' is sequence }}|{{ 3 is iterable }})",
       R"(True|True|True|False|False|True|True|False)"},
      {R"({{ 5 is divisibleby 3 }}|{{ 6 is divisibleby(3) }}|{{ 3 is odd }}|{{ 4.0 is even }}|{{ messages|length is divisibleby 2 }})",
       R"(False|True|True|True|True)"},
      {R"({{ 'a' is lower }}|{{ 'A' is upper }}|{{ 'a1' is lower }}|{{ '1' is lower }}|{{ 1 is in [1, 2] }}|{{ 1 is sameas 1 }}|{{ 'upper' is filter }}|{{ 'odd' is test }})",
       R"(True|True|True|False|True|True|True|True)"},
      {R"({{ 2 is eq 2 }}|{{ 2 is equalto 3 }}|{{ 2 is ne 2 }}|{{ 2 is gt 1 }}|{{ 2 is lt 1 }}|{{ 2 is ge 2 }}|{{ 2 is le 1 }}|{{ 2 is greaterthan 1 }}|{{ 2 is lessthan 1 }})",
       R"(True|False|False|True|False|True|False|True|False)"},
      {R"({{ undefined_var is callable }}|{{ range is callable }}|{{ 'a'.upper is callable }}|{{ true is boolean }}|{{ 1 is boolean }}|{{ true is true }}|{{ 1 is true }}|{{ false is false }}|{{ 1.5 is float }}|{{ 1 is float }}|{{ 'x' is escaped }})",
       R"(True|True|True|True|False|True|False|True|True|False|False)"},
      {R"({{ 'x' is string }}|{{ 1 is string }}|{{ [1] is sequence }}|{{ messages[0] is mapping }}|{{ 'x' if none is none }})",
       R"(True|False|True|True|x)"},
  };
  check_cases(cases);
}

TEST(Jinja, Methods) {
  const Case cases[] = {
      {R"({{ 'a,b,,c'.split(',') }}|{{ '  a  b '.split() }}|{{ 'a b c'.split(' ', 1) }}|{{ 'a b c'.rsplit(' ', 1) }}|{{ 'x.y.z'.rsplit('.', 1)[0] }})",
       R"(['a', 'b', '', 'c']|['a', 'b']|['a', 'b c']|['a b', 'c']|x.y)"},
      {R"({{ 'Hello'.startswith('He') }}|{{ 'Hello'.endswith(('x', 'lo')) }}|{{ ' a '.strip() }}|{{ 'xay'.strip('xy') }}|{{ ' x '.lstrip() }}|{{ ' x '.rstrip() }})",
       R"(True|True|a|a|x | x)"},
      {R"({{ 'a-b'.replace('-', '+') }}|{{ 'Hello World'.replace('o', '0', 1) }}|{{ 'abc'.find('c') }}|{{ 'abc'.find('z') }}|{{ 'aaa'.count('a') }})",
       R"(a+b|Hell0 World|2|-1|3)"},
      {R"({{ 'ab'.upper() }}|{{ 'Ab'.lower() }}|{{ 'ab cd'.title() }}|{{ 'hello-world (foo)'.title() }}|{{ 'a'.isdigit() }}|{{ '12'.isdigit() }}|{{ 'a b'.isspace() }}|{{ ' '.isspace() }}|{{ 'abc'.isalpha() }})",
       R"(AB|ab|Ab Cd|Hello-World (Foo)|False|True|False|True|True)"},
      {R"({{ '{} {}'.format(1, 'b') }}|{{ '{0}{name}'.format(1, name='n') }}|{{ '{:>6}|{:<6}|{:^7}|{:06.2f}|{:,}|{:+d}|{:x}|{:.2%}|{!r}'.format('a', 'b', 'c', 3.14159, 1234567, 5, 255, 0.256, 'q') }})",
       R"(1 b|1n|     a|b     |   c   |003.14|1,234,567|+5|ff|25.60%|'q')"},
      {R"({{ ', '.join(['a', 'b']) }}|{{ 'a\nb\r\nc'.splitlines() }}|{{ [1, 2, 1].count(1) }}|{{ [1, 2].index(2) }})",
       R"(a, b|['a', 'b', 'c']|2|1)"},
      {R"({{ {'a': 1}.get('a') }}|{{ {'a': 1}.get('b') }}|{{ {'a': 1}.get('b', 2) }}|{{ {'a': 1, 'b': 2}.keys()|list }}|{{ {'a': 1}.values()|list }}|{{ {'a': 1}.items()|list }})",
       R"(1|None|2|['a', 'b']|[1]|[('a', 1)])"},
      {R"({{ 'hello world'.split(' ')[1]|capitalize }}|{{ 'a,b'.split(',')|length }})",
       R"(World|2)"},
  };
  check_cases(cases);
}

TEST(Jinja, ToJson) {
  const Case cases[] = {
      {R"({{ {'b': 1, 'a': [1, 2.0, 'x', none, true]}|tojson }})",
       R"({"b": 1, "a": [1, 2.0, "x", null, true]})"},
      {R"({{ {'b': 1, 'a': [1, {}]}|tojson(indent=2) }})",
       R"({
  "b": 1,
  "a": [
    1,
    {}
  ]
})"},
      {R"({{ 42|tojson }}|{{ 'é"\n'|tojson }})",
       R"(42|"é\"\n")"},
      {R"({{ {'a': 1, 'b': [1, 2]}|tojson(indent=2) }}|{{ [1, 2]|tojson(separators=(',', ':')) }}|{{ {'b': 1, 'a': 2}|tojson(sort_keys=true) }})",
       R"({
  "a": 1,
  "b": [
    1,
    2
  ]
}|[1,2]|{"a": 2, "b": 1})"},
      {R"({{ 'é'|tojson(ensure_ascii=true) }}|{{ [1, 'a']|tojson(indent='\t') }}|{{ 1.0|tojson }}|{{ (1, 2)|tojson }}|{{ [1, 2]|tojson(indent=0) }})",
       R"("\u00e9"|[
	1,
	"a"
]|1.0|[1, 2]|[
1,
2
])"},
      {R"({{ 'a\u2028b'|tojson }}|{{ '\x01\x7f'|tojson }}|{{ '日本語'|tojson }}|{{ '😀'|tojson(ensure_ascii=true) }})",
       "\"a b\"|\"\\u0001\x7f""\"|\"日本語\"|\"\\ud83d\\ude00\""},
      {R"({{ messages|tojson }})",
       R"([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "What is 2+2?"}])"},
      {R"({{ messages[0]|tojson(indent=4) }})",
       R"({
    "role": "system",
    "content": "Be brief."
})"},
      {R"({{ tools|tojson }})",
       R"([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}])"},
      {R"({% for t in tools %}{{ t.function.name }}:{{ t.function.parameters|tojson }}
{% endfor %})",
       R"(get_weather:{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
)"},
      {R"({{ [none, true, false, 1e100, -0.5]|tojson }}|{{ {1: 'int key', none: 'none key', true: 'bool key'}|tojson }})",
       R"([null, true, false, 1e+100, -0.5]|{"1": "bool key", "null": "none key"})"},
  };
  check_cases(cases);
}

TEST(Jinja, Chat) {
  const Case cases[] = {
      {R"({% for m in messages %}{% if loop.first and m.role != 'system' %}SYS
{% endif %}{{ '<|' + m.role + '|>' + m.content }}{% if not loop.last %}
{% endif %}{% endfor %})",
       R"(<|system|>Be brief.<|user|>Hi there<|assistant|>Hello!<|user|>What is 2+2?)"},
      {R"({% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}{% set rest = messages[1:] %}{% else %}{% set sys = 'default' %}{% set rest = messages %}{% endif %}[{{ sys }}]{% for m in rest %}({{ m.role }}){% endfor %})",
       R"([Be brief.](user)(assistant)(user))"},
      {R"({{ messages|selectattr('role', 'eq', 'user')|map(attribute='content')|join(' / ') }})",
       R"(Hi there / What is 2+2?)"},
      {R"({{ messages[-1].content|trim|length }}|{{ (messages|last).role }}|{{ messages|rejectattr('role', 'in', ['system'])|list|length }})",
       R"(12|user|3)"},
      {R"({{ strftime_now('%Y-%m-%d') }}|{{ strftime_now('%d %b %Y') }})",
       R"(2023-11-14|14 Nov 2023)"},
      {R"({% if tools is not none %}tools{% else %}none{% endif %}|{{ tools is defined }})",
       R"(tools|True)"},
      {R"({{ tools|map(attribute='function')|map(attribute='name')|list }})",
       R"(['get_weather'])"},
      {R"({%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{%- for tool in tools %}
    {{- tool | tojson }}
    {{- '\n' }}
{%- endfor %})",
       R"(Be brief.

{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
)"},
      {R"({%- set loop_messages = messages -%}{%- for message in loop_messages -%}{{ '<|' ~ message.role ~ '|>\n' ~ message.content | trim ~ '<|end|>\n' }}{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|assistant|>\n' }}{%- endif -%})",
       R"(<|system|>
Be brief.<|end|>
<|user|>
Hi there<|end|>
<|assistant|>
Hello!<|end|>
<|user|>
What is 2+2?<|end|>
<|assistant|>
)"},
      {R"({{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}{{ eos_token if m.role == 'assistant' }}
{% endfor %})",
       R"(<s>system: Be brief.
user: Hi there
assistant: Hello!</s>
user: What is 2+2?
)"},
  };
  check_cases(cases);
}

TEST(Jinja, LazySequences) {
  const Case cases[] = {
      {R"({% if [1, 2]|select('gt', 5) %}truthy{% endif %}|{% if [1, 2]|select('gt', 5)|list %}{% else %}empty list{% endif %})",
       R"(truthy|empty list)"},
      {R"({{ {'a': 1}.items() }}|{{ {'a': 1}.keys() }}|{{ {'a': 1}.values() }}|{{ {'a': 1}.items()|length }})",
       R"(dict_items([('a', 1)])|dict_keys(['a'])|dict_values([1])|1)"},
      {R"({{ ([1, 2]|select('odd'))[0] }}|{{ ([1, 2]|map('string')|list)[0] }}|{{ {'a': 1}.keys()[0] }})",
       R"(|1|)"},
      {R"({{ [1, 2]|batch(1)|reverse }}|{{ [1, 2]|select|first }}|{{ 'b' in ['a', 'b']|map('lower') }})",
       R"([[2], [1]]|1|True)"},
      {R"({{ [1, 2]|select('odd') is sequence }}|{{ [1, 2]|select('odd') is iterable }}|{{ {'a': 1}.keys() is sequence }})",
       R"(False|True|False)"},
      {R"({{ 3.5 is odd }}|{{ 3 is odd }}|{{ -3 is odd }}|{{ -4 is even }}|{{ 2.0 is even }})",
       R"(False|True|True|True|True)"},
      {R"({{ [1] is lower }}|{{ 'abc'|list is lower }}|{{ {'a': 1}|last }}|{{ '{}' % [1] }})",
       R"(False|True|a|{})"},
  };
  check_cases(cases);
}

TEST(Jinja, SortedContextKeysWithPlainJson) {
  // nlohmann::json sorts object keys; ordered_json keeps them (as Python dicts do).
  const Template t = Template::parse("{{ d|tojson }}|{% for k in d %}{{ k }}{% endfor %}");
  EXPECT_EQ(t.render(nlohmann::json::parse(R"({"d": {"b": 1, "a": 2}})")), R"({"a": 2, "b": 1}|ab)");
  EXPECT_EQ(t.render(nlohmann::ordered_json::parse(R"({"d": {"b": 1, "a": 2}})")), R"({"b": 1, "a": 2}|ba)");
}

TEST(Jinja, NullContextAndReuse) {
  const Template t = Template::parse("{{ x|default('none') }}");
  EXPECT_EQ(t.render(nlohmann::json()), "none");
  EXPECT_EQ(t.render(nlohmann::json{{"x", 1}}), "1");
  EXPECT_EQ(t.render(nlohmann::json{{"x", "again"}}), "again");  // a Template renders many times
}

TEST(Jinja, ConcurrentRendersOfOneTemplate) {
  const Template t = Template::parse(
      "{% macro m(x) %}[{{ x|upper }}]{% endmacro %}{% set ns = namespace(n=0) %}"
      "{% for msg in messages %}{% set ns.n = ns.n + 1 %}{{ m(msg.role) }}{{ msg.content|tojson }}{% endfor %}{{ ns.n }}");
  const auto context = nlohmann::ordered_json::parse(kContext);
  const std::string expected = t.render(context);
  std::vector<std::thread> threads;
  std::vector<int> mismatches(4, 0);
  for (int k = 0; k < 4; ++k) {
    threads.emplace_back([&, k] {
      for (int i = 0; i < 200; ++i) mismatches[k] += t.render(context) != expected;
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(mismatches, std::vector<int>(4, 0));
  EXPECT_EQ(expected.substr(0, 19), R"([SYSTEM]"Be brief.")");
}

TEST(Jinja, StrftimeNowUsesTheClock) {
  const Template t = Template::parse("{{ strftime_now('%Y') }}");
  const std::string year = t.render(nlohmann::json::object());  // the real clock
  EXPECT_EQ(year.size(), 4u);
  EXPECT_GE(std::stoi(year), 2024);
}

}  // namespace
}  // namespace kestrel::jinja
