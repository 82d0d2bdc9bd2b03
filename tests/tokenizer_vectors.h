// Shared by the tokenizer tests: llama.cpp's reference vectors (../shared/data/tokenizer-vectors,
// format in its README) and a Hugging Face tokenizer.json written from a vocabulary and merges file.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "test_util.h"

namespace kestrel::test {

struct VectorCase {
  std::string text;
  std::vector<int32_t> ids;  // Hugging Face tokenizers' ids with add_special_tokens=False
};

inline std::string vectors_dir() { return data_dir() + "/tokenizer-vectors"; }

// ggml-vocab-<name>.gguf in vectors_dir(); its vectors are the .inp and .out files beside it.
inline std::string vocab_gguf(const std::string& name) { return vectors_dir() + "/ggml-vocab-" + name + ".gguf"; }

// Every vectors file holds this many cases.
inline constexpr size_t kVectorCases = 46;

// The vocab-only GGUFs whose vectors the tokenizer runs in-process and through `kestrel tokenize`:
// SentencePiece (llama-spm, phi-3) and byte-level BPE (gpt-2, refact, mpt, deepseek-llm).
inline constexpr const char* kVocabGgufs[] = {"llama-spm", "phi-3", "gpt-2", "refact", "mpt", "deepseek-llm"};

// A gtest parameter name for a kVocabGgufs entry ('-' is not allowed there): "llama-spm" -> "llama_spm".
inline std::string vocab_param_name(const ::testing::TestParamInfo<const char*>& info) {
  std::string s = info.param;
  for (char& c : s) {
    if (c == '-') c = '_';
  }
  return s;
}

// The cases of `base`.inp / `base`.out (base: the path of ggml-vocab-X.gguf, which need not exist).
inline std::vector<VectorCase> load_vectors(const std::string& base) {
  const std::string inp = read_file(base + ".inp");
  const std::string out = read_file(base + ".out");
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

// Reads the vectors of vocab_gguf(name), expects kVectorCases of them, and calls visit(i, case) for
// the cases whose index is in `which` (every case when `which` is empty).
template <typename Visit>
void for_each_vector(const std::string& name, Visit&& visit, const std::vector<size_t>& which = {}) {
  const std::vector<VectorCase> cases = load_vectors(vocab_gguf(name));
  EXPECT_EQ(cases.size(), kVectorCases) << name;
  if (which.empty()) {
    for (size_t i = 0; i < cases.size(); ++i) visit(i, cases[i]);
    return;
  }
  for (size_t i : which) {
    if (i < cases.size()) visit(i, cases[i]);
  }
}

// A folder holding a tokenizer.json with the given vocabulary (JSON text -> id) and merges ("a b"
// lines, optional #version first line), in the layout of the real files: Split regex + ByteLevel
// without regex, NFC normalizer, added tokens, merges as pairs or strings. The caller removes it.
inline std::string write_tokenizer_json(const std::string& vocab_path, const std::string& merges_path,
                                        const std::string& regex, bool ignore_merges, bool pair_merges,
                                        const nlohmann::json& added) {
  using nlohmann::json;
  json merges = json::array();
  std::istringstream lines(read_file(merges_path));
  std::string line;
  while (std::getline(lines, line)) {
    if (line.empty() || line.rfind("#version", 0) == 0) continue;
    const size_t sp = line.find(' ');
    if (pair_merges) {
      merges.push_back(json::array({line.substr(0, sp), line.substr(sp + 1)}));
    } else {
      merges.push_back(line);
    }
  }
  json j;
  j["version"] = "1.0";
  j["added_tokens"] = added;
  j["normalizer"] = {{"type", "NFC"}};
  j["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers",
       json::array(
           {{{"type", "Split"}, {"pattern", {{"Regex", regex}}}, {"behavior", "Isolated"}, {"invert", false}},
            {{"type", "ByteLevel"},
             {"add_prefix_space", false},
             {"trim_offsets", false},
             {"use_regex", false}}})}};
  j["post_processor"] = {
      {"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}};
  j["decoder"] = {
      {"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}};
  j["model"] = {{"type", "BPE"},
                {"dropout", nullptr},
                {"unk_token", nullptr},
                {"byte_fallback", false},
                {"ignore_merges", ignore_merges},
                {"vocab", json::parse(read_file(vocab_path))},
                {"merges", merges}};
  const std::string dir = temp_path("tokjson", "_" + std::to_string(ignore_merges));
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/tokenizer.json", std::ios::binary) << j.dump();
  return dir;
}

}  // namespace kestrel::test
