// Tokenizer loader for GGUF metadata (the tokenizer.ggml.* keys written by llama.cpp's converters).
#include "core/error.h"
#include "io/gguf.h"
#include "tokenizer/pre_tokenizer.h"
#include "tokenizer/tokenizer.h"

namespace kestrel {

namespace {

// GGUF stores "no such token" as -1 or as 0xFFFFFFFF in a uint32 field; any other id outside the
// vocabulary is a broken file.
int32_t token_id_or(const GgufFile& f, const char* key, int32_t fallback, int32_t n_vocab) {
  const int64_t v = f.get_int_or(key, fallback);
  if (v < 0 || v == 0xFFFFFFFF) return -1;
  if (v >= n_vocab) {
    throw Error(f.path() + ": " + key + " = " + std::to_string(v) + " is outside the vocabulary (" +
                std::to_string(n_vocab) + " tokens)");
  }
  return static_cast<int32_t>(v);
}

}  // namespace

std::unique_ptr<Tokenizer> Tokenizer::from_gguf(const GgufFile& f) {
  const std::string where = f.path() + ": ";
  const std::string model = f.get_string_or("tokenizer.ggml.model", "");
  TokenizerSpec spec;
  if (model == "llama") {
    spec.kind = TokenizerKind::SPM;
  } else if (model == "gpt2") {
    spec.kind = TokenizerKind::BPE;
  } else if (model.empty()) {
    throw Error(where + "tokenizer.ggml.model is missing");
  } else {
    throw Error(where + "tokenizer.ggml.model '" + model + "' is not supported (only 'llama' and 'gpt2')");
  }

  if (!f.has("tokenizer.ggml.tokens")) throw Error(where + "tokenizer.ggml.tokens is missing");
  const std::vector<std::string>& texts = f.get_string_array("tokenizer.ggml.tokens");
  const size_t n = texts.size();
  if (n == 0 || n > (size_t{1} << 24))
    throw Error(where + "tokenizer.ggml.tokens has " + std::to_string(n) + " entries");
  std::vector<float> scores;
  if (f.has("tokenizer.ggml.scores")) {
    scores = f.get_float_array("tokenizer.ggml.scores");
    if (scores.size() != n) {
      throw Error(where + "tokenizer.ggml.scores has " + std::to_string(scores.size()) +
                  " entries, tokens has " + std::to_string(n));
    }
  }
  std::vector<int64_t> types;
  if (f.has("tokenizer.ggml.token_type")) {
    types = f.get_int_array("tokenizer.ggml.token_type");
    if (types.size() != n) {
      throw Error(where + "tokenizer.ggml.token_type has " + std::to_string(types.size()) +
                  " entries, tokens has " + std::to_string(n));
    }
  }
  spec.tokens.resize(n);
  for (size_t i = 0; i < n; ++i) {
    TokenData& t = spec.tokens[i];
    t.text = texts[i];
    t.score = scores.empty() ? 0.0f : scores[i];
    const int64_t ty = types.empty() ? 1 : types[i];
    if (ty < 0 || ty > 6)
      throw Error(where + "tokenizer.ggml.token_type[" + std::to_string(i) + "] = " + std::to_string(ty) +
                  " is not a token type");
    t.type = static_cast<TokenType>(ty);
  }

  const auto n_vocab = static_cast<int32_t>(n);
  const bool spm = spec.kind == TokenizerKind::SPM;
  spec.bos_id = token_id_or(f, "tokenizer.ggml.bos_token_id", spm ? 1 : -1, n_vocab);
  spec.eos_id = token_id_or(f, "tokenizer.ggml.eos_token_id", spm ? 2 : -1, n_vocab);
  spec.unk_id = token_id_or(f, "tokenizer.ggml.unknown_token_id", spm ? 0 : -1, n_vocab);
  spec.pad_id = token_id_or(f, "tokenizer.ggml.padding_token_id", -1, n_vocab);
  spec.eot_id = token_id_or(f, "tokenizer.ggml.eot_token_id", -1, n_vocab);
  spec.eom_id = token_id_or(f, "tokenizer.ggml.eom_token_id", -1, n_vocab);
  spec.add_bos = f.get_bool_or("tokenizer.ggml.add_bos_token", spm);
  spec.add_eos = f.get_bool_or("tokenizer.ggml.add_eos_token", false);

  if (spm) {
    spec.add_space_prefix = f.get_bool_or("tokenizer.ggml.add_space_prefix", true);
    spec.pre_name = "llama";
  } else {
    // llama.cpp ignores add_space_prefix for byte-level BPE, and so does this loader.
    spec.pre_name = f.get_string_or("tokenizer.ggml.pre", "default");
    spec.pre_patterns = PreTokenizer::patterns_for(spec.pre_name);
    if (spec.pre_patterns.empty())
      throw Error(where + "tokenizer.ggml.pre '" + spec.pre_name +
                  "' is not a supported pre-tokenizer (supported: " + PreTokenizer::known_names() + ")");
    spec.ignore_merges = PreTokenizer::ignores_merges(spec.pre_name);
    if (!f.has("tokenizer.ggml.merges"))
      throw Error(where + "tokenizer.ggml.merges is missing (required for 'gpt2')");
    const std::vector<std::string>& merges = f.get_string_array("tokenizer.ggml.merges");
    spec.merges.reserve(merges.size());
    for (size_t i = 0; i < merges.size(); ++i) {
      const std::string& m = merges[i];
      const size_t sp = m.find(' ', 1);  // a merge's left part is never empty, but may itself be " "
      if (sp == std::string::npos)
        throw Error(where + "tokenizer.ggml.merges[" + std::to_string(i) + "] '" + m + "' has no space");
      spec.merges.emplace_back(m.substr(0, sp), m.substr(sp + 1));
    }
  }
  try {
    return from_spec(std::move(spec));
  } catch (const Error& e) {
    throw Error(where + e.what());
  }
}

}  // namespace kestrel
