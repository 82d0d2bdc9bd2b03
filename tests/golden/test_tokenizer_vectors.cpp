// Tokenizer ids against llama.cpp's reference vectors (../shared/data/tokenizer-vectors): each
// ggml-vocab-X.gguf.inp holds test strings, X.gguf.out the ids Hugging Face tokenizers produced for
// them with add_special_tokens=False (so: add_special = false, parse_special = false here).
//
// Covered: llama-spm, phi-3 (SentencePiece BPE), gpt-2, refact, mpt, deepseek-llm (byte-level BPE
// from the vocab GGUFs), llama-bpe (Llama 3, from ../llama3-bpe-vocab since its GGUF is not in the
// data set) and qwen2 (from ../qwen2-bpe-vocab). llama-spm again from Meta's tokenizer.model
// (../llama2-tokenizer), which holds the same vocabulary.
// Not covered: bert-bge (a WordPiece tokenizer, which the engine does not implement) and command-r
// (only .inp/.out are in the data set, no vocabulary file).
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "io/gguf.h"
#include "test_util.h"
#include "tokenizer_vectors.h"
#include "tokenizer/pre_tokenizer.h"
#include "tokenizer/tokenizer.h"

namespace kestrel {
namespace {

using test::for_each_vector;
using test::load_vectors;
using test::vocab_gguf;
using test::VectorCase;
using test::write_tokenizer_json;

std::string show_ids(const std::vector<int32_t>& ids) {
  std::string s;
  for (int32_t id : ids) s += " " + std::to_string(id);
  return s;
}

// Checks every case; returns the number that passed.
int check_vectors(const Tokenizer& tok, const std::string& name) {
  int passed = 0;
  for_each_vector(name, [&](size_t i, const VectorCase& c) {
    const std::vector<int32_t> got = tok.encode(c.text, /*add_special=*/false, /*parse_special=*/false);
    EXPECT_EQ(got, c.ids) << name << " case " << i << " text '" << c.text << "'\n  want" << show_ids(c.ids)
                          << "\n  got " << show_ids(got);
    if (got == c.ids) ++passed;
  });
  return passed;
}

// decode(encode(x)) == x for every vector input (the SentencePiece dummy prefix is removed by decode).
void check_round_trip(const Tokenizer& tok, const std::string& name) {
  for (const VectorCase& c : load_vectors(vocab_gguf(name))) {
    const std::vector<int32_t> ids = tok.encode(c.text, false, false);
    EXPECT_EQ(tok.decode(ids), c.text) << name;
  }
}

std::unique_ptr<Tokenizer> gguf_tokenizer(const std::string& name) {
  return Tokenizer::from_gguf(GgufFile::open(vocab_gguf(name)));
}

class TokVectorsGguf : public ::testing::TestWithParam<const char*> {};

TEST_P(TokVectorsGguf, MatchesReferenceIds) {
  const std::string name = GetParam();
  KESTREL_REQUIRE_FILE(vocab_gguf(name));
  const auto tok = gguf_tokenizer(name);
  EXPECT_EQ(check_vectors(*tok, name), 46) << name;
}

TEST_P(TokVectorsGguf, RoundTrips) {
  const std::string name = GetParam();
  KESTREL_REQUIRE_FILE(vocab_gguf(name));
  check_round_trip(*gguf_tokenizer(name), name);
}

INSTANTIATE_TEST_SUITE_P(TokVocab, TokVectorsGguf, ::testing::ValuesIn(test::kVocabGgufs), test::vocab_param_name);

std::unique_ptr<Tokenizer> llama3_tokenizer() {
  const std::string dir = test::data_dir() + "/llama3-bpe-vocab";
  const std::vector<AddedToken> added = {{"<|begin_of_text|>", 128000, true},
                                         {"<|end_of_text|>", 128001, true}};
  return Tokenizer::from_bpe_files(dir + "/encoder.json", dir + "/vocab.bpe", "llama-bpe", added);
}

TEST(TokVectors, LlamaBpeFromLlama3Vocab) {
  KESTREL_REQUIRE_FILE(test::data_dir() + "/llama3-bpe-vocab/encoder.json");
  const auto tok = llama3_tokenizer();
  EXPECT_EQ(check_vectors(*tok, "llama-bpe"), 46);
  check_round_trip(*tok, "llama-bpe");
}

TEST(TokVectors, Qwen2FromHfFolder) {
  const std::string dir = test::data_dir() + "/qwen2-bpe-vocab";
  KESTREL_REQUIRE_FILE(dir + "/vocab.json");
  const auto tok = Tokenizer::from_hf_dir(dir);  // tokenizer_class Qwen2Tokenizer selects the qwen2 regex
  EXPECT_EQ(check_vectors(*tok, "qwen2"), 46);
  check_round_trip(*tok, "qwen2");
}

TEST(TokVectors, Qwen2FromBpeFiles) {
  const std::string dir = test::data_dir() + "/qwen2-bpe-vocab";
  KESTREL_REQUIRE_FILE(dir + "/vocab.json");
  const auto tok = Tokenizer::from_bpe_files(dir + "/vocab.json", dir + "/merges.txt", "qwen2");
  EXPECT_EQ(check_vectors(*tok, "qwen2"), 46);
}

// The same vocabularies written as a Hugging Face tokenizer.json (test::write_tokenizer_json), to
// test that loader at full size.
TEST(TokVectors, Qwen2FromTokenizerJson) {
  const std::string src = test::data_dir() + "/qwen2-bpe-vocab";
  KESTREL_REQUIRE_FILE(src + "/vocab.json");
  const nlohmann::json added =
      nlohmann::json::array({{{"id", 151643}, {"content", "<|endoftext|>"}, {"special", true}},
                             {{"id", 151644}, {"content", "<|im_start|>"}, {"special", true}},
                             {{"id", 151645}, {"content", "<|im_end|>"}, {"special", true}}});
  const std::string dir = write_tokenizer_json(src + "/vocab.json", src + "/merges.txt",
                                               PreTokenizer::patterns_for("qwen2").at(0),
                                               /*ignore_merges=*/false, /*pair_merges=*/false, added);
  const auto tok = Tokenizer::from_hf_dir(dir);
  std::filesystem::remove_all(dir);
  EXPECT_EQ(check_vectors(*tok, "qwen2"), 46);
  EXPECT_EQ(tok->encode("<|im_start|>", false, true), (std::vector<int32_t>{151644}));
}

TEST(TokVectors, LlamaBpeFromTokenizerJson) {
  const std::string src = test::data_dir() + "/llama3-bpe-vocab";
  KESTREL_REQUIRE_FILE(src + "/encoder.json");
  const nlohmann::json added =
      nlohmann::json::array({{{"id", 128000}, {"content", "<|begin_of_text|>"}, {"special", true}},
                             {{"id", 128001}, {"content", "<|end_of_text|>"}, {"special", true}}});
  const std::string dir = write_tokenizer_json(src + "/encoder.json", src + "/vocab.bpe",
                                               PreTokenizer::patterns_for("llama-bpe").at(0),
                                               /*ignore_merges=*/true, /*pair_merges=*/true, added);
  const auto tok = Tokenizer::from_hf_dir(dir);
  std::filesystem::remove_all(dir);
  EXPECT_EQ(check_vectors(*tok, "llama-bpe"), 46);
}

TEST(TokVectors, LlamaSpmFromSentencePieceModel) {
  const std::string dir = test::data_dir() + "/llama2-tokenizer";
  KESTREL_REQUIRE_FILE(dir + "/tokenizer.model");
  const auto tok = Tokenizer::from_sentencepiece_model(dir + "/tokenizer.model");
  EXPECT_EQ(tok->n_vocab(), 32000);
  EXPECT_EQ(tok->bos_id(), 1);
  EXPECT_EQ(tok->eos_id(), 2);
  EXPECT_EQ(tok->unk_id(), 0);
  EXPECT_TRUE(tok->add_bos());
  EXPECT_EQ(check_vectors(*tok, "llama-spm"), 46);
  check_round_trip(*tok, "llama-spm");
  // The folder has no tokenizer.json or vocab.json: from_hf_dir reads tokenizer.model.
  EXPECT_EQ(check_vectors(*Tokenizer::from_hf_dir(dir), "llama-spm"), 46);
}

}  // namespace
}  // namespace kestrel
