// Tokenizer ids against llama.cpp's reference vectors (../shared/data/tokenizer-vectors): each
// ggml-vocab-X.gguf.inp holds test strings, X.gguf.out the ids Hugging Face tokenizers produced for
// them with add_special_tokens=False (so: add_special = false, parse_special = false here).
//
// Covered: llama-spm, phi-3 (SentencePiece BPE), gpt-2, refact, mpt, deepseek-llm (byte-level BPE
// from the vocab GGUFs), llama-bpe (Llama 3, from ../llama3-bpe-vocab since its GGUF is not in the
// data set) and qwen2 (from ../qwen2-bpe-vocab).
// Not covered: bert-bge (a WordPiece tokenizer, which the engine does not implement) and command-r
// (only .inp/.out are in the data set, no vocabulary file).
#include <gtest/gtest.h>

#include <sstream>

#include "io/gguf.h"
#include "test_util.h"
#include "tokenizer/tokenizer.h"

namespace kestrel {
namespace {

struct VectorCase {
  std::string text;
  std::vector<int32_t> ids;
};

std::vector<VectorCase> load_vectors(const std::string& base) {
  const std::string inp = test::read_file(base + ".inp");
  const std::string out = test::read_file(base + ".out");
  const std::string sep = "\n__ggml_vocab_test__\n";
  std::vector<std::string> texts;
  size_t pos = 0;
  while (pos < inp.size()) {
    const size_t end = inp.find(sep, pos);
    if (end == std::string::npos) break;  // nothing after the final separator
    texts.push_back(inp.substr(pos, end - pos));
    pos = end + sep.size();
  }
  std::vector<VectorCase> cases;
  std::istringstream lines(out);
  std::string line;
  size_t i = 0;
  while (std::getline(lines, line)) {
    VectorCase c;
    if (i < texts.size()) c.text = texts[i];
    std::istringstream ids(line);
    int64_t id;
    while (ids >> id) c.ids.push_back(static_cast<int32_t>(id));
    cases.push_back(std::move(c));
    ++i;
  }
  EXPECT_EQ(texts.size(), cases.size()) << base;
  return cases;
}

std::string vectors_dir() { return test::data_dir() + "/tokenizer-vectors"; }

std::string show_ids(const std::vector<int32_t>& ids) {
  std::string s;
  for (int32_t id : ids) s += " " + std::to_string(id);
  return s;
}

// Checks every case; returns the number that passed.
int check_vectors(const Tokenizer& tok, const std::string& name) {
  const std::vector<VectorCase> cases = load_vectors(vectors_dir() + "/ggml-vocab-" + name + ".gguf");
  EXPECT_EQ(cases.size(), 46u) << name;
  int passed = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::vector<int32_t> got = tok.encode(cases[i].text, /*add_special=*/false, /*parse_special=*/false);
    EXPECT_EQ(got, cases[i].ids) << name << " case " << i << " text '" << cases[i].text << "'\n  want" << show_ids(cases[i].ids)
                                 << "\n  got " << show_ids(got);
    if (got == cases[i].ids) ++passed;
  }
  return passed;
}

// decode(encode(x)) == x for every vector input (the SentencePiece dummy prefix is removed by decode).
void check_round_trip(const Tokenizer& tok, const std::string& name) {
  for (const VectorCase& c : load_vectors(vectors_dir() + "/ggml-vocab-" + name + ".gguf")) {
    const std::vector<int32_t> ids = tok.encode(c.text, false, false);
    EXPECT_EQ(tok.decode(ids), c.text) << name;
  }
}

std::unique_ptr<Tokenizer> gguf_tokenizer(const std::string& name) {
  const GgufFile f = GgufFile::open(vectors_dir() + "/ggml-vocab-" + name + ".gguf");
  return Tokenizer::from_gguf(f);
}

class TokVectorsGguf : public ::testing::TestWithParam<const char*> {};

TEST_P(TokVectorsGguf, MatchesReferenceIds) {
  const std::string name = GetParam();
  KESTREL_REQUIRE_FILE(vectors_dir() + "/ggml-vocab-" + name + ".gguf");
  const auto tok = gguf_tokenizer(name);
  EXPECT_EQ(check_vectors(*tok, name), 46) << name;
}

TEST_P(TokVectorsGguf, RoundTrips) {
  const std::string name = GetParam();
  KESTREL_REQUIRE_FILE(vectors_dir() + "/ggml-vocab-" + name + ".gguf");
  check_round_trip(*gguf_tokenizer(name), name);
}

INSTANTIATE_TEST_SUITE_P(TokVocab, TokVectorsGguf,
                         ::testing::Values("llama-spm", "phi-3", "gpt-2", "refact", "mpt", "deepseek-llm"),
                         [](const auto& info) {
                           std::string s = info.param;
                           for (char& c : s) {
                             if (c == '-') c = '_';
                           }
                           return s;
                         });

std::unique_ptr<Tokenizer> llama3_tokenizer() {
  const std::string dir = test::data_dir() + "/llama3-bpe-vocab";
  const std::vector<AddedToken> added = {{"<|begin_of_text|>", 128000, true}, {"<|end_of_text|>", 128001, true}};
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

}  // namespace
}  // namespace kestrel
