// Gemma 3 270M (models/gemma-3-270m-q4_k_m.gguf, scripts/fetch_model.sh gemma3-270m). The
// tokenizer read from the GGUF must give Hugging Face transformers' prompt ids for the prompts of ../shared/data/gemma3-270m/greedy-transformers.json
// and decode its continuations to transformers' text; the GGUF reader must read the file's
// metadata and tensor directory as llama.cpp wrote them; greedy decoding must follow transformers'.
#include <gtest/gtest.h>

#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#if KESTREL_HAS_CUDA
#include "backend/cuda/cuda_runner.h"
#endif
#include "engine/engine.h"
#include "io/gguf.h"
#include "model/llama_weights.h"
#include "template/chat_render.h"
#include "test_util.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/tokenizer_source.h"

namespace kestrel {
namespace {

std::string gemma_path() { return test::model_dir() + "/gemma-3-270m-q4_k_m.gguf"; }
std::string transcripts_path() { return test::data_dir() + "/gemma3-270m/greedy-transformers.json"; }

TEST(Gemma3_270m, TokenizerMatchesTransformersPromptIds) {
  KESTREL_REQUIRE_FILE(gemma_path());
  KESTREL_REQUIRE_FILE(transcripts_path());
  const auto tok = load_tokenizer(gemma_path());
  EXPECT_EQ(tok->kind(), TokenizerKind::SPM);
  EXPECT_EQ(tok->n_vocab(), 262144);
  EXPECT_EQ(tok->bos_id(), 2);
  EXPECT_EQ(tok->eos_id(), 1);
  EXPECT_TRUE(tok->add_bos());
  EXPECT_FALSE(tok->add_eos());
  const auto cases = nlohmann::json::parse(test::read_file(transcripts_path())).at("cases");
  ASSERT_EQ(cases.size(), 6u);
  for (const auto& c : cases) {
    const std::string prompt = c.at("prompt").get<std::string>();
    const auto want = c.at("prompt_ids").get<std::vector<int32_t>>();
    EXPECT_EQ(tok->encode(prompt, /*add_special=*/true, /*parse_special=*/false), want) << prompt;
    EXPECT_EQ(tok->encode(prompt, /*add_special=*/true, /*parse_special=*/true), want) << prompt;
    // No dummy-prefix space (add_space_prefix false): the text comes back as it went in.
    EXPECT_EQ(tok->decode(want, /*skip_special=*/true), prompt);
  }
}

TEST(Gemma3_270m, TokenizerDecodesTransformersContinuations) {
  KESTREL_REQUIRE_FILE(gemma_path());
  KESTREL_REQUIRE_FILE(transcripts_path());
  const auto tok = load_tokenizer(gemma_path());
  const auto cases = nlohmann::json::parse(test::read_file(transcripts_path())).at("cases");
  for (const auto& c : cases) {
    const auto ids = c.at("output_ids").get<std::vector<int32_t>>();
    const std::string text = c.at("text").get<std::string>();
    ASSERT_EQ(ids.size(), 32u);
    EXPECT_EQ(tok->decode(ids, /*skip_special=*/false, /*continuation=*/true), text);
    // Prompt and continuation decode to the concatenation of their texts.
    auto all = c.at("prompt_ids").get<std::vector<int32_t>>();
    all.insert(all.end(), ids.begin(), ids.end());
    EXPECT_EQ(tok->decode(all, /*skip_special=*/true), c.at("prompt").get<std::string>() + text);
  }
  // <end_of_turn> ends generation besides <eos>; <start_of_turn> does not.
  EXPECT_TRUE(tok->is_eog(1));
  EXPECT_TRUE(tok->is_eog(106));
  EXPECT_FALSE(tok->is_eog(105));
}

// Ids from transformers 5.24.0 (tokenizers 0.23.3): AutoTokenizer.from_pretrained(models/,
// gguf_file="gemma-3-270m-q4_k_m.gguf"), which reproduces the six prompts' ids above;
// split_special_tokens = !parse_special. They cover the turn markers, whitespace runs (spaces are
// merged as pieces, so a run past the longest token, 31, splits 16 + 24; a literal U+2581 joins a
// run), newline and tab runs (added tokens, cut out longest first), HTML tags (user-defined),
// byte fallback for characters outside the vocabulary, and a carriage return.
TEST(Gemma3_270m, TokenizerMatchesTransformersOnTurnsWhitespaceAndBytes) {
  KESTREL_REQUIRE_FILE(gemma_path());
  const auto tok = load_tokenizer(gemma_path());
  struct Case {
    std::string text;
    bool parse_special;
    std::vector<int32_t> ids;
  };
  const std::vector<Case> cases = {
      {"<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n", true,
       {2, 105, 2364, 107, 3689, 563, 236743, 236778, 236862, 236778, 236881, 106, 107, 105, 4368, 107}},
      {"<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n", false,
       {2, 236820, 3041, 236779, 1340, 236779, 887, 236813, 2364, 107, 3689, 563, 236743, 236778, 236862, 236778,
        145912, 643, 236779, 1340, 236779, 887, 236813, 107}},
      {"x" + std::string(40, ' ') + "y", true, {2, 236781, 152, 160, 236762}},
      {"a \u2581\u2581\u2581b \u2581c", true, {2, 236746, 140, 236763, 138, 236755}},
      {std::string(33, '\n') + "\t\t\t<table><td>cell</td></table>", true, {2, 137, 108, 255970, 168, 175, 5447, 183, 176}},
      {"\u00dcn\u00efc\u00f6d\u00e9 \U0001d518\U0001d52b\U0001d526 \U0001f999 \u65e5\u672c\u8a9e", true,
       {2, 238194, 236749, 238527, 236755, 55515, 236859, 236743, 478, 395, 386, 390, 478, 395, 386, 409, 254865,
        236743, 478, 397, 404, 391, 33375, 238582}},
      {"def f(x):\n    return x  # two\n\n\n", true,
       {2, 2063, 517, 236769, 236781, 1473, 107, 140, 2060, 1123, 138, 236865, 1156, 109}},
      {"x\r\ny", true, {2, 236781, 251, 107, 236762}},
  };
  for (const Case& c : cases) {
    const auto ids = tok->encode(c.text, /*add_special=*/true, c.parse_special);
    EXPECT_EQ(ids, c.ids) << "'" << c.text << "' parse_special=" << c.parse_special;
    // Decoding (after BOS) gives the text back, except the literal U+2581, which is a space once
    // encoded.
    const std::vector<int32_t> after_bos(ids.begin() + (ids.empty() ? 0 : 1), ids.end());
    if (c.text.find("\u2581") == std::string::npos) EXPECT_EQ(tok->decode(after_bos), c.text);
  }
}

// The whitespace-run rule on a vocabulary of its own (no model file needed): runs of 2..4 spaces are
// USER_DEFINED tokens spelled with spaces, as llama.cpp's converter writes Gemma's, scored -1000.
// They merge pairwise before anything else, shorter runs first, as transformers' Gemma tokenizer
// does: five spaces become 2 + 3, not the longest token first (4 + "▁b"), and a literal U+2581
// joins the run. Newline runs stay added tokens cut out of the text first.
TEST(Gemma3_270m, SpaceRunTokensMergeAsPieces) {
  TokenizerSpec spec;
  spec.kind = TokenizerKind::SPM;
  auto add = [&](std::string text, float score, TokenType type) {
    spec.tokens.push_back({std::move(text), score, type});
    return static_cast<int32_t>(spec.tokens.size() - 1);
  };
  add("<unk>", 0, TokenType::UNKNOWN);
  const int32_t sp2 = add("  ", -1000, TokenType::USER_DEFINED);
  const int32_t sp3 = add("   ", -1000, TokenType::USER_DEFINED);
  const int32_t sp4 = add("    ", -1000, TokenType::USER_DEFINED);
  const int32_t nl = add("\n", -1000, TokenType::USER_DEFINED);
  const int32_t nl2 = add("\n\n", -1000, TokenType::USER_DEFINED);
  const int32_t a = add("a", -1, TokenType::NORMAL);
  const int32_t b = add("b", -2, TokenType::NORMAL);
  const int32_t space = add("\u2581", -3, TokenType::NORMAL);
  const int32_t space_b = add("\u2581b", 0, TokenType::NORMAL);
  spec.unk_id = 0;
  const auto tok = Tokenizer::from_spec(std::move(spec));
  auto enc = [&](const std::string& text) { return tok->encode(text, false, false); };
  EXPECT_EQ(enc("a b"), (std::vector<int32_t>{a, space_b}));
  EXPECT_EQ(enc("a  b"), (std::vector<int32_t>{a, sp2, b}));
  EXPECT_EQ(enc("a    b"), (std::vector<int32_t>{a, sp4, b}));
  EXPECT_EQ(enc("a     b"), (std::vector<int32_t>{a, sp2, sp3, b}));
  EXPECT_EQ(enc("a \u2581b"), (std::vector<int32_t>{a, sp2, b}));
  EXPECT_EQ(enc("a\n\n\nb"), (std::vector<int32_t>{a, nl2, nl, b}));
  EXPECT_EQ(tok->decode(enc("a     b \n\nb")), "a     b \n\nb");
  EXPECT_EQ(enc(" "), (std::vector<int32_t>{space}));
}

// Without tokenizer.chat_template (this GGUF has none) a vocabulary with <start_of_turn> gets the
// Gemma turn format; it renders a conversation as the Gemma-style Jinja golden template does.
TEST(Gemma3_270m, ChatFallbackIsGemmaTurns) {
  const ChatTemplate t = ChatTemplate::detect("", /*has_im_start=*/false, /*has_start_of_turn=*/true);
  ASSERT_EQ(t.kind(), ChatTemplate::Kind::Gemma);
  EXPECT_EQ(t.end_of_turn(), "<end_of_turn>");
  EXPECT_EQ(ChatTemplate::detect("", false, false).kind(), ChatTemplate::Kind::Plain);
  EXPECT_EQ(ChatTemplate::detect("", true, true).kind(), ChatTemplate::Kind::ChatML);
  EXPECT_EQ(ChatTemplate::detect("{{ '<start_of_turn>' }}", false).kind(), ChatTemplate::Kind::Gemma);
  const std::vector<ChatMessage> conv = {{"system", "You are a concise assistant."},
                                         {"user", "  What is the capital of France?  "},
                                         {"assistant", "Paris."},
                                         {"user", "And of Italy?"}};
  EXPECT_EQ(t.apply(conv, true),
            "<start_of_turn>user\nYou are a concise assistant.\n\nWhat is the capital of France?<end_of_turn>\n"
            "<start_of_turn>model\nParis.<end_of_turn>\n"
            "<start_of_turn>user\nAnd of Italy?<end_of_turn>\n"
            "<start_of_turn>model\n");
  EXPECT_EQ(t.apply({{"user", "Hi"}}, false), "<start_of_turn>user\nHi<end_of_turn>\n");
  // The same conversations through the Jinja engine and the golden template (BOS left to the encoder).
  const std::string tmpl = test::read_file(std::string(KESTREL_TEST_SOURCE_DIR) + "/golden/chat_templates/gemma_turns.jinja");
  ChatTemplateInputs in;
  in.messages = nlohmann::ordered_json::array();
  for (const ChatMessage& m : conv) in.messages.push_back({{"role", m.role}, {"content", m.content}});
  in.add_generation_prompt = true;
  EXPECT_EQ(render_chat_template(tmpl, in), t.apply(conv, true));
}

// The metadata llama.cpp writes for gemma3 (the keys the architecture reads) and the tensor
// directory: 18 layers of 13 tensors plus the embedding (tied output) and the final norm.
TEST(Gemma3_270m, GgufMetadataAndTensors) {
  KESTREL_REQUIRE_FILE(gemma_path());
  const GgufFile f = GgufFile::open(gemma_path());
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.metadata().size(), 33u);
  EXPECT_EQ(f.get_string("general.architecture"), "gemma3");
  EXPECT_EQ(f.get_int("gemma3.context_length"), 32768);
  EXPECT_EQ(f.get_int("gemma3.embedding_length"), 640);
  EXPECT_EQ(f.get_int("gemma3.block_count"), 18);
  EXPECT_EQ(f.get_int("gemma3.feed_forward_length"), 2048);
  EXPECT_EQ(f.get_int("gemma3.attention.head_count"), 4);
  EXPECT_EQ(f.get_int("gemma3.attention.head_count_kv"), 1);
  EXPECT_EQ(f.get_int("gemma3.attention.key_length"), 256);
  EXPECT_EQ(f.get_int("gemma3.attention.value_length"), 256);
  EXPECT_EQ(f.get_int("gemma3.attention.sliding_window"), 512);
  EXPECT_FLOAT_EQ(static_cast<float>(f.get_float("gemma3.attention.layer_norm_rms_epsilon")), 1e-6f);
  EXPECT_EQ(f.get_float("gemma3.rope.freq_base"), 1e6);
  // Not in the file (llama.cpp fixes them for gemma3): the local layers' RoPE base (1e4) and the
  // sliding-window pattern (5 local : 1 global).
  EXPECT_FALSE(f.has("gemma3.rope.freq_base_swa"));
  EXPECT_FALSE(f.has("gemma3.attention.sliding_window_pattern"));
  EXPECT_FALSE(f.has("tokenizer.chat_template"));
  EXPECT_EQ(f.get_int("general.file_type"), 15);  // MOSTLY_Q4_K_M

  ASSERT_EQ(f.tensors().size(), 236u);
  EXPECT_EQ(f.find_tensor("output.weight"), nullptr);
  struct Want {
    const char* name;
    GgmlType type;
    std::vector<int64_t> ne;
  };
  const std::vector<Want> want = {
      {"token_embd.weight", GgmlType::Q8_0, {640, 262144}},
      {"output_norm.weight", GgmlType::F32, {640}},
      {"blk.0.attn_norm.weight", GgmlType::F32, {640}},
      {"blk.0.attn_q.weight", GgmlType::Q5_0, {640, 1024}},
      {"blk.0.attn_k.weight", GgmlType::Q5_0, {640, 256}},
      {"blk.0.attn_v.weight", GgmlType::Q8_0, {640, 256}},
      {"blk.0.attn_q_norm.weight", GgmlType::F32, {256}},
      {"blk.0.attn_k_norm.weight", GgmlType::F32, {256}},
      {"blk.0.attn_output.weight", GgmlType::Q4_K, {1024, 640}},
      {"blk.0.post_attention_norm.weight", GgmlType::F32, {640}},
      {"blk.0.ffn_norm.weight", GgmlType::F32, {640}},
      {"blk.0.ffn_gate.weight", GgmlType::Q5_0, {640, 2048}},
      {"blk.0.ffn_up.weight", GgmlType::Q5_0, {640, 2048}},
      {"blk.0.ffn_down.weight", GgmlType::Q6_K, {2048, 640}},
      {"blk.0.post_ffw_norm.weight", GgmlType::F32, {640}},
      {"blk.2.attn_v.weight", GgmlType::Q5_0, {640, 256}},
      {"blk.2.ffn_down.weight", GgmlType::Q4_K, {2048, 640}},
      {"blk.17.post_ffw_norm.weight", GgmlType::F32, {640}},
  };
  for (const Want& w : want) {
    const GgufTensorInfo* t = f.find_tensor(w.name);
    ASSERT_NE(t, nullptr) << w.name;
    EXPECT_EQ(t->type, w.type) << w.name;
    EXPECT_EQ(t->ne, w.ne) << w.name;
  }
}

// The model's greedy continuations against transformers' (which dequantizes the same GGUF and runs
// Gemma3ForCausalLM in float32): kestrel's kernels round activations to 16 bits (the CUDA backend
// keeps them, its weights and its KV cache in bf16), so a step whose reference top-1/top-2 margin
// is a near-tie (< 0.05; the smallest margins of the six cases are 0.0048-0.086) may pick the other
// token. Each case must match up to its end or up to a step that is such a near-tie, where the
// comparison stops.
void expect_transformers_transcripts(const LlamaModel& model, std::unique_ptr<ModelRunner> runner, KvDtype kv) {
  ASSERT_EQ(model.hparams().arch, "gemma3");
  EXPECT_EQ(model.hparams().layer_window(0), 512);
  EXPECT_EQ(model.hparams().layer_window(5), 0);
  const auto cases = nlohmann::json::parse(test::read_file(transcripts_path())).at("cases");
  std::vector<std::vector<int32_t>> prompts;
  for (const auto& c : cases) prompts.push_back(c.at("prompt_ids").get<std::vector<int32_t>>());
  EngineConfig config;
  config.kv_dtype = kv;
  config.max_model_len = 256;
  if (runner != nullptr) config.block_size = runner->block_size();
  Engine engine(model, nullptr, config, std::move(runner));
  const auto got = test::greedy_ids(engine, prompts, 32);
  int exact = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto want = cases[i].at("output_ids").get<std::vector<int32_t>>();
    const auto margins = cases[i].at("top1_top2_margins").get<std::vector<double>>();
    size_t k = 0;
    while (k < want.size() && got[i][k] == want[k]) ++k;
    if (k == want.size()) {
      ++exact;
      continue;
    }
    std::printf("case %zu: first difference at step %zu (reference margin %.4f)\n", i, k, margins[k]);
    EXPECT_LT(margins[k], 0.05) << "case " << i << " differs at step " << k << " where the reference is not a near-tie";
  }
  std::printf("%d of %zu continuations equal transformers' in all 32 tokens\n", exact, cases.size());
}

TEST(Gemma3_270m, GreedyTranscriptsMatchTransformers) {
  KESTREL_REQUIRE_FILE(gemma_path());
  KESTREL_REQUIRE_FILE(transcripts_path());
  const auto model = LlamaModel::load(gemma_path());
  expect_transformers_transcripts(*model, nullptr, KvDtype::F32);
}

#if KESTREL_HAS_CUDA
// The same on the CUDA backend (head_dim 256 on the tensor-core attention kernels, windows of 512
// in five of every six layers), eagerly and through decode graphs. Skipped without a GPU.
TEST(Gemma3_270m, GreedyTranscriptsMatchTransformersOnCuda) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  KESTREL_REQUIRE_FILE(gemma_path());
  KESTREL_REQUIRE_FILE(transcripts_path());
  const auto model = LlamaModel::load(gemma_path());
  for (const bool eager : {true, false}) {
    SCOPED_TRACE(eager ? "eager" : "graphs");
    RunnerOptions o;
    o.block_size = 16;
    o.n_kv_blocks = 512;
    o.enforce_eager = eager;
    expect_transformers_transcripts(*model, make_cuda_model_runner(*model, o), KvDtype::BF16);
  }
}
#endif

}  // namespace
}  // namespace kestrel
