// JSON Schema compiler and token masks against the official JSON-Schema-Test-Suite (Debian package
// json-schema-test-suite, draft 7 required tests; scripts/install_deps.sh installs it). For every
// schema the compiler accepts, each instance is serialised compactly with sorted keys (nlohmann's
// order; the grammar takes properties in that order with JsonSchemaOptions::sort_properties) and fed through the default model's tokenizer
// (SmolLM2; the Llama 3 vocabulary when the model is absent) token by token: every token must be
// in the mask, and the end of text must allow EOS. Valid instances must be accepted, invalid ones
// rejected. Schemas with keywords the compiler refuses count as unsupported.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "io/gguf.h"
#include "sampling/grammar/json_schema.h"
#include "sampling/grammar/matcher.h"
#include "test_util.h"
#include "tokenizer/tokenizer.h"

namespace kestrel::grammar {
namespace {

constexpr const char* kSuiteDir = "/usr/share/json-schema-test-suite/tests/draft7";

std::unique_ptr<Tokenizer> default_tokenizer() {
  const std::string smol = test::model_dir() + "/SmolLM2-135M-Instruct.Q4_1.gguf";
  if (test::file_exists(smol)) return Tokenizer::from_gguf(GgufFile::open(smol));
  const std::string dir = test::data_dir() + "/llama3-bpe-vocab";
  const std::vector<AddedToken> added = {{"<|begin_of_text|>", 128000, true}, {"<|end_of_text|>", 128001, true}};
  return Tokenizer::from_bpe_files(dir + "/encoder.json", dir + "/vocab.bpe", "llama-bpe", added);
}

// Whether the grammar takes `text` as the tokenizer splits it, every token checked against the
// mask first.
bool accepted_under_masks(const std::shared_ptr<const CompiledGrammar>& cg, const Tokenizer& tok, const std::string& text) {
  GrammarMatcher m(cg);
  std::vector<uint32_t> mask(bitmask_words(cg->vocab().n_vocab));
  for (int32_t id : tok.encode(text, false, false)) {
    m.fill_next_token_bitmask(mask);
    bool in_mask = ((mask[static_cast<size_t>(id) / 32] >> (id % 32)) & 1u) != 0;
    bool ok = m.accept_token(id);
    EXPECT_EQ(in_mask, ok) << "mask and accept_token disagree on token " << id << " of " << text;
    if (!ok) return false;
  }
  m.fill_next_token_bitmask(mask);
  const int32_t eos = cg->vocab().eos_id;  // none in the Llama 3 vocabulary files
  if (eos >= 0) EXPECT_EQ(((mask[static_cast<size_t>(eos) / 32] >> (eos % 32)) & 1u) != 0, m.can_end()) << text;
  return m.can_end();
}

TEST(GrammarSuite, Draft7ValidAcceptedInvalidRejected) {
  KESTREL_REQUIRE_FILE(std::string(kSuiteDir) + "/type.json");
  const auto tok = default_tokenizer();
  const auto vocab = TokenVocab::from_tokenizer(*tok);
  std::vector<std::filesystem::path> files;
  for (const auto& e : std::filesystem::directory_iterator(kSuiteDir))
    if (e.is_regular_file() && e.path().extension() == ".json") files.push_back(e.path());
  std::sort(files.begin(), files.end());
  JsonSchemaOptions opts;
  opts.oneof_as_anyof = false;  // count non-exclusive oneOf as unsupported rather than loosen it
  opts.sort_properties = true;
  opts.integral_fraction = true;  // instances such as 1.0 for an integer
  size_t schemas = 0, compiled = 0, valid_total = 0, invalid_total = 0, valid_rejected = 0, invalid_accepted = 0;
  std::map<std::string, size_t> refused;  // keyword -> schemas
  for (const auto& path : files) {
    std::ifstream in(path);
    const nlohmann::json groups = nlohmann::json::parse(in);
    for (const auto& group : groups) {
      ++schemas;
      const auto schema = nlohmann::ordered_json::parse(group["schema"].dump());
      std::string gbnf;
      try {
        gbnf = json_schema_to_gbnf(schema, opts);
      } catch (const GrammarError& e) {
        ++refused[e.keyword()];
        continue;
      }
      ++compiled;
      auto cg = std::make_shared<CompiledGrammar>(Grammar::parse_gbnf(gbnf), vocab);
      for (const auto& t : group["tests"]) {
        const std::string text = t["data"].dump();
        const bool valid = t["valid"].get<bool>();
        const bool ok = accepted_under_masks(cg, *tok, text);
        (valid ? valid_total : invalid_total)++;
        if (valid && !ok) {
          ++valid_rejected;
          ADD_FAILURE() << path.filename() << " \"" << group["description"].get<std::string>() << "\": valid "
                        << text << " rejected; grammar:\n" << gbnf;
        }
        if (!valid && ok) {
          ++invalid_accepted;
          ADD_FAILURE() << path.filename() << " \"" << group["description"].get<std::string>() << "\": invalid "
                        << text << " accepted; grammar:\n" << gbnf;
        }
      }
    }
  }
  std::printf("json-schema-test-suite draft7: %zu of %zu schemas compiled; %zu valid and %zu invalid instances checked; "
              "valid rejected %zu, invalid accepted %zu\nrefused keywords:",
              compiled, schemas, valid_total, invalid_total, valid_rejected, invalid_accepted);
  for (const auto& [k, n] : refused) std::printf(" %s=%zu", k.c_str(), n);
  std::printf("\n");
  EXPECT_EQ(valid_rejected, 0u);
  EXPECT_EQ(invalid_accepted, 0u);
  EXPECT_GE(compiled, 57u);  // what the supported keywords cover today (of 124): guards against regressions
}

// The chain cap (CompiledGrammar::kChainCap) on the default vocabulary: walks from the start of the
// bench schemas' strings bounded beyond the cap (maxLength 60 and 160) to the end of the document,
// drawing long tokens first so they run deep into those strings, give at every step the same mask
// as the grammar with every chain link its own split, and the capped grammar computes fewer splits.
TEST(GrammarSuite, ChainCapKeepsTheMasksOfLongBoundedStrings) {
  const auto tok = default_tokenizer();
  const auto vocab = TokenVocab::from_tokenizer(*tok);
  // Each walk starts inside the long string (the text before it accepted as bytes, unchecked).
  const std::vector<std::pair<const char*, const char*>> cases = {
      {"10_event.json", R"({"title":")"}, {"15_user_profile.json", R"({"username":"abc","display_name":"x","bio":")"}};
  for (const auto& [name, prefix] : cases) {
    std::ifstream in(std::string(KESTREL_TEST_SOURCE_DIR) + "/../bench/data/schemas/" + name);
    ASSERT_TRUE(in.good()) << name;
    const std::string gbnf = json_schema_to_gbnf(nlohmann::ordered_json::parse(in));
    auto capped = std::make_shared<CompiledGrammar>(Grammar::parse_gbnf(gbnf), vocab);
    auto plain = std::make_shared<CompiledGrammar>(Grammar::parse_gbnf(gbnf), vocab, 0);
    std::vector<uint32_t> mask(bitmask_words(vocab->n_vocab)), mask_plain(mask.size());
    uint64_t rng = 7;
    size_t steps = 0;
    for (int walk = 0; walk < 4; ++walk) {
      GrammarMatcher m(capped), p(plain);
      ASSERT_TRUE(m.accept_bytes(prefix) && p.accept_bytes(prefix)) << name;
      for (int step = 0; step < 200 && !m.is_terminated(); ++step, ++steps) {
        m.fill_next_token_bitmask(mask);
        p.fill_next_token_bitmask(mask_plain);
        ASSERT_EQ(mask, mask_plain) << name << ", walk " << walk << ", step " << step;
        std::vector<int32_t> ok;
        for (int32_t id = 0; id < vocab->n_vocab; ++id)
          if ((mask[static_cast<size_t>(id) / 32] >> (id % 32)) & 1u) ok.push_back(id);
        ASSERT_FALSE(ok.empty()) << name;
        // The longest of a few allowed tokens; a short one now and then, so that structure comes too.
        int32_t pick = -1;
        for (int tries = 0; tries < (walk % 2 == 0 ? 8 : 2); ++tries) {
          rng = rng * 6364136223846793005ull + 1442695040888963407ull;
          const int32_t id = ok[(rng >> 33) % ok.size()];
          if (pick < 0 || vocab->bytes[static_cast<size_t>(id)].size() > vocab->bytes[static_cast<size_t>(pick)].size())
            pick = id;
        }
        ASSERT_TRUE(m.accept_token(pick));
        ASSERT_TRUE(p.accept_token(pick));
      }
    }
    EXPECT_GT(steps, 100u) << name;
    EXPECT_LT(capped->n_splits(), plain->n_splits()) << name;
  }
}

}  // namespace
}  // namespace kestrel::grammar
