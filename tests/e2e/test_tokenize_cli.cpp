// `kestrel tokenize` from tokenizer-only sources: vocab-only GGUFs of any architecture, a
// tokenizer.json file, a SentencePiece tokenizer.model and Hugging Face folders whose model kestrel
// does not run. The ids must equal llama.cpp's reference vectors (Hugging Face tokenizers' ids, see
// ../shared/data/tokenizer-vectors/README.md) for a spread of the vector inputs; a tokenizer kestrel
// does not implement must be named in the error.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

#include "gguf_builder.h"
#include "io/gguf.h"
#include "test_util.h"
#include "tokenizer/pre_tokenizer.h"
#include "tokenizer_vectors.h"

namespace kestrel {
namespace {

using test::data_dir;
using test::kestrel_binary;
using test::run_command;
using test::temp_path;
using test::vectors_dir;
using test::vocab_gguf;
using test::write_file;

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// Vector inputs run through the CLI (one process each): plain text, the empty string, whitespace
// only, punctuation, Cyrillic, mixed CJK/emoji/digits, a digit run, Vietnamese and the long mixed text.
const std::vector<size_t> kCases = {0, 2, 10, 17, 20, 32, 42, 43, 45};

std::string tokenize(const std::string& source, const std::string& text, int* rc) {
  std::string out;
  *rc = run_command(kestrel_binary() + " tokenize --tokenizer " + shell_quote(source) + " " +
                        shell_quote(text) + " 2>&1",
                    &out);
  return out;
}

std::string ids_line(const std::vector<int32_t>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? " " : "") + std::to_string(ids[i]);
  return s + "\n";
}

// `source` tokenizes the chosen inputs of ggml-vocab-`vectors`.gguf.{inp,out} to the reference ids.
void expect_vectors(const std::string& source, const std::string& vectors) {
  test::for_each_vector(
      vectors,
      [&](size_t i, const test::VectorCase& c) {
        int rc = -1;
        const std::string out = tokenize(source, c.text, &rc);
        EXPECT_EQ(rc, 0) << source << ": " << out;
        EXPECT_EQ(out, ids_line(c.ids)) << source << " case " << i << " '" << c.text << "'";
      },
      kCases);
}

class TokenizeCliVocab : public ::testing::TestWithParam<const char*> {};

// Vocab-only GGUFs (no tensors) of the llama, phi3, gpt2, refact, mpt and deepseek architectures.
TEST_P(TokenizeCliVocab, VocabOnlyGgufMatchesReferenceIds) {
  const std::string path = vocab_gguf(GetParam());
  KESTREL_REQUIRE_FILE(path);
  expect_vectors(path, GetParam());
}

INSTANTIATE_TEST_SUITE_P(Vocab, TokenizeCliVocab, ::testing::ValuesIn(test::kVocabGgufs), test::vocab_param_name);

// Old vocab GGUFs without tokenizer.ggml.pre (gpt-neox: byte-level BPE, so the GPT-2 regex;
// baichuan: SentencePiece). No reference vectors exist for them: "Hello world" must give the ids
// whose vocabulary text is the two words, as the file itself lists them.
TEST(TokenizeCli, VocabGgufWithoutPreTokenizerKey) {
  for (const auto& [name, words] :
       std::vector<std::pair<std::string, std::vector<std::string>>>{
           {"gpt-neox", {"Hello", "\xC4\xA0world"}},              // "Ġworld": GPT-2 byte alphabet
           {"baichuan", {"\xE2\x96\x81Hello", "\xE2\x96\x81world"}}}) {  // "▁": SentencePiece space
    const std::string path = vocab_gguf(name);
    KESTREL_REQUIRE_FILE(path);
    const GgufFile f = GgufFile::open(path);
    const auto& tokens = f.get_string_array("tokenizer.ggml.tokens");
    std::vector<int32_t> want;
    for (const std::string& w : words) {
      const auto it = std::find(tokens.begin(), tokens.end(), w);
      ASSERT_NE(it, tokens.end()) << name << " has no token '" << w << "'";
      want.push_back(static_cast<int32_t>(it - tokens.begin()));
    }
    int rc = -1;
    EXPECT_EQ(tokenize(path, "Hello world", &rc), ids_line(want)) << name;
    EXPECT_EQ(rc, 0);
  }
}

// bert-bge is a WordPiece vocabulary: the error names the tokenizer model, not the architecture.
TEST(TokenizeCli, UnsupportedTokenizerModelIsNamed) {
  const std::string path = vocab_gguf("bert-bge");
  KESTREL_REQUIRE_FILE(path);
  int rc = 0;
  const std::string out = tokenize(path, "Hello world", &rc);
  EXPECT_NE(rc, 0);
  EXPECT_NE(out.find("tokenizer.ggml.model 'bert' is not supported"), std::string::npos) << out;
  EXPECT_EQ(out.find("architecture"), std::string::npos) << out;
}

// A vocab GGUF of an architecture kestrel does not run, with a pre-tokenizer it does not know.
TEST(TokenizeCli, UnsupportedPreTokenizerIsNamedWithTheSupportedOnes) {
  using B = test::GgufBuilder;
  const auto image = B().kv("general.architecture", B::str("starcoder2"))
                         .kv("tokenizer.ggml.model", B::str("gpt2"))
                         .kv("tokenizer.ggml.pre", B::str("mystery-pre"))
                         .kv("tokenizer.ggml.tokens", B::strings({"a", "b", "ab"}))
                         .kv("tokenizer.ggml.merges", B::strings({"a b"}))
                         .build();
  const std::string path = write_file(temp_path("vocab", ".gguf"), image);
  int rc = 0;
  const std::string out = tokenize(path, "ab", &rc);
  std::filesystem::remove(path);
  EXPECT_NE(rc, 0);
  EXPECT_NE(out.find("tokenizer.ggml.pre 'mystery-pre' is not a supported pre-tokenizer"), std::string::npos)
      << out;
  EXPECT_NE(out.find("supported: " + PreTokenizer::known_names()), std::string::npos) << out;
  EXPECT_EQ(out.find("architecture"), std::string::npos) << out;
}

// The same file with a known pre-tokenizer tokenizes: the architecture plays no part.
TEST(TokenizeCli, VocabGgufOfAnyArchitecture) {
  using B = test::GgufBuilder;
  const auto image = B().kv("general.architecture", B::str("starcoder2"))
                         .kv("tokenizer.ggml.model", B::str("gpt2"))
                         .kv("tokenizer.ggml.pre", B::str("starcoder"))
                         .kv("tokenizer.ggml.tokens", B::strings({"a", "b", "ab"}))
                         .kv("tokenizer.ggml.merges", B::strings({"a b"}))
                         .build();
  const std::string path = write_file(temp_path("vocab_ok", ".gguf"), image);
  int rc = -1;
  const std::string out = tokenize(path, "abba", &rc);
  std::filesystem::remove(path);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_EQ(out, "2 1 0\n");  // "ab" merged, then "b", "a"
}

// A tokenizer.json file on its own (Qwen2's vocabulary, written by test::write_tokenizer_json).
TEST(TokenizeCli, TokenizerJsonFile) {
  const std::string src = data_dir() + "/qwen2-bpe-vocab";
  KESTREL_REQUIRE_FILE(src + "/vocab.json");
  const std::string dir = test::write_tokenizer_json(
      src + "/vocab.json", src + "/merges.txt", PreTokenizer::patterns_for("qwen2").at(0),
      /*ignore_merges=*/false, /*pair_merges=*/false,
      nlohmann::json::array({{{"id", 151644}, {"content", "<|im_start|>"}, {"special", true}}}));
  expect_vectors(dir + "/tokenizer.json", "qwen2");
  std::string out;
  EXPECT_EQ(run_command(kestrel_binary() + " tokenize --special -m " + dir + "/tokenizer.json '<|im_start|>'",
                        &out),
            0);
  EXPECT_EQ(out, "151644\n");
  std::filesystem::remove_all(dir);
}

// Hugging Face folders: Qwen2's tokenizer folder (vocab.json, merges.txt, tokenizer_config.json) and
// a tiny Qwen2-MoE model folder (tokenizer.model: Llama 2's vocabulary), whose architecture kestrel
// does not run; and that tokenizer.model file on its own.
TEST(TokenizeCli, HfFoldersAndSentencePieceModel) {
  const std::string qwen2 = data_dir() + "/qwen2-bpe-vocab";
  const std::string moe = data_dir() + "/hf-tiny/qwen2-moe-tiny";
  KESTREL_REQUIRE_FILE(qwen2 + "/vocab.json");
  KESTREL_REQUIRE_FILE(moe + "/tokenizer.model");
  expect_vectors(qwen2, "qwen2");
  expect_vectors(moe, "llama-spm");
  expect_vectors(moe + "/tokenizer.model", "llama-spm");
}

TEST(TokenizeCli, NotATokenizerSourceIsNamed) {
  int rc = 0;
  const std::string missing = data_dir() + "/no-such-tokenizer.gguf";
  std::string out = tokenize(missing, "x", &rc);
  EXPECT_NE(rc, 0);
  EXPECT_NE(out.find(missing + ": no such file or folder"), std::string::npos) << out;
  const std::string readme = vectors_dir() + "/README.md";
  KESTREL_REQUIRE_FILE(readme);
  out = tokenize(readme, "x", &rc);
  EXPECT_NE(rc, 0);
  EXPECT_NE(out.find(readme + ": not a tokenizer source"), std::string::npos) << out;
}

}  // namespace
}  // namespace kestrel
