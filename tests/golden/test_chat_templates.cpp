// Real chat templates against Python jinja2 with transformers' settings: every case of
// tests/golden/chat_templates/expected.json (written by generate.py there) renders to exactly
// the stored text, or fails with a TemplateError where jinja2 failed. Where jinja2 failed only
// because an attribute of an undefined value was read, kestrel (lenient there) must give the
// stored "lenient_output" (jinja2's ChainableUndefined).
#include <gtest/gtest.h>

#include <chrono>

#include "chat_template_sources.h"
#include "template/chat_render.h"
#include "template/jinja.h"

namespace kestrel {
namespace {

void check_template(const std::string& name) {
  const auto expected = test::read_chat_golden_json("expected.json");
  const auto conversations = test::read_chat_golden_json("conversations.json");
  const auto tools = test::read_chat_golden_json("tools.json");
  const std::string where = expected.at("templates").at(name).get<std::string>();
  KESTREL_REQUIRE_FILE(test::chat_template_path(where));
  const jinja::Template tmpl = jinja::Template::parse(test::load_chat_template(where));
  int n_cases = 0;
  for (const auto& c : expected.at("cases")) {
    if (c.at("template") != name) continue;
    ++n_cases;
    const std::string conv = c.at("conversation").get<std::string>();
    SCOPED_TRACE(name + " / " + conv + (c.at("tools").get<bool>() ? " / tools" : "") +
                 (c.at("add_generation_prompt").get<bool>() ? " / add_generation_prompt" : ""));
    ChatTemplateInputs in;
    in.messages = conversations.at(conv);
    if (c.at("tools").get<bool>()) in.tools = tools;
    in.add_generation_prompt = c.at("add_generation_prompt").get<bool>();
    in.bos_token = expected.at("bos_token").get<std::string>();
    in.eos_token = expected.at("eos_token").get<std::string>();
    in.options.now = std::chrono::system_clock::from_time_t(expected.at("now").get<int64_t>());
    const bool want_error = c.contains("error") && !c.contains("lenient_output");
    try {
      const std::string out = render_chat_template(tmpl, in);
      if (want_error) {
        ADD_FAILURE() << "jinja2 failed (" << c.at("error").get<std::string>() << ") but kestrel rendered:\n" << out;
      } else {
        EXPECT_EQ(out, c.contains("output") ? c.at("output").get<std::string>() : c.at("lenient_output").get<std::string>());
      }
    } catch (const jinja::TemplateError& e) {
      if (!want_error) ADD_FAILURE() << "TemplateError: " << e.what();
    }
  }
  EXPECT_GT(n_cases, 0);
}

TEST(ChatTemplateGolden, Qwen2TokenizerConfig) { check_template("qwen2"); }
TEST(ChatTemplateGolden, Phi3Gguf) { check_template("phi3"); }
TEST(ChatTemplateGolden, SmolLM2Gguf) { check_template("smollm2"); }
TEST(ChatTemplateGolden, ToolsChatml) { check_template("tools_chatml"); }
TEST(ChatTemplateGolden, HeaderStyle) { check_template("header_style"); }
TEST(ChatTemplateGolden, Alternating) { check_template("alternating"); }
TEST(ChatTemplateGolden, KitchenSink) { check_template("kitchen_sink"); }
TEST(ChatTemplateGolden, GemmaTurns) { check_template("gemma_turns"); }

TEST(ChatTemplateGolden, GemmaTurnsByHand) {
  // Written from the Gemma turn format, independently of jinja2: the system text opens the first
  // user turn after a blank line, the assistant's turns are "model", the generation prompt opens one.
  ChatTemplateInputs in;
  in.messages = test::read_chat_golden_json("conversations.json").at("system_user_assistant");
  in.add_generation_prompt = true;
  in.bos_token = "<bos>";
  EXPECT_EQ(render_chat_template(test::read_file(test::chat_golden_dir() + "/gemma_turns.jinja"), in),
            "<bos><start_of_turn>user\nYou are a concise assistant.\n\nWhat is the capital of France?<end_of_turn>\n"
            "<start_of_turn>model\nParis.<end_of_turn>\n"
            "<start_of_turn>user\nAnd of Italy?<end_of_turn>\n"
            "<start_of_turn>model\n");
}

TEST(ChatTemplateGolden, ErrorsAsJinja2Reports) {
  // The alternation check of the Mistral-style template: raise_exception's text comes through.
  ChatTemplateInputs in;
  in.messages = test::read_chat_golden_json("conversations.json").at("assistant_first");
  try {
    render_chat_template(test::read_file(test::chat_golden_dir() + "/alternating.jinja"), in);
    ADD_FAILURE() << "rendered";
  } catch (const jinja::TemplateError& e) {
    EXPECT_EQ(e.kind(), jinja::TemplateError::Kind::Raised);
    EXPECT_STREQ(e.what(), "Conversation roles must alternate user/assistant/user/assistant/...");
  }
}

TEST(ChatTemplateGolden, SelectChatTemplate) {
  const auto list = nlohmann::json::parse(
      R"([{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}, {"name": "rag", "template": "R"}])");
  EXPECT_EQ(select_chat_template(list, false), "D");
  EXPECT_EQ(select_chat_template(list, true), "T");
  EXPECT_EQ(select_chat_template(list, true, "rag"), "R");
  EXPECT_EQ(select_chat_template(nlohmann::json("S"), true), "S");
  EXPECT_THROW(select_chat_template(nlohmann::json::parse(R"([{"name": "x", "template": "X"}])"), false), Error);
  EXPECT_THROW(select_chat_template(list, false, "missing"), Error);
  EXPECT_THROW(select_chat_template(nlohmann::json(3), false), Error);
}

TEST(ChatTemplateGolden, ExtraVariablesOverride) {
  ChatTemplateInputs in;
  in.messages = nlohmann::ordered_json::parse(R"([{"role": "user", "content": "Hi"}])");
  in.bos_token = "<s>";
  in.extra = {{"enable_thinking", false}, {"bos_token", "<BOS>"}};
  EXPECT_EQ(render_chat_template("{{ bos_token }}{{ messages[0].content }}{% if enable_thinking is false %} /no_think{% endif %}"
                                 "{{ tools }}{{ documents }}{{ add_generation_prompt }}",
                                 in),
            "<BOS>Hi /no_thinkNoneNoneFalse");
  in.extra = nlohmann::ordered_json::array();
  EXPECT_THROW(render_chat_template("x", in), Error);
}

}  // namespace
}  // namespace kestrel
