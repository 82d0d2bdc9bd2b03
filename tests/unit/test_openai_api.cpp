// The server's logprobs objects (server/openai_api.h) on the stories260K tokenizer: every generated
// token is listed (a final EOS too), and text_offset points into the text the response returns,
// for generated tokens and for an echoed prompt with special tokens.
#include <gtest/gtest.h>

#include <limits>
#include <string>
#include <vector>

#include "server/openai_api.h"
#include "test_util.h"

namespace kestrel::cli {
namespace {

std::unique_ptr<Tokenizer> stories_tokenizer() {
  const auto model = LlamaModel::load_gguf(test::data_dir() + "/stories260K/stories260K.gguf");
  return Tokenizer::from_gguf(model->file());
}

LogprobSummary summary(int32_t id, float logprob) { return LogprobSummary{{id, logprob}, {}}; }

// Each token's text_offset, checked against the text: a token's text starts there (or without
// its leading space: SentencePiece's dummy prefix, which the text may not have), or the token adds
// no text (the next token starts at the same offset: a BOS the server added).
void expect_offsets_point_into(const Json& lp, const std::string& text) {
  const auto& tokens = lp.at("tokens");
  const auto& offsets = lp.at("text_offset");
  ASSERT_EQ(tokens.size(), offsets.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    const std::string t = tokens[i];
    const auto at = offsets[i].get<size_t>();  // ASCII here: characters are bytes
    ASSERT_LE(at, text.size()) << i;
    const bool here =
        text.compare(at, t.size(), t) == 0 || (t[0] == ' ' && text.compare(at, t.size() - 1, t, 1) == 0);
    const bool next_here = i + 1 < offsets.size() && offsets[i + 1] == offsets[i];  // added no text
    EXPECT_TRUE(here || next_here) << "token " << i << " [" << t << "] at " << at << " of [" << text << "]";
  }
}

// lm-evaluation-harness scores the last entry as the answer's last token: a generated EOS
// ("stop") must be listed, not dropped (it was: 16 entries for 16 prompt tokens + 1 generated).
TEST(OpenAiApi, LoggedTokensKeepAFinalStopToken) {
  KESTREL_REQUIRE_FILE(test::data_dir() + "/stories260K/stories260K.gguf");
  const auto tok = stories_tokenizer();
  const int32_t eos = tok->eos_id();
  RequestOutput o;
  o.new_token_ids = {eos};
  o.logprobs = {summary(eos, -0.25f)};
  o.finished = true;
  o.finish_reason = "stop";
  const LoggedTokens t = logged_tokens(o);
  ASSERT_EQ(t.ids, (std::vector<int32_t>{eos}));
  int64_t offset = 7;
  const Json lp = completion_logprobs(*tok, t, &offset);
  EXPECT_EQ(lp["tokens"], Json::array({"</s>"}));
  EXPECT_EQ(lp["token_logprobs"], Json::array({-0.25}));
  EXPECT_EQ(lp["text_offset"], Json::array({7}));
  EXPECT_EQ(offset, 7);  // no characters: the text leaves EOS out
  // Chat lists it too.
  EXPECT_EQ(chat_logprobs(*tok, t)["content"].size(), 1u);

  // Text tokens before it advance the offset by their characters; no logprobs asked: nothing.
  const std::vector<int32_t> story = tok->encode("Once upon a time", false, false);
  RequestOutput more;
  more.new_token_ids = story;
  for (int32_t id : story) more.logprobs.push_back(summary(id, -1.0f));
  more.new_token_ids.push_back(eos);
  more.logprobs.push_back(summary(eos, -0.5f));
  offset = 0;
  const Json lp2 = completion_logprobs(*tok, logged_tokens(more), &offset);
  EXPECT_EQ(lp2["tokens"].size(), story.size() + 1);
  EXPECT_EQ(lp2["text_offset"].back(), std::string(" Once upon a time").size());
  EXPECT_EQ(offset, static_cast<int64_t>(std::string(" Once upon a time").size()));
  more.logprobs.clear();
  EXPECT_TRUE(logged_tokens(more).ids.empty());
}

// A text prompt with special-token text is echoed as given; each text_offset points at its token's
// text there, special tokens included (they used to add no characters, shifting every later
// offset). The BOS the server adds is not in the text and adds nothing.
TEST(OpenAiApi, EchoOffsetsFollowATextPromptWithSpecialTokens) {
  KESTREL_REQUIRE_FILE(test::data_dir() + "/stories260K/stories260K.gguf");
  const auto tok = stories_tokenizer();
  const std::string text = "Once upon a time</s>Lily<s> ran";
  const std::vector<int32_t> ids = tok->encode(text, /*add_special=*/true, /*parse_special=*/true);
  ASSERT_EQ(ids.front(), tok->bos_id());
  ASSERT_EQ(std::count(ids.begin(), ids.end(), tok->eos_id()), 1);
  int64_t offset = 0;
  const Json lp = echo_logprobs(*tok, ids, {}, text, &offset);
  EXPECT_EQ(offset, static_cast<int64_t>(text.size()));
  expect_offsets_point_into(lp, text);
  const auto eos_at = std::find(ids.begin(), ids.end(), tok->eos_id()) - ids.begin();
  EXPECT_EQ(lp["text_offset"][eos_at], text.find("</s>"));
  EXPECT_EQ(lp["text_offset"][eos_at + 1], text.find("Lily"));
  EXPECT_EQ(lp["text_offset"][0], 0);
  EXPECT_EQ(lp["text_offset"][1], 0);  // BOS added no characters
}

// The same prompt as token ids is echoed with its special tokens (prompt_text decodes them), and
// the offsets follow that text.
TEST(OpenAiApi, EchoOfTokenIdsKeepsSpecialTokens) {
  KESTREL_REQUIRE_FILE(test::data_dir() + "/stories260K/stories260K.gguf");
  const auto tok = stories_tokenizer();
  const std::vector<int32_t> ids = tok->encode("Once upon a time</s>Lily", true, true);
  OpenAiRequest r;
  r.prompts.push_back({"", ids});
  const std::string echoed = prompt_text(r, *tok);
  // The decoded ids: "Lily" after </s> was encoded with SentencePiece's dummy-prefix space.
  EXPECT_EQ(echoed, "<s>Once upon a time</s> Lily");
  int64_t offset = 3;  // as if the choice's text had 3 characters before
  const Json lp = echo_logprobs(*tok, ids, {}, echoed, &offset);
  EXPECT_EQ(offset, 3 + static_cast<int64_t>(echoed.size()));
  Json shifted = lp;
  for (auto& o : shifted["text_offset"]) o = o.get<int64_t>() - 3;
  expect_offsets_point_into(shifted, echoed);
  EXPECT_EQ(shifted["text_offset"][1], 3);  // "Once" after "<s>"
}


// The first word of a SentencePiece prompt is tokenized with a leading space the text does not
// have ("▁Once"): echoed, its token is listed as the text it covers, "Once" (it was " Once" at
// text_offset 0 of "Once upon..."), and so is the chosen token among its top alternatives.
TEST(OpenAiApi, EchoListsTheFirstWordWithoutSentencePiecesSpace) {
  KESTREL_REQUIRE_FILE(test::data_dir() + "/stories260K/stories260K.gguf");
  const auto tok = stories_tokenizer();
  const std::string text = "Once upon a time";
  const std::vector<int32_t> ids = tok->encode(text, /*add_special=*/true, /*parse_special=*/true);
  ASSERT_GE(ids.size(), 3u);
  ASSERT_EQ(ids[0], tok->bos_id());
  ASSERT_EQ(tok->token_to_piece(ids[1]), " Once");  // the tokenizer's space
  std::vector<LogprobSummary> prompt_logprobs;
  for (size_t i = 1; i < ids.size(); ++i) {
    LogprobSummary s = summary(ids[i], -1.5f);
    s.top = {{ids[i], -1.5f}, {ids[(i % (ids.size() - 1)) + 1], -2.0f}};
    prompt_logprobs.push_back(s);
  }
  int64_t offset = 0;
  const Json lp = echo_logprobs(*tok, ids, prompt_logprobs, text, &offset);
  EXPECT_EQ(offset, static_cast<int64_t>(text.size()));
  ASSERT_EQ(lp["tokens"].size(), ids.size());
  EXPECT_EQ(lp["tokens"][0], "<s>");
  EXPECT_EQ(lp["tokens"][1], "Once");
  EXPECT_EQ(lp["text_offset"][1], 0);
  EXPECT_EQ(lp["tokens"][2], tok->token_to_piece(ids[2]));  // later words keep their space: the text has it
  EXPECT_EQ(lp["tokens"][2].get<std::string>()[0], ' ');
  // Each token's text is the text at its offset.
  for (size_t i = 1; i < ids.size(); ++i) {
    const std::string t = lp["tokens"][i];
    EXPECT_EQ(text.substr(lp["text_offset"][i].get<size_t>(), t.size()), t) << i;
    EXPECT_EQ(lp["top_logprobs"][i][t], -1.5) << i << " " << lp["top_logprobs"][i].dump();
  }
  EXPECT_FALSE(lp["top_logprobs"][1].contains(" Once"));
}
// vLLM's prompt_logprobs: null for the first token, then each position's prompt token (its own
// rank) and the n_top likeliest (ranks 1..n_top), keyed by id, one already listed not repeated;
// a position the engine did not score is null.
TEST(OpenAiApi, PromptLogprobsInVllmsShape) {
  KESTREL_REQUIRE_FILE(test::data_dir() + "/stories260K/stories260K.gguf");
  const auto tok = stories_tokenizer();
  const std::vector<int32_t> prompt = {1, 403, 407, 261};
  std::vector<LogprobSummary> lps(2);
  lps[0] = LogprobSummary{{403, -0.5f}, {{403, -0.5f}, {385, -1.5f}, {9, -3.0f}}, 1};
  lps[1] = LogprobSummary{{407, -4.0f}, {{383, -0.1f}, {385, -2.5f}}, 7};
  const Json pl = prompt_logprobs_json(*tok, prompt, lps, 2);
  ASSERT_EQ(pl.size(), 4u);
  EXPECT_TRUE(pl[0].is_null());
  EXPECT_TRUE(pl[3].is_null());  // not scored
  EXPECT_EQ(pl[1].size(), 2u);   // 403 is the top one; 9 is past n_top
  EXPECT_EQ(pl[1]["403"], (Json{{"logprob", -0.5}, {"rank", 1}, {"decoded_token", tok->token_to_piece(403)}}));
  EXPECT_EQ(pl[1]["385"]["rank"], 2);
  EXPECT_EQ(pl[2].size(), 3u);
  EXPECT_EQ(pl[2].begin().key(), "407");  // the prompt token first
  EXPECT_EQ(pl[2]["407"]["rank"], 7);
  EXPECT_EQ(pl[2]["383"]["rank"], 1);
  EXPECT_EQ(pl[2]["385"]["rank"], 2);
  EXPECT_EQ(prompt_logprobs_json(*tok, prompt, lps, 0)[2].size(), 1u);
}

// A token a mask or a bias rules out has logprob -inf, which JSON cannot hold (the library writes
// null, which OpenAI's schema does not allow): every logprob field gives it as -9999.0, as vLLM does.
TEST(OpenAiApi, MaskedTokensLogprobIsMinus9999NotNull) {
  KESTREL_REQUIRE_FILE(test::data_dir() + "/stories260K/stories260K.gguf");
  const auto tok = stories_tokenizer();
  const float inf = std::numeric_limits<float>::infinity();
  RequestOutput o;
  o.new_token_ids = {403};
  o.logprobs = {LogprobSummary{{403, -0.5f}, {{403, -0.5f}, {385, -inf}}, 1}};
  const LoggedTokens t = logged_tokens(o);
  int64_t offset = 0;
  const Json lp = completion_logprobs(*tok, t, &offset);
  EXPECT_EQ(lp["top_logprobs"][0][tok->token_to_piece(385)], -9999.0);
  const Json chat = chat_logprobs(*tok, t)["content"][0];
  EXPECT_EQ(chat["top_logprobs"][1]["logprob"], -9999.0);
  const std::vector<int32_t> prompt = {1, 403};
  const std::vector<LogprobSummary> lps = {LogprobSummary{{403, -inf}, {{385, -0.1f}}, 900}};
  const Json pl = prompt_logprobs_json(*tok, prompt, lps, 1);
  EXPECT_EQ(pl[1]["403"]["logprob"], -9999.0);
  EXPECT_EQ(lp.dump().find("null"), std::string::npos);
}


}  // namespace
}  // namespace kestrel::cli
