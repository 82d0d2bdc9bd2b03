// Tokenizer loaders for Hugging Face tokenizer folders (tokenizer.json, or the older vocab.json +
// merges.txt layout). Field meanings follow the Hugging Face tokenizers serialization format.
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "io/mapped_file.h"
#include "tokenizer/pre_tokenizer.h"
#include "tokenizer/spec_loaders.h"
#include "tokenizer/tokenizer.h"
#include "io/json_text.h"

namespace kestrel {

namespace {

using nlohmann::json;
namespace fs = std::filesystem;

std::string read_text(const std::string& path) { return read_regular_file(path); }

json read_json(const std::string& path) {
  try {
    return json::parse(read_text(path));
  } catch (const json::exception& e) {
    throw Error(path + ": invalid JSON: " + e.what());
  }
}

std::string path_in(const std::string& dir, const char* name) { return (fs::path(dir) / name).string(); }

// Present as any kind of file: a FIFO or a directory in a tokenizer file's place gets
// read_regular_file's "not a regular file" error instead of being passed over.
bool exists(const std::string& path) {
  std::error_code ec;
  return fs::exists(path, ec);
}

// Regex that matches `s` literally.
std::string regex_escape(std::string_view s) {
  std::string out;
  for (char c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x80 && !std::isalnum(u)) out.push_back('\\');
    out.push_back(c);
  }
  return out;
}

// A token named in a config: "text", {"content": "text", ...} or null.
std::optional<std::string> token_text(const json& j) {
  if (j.is_string()) return j.get<std::string>();
  if (j.is_object() && j.contains("content") && j["content"].is_string())
    return j["content"].get<std::string>();
  return std::nullopt;
}

// Vocabulary under construction: text by id plus added tokens.
struct VocabBuilder {
  std::vector<TokenData> tokens;

  void set(int64_t id, std::string text, TokenType type, const std::string& where) {
    if (id < 0 || id > (int64_t{1} << 24))
      throw Error(where + ": token id " + std::to_string(id) + " is out of range");
    if (static_cast<size_t>(id) >= tokens.size())
      tokens.resize(static_cast<size_t>(id) + 1, TokenData{"", 0.0f, TokenType::UNUSED});
    tokens[static_cast<size_t>(id)] = TokenData{std::move(text), 0.0f, type};
  }

  void load_vocab_object(const json& vocab, const std::string& where) {
    if (!vocab.is_object()) throw Error(where + ": vocab is not a JSON object");
    for (const auto& [text, id] : vocab.items()) {
      if (!id.is_number_integer()) throw Error(where + ": id of token '" + text + "' is not an integer");
      const auto i = id.get<int64_t>();
      if (i >= 0 && static_cast<size_t>(i) < tokens.size() &&
          tokens[static_cast<size_t>(i)].type != TokenType::UNUSED) {
        throw Error(where + ": id " + std::to_string(i) + " is used twice");
      }
      set(i, text, TokenType::NORMAL, where);
    }
  }

  std::optional<int32_t> find(const std::string& text) const {
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (tokens[i].text == text) return static_cast<int32_t>(i);
    }
    return std::nullopt;
  }
};

std::vector<std::pair<std::string, std::string>> read_merges_file(const std::string& path) {
  std::vector<std::pair<std::string, std::string>> merges;
  std::istringstream in(read_text(path));
  std::string line;
  size_t line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty()) continue;
    if (line_no == 1 && line.rfind("#version", 0) == 0) continue;
    const size_t sp = line.find(' ');
    if (sp == std::string::npos || sp == 0 || sp + 1 == line.size()) {
      throw Error(path + ": line " + std::to_string(line_no) + " is not a 'left right' merge: '" + line +
                  "'");
    }
    merges.emplace_back(line.substr(0, sp), line.substr(sp + 1));
  }
  return merges;
}

std::vector<std::string> pre_patterns(std::string_view pre, bool* ignore_merges) {
  std::vector<std::string> patterns = PreTokenizer::patterns_for(pre);
  if (patterns.empty()) {
    throw Error("tokenizer: unknown pre-tokenizer '" + std::string(pre) + "' (supported: " +
                PreTokenizer::known_names() + ")");
  }
  *ignore_merges = PreTokenizer::ignores_merges(pre);
  return patterns;
}

// Applies the BOS/EOS/UNK/PAD names and add_*_token flags of tokenizer_config.json /
// special_tokens_map.json (either may be missing).
void apply_token_config(const json& cfg, const VocabBuilder& vb, TokenizerSpec* spec) {
  auto id_of = [&](const char* key) -> std::optional<int32_t> {
    if (!cfg.contains(key)) return std::nullopt;
    std::optional<std::string> text = token_text(cfg[key]);
    if (!text) return std::nullopt;
    return vb.find(*text);
  };
  if (auto id = id_of("bos_token")) spec->bos_id = *id;
  if (auto id = id_of("eos_token")) spec->eos_id = *id;
  if (auto id = id_of("unk_token")) spec->unk_id = *id;
  if (auto id = id_of("pad_token")) spec->pad_id = *id;
  if (cfg.contains("add_bos_token") && cfg["add_bos_token"].is_boolean())
    spec->add_bos = cfg["add_bos_token"].get<bool>();
  if (cfg.contains("add_eos_token") && cfg["add_eos_token"].is_boolean())
    spec->add_eos = cfg["add_eos_token"].get<bool>();
}

// Pre-tokenizer of tokenizer.json, flattened to a regex list.
struct HfPre {
  std::vector<std::string> patterns;
  bool byte_level = false;
  bool add_prefix_space = false;
};

void parse_pre_tokenizer(const json& j, const std::string& where, HfPre* out) {
  if (j.is_null()) return;
  const std::string type = j.value("type", "");
  if (type == "Sequence") {
    for (const json& p : j.at("pretokenizers")) parse_pre_tokenizer(p, where, out);
  } else if (type == "ByteLevel") {
    out->byte_level = true;
    out->add_prefix_space = j.value("add_prefix_space", true);
    if (j.value("use_regex", true)) out->patterns.push_back(PreTokenizer::gpt2_pattern());
  } else if (type == "Split") {
    const std::string behavior = j.value("behavior", "");
    if (behavior != "Isolated")
      throw Error(where + ": pre_tokenizer Split behavior '" + behavior + "' is not supported");
    if (j.value("invert", false)) throw Error(where + ": pre_tokenizer Split with invert is not supported");
    const json& pat = j.at("pattern");
    if (pat.contains("Regex")) {
      out->patterns.push_back(pat["Regex"].get<std::string>());
    } else if (pat.contains("String")) {
      out->patterns.push_back(regex_escape(pat["String"].get<std::string>()));
    } else {
      throw Error(where + ": pre_tokenizer Split has no Regex or String pattern");
    }
  } else if (type == "Digits") {
    out->patterns.push_back(j.value("individual_digits", false) ? R"(\p{N})" : R"(\p{N}+)");
  } else {
    throw Error(where + ": pre_tokenizer type '" + type + "' is not supported");
  }
}

void check_normalizer(const json& j, const std::string& where) {
  if (j.is_null()) return;
  const std::string type = j.value("type", "");
  if (type == "Sequence") {
    for (const json& n : j.at("normalizers")) check_normalizer(n, where);
    return;
  }
  // NFC is skipped on purpose: no Unicode normalization tables in the engine, and chat text is
  // nearly always NFC already.
  if (type == "NFC") return;
  throw Error(where + ": normalizer type '" + type + "' is not supported");
}

// BOS/EOS from a TemplateProcessing post-processor: "single" = [SpecialToken?, Sequence A, SpecialToken?].
void parse_post_processor(const json& j, const VocabBuilder& vb, TokenizerSpec* spec) {
  if (j.is_null()) return;
  const std::string type = j.value("type", "");
  if (type == "Sequence") {
    for (const json& p : j.at("processors")) parse_post_processor(p, vb, spec);
    return;
  }
  if (type != "TemplateProcessing" || !j.contains("single") || !j["single"].is_array()) return;
  const json& single = j["single"];
  bool seen_sequence = false;
  for (const json& item : single) {
    if (item.contains("Sequence")) {
      seen_sequence = true;
    } else if (item.contains("SpecialToken")) {
      std::optional<int32_t> id = vb.find(item["SpecialToken"].value("id", ""));
      if (!id) continue;
      if (!seen_sequence) {
        spec->add_bos = true;
        spec->bos_id = *id;
      } else {
        spec->add_eos = true;
        spec->eos_id = *id;
      }
    }
  }
}

TokenizerSpec spec_from_tokenizer_json(const std::string& path, VocabBuilder* vb) {
  const json j = read_json(path);
  TokenizerSpec spec;
  spec.kind = TokenizerKind::BPE;
  try {
    const json& model = j.at("model");
    const std::string type = model.value("type", "BPE");
    if (type != "BPE") throw Error(path + ": model.type '" + type + "' is not supported (only BPE)");
    if (model.contains("continuing_subword_prefix") && model["continuing_subword_prefix"].is_string() &&
        !model["continuing_subword_prefix"].get<std::string>().empty()) {
      throw Error(path + ": model.continuing_subword_prefix is not supported");
    }
    vb->load_vocab_object(model.at("vocab"), path);
    for (const json& m : model.at("merges")) {
      if (m.is_string()) {
        const auto s = m.get<std::string>();
        const size_t sp = s.find(' ');
        if (sp == std::string::npos) throw Error(path + ": merge '" + s + "' has no space");
        spec.merges.emplace_back(s.substr(0, sp), s.substr(sp + 1));
      } else if (m.is_array() && m.size() == 2) {
        spec.merges.emplace_back(m[0].get<std::string>(), m[1].get<std::string>());
      } else {
        throw Error(path + ": a merge is neither \"a b\" nor [a, b]: " + json_shown(m));
      }
    }
    spec.ignore_merges = model.value("ignore_merges", false);
    if (j.contains("added_tokens")) {
      for (const json& a : j["added_tokens"]) {
        vb->set(a.at("id").get<int64_t>(), a.at("content").get<std::string>(),
                a.value("special", false) ? TokenType::CONTROL : TokenType::USER_DEFINED, path);
      }
    }
    if (model.contains("unk_token")) {
      if (std::optional<std::string> unk = token_text(model["unk_token"])) {
        if (auto id = vb->find(*unk)) spec.unk_id = *id;
      }
    }
    check_normalizer(j.value("normalizer", json()), path);
    HfPre pre;
    parse_pre_tokenizer(j.value("pre_tokenizer", json()), path, &pre);
    const json decoder = j.value("decoder", json());
    if (!pre.byte_level && !(decoder.is_object() && decoder.value("type", "") == "ByteLevel")) {
      throw Error(path + ": only byte-level BPE is supported (no ByteLevel pre-tokenizer or decoder)");
    }
    spec.pre_patterns = std::move(pre.patterns);
    spec.add_space_prefix = pre.add_prefix_space;
    spec.pre_name = "tokenizer.json";
    parse_post_processor(j.value("post_processor", json()), *vb, &spec);
  } catch (const json::exception& e) {
    throw Error(path + ": unexpected structure: " + e.what());
  }
  return spec;
}

// Added tokens and special-token names of the transformers config files next to the vocabulary.
void apply_transformers_configs(const std::string& dir, VocabBuilder* vb, TokenizerSpec* spec) {
  json cfg = json::object();
  const std::string cfg_path = path_in(dir, "tokenizer_config.json");
  if (exists(cfg_path)) cfg = read_json(cfg_path);
  json special_map = json::object();
  const std::string map_path = path_in(dir, "special_tokens_map.json");
  if (exists(map_path)) special_map = read_json(map_path);

  // Texts the configs call special.
  std::vector<std::string> special_texts;
  for (const json* src : {&cfg, &special_map}) {
    for (const char* key :
         {"bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"}) {
      if (src->contains(key)) {
        if (auto t = token_text((*src)[key])) special_texts.push_back(*t);
      }
    }
    if (src->contains("additional_special_tokens") && (*src)["additional_special_tokens"].is_array()) {
      for (const json& t : (*src)["additional_special_tokens"]) {
        if (auto s = token_text(t)) special_texts.push_back(*s);
      }
    }
  }
  auto is_named_special = [&](const std::string& t) {
    return std::find(special_texts.begin(), special_texts.end(), t) != special_texts.end();
  };

  const std::string added_path = path_in(dir, "added_tokens.json");
  if (exists(added_path)) {
    const json added = read_json(added_path);
    if (!added.is_object()) throw Error(added_path + ": not a JSON object");
    for (const auto& [text, id] : added.items()) {
      if (!id.is_number_integer()) throw Error(added_path + ": id of '" + text + "' is not an integer");
      vb->set(id.get<int64_t>(), text, is_named_special(text) ? TokenType::CONTROL : TokenType::USER_DEFINED,
              added_path);
    }
  }
  if (cfg.contains("added_tokens_decoder") && cfg["added_tokens_decoder"].is_object()) {
    for (const auto& [id_text, tok] : cfg["added_tokens_decoder"].items()) {
      int64_t id = -1;
      try {
        id = std::stoll(id_text);
      } catch (const std::exception&) {
        throw Error(cfg_path + ": added_tokens_decoder key '" + id_text + "' is not an id");
      }
      const std::optional<std::string> text = token_text(tok);
      if (!text) throw Error(cfg_path + ": added_tokens_decoder[" + id_text + "] has no content");
      vb->set(id, *text, tok.value("special", false) ? TokenType::CONTROL : TokenType::USER_DEFINED,
              cfg_path);
    }
  }
  apply_token_config(special_map, *vb, spec);
  apply_token_config(cfg, *vb, spec);
}

TokenizerSpec spec_from_bpe_files(const std::string& vocab_path, const std::string& merges_path,
                                  std::string_view pre, std::span<const AddedToken> added) {
  VocabBuilder vb;
  vb.load_vocab_object(read_json(vocab_path), vocab_path);
  TokenizerSpec spec;
  spec.kind = TokenizerKind::BPE;
  spec.merges = read_merges_file(merges_path);
  spec.pre_patterns = pre_patterns(pre, &spec.ignore_merges);
  spec.pre_name = std::string(pre);
  for (const AddedToken& a : added) {
    vb.set(a.id, a.text, a.special ? TokenType::CONTROL : TokenType::USER_DEFINED,
           "added token '" + a.text + "'");
  }
  spec.tokens = std::move(vb.tokens);
  return spec;
}

TokenizerSpec spec_from_hf_dir(const std::string& dir, std::string_view pre) {
  VocabBuilder vb;
  TokenizerSpec spec;
  const std::string tj = path_in(dir, "tokenizer.json");
  const std::string sp_model = path_in(dir, "tokenizer.model");
  bool have_spec = false;
  if (exists(tj)) {
    try {
      spec = spec_from_tokenizer_json(tj, &vb);
      have_spec = true;
    } catch (const Error&) {
      // A SentencePiece-style tokenizer.json (Metaspace, Prepend/Replace normalizers) is not read;
      // the folder's tokenizer.model describes the same tokenizer.
      if (!exists(sp_model)) throw;
      vb = VocabBuilder();
    }
  }
  if (!have_spec && exists(sp_model)) {
    spec = spm_spec_from_model_file(sp_model);
    vb.tokens = std::move(spec.tokens);
  } else if (!have_spec) {
    std::string vocab_path = path_in(dir, "vocab.json");
    if (!exists(vocab_path)) vocab_path = path_in(dir, "encoder.json");
    std::string merges_path = path_in(dir, "merges.txt");
    if (!exists(merges_path)) merges_path = path_in(dir, "vocab.bpe");
    if (!exists(vocab_path) || !exists(merges_path)) {
      throw Error(
          dir + ": no tokenizer.json, tokenizer.model, or vocab.json/encoder.json with merges.txt/vocab.bpe");
    }
    vb.load_vocab_object(read_json(vocab_path), vocab_path);
    spec.kind = TokenizerKind::BPE;
    spec.merges = read_merges_file(merges_path);
    std::string pre_name(pre);
    if (pre_name.empty()) {
      pre_name = "gpt-2";
      const std::string cfg_path = path_in(dir, "tokenizer_config.json");
      if (exists(cfg_path)) {
        const json cfg = read_json(cfg_path);
        if (cfg.value("tokenizer_class", "") == "Qwen2Tokenizer") pre_name = "qwen2";
      }
    }
    spec.pre_patterns = pre_patterns(pre_name, &spec.ignore_merges);
    spec.pre_name = pre_name;
  }
  apply_transformers_configs(dir, &vb, &spec);
  spec.tokens = std::move(vb.tokens);
  return spec;
}

}  // namespace

TokenizerSpec spec_from_tokenizer_json_file(const std::string& path) {
  VocabBuilder vb;
  TokenizerSpec spec = spec_from_tokenizer_json(path, &vb);
  spec.tokens = std::move(vb.tokens);
  return spec;
}

std::unique_ptr<Tokenizer> Tokenizer::from_bpe_files(const std::string& vocab_path,
                                                     const std::string& merges_path, std::string_view pre,
                                                     std::span<const AddedToken> added) {
  try {
    return from_spec(spec_from_bpe_files(vocab_path, merges_path, pre, added));
  } catch (const nlohmann::json::exception& e) {
    throw Error(vocab_path + ": unexpected JSON structure: " + e.what());
  }
}

std::unique_ptr<Tokenizer> Tokenizer::from_hf_dir(const std::string& dir, std::string_view pre) {
  try {
    return from_spec(spec_from_hf_dir(dir, pre));
  } catch (const nlohmann::json::exception& e) {
    throw Error(dir + ": unexpected JSON structure: " + e.what());
  }
}

}  // namespace kestrel
