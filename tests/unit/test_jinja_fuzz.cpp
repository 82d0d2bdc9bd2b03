// Templates are untrusted input: random mutations of the real chat templates (and random token
// soup) must either render or fail with TemplateError; never another exception, a crash, a hang
// or unbounded memory. Run under ASan/UBSan by scripts/test.sh. Seeded, so failures reproduce;
// KESTREL_JINJA_FUZZ_ITERS scales the number of mutants per template (default 400).
#include <gtest/gtest.h>

#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "chat_template_sources.h"
#include "core/env.h"
#include "template/chat_render.h"
#include "template/jinja.h"

namespace kestrel {
namespace {

const char* const kFragments[] = {
    "{{", "}}", "{%", "%}", "{%-", "-%}", "{{-", "-}}", "{#", "#}", "{% endfor %}", "{% endif %}",
    "{% for x in messages %}", "{% if x %}", "{% elif y %}", "{% else %}", "|", "|tojson", "|tojson(indent=2)",
    "|join(', ')", "|length", "|map(attribute='role')", "|selectattr('role', 'equalto', 'user')", "|list", "|first",
    "|sort", "|unique", "|trim", "|int", "|round(2)", "|indent(4)", "|replace('a', 'bb')", "|format(1)", "(", ")", "[",
    "]", "{", "}", "'", "\"", "\\", ".", ",", ":", "~", "+", "-", "*", "**", "//", "%", " is ", " is not ", " not ",
    " in ", " and ", " or ", " if ", " else ", "loop.", "loop.index", "loop.previtem", "loop.cycle(1, 2)", "ns.",
    "namespace(x=1)", "{% set ns = namespace(a=[]) %}", "{% set ns.a = ns.a + ns.a %}", "range(99999)", "range(3)",
    "messages", "messages[0]", "messages[1:]", "messages[::-1]", "none", "true", "999999999999999999", "-1", "0.5e308",
    "'x' * 99999", "raise_exception('boom')", "strftime_now('%Y')", "caller()", "{% macro m(a, b=1) %}",
    "{% endmacro %}", "m()", "m(m())", "{% set x = ", " = ", "{% break %}", "{% continue %}", "{% raw %}",
    "{% endraw %}", "\xff", "\xc3", "\xc3\xa9", "\xe2\x80\xa8", "\n", " ", "  ", "\t", "{% generation %}",
    "{% endgeneration %}", "{% call m() %}", "{% endcall %}", "{% filter upper %}", "{% endfilter %}",
    "{% with a = 1 %}", "{% endwith %}", "varargs", "kwargs", "'%s %d' % (1, 2)", "'{}'.format(1)", "tools",
    "add_generation_prompt", "dict(a=1)", "joiner()", "x.split()", ".items()", ".get('role')",
};

int iterations() {
  if (auto e = env_var(EnvVar::JinjaFuzzIters)) return std::max(1, std::atoi(e->c_str()));
  return 400;
}

std::string mutate(const std::string& source, std::mt19937_64& rng) {
  std::string s = source;
  const int n_mutations = rng() % 2 == 0 ? 1 : 2 + static_cast<int>(rng() % 3);
  for (int m = 0; m < n_mutations; ++m) {
    const size_t pos = s.empty() ? 0 : rng() % (s.size() + 1);
    switch (rng() % 5) {
      case 0: {  // delete a range
        const size_t len = 1 + rng() % 20;
        if (pos < s.size()) s.erase(pos, len);
        break;
      }
      case 1:  // insert a fragment
        s.insert(pos, kFragments[rng() % (sizeof(kFragments) / sizeof(kFragments[0]))]);
        break;
      case 2: {  // duplicate a range
        if (pos >= s.size()) break;
        const size_t len = std::min<size_t>(1 + rng() % 200, s.size() - pos);
        s.insert(pos, s.substr(pos, len));
        break;
      }
      case 3:  // overwrite a byte
        if (pos < s.size()) s[pos] = static_cast<char>(rng() % 256);
        break;
      default: {  // move a range elsewhere
        if (pos >= s.size()) break;
        const size_t len = std::min<size_t>(1 + rng() % 50, s.size() - pos);
        const std::string piece = s.substr(pos, len);
        s.erase(pos, len);
        s.insert(s.empty() ? 0 : rng() % (s.size() + 1), piece);
      }
    }
  }
  return s;
}

struct Tally {
  int parsed = 0;
  int rendered = 0;
  int template_errors = 0;
};

// Parses and renders with a few conversations; anything but TemplateError fails the test.
void try_source(const std::string& source, const std::vector<ChatTemplateInputs>& inputs, Tally& tally) {
  try {
    const jinja::Template t = jinja::Template::parse(source);
    ++tally.parsed;
    for (const ChatTemplateInputs& in : inputs) {
      try {
        const std::string out = render_chat_template(t, in);
        EXPECT_LE(out.size(), in.options.limits.max_output_bytes);
        ++tally.rendered;
      } catch (const jinja::TemplateError&) {
        ++tally.template_errors;
      }
    }
  } catch (const jinja::TemplateError&) {
    ++tally.template_errors;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not a TemplateError: " << e.what() << "\nsource:\n" << source;
  }
}

std::vector<ChatTemplateInputs> fuzz_inputs() {
  const auto conversations = test::read_chat_golden_json("conversations.json");
  const auto tools = test::read_chat_golden_json("tools.json");
  std::vector<ChatTemplateInputs> out;
  for (const char* conv : {"system_user_assistant", "tool_calls", "content_parts"}) {
    ChatTemplateInputs in;
    in.messages = conversations.at(conv);
    in.tools = tools;
    in.add_generation_prompt = true;
    in.bos_token = "<s>";
    in.eos_token = "</s>";
    in.options.limits.max_work = 2'000'000;  // small bounds keep the run short
    in.options.limits.max_output_bytes = 1 << 20;
    in.options.limits.max_list_items = 1 << 16;
    out.push_back(std::move(in));
  }
  return out;
}

TEST(JinjaFuzz, MutatedRealTemplatesRenderOrFail) {
  const auto templates = test::load_chat_templates();
  ASSERT_GE(templates.size(), 4u);  // the golden folder's own templates at least
  const std::vector<ChatTemplateInputs> inputs = fuzz_inputs();
  std::mt19937_64 rng(20251130);
  Tally tally;
  int n = 0;
  for (const auto& [name, text] : templates) {
    for (int i = 0; i < iterations(); ++i, ++n) try_source(mutate(text, rng), inputs, tally);
  }
  // Most mutants still parse; some render and some fail: both paths are exercised.
  EXPECT_GT(tally.parsed, n / 10);
  EXPECT_GT(tally.rendered, 0);
  EXPECT_GT(tally.template_errors, 0);
  std::printf("%d mutants: %d parsed; %d renders and %d TemplateErrors\n", n, tally.parsed, tally.rendered,
              tally.template_errors);
}

TEST(JinjaFuzz, TokenSoupRendersOrFails) {
  const std::vector<ChatTemplateInputs> inputs = fuzz_inputs();
  std::mt19937_64 rng(7);
  Tally tally;
  const size_t n_fragments = sizeof(kFragments) / sizeof(kFragments[0]);
  for (int i = 0; i < iterations() * 5; ++i) {
    std::string s;
    const int len = 1 + static_cast<int>(rng() % 40);
    for (int k = 0; k < len; ++k) s += kFragments[rng() % n_fragments];
    try_source(s, {inputs[0]}, tally);
  }
  EXPECT_GT(tally.parsed, 0);
}

}  // namespace
}  // namespace kestrel
