#include "tokenizer/pre_tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "core/error.h"
#include "tokenizer/utf8.h"

namespace kestrel {

namespace {

// The regexes below are facts taken from the models' Hugging Face tokenizer.json files (as listed by
// llama.cpp's llama-vocab.cpp for each tokenizer.ggml.pre name), written out with PCRE2 escapes.

// GPT-2 (openai/gpt-2 encoder.py). The trailing "|\s+" makes every character part of some match; the
// split keeps unmatched stretches anyway, so the pieces are the same with or without it.
const std::string kGpt2 = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Llama 3 (tiktoken cl100k_base style): case-insensitive contractions, numbers in groups of up to 3.
const std::string kLlama3 =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// Qwen2: as Llama 3 but every digit is its own piece.
const std::string kQwen2 =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// DeepSeek LLM: newlines, then runs of cased letters (the explicit list of the Unicode cased-letter
// ranges the model was trained with), ASCII/fullwidth punctuation, trailing whitespace, CJK and
// Hangul, numbers.
const std::string kDeepseekLetters =
    R"(\s?[A-Za-z\x{B5}\x{C0}-\x{D6}\x{D8}-\x{F6}\x{F8}-\x{1BA}\x{1BC}-\x{1BF}\x{1C4}-\x{293})"
    R"(\x{295}-\x{2AF}\x{370}-\x{373}\x{376}\x{377}\x{37B}-\x{37D}\x{37F}\x{386}\x{388}-\x{38A})"
    R"(\x{38C}\x{38E}-\x{3A1}\x{3A3}-\x{3F5}\x{3F7}-\x{481}\x{48A}-\x{52F}\x{531}-\x{556})"
    R"(\x{10A0}-\x{10C5}\x{13A0}-\x{13F5}\x{13F8}-\x{13FD}\x{1C90}-\x{1CBA}\x{1CBD}-\x{1CBF})"
    R"(\x{1D00}-\x{1D2B}\x{1D6B}-\x{1D77}\x{1D79}-\x{1D9A}\x{1E00}-\x{1F15}\x{1F18}-\x{1F1D})"
    R"(\x{1F20}-\x{1F45}\x{1F48}-\x{1F4D}\x{1F50}-\x{1F57}\x{1F59}\x{1F5B}\x{1F5D}\x{1F5F}-\x{1F7D})"
    R"(\x{1F80}-\x{1FB4}\x{1FB6}-\x{1FBC}\x{1FBE}\x{1FC2}-\x{1FC4}\x{1FC6}-\x{1FCC})"
    R"(\x{1FD0}-\x{1FD3}\x{1FD6}-\x{1FDB}\x{1FE0}-\x{1FEC}\x{1FF2}-\x{1FF4}\x{1FF6}-\x{1FFC})"
    R"(\x{2102}\x{2107}\x{210A}-\x{2113}\x{2115}\x{2119}-\x{211D}\x{2124}\x{2126}\x{2128})"
    R"(\x{212A}-\x{212D}\x{212F}-\x{2134}\x{2139}\x{213C}-\x{213F}\x{2145}-\x{2149}\x{214E}\x{2183})"
    R"(\x{2184}\x{2C00}-\x{2C7B}\x{2C7E}-\x{2CE4}\x{2CEB}-\x{2CEE}\x{2CF2}\x{2CF3}\x{A640}-\x{A66D})"
    R"(\x{A680}-\x{A69B}\x{A722}-\x{A76F}\x{A771}-\x{A787}\x{A78B}-\x{A78E}\x{AB70}-\x{ABBF})"
    R"(\x{FB00}-\x{FB06}\x{FB13}-\x{FB17}\x{FF21}-\x{FF3A}\x{FF41}-\x{FF5A}\x{10400}-\x{1044F})"
    R"(\x{104B0}-\x{104D3}\x{104D8}-\x{104FB}\x{10C80}-\x{10CB2}\x{10CC0}-\x{10CF2})"
    R"(\x{118A0}-\x{118DF}\x{1E900}-\x{1E943}]+)";
const std::string kDeepseekPunct =
    R"(\s?[!-/:-~\x{FF01}-\x{FF0F}\x{FF1A}-\x{FF5E}\x{2018}-\x{201F}\x{3000}-\x{3002}]+)";
const std::string kDeepseekCjk = R"([\x{4E00}-\x{9FA5}\x{800}-\x{4E00}\x{AC00}-\x{D7FF}]+)";

const std::string kSingleDigit = R"(\p{N})";

}  // namespace

struct PreTokenizer::Regex {
  pcre2_code* code = nullptr;
  bool jit = false;
  ~Regex() { pcre2_code_free(code); }
};

PreTokenizer::PreTokenizer(const std::vector<std::string>& patterns) : patterns_(patterns) {
  for (const std::string& p : patterns) {
    int err = 0;
    PCRE2_SIZE err_off = 0;
    pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(p.data()), p.size(), PCRE2_UTF | PCRE2_UCP,
                                     &err, &err_off, nullptr);
    if (code == nullptr) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof msg);
      throw Error("pre-tokenizer regex '" + p + "' does not compile at offset " + std::to_string(err_off) +
                  ": " + reinterpret_cast<const char*>(msg));
    }
    auto re = std::make_shared<Regex>();
    re->code = code;
    // JIT is an optimization only: without it (unsupported CPU, W^X policy) pcre2_match interprets.
    re->jit = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
    regexes_.push_back(std::move(re));
  }
}

const std::string& PreTokenizer::gpt2_pattern() { return kGpt2; }

namespace {

// tokenizer.ggml.pre names (llama.cpp's) and the regexes of their models' tokenizers.
struct NamedPre {
  std::vector<std::string_view> names;
  std::vector<std::string> patterns;
};

const std::vector<NamedPre>& named_pres() {
  static const std::vector<NamedPre> table = {
      {{"default", "gpt-2", "gpt2", "mpt", "olmo", "jais", "gpt-neox", "trillion"}, {kGpt2}},
      {{"starcoder", "refact", "smollm", "command-r", "codeshell", "exaone", "minerva-7b"},
       {kSingleDigit, kGpt2}},
      {{"llama3", "llama-bpe", "llama-v3", "dbrx", "smaug-bpe", "chatglm-bpe", "falcon3"}, {kLlama3}},
      {{"qwen2", "stablelm2"}, {kQwen2}},
      {{"deepseek-llm"},
       {R"([\r\n])", kDeepseekLetters, kDeepseekPunct, R"(\s+$)", kDeepseekCjk, R"(\p{N}+)"}},
      {{"deepseek-coder"}, {R"([\r\n])", R"(\s?\p{L}+)", R"(\s?\p{P}+)", kDeepseekCjk, kSingleDigit}},
      {{"falcon"}, {R"([\p{P}\$\+<=>\^~\|`]+)", kGpt2, R"([0-9][0-9][0-9])"}},
      {{"poro-chat", "bloom", "gpt3-finnish"},
       {R"( ?[^(\s|.,!?\x{2026}\x{3002}\x{FF0C}\x{3001}\x{964}\x{6D4}\x{60C})]+)"}},
      {{"viking"}, {R"( ?[^(\s|.,!?\x{2026}\x{3002}\x{FF0C}\x{3001}\x{964}\x{6D4}\x{60C})]+)", kSingleDigit}},
  };
  return table;
}

}  // namespace

std::vector<std::string> PreTokenizer::patterns_for(std::string_view name) {
  for (const NamedPre& p : named_pres()) {
    for (std::string_view n : p.names) {
      if (n == name) return p.patterns;
    }
  }
  return {};
}

std::string PreTokenizer::known_names() {
  std::string out;
  for (const NamedPre& p : named_pres()) {
    for (std::string_view n : p.names) {
      out += out.empty() ? "" : ", ";
      out += n;
    }
  }
  return out;
}

PreTokenizer PreTokenizer::from_name(std::string_view name, bool* ignore_merges) {
  std::vector<std::string> patterns = patterns_for(name);
  if (patterns.empty()) {
    throw Error("tokenizer.ggml.pre: unknown pre-tokenizer '" + std::string(name) + "' (supported: " +
                known_names() + ")");
  }
  if (ignore_merges != nullptr) *ignore_merges = ignores_merges(name);
  return PreTokenizer(patterns);
}

bool PreTokenizer::ignores_merges(std::string_view name) {
  return name == "llama3" || name == "llama-bpe" || name == "llama-v3" || name == "falcon3";
}

void PreTokenizer::split(std::string_view text, std::vector<std::string_view>* out) const {
  if (text.empty()) return;
  std::vector<std::string_view> cur{text};
  std::vector<std::string_view> next;
  pcre2_match_data* md = regexes_.empty() ? nullptr : pcre2_match_data_create(1, nullptr);
  struct MdFree {
    pcre2_match_data* p;
    ~MdFree() { pcre2_match_data_free(p); }
  } md_free{md};
  if (!regexes_.empty() && md == nullptr) throw Error("pre-tokenizer: out of memory for PCRE2 match data");

  for (const auto& re : regexes_) {
    next.clear();
    for (std::string_view piece : cur) {
      const auto* subject = reinterpret_cast<PCRE2_SPTR>(piece.data());
      size_t pos = 0;      // where the next search starts
      size_t emitted = 0;  // end of what has been emitted so far
      while (pos < piece.size()) {
        // The input was checked (or sanitized) to be valid UTF-8 before pre-tokenization.
        int rc = pcre2_match(re->code, subject, piece.size(), pos, PCRE2_NO_UTF_CHECK, md, nullptr);
        if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {
          // A pathological input outgrew the JIT's stack; the interpreter keeps its frames on the heap.
          rc = pcre2_match(re->code, subject, piece.size(), pos, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, md,
                           nullptr);
        }
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) {
          PCRE2_UCHAR msg[256];
          pcre2_get_error_message(rc, msg, sizeof msg);
          throw Error("pre-tokenizer: regex match failed: " +
                      std::string(reinterpret_cast<const char*>(msg)));
        }
        const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
        const size_t start = ov[0];
        const size_t end = ov[1];
        if (end == start) {
          // An empty match carries no text: step over one character, which joins the unmatched stretch.
          pos = start + utf8_char_len(static_cast<uint8_t>(piece[start]));
          continue;
        }
        if (start > emitted) next.push_back(piece.substr(emitted, start - emitted));
        next.push_back(piece.substr(start, end - start));
        emitted = end;
        pos = end;
      }
      if (emitted < piece.size()) next.push_back(piece.substr(emitted));
    }
    cur.swap(next);
  }
  out->insert(out->end(), cur.begin(), cur.end());
}

}  // namespace kestrel
