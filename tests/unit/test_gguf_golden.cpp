// GGUF reader golden checks on real files (stories260K, llama-2-tiny-random, the default SmolLM2
// model, the tokenizer vocabularies); reference values read with the `gguf` Python package
// (gguf-py, GGUFReader) from the same files.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "core/error.h"
#include "gguf_test_support.h"
#include "io/gguf.h"
#include "test_util.h"

using namespace kestrel;
using namespace kestrel::test::gguf;

namespace {
using test::stories_path;
}  // namespace

TEST(GgufGolden, Stories260K) {
  const std::string path = stories_path();
  KESTREL_REQUIRE_FILE(path);
  const GgufFile f = GgufFile::open(path);
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.alignment(), 32u);
  EXPECT_EQ(f.data_offset(), 14176u);
  EXPECT_EQ(f.metadata().size(), 19u);
  ASSERT_EQ(f.tensors().size(), 48u);
  for (const auto& t : f.tensors()) EXPECT_EQ(t.type, GgmlType::F32) << t.name;

  EXPECT_EQ(f.get_string("general.architecture"), "llama");
  EXPECT_EQ(f.get_string("tokenizer.ggml.model"), "llama");
  EXPECT_EQ(f.get_int("llama.embedding_length"), 64);
  EXPECT_EQ(f.get_int("llama.feed_forward_length"), 172);
  EXPECT_EQ(f.get_int("llama.block_count"), 5);
  EXPECT_EQ(f.get_int("llama.attention.head_count_kv"), 4);
  EXPECT_EQ(f.get_int("tokenizer.ggml.padding_token_id"), 4294967295LL);
  EXPECT_EQ(f.get_float("llama.attention.layer_norm_rms_epsilon"), static_cast<double>(1e-5f));
  const auto& tokens = f.get_string_array("tokenizer.ggml.tokens");
  ASSERT_EQ(tokens.size(), 512u);
  EXPECT_EQ(tokens[1], "<s>");
  EXPECT_EQ(tokens[3], "<0x00>");
  EXPECT_EQ(tokens[259], "\xe2\x96\x81t");
  const auto scores = f.get_float_array("tokenizer.ggml.scores");
  ASSERT_EQ(scores.size(), 512u);
  EXPECT_EQ(scores[511], -252.0f);
  const auto types = f.get_int_array("tokenizer.ggml.token_type");
  ASSERT_EQ(types.size(), 512u);
  EXPECT_EQ(types[0], 2);
  EXPECT_EQ(types[1], 3);
  EXPECT_EQ(types[3], 6);

  const GgufTensorInfo* emb = f.find_tensor("token_embd.weight");
  ASSERT_NE(emb, nullptr);
  EXPECT_EQ(emb->ne, (std::vector<int64_t>{64, 512}));
  EXPECT_EQ(emb->n_bytes, 131072u);
  EXPECT_EQ(bits_of(f32_at(emb->data)), 0xbe96e950u);  // -0.29474878

  const GgufTensorInfo* norm = f.find_tensor("output_norm.weight");
  ASSERT_NE(norm, nullptr);
  EXPECT_EQ(norm->ne, (std::vector<int64_t>{64}));
  EXPECT_EQ(norm->offset, 145248u - 14176u);
  EXPECT_EQ(bits_of(f32_at(norm->data)), 0x401d54efu);  // 2.458309
  EXPECT_NEAR(f32_at(norm->data + 4), 1.3673227f, 1e-7);

  const GgufTensorInfo* down = f.find_tensor("blk.4.ffn_down.weight");
  ASSERT_NE(down, nullptr);
  EXPECT_EQ(down->ne, (std::vector<int64_t>{172, 64}));
  EXPECT_NEAR(f32_at(down->data + 4), -0.02296368f, 1e-8);

  // The last tensor ends exactly at the end of the file.
  const GgufTensorInfo* last = f.find_tensor("blk.4.ffn_norm.weight");
  ASSERT_NE(last, nullptr);
  EXPECT_EQ(f.data_offset() + last->offset + last->n_bytes, 1185376u);
}

TEST(GgufGolden, Stories260KTruncatedAtSampledOffsets) {
  const std::string path = stories_path();
  KESTREL_REQUIRE_FILE(path);
  const std::string s = test::read_file(path);
  const std::vector<uint8_t> bytes(s.begin(), s.end());
  std::vector<size_t> cuts;
  for (size_t n = 0; n < 64; ++n) cuts.push_back(n);
  for (size_t n = 64; n <= 14176; n += 41) cuts.push_back(n);  // through the header
  for (size_t n : {14175u, 14177u, 145248u, 1185375u}) cuts.push_back(n);
  for (size_t n : cuts) {
    const std::vector<uint8_t> cut(bytes.begin(), bytes.begin() + static_cast<ptrdiff_t>(n));
    ASSERT_TRUE(fails_with(cut, "truncated")) << "cut at " << n;
  }
  EXPECT_EQ(parse(bytes).tensors().size(), 48u);
}

TEST(GgufGolden, LlamaTinyRandom) {
  const std::string path = test::data_dir() + "/llama-2-tiny-random/llama-2-tiny-random.gguf";
  KESTREL_REQUIRE_FILE(path);
  const GgufFile f = GgufFile::open(path);
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.data_offset(), 724416u);
  ASSERT_EQ(f.tensors().size(), 12u);
  std::map<GgmlType, int> by_type;
  for (const auto& t : f.tensors()) ++by_type[t.type];
  EXPECT_EQ(by_type[GgmlType::F16], 9);
  EXPECT_EQ(by_type[GgmlType::F32], 3);
  const GgufTensorInfo* emb = f.find_tensor("token_embd.weight");
  ASSERT_NE(emb, nullptr);
  EXPECT_EQ(emb->type, GgmlType::F16);
  EXPECT_EQ(emb->ne, (std::vector<int64_t>{8, 32000}));
  EXPECT_EQ(emb->n_bytes, 512000u);
  const GgufTensorInfo* out = f.find_tensor("output.weight");
  ASSERT_NE(out, nullptr);
  EXPECT_EQ(out->offset, 1238560u - 724416u);
  EXPECT_EQ(f32_at(f.find_tensor("output_norm.weight")->data), 1.0f);
  EXPECT_EQ(f.get_int("llama.embedding_length"), 8);
  const auto& tokens = f.get_string_array("tokenizer.ggml.tokens");
  ASSERT_EQ(tokens.size(), 32000u);
  EXPECT_EQ(tokens[31999], "\xe7\xbb\x99");
}

TEST(GgufGolden, SmolLM2Q4_1) {
  const std::string path = test::model_dir() + "/SmolLM2-135M-Instruct.Q4_1.gguf";
  KESTREL_REQUIRE_FILE(path);
  const GgufFile f = GgufFile::open(path);
  EXPECT_EQ(f.data_offset(), 1785664u);
  ASSERT_EQ(f.tensors().size(), 272u);
  std::map<GgmlType, int> by_type;
  for (const auto& t : f.tensors()) ++by_type[t.type];
  EXPECT_EQ(by_type[GgmlType::Q4_1], 210);
  EXPECT_EQ(by_type[GgmlType::F32], 61);
  EXPECT_EQ(by_type[GgmlType::Q8_0], 1);
  EXPECT_EQ(by_type.size(), 3u);

  const GgufTensorInfo* emb = f.find_tensor("token_embd.weight");
  ASSERT_NE(emb, nullptr);
  EXPECT_EQ(emb->type, GgmlType::Q8_0);
  EXPECT_EQ(emb->ne, (std::vector<int64_t>{576, 49152}));
  EXPECT_EQ(emb->n_bytes, 30081024u);
  EXPECT_EQ(emb->data[0], 0x32);  // first Q8_0 block's fp16 scale, low byte
  EXPECT_EQ(emb->data[1], 0x19);
  const GgufTensorInfo* down = f.find_tensor("blk.0.ffn_down.weight");
  ASSERT_NE(down, nullptr);
  EXPECT_EQ(down->type, GgmlType::Q4_1);
  EXPECT_EQ(down->ne, (std::vector<int64_t>{1536, 576}));
  EXPECT_EQ(down->n_bytes, 552960u);
  EXPECT_EQ(bits_of(f32_at(f.find_tensor("output_norm.weight")->data)), 0x3fe10000u);  // 1.7578125

  EXPECT_EQ(f.get_int("llama.block_count"), 30);
  EXPECT_EQ(f.get_float("llama.rope.freq_base"), 100000.0);
  EXPECT_FALSE(f.get_bool_or("tokenizer.ggml.add_bos_token", true));
  EXPECT_EQ(f.get_string("tokenizer.ggml.model"), "gpt2");
  const auto& tokens = f.get_string_array("tokenizer.ggml.tokens");
  ASSERT_EQ(tokens.size(), 49152u);
  EXPECT_EQ(tokens[0], "<|endoftext|>");
  const auto& merges = f.get_string_array("tokenizer.ggml.merges");
  ASSERT_EQ(merges.size(), 48900u);
  EXPECT_EQ(merges[0], "\xc4\xa0 t");
  EXPECT_EQ(f.get_string_array("general.languages"), (std::vector<std::string>{"en"}));
}

TEST(GgufGolden, VocabOnlyLlamaSpm) {
  const std::string path = test::data_dir() + "/tokenizer-vectors/ggml-vocab-llama-spm.gguf";
  KESTREL_REQUIRE_FILE(path);
  const GgufFile f = GgufFile::open(path);
  EXPECT_TRUE(f.tensors().empty());
  EXPECT_EQ(f.data_offset(), 723869u);  // the file ends before the padding
  const auto& tokens = f.get_string_array("tokenizer.ggml.tokens");
  ASSERT_EQ(tokens.size(), 32000u);
  EXPECT_EQ(tokens[29871], "\xe2\x96\x81");
  EXPECT_EQ(f.get_float_array("tokenizer.ggml.scores").size(), 32000u);
  EXPECT_TRUE(f.get_bool_or("tokenizer.ggml.add_bos_token", false));
  EXPECT_FALSE(f.get_bool_or("tokenizer.ggml.add_eos_token", true));
}

TEST(GgufGolden, EveryVocabFileLoads) {
  const std::string dir = test::data_dir() + "/tokenizer-vectors";
  KESTREL_REQUIRE_FILE(dir);
  const std::map<std::string, size_t> n_tokens = {
      {"ggml-vocab-baichuan.gguf", 64000},      {"ggml-vocab-bert-bge.gguf", 30522},
      {"ggml-vocab-deepseek-llm.gguf", 102400}, {"ggml-vocab-gpt-2.gguf", 50257},
      {"ggml-vocab-gpt-neox.gguf", 50432},      {"ggml-vocab-llama-spm.gguf", 32000},
      {"ggml-vocab-mpt.gguf", 50432},           {"ggml-vocab-phi-3.gguf", 32064},
      {"ggml-vocab-refact.gguf", 49216}};
  for (const auto& [name, n] : n_tokens) {
    const std::string path = dir + "/" + name;
    if (!test::file_exists(path)) continue;
    const GgufFile f = GgufFile::open(path);
    EXPECT_EQ(f.get_string_array("tokenizer.ggml.tokens").size(), n) << name;
  }
}
