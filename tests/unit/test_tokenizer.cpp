// Tokenizer unit tests: UTF-8 and byte-level helpers, pre-tokenizer splits, loaders (GGUF in memory,
// tokenizer.json), special tokens, decoding and streaming, speed. Reference ids come from the data
// READMEs (stories260K run.c ids, Ollama's Llama 3 examples) and from the models' own metadata.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "core/error.h"
#include "gguf_builder.h"
#include "io/gguf.h"
#include "test_util.h"
#include "tokenizer/byte_level.h"
#include "tokenizer/pre_tokenizer.h"
#include "tokenizer/stream_decoder.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace kestrel {
namespace {

using Ids = std::vector<int32_t>;

std::string vectors_dir() { return test::data_dir() + "/tokenizer-vectors"; }

std::unique_ptr<Tokenizer> load_gguf_tokenizer(const std::string& path) {
  const GgufFile f = GgufFile::open(path);
  return Tokenizer::from_gguf(f);
}

std::unique_ptr<Tokenizer> llama3_tokenizer() {
  const std::string dir = test::data_dir() + "/llama3-bpe-vocab";
  const std::vector<AddedToken> added = {{"<|begin_of_text|>", 128000, true},
                                         {"<|end_of_text|>", 128001, true}};
  return Tokenizer::from_bpe_files(dir + "/encoder.json", dir + "/vocab.bpe", "llama-bpe", added);
}

std::vector<std::string> split(const PreTokenizer& pre, std::string_view text) {
  std::vector<std::string_view> pieces;
  pre.split(text, &pieces);
  return {pieces.begin(), pieces.end()};
}

// ---------------------------------------------------------------------------------------------
// UTF-8 and the byte alphabet

TEST(TokUtf8, StepsClassifyMaximalSubparts) {
  EXPECT_TRUE(utf8_is_valid("h\xC3\xA9\xE2\x82\xAC\xF0\x9F\xA6\x99"));  // hé€🦙
  EXPECT_FALSE(utf8_is_valid("\xC0\x80"));                              // overlong
  EXPECT_FALSE(utf8_is_valid("\xED\xA0\x80"));                          // surrogate
  EXPECT_FALSE(utf8_is_valid("\xF0\x9F\xA6"));                          // truncated
  const Utf8Step trunc = utf8_step("\xF0\x9F\xA6", 0);
  EXPECT_EQ(trunc.kind, Utf8Kind::INCOMPLETE);
  EXPECT_EQ(trunc.len, 3u);
  // "\xE2\x82" followed by 'A': one U+FFFD for the two bytes, then 'A'.
  EXPECT_EQ(utf8_sanitize("\xE2\x82"
                          "A"),
            "\xEF\xBF\xBD"
            "A");
  // Each stray continuation byte is its own subpart.
  EXPECT_EQ(utf8_sanitize("\x80\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(utf8_sanitize("\xF0\x9F\xA6"), "\xEF\xBF\xBD");
}

TEST(TokByteLevel, Gpt2AlphabetRoundTrips) {
  EXPECT_EQ(byte_level_char(' '), "\xC4\xA0");   // U+0120 'Ġ'
  EXPECT_EQ(byte_level_char('\n'), "\xC4\x8A");  // U+010A 'Ċ'
  EXPECT_EQ(byte_level_char('a'), "a");
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  EXPECT_EQ(byte_level_decode(byte_level_encode(all)), all);
  // Characters outside the alphabet (added tokens) pass through.
  EXPECT_EQ(byte_level_decode("<|im_end|> \xE2\x96\x81"), "<|im_end|> \xE2\x96\x81");
}

// ---------------------------------------------------------------------------------------------
// Pre-tokenizers

TEST(TokPreTokenizer, Gpt2Splits) {
  const PreTokenizer pre = PreTokenizer::from_name("gpt-2");
  EXPECT_EQ(split(pre, "Hello world"), (std::vector<std::string>{"Hello", " world"}));
  // Runs of spaces: all but the last space stay together, the last one joins the word.
  EXPECT_EQ(split(pre, "a   b"), (std::vector<std::string>{"a", "  ", " b"}));
  EXPECT_EQ(split(pre, "I'm 33!"), (std::vector<std::string>{"I", "'m", " 33", "!"}));
}

TEST(TokPreTokenizer, Llama3AndQwen2Digits) {
  bool ignore = false;
  const PreTokenizer llama3 = PreTokenizer::from_name("llama-bpe", &ignore);
  EXPECT_TRUE(ignore);
  EXPECT_EQ(split(llama3, "1234567"), (std::vector<std::string>{"123", "456", "7"}));
  EXPECT_EQ(split(llama3, "I'M ok\n\n"), (std::vector<std::string>{"I", "'M", " ok", "\n\n"}));
  const PreTokenizer qwen2 = PreTokenizer::from_name("qwen2", &ignore);
  EXPECT_FALSE(ignore);
  EXPECT_EQ(split(qwen2, "123"), (std::vector<std::string>{"1", "2", "3"}));
}

TEST(TokPreTokenizer, SequenceKeepsUnmatchedStretches) {
  // smollm = single digits, then GPT-2 on each piece.
  const PreTokenizer pre = PreTokenizer::from_name("smollm");
  EXPECT_EQ(split(pre, "ab 12"), (std::vector<std::string>{"ab", " ", "1", "2"}));
  const PreTokenizer custom({"x"});
  EXPECT_EQ(split(custom, "axxb"), (std::vector<std::string>{"a", "x", "x", "b"}));
  const PreTokenizer none;
  EXPECT_EQ(split(none, "a b"), (std::vector<std::string>{"a b"}));
}

TEST(TokPreTokenizer, AllNamedOnesCompile) {
  for (const char* name :
       {"default", "gpt-2", "mpt", "starcoder", "refact", "smollm", "falcon", "gpt-neox", "llama3",
        "llama-bpe", "qwen2", "deepseek-llm", "deepseek-coder", "bloom", "viking", "command-r"}) {
    EXPECT_NO_THROW(PreTokenizer::from_name(name)) << name;
  }
  try {
    PreTokenizer::from_name("no-such-pre");
    FAIL() << "expected kestrel::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no-such-pre"), std::string::npos) << e.what();
  }
  EXPECT_THROW(PreTokenizer({"(unclosed"}), Error);
}

TEST(TokPreTokenizer, LongWhitespaceRunDoesNotFail) {
  // \s+(?!\S) backtracks over the whole run; a long run must not exhaust the JIT stack.
  const std::string text = std::string(200000, ' ') + "x";
  const std::vector<std::string> pieces = split(PreTokenizer::from_name("gpt-2"), text);
  ASSERT_EQ(pieces.size(), 2u);
  EXPECT_EQ(pieces[1], " x");
}

// ---------------------------------------------------------------------------------------------
// SentencePiece (stories260K, Llama 2)

TEST(TokSpm, Stories260KPromptIdsMatchRunC) {
  const std::string dir = test::data_dir() + "/stories260K";
  KESTREL_REQUIRE_FILE(dir + "/stories260K.gguf");
  const auto tok = load_gguf_tokenizer(dir + "/stories260K.gguf");
  EXPECT_EQ(tok->kind(), TokenizerKind::SPM);
  EXPECT_EQ(tok->n_vocab(), 512);
  EXPECT_EQ(tok->bos_id(), 1);
  EXPECT_TRUE(tok->add_bos());

  // "=== prompt: [TEXT]" then "prompt_ids: 1 ..." for each run.
  std::istringstream in(test::read_file(dir + "/expected-greedy-llama2c-run.txt"));
  std::string line;
  std::string prompt;
  int checked = 0;
  while (std::getline(in, line)) {
    if (line.rfind("=== prompt: [", 0) == 0) {
      prompt = line.substr(13, line.size() - 14);
    } else if (line.rfind("prompt_ids:", 0) == 0) {
      Ids want;
      std::istringstream ids(line.substr(11));
      int32_t id;
      while (ids >> id) want.push_back(id);
      EXPECT_EQ(tok->encode(prompt, /*add_special=*/true, /*parse_special=*/false), want)
          << "prompt '" << prompt << "'";
      ++checked;
    }
  }
  EXPECT_EQ(checked, 6);
}

TEST(TokSpm, LlamaSpmPiecesAndDecode) {
  KESTREL_REQUIRE_FILE(vectors_dir() + "/ggml-vocab-llama-spm.gguf");
  const auto tok = load_gguf_tokenizer(vectors_dir() + "/ggml-vocab-llama-spm.gguf");
  EXPECT_EQ(tok->encode("Hello world", false, false), (Ids{15043, 3186}));
  EXPECT_EQ(tok->encode("Hello world", true, false), (Ids{1, 15043, 3186}));
  EXPECT_EQ(tok->encode("", true, false), (Ids{1}));
  EXPECT_EQ(tok->encode("", false, false), Ids{});
  EXPECT_EQ(tok->token_to_piece(15043), " Hello");
  EXPECT_EQ(tok->token_to_piece(3 + 0x0A), "\n");  // <0x0A>
  // The dummy-prefix space is dropped after BOS, with or without special tokens shown.
  EXPECT_EQ(tok->decode(Ids{1, 15043, 3186}, /*skip_special=*/true), "Hello world");
  EXPECT_EQ(tok->decode(Ids{1, 15043, 3186}, /*skip_special=*/false), "<s>Hello world");
  EXPECT_EQ(tok->decode(Ids{15043, 15043}), "Hello Hello");
  // <s> is parsed as BOS only when asked.
  EXPECT_EQ(tok->encode("<s>Hi", false, true).front(), 1);
  EXPECT_NE(tok->encode("<s>Hi", false, false).front(), 1);
  EXPECT_TRUE(tok->is_eog(2));
  EXPECT_FALSE(tok->is_eog(1));
  EXPECT_TRUE(tok->is_special(1));
  EXPECT_FALSE(tok->is_special(15043));
  EXPECT_EQ(tok->decode(Ids{32000}), "");  // padded embedding rows have no text (decode())
  EXPECT_THROW(tok->token_to_piece(32000), Error);
  EXPECT_THROW(tok->decode(Ids{-1}), Error);
  EXPECT_THROW(tok->token_to_piece(-1), Error);
}

TEST(TokSpm, ByteFallbackForUnknownCharacters) {
  KESTREL_REQUIRE_FILE(vectors_dir() + "/ggml-vocab-llama-spm.gguf");
  const auto tok = load_gguf_tokenizer(vectors_dir() + "/ggml-vocab-llama-spm.gguf");
  // U+1F999 is not a Llama 2 piece: its four UTF-8 bytes come out as <0xF0><0x9F><0xA6><0x99>.
  const Ids ids = tok->encode("\xF0\x9F\xA6\x99", false, false);
  EXPECT_EQ(ids, (Ids{29871, 3 + 0xF0, 3 + 0x9F, 3 + 0xA6, 3 + 0x99}));
  EXPECT_EQ(tok->decode(ids), "\xF0\x9F\xA6\x99");
  // Invalid UTF-8 input is read as U+FFFD.
  EXPECT_EQ(tok->encode("a\xFF", false, false), tok->encode("a\xEF\xBF\xBD", false, false));
}

// ---------------------------------------------------------------------------------------------
// Byte-level BPE

TEST(TokBpe, Llama3ReadmeExamples) {
  KESTREL_REQUIRE_FILE(test::data_dir() + "/llama3-bpe-vocab/encoder.json");
  const auto tok = llama3_tokenizer();
  EXPECT_EQ(tok->n_vocab(), 128002);
  EXPECT_EQ(tok->encode("hello world", false, false), (Ids{15339, 1917}));
  EXPECT_EQ(tok->encode("0", false, false), (Ids{15}));
  EXPECT_EQ(tok->encode("00", false, false), (Ids{410}));
  EXPECT_EQ(tok->encode("000", false, false), (Ids{931}));
  EXPECT_EQ(tok->encode("0000", false, false), (Ids{931, 15}));
  EXPECT_EQ(tok->encode("hello <|end_of_text|>", false, true), (Ids{15339, 220, 128001}));
  const Ids plain = tok->encode("hello <|end_of_text|>", false, false);
  EXPECT_EQ(std::count(plain.begin(), plain.end(), 128001), 0);
  EXPECT_EQ(tok->decode(plain), "hello <|end_of_text|>");
  EXPECT_EQ(tok->decode(Ids{15339, 220, 128001}, /*skip_special=*/true), "hello ");
  EXPECT_EQ(tok->decode(Ids{15339, 220, 128001}, /*skip_special=*/false), "hello <|end_of_text|>");
  EXPECT_EQ(tok->token_id("<|end_of_text|>"), 128001);
  EXPECT_TRUE(tok->is_eog(128001));
  EXPECT_TRUE(tok->is_special(128001));
  EXPECT_FALSE(tok->add_bos());
}

TEST(TokBpe, Qwen2FolderSpecialTokens) {
  const std::string dir = test::data_dir() + "/qwen2-bpe-vocab";
  KESTREL_REQUIRE_FILE(dir + "/vocab.json");
  const auto tok = Tokenizer::from_hf_dir(dir);
  EXPECT_EQ(tok->n_vocab(), 151646);
  EXPECT_EQ(tok->token_id("<|im_start|>"), 151644);
  EXPECT_EQ(tok->eos_id(), 151645);  // tokenizer_config.json: eos_token <|im_end|>
  EXPECT_EQ(tok->bos_id(), -1);      // bos_token null
  EXPECT_EQ(tok->pad_id(), 151643);
  EXPECT_TRUE(tok->is_eog(151645));
  EXPECT_TRUE(tok->is_eog(151643));  // <|endoftext|>
  EXPECT_FALSE(tok->is_eog(151644));
  const Ids ids = tok->encode("<|im_start|>user\nHi<|im_end|>", true, true);
  ASSERT_GE(ids.size(), 3u);
  EXPECT_EQ(ids.front(), 151644);
  EXPECT_EQ(ids.back(), 151645);
  EXPECT_EQ(tok->decode(ids), "<|im_start|>user\nHi<|im_end|>");
  EXPECT_EQ(tok->decode(ids, true), "user\nHi");
}

TEST(TokBpe, DefaultModelParsesChatTemplateTokens) {
  const std::string path = test::model_dir() + "/SmolLM2-135M-Instruct.Q4_1.gguf";
  KESTREL_REQUIRE_FILE(path);
  const auto tok = load_gguf_tokenizer(path);
  const std::optional<int32_t> im_start = tok->token_id("<|im_start|>");
  const std::optional<int32_t> im_end = tok->token_id("<|im_end|>");
  ASSERT_TRUE(im_start && im_end);
  EXPECT_EQ(*im_start, 1);
  EXPECT_EQ(*im_end, 2);
  const std::string chat = "<|im_start|>user\nHi<|im_end|>";
  const Ids parsed = tok->encode(chat, false, true);
  ASSERT_FALSE(parsed.empty());
  EXPECT_EQ(parsed.front(), *im_start);
  EXPECT_EQ(parsed.back(), *im_end);
  const Ids literal = tok->encode(chat, false, false);
  EXPECT_NE(literal.front(), *im_start);
  EXPECT_EQ(std::count(literal.begin(), literal.end(), *im_start), 0);
  EXPECT_EQ(tok->decode(literal), chat);
  EXPECT_FALSE(tok->add_bos());  // tokenizer.ggml.add_bos_token = false
  EXPECT_TRUE(tok->is_eog(*im_end));
  EXPECT_TRUE(tok->is_eog(0));  // <|endoftext|>
  EXPECT_FALSE(tok->is_eog(*im_start));
}

// ---------------------------------------------------------------------------------------------
// Streaming

// Every chunk a StreamDecoder returns must be valid UTF-8 on its own, and all chunks together
// must equal decode().
void expect_stream_matches_decode(const Tokenizer& tok, const Ids& ids) {
  StreamDecoder sd(tok);
  std::string all;
  for (int32_t id : ids) {
    const std::string chunk = sd.push(id);
    EXPECT_TRUE(utf8_is_valid(chunk)) << "chunk after id " << id;
    all += chunk;
  }
  const std::string rest = sd.flush();
  EXPECT_TRUE(utf8_is_valid(rest));
  all += rest;
  EXPECT_EQ(all, tok.decode(ids));
}

// Models may have more embedding rows than the tokenizer has tokens (padded vocabularies): those
// ids decode to nothing, in decode() and in a stream alike; a negative id is still an error.
TEST(TokStream, IdsBeyondTheVocabularyHaveNoText) {
  KESTREL_REQUIRE_FILE(vectors_dir() + "/ggml-vocab-llama-spm.gguf");
  const auto tok = load_gguf_tokenizer(vectors_dir() + "/ggml-vocab-llama-spm.gguf");
  const Ids ids = tok->encode("Hello world", false, false);
  Ids padded = ids;
  padded.insert(padded.begin() + 1, tok->n_vocab());
  padded.push_back(tok->n_vocab() + 1000);
  EXPECT_EQ(tok->decode(padded), tok->decode(ids));
  expect_stream_matches_decode(*tok, padded);
  EXPECT_THROW(tok->decode(Ids{-1}), Error);
}

TEST(TokStream, EmojiOneByteTokenAtATimeSpm) {
  KESTREL_REQUIRE_FILE(vectors_dir() + "/ggml-vocab-llama-spm.gguf");
  const auto tok = load_gguf_tokenizer(vectors_dir() + "/ggml-vocab-llama-spm.gguf");
  const std::string text = "a \xF0\x9F\xA6\x99\xF0\x9F\x98\x81 b";  // "a 🦙😁 b"
  const Ids ids = tok->encode(text, true, false);
  StreamDecoder sd(*tok, /*skip_special=*/true);  // BOS shows nothing; the dummy-prefix space is dropped
  std::vector<std::string> chunks;
  for (int32_t id : ids) chunks.push_back(sd.push(id));
  chunks.push_back(sd.flush());
  std::string all;
  for (const std::string& c : chunks) {
    EXPECT_TRUE(utf8_is_valid(c));
    all += c;
  }
  EXPECT_EQ(all, text);
  // The llama arrives whole in the chunk of its last byte token, never in pieces.
  EXPECT_NE(std::find(chunks.begin(), chunks.end(), "\xF0\x9F\xA6\x99"), chunks.end());
  expect_stream_matches_decode(*tok, ids);
}

TEST(TokStream, EmojiByteLevelAndVectors) {
  KESTREL_REQUIRE_FILE(vectors_dir() + "/ggml-vocab-gpt-2.gguf");
  const auto tok = load_gguf_tokenizer(vectors_dir() + "/ggml-vocab-gpt-2.gguf");
  // Byte-level: feed the emoji's four single-byte tokens one at a time.
  const std::string llama = "\xF0\x9F\xA6\x99";
  StreamDecoder sd(*tok);
  std::string out;
  for (char c : llama) {
    const std::optional<int32_t> id = tok->token_id(byte_level_char(static_cast<uint8_t>(c)));
    ASSERT_TRUE(id);
    const std::string chunk = sd.push(*id);
    EXPECT_TRUE(utf8_is_valid(chunk));
    out += chunk;
    if (out.empty()) {
      EXPECT_GT(sd.pending_bytes(), 0u);
    }
  }
  EXPECT_EQ(out, llama);
  EXPECT_EQ(sd.flush(), "");
  const std::string text =
      "\xF0\x9F\x9A\x80 (normal) \xF0\x9F\x98\xB6\xE2\x80\x8D\xF0\x9F\x8C\xAB\xEF\xB8\x8F \xE2\x9C\x85";
  expect_stream_matches_decode(*tok, tok->encode(text, false, false));
}

TEST(TokStream, BrokenBytesBecomeReplacementCharacters) {
  KESTREL_REQUIRE_FILE(vectors_dir() + "/ggml-vocab-gpt-2.gguf");
  const auto tok = load_gguf_tokenizer(vectors_dir() + "/ggml-vocab-gpt-2.gguf");
  auto byte_id = [&](uint8_t b) { return *tok->token_id(byte_level_char(b)); };
  StreamDecoder sd(*tok);
  EXPECT_EQ(sd.push(byte_id(0xF0)), "");
  EXPECT_EQ(sd.push(byte_id(0x9F)), "");
  // 'a' cannot continue the sequence: the two held bytes become one U+FFFD, then 'a'.
  EXPECT_EQ(sd.push(byte_id('a')),
            "\xEF\xBF\xBD"
            "a");
  EXPECT_EQ(sd.push(byte_id(0xFF)), "\xEF\xBF\xBD");
  EXPECT_EQ(sd.push(byte_id(0xE2)), "");
  EXPECT_EQ(sd.flush(), "\xEF\xBF\xBD");  // an unfinished tail at the end
  EXPECT_EQ(tok->decode(Ids{byte_id(0xF0), byte_id('a')}),
            "\xEF\xBF\xBD"
            "a");
}

// ---------------------------------------------------------------------------------------------
// Random input (fixed seed): no throw, lossless round trip of the sanitized text, streaming equals
// decoding, and never broken UTF-8 out.

std::string random_text(std::mt19937& rng) {
  static const std::vector<std::string> atoms = {"a",
                                                 "Z",
                                                 " ",
                                                 "  ",
                                                 "\t",
                                                 "\n",
                                                 "\r\n",
                                                 "3",
                                                 "42",
                                                 "'s",
                                                 "!",
                                                 "(",
                                                 "\xC3\xA9",
                                                 "\xE2\x96\x81",
                                                 "\xE4\xB8\xAD",
                                                 "\xF0\x9F\xA6\x99",
                                                 "\xE2\x80\x8D",
                                                 "<s>",
                                                 "</s>",
                                                 "<|endoftext|>",
                                                 "<0x41>",
                                                 "\xFF",
                                                 "\x80",
                                                 "\xE2\x82",
                                                 "\xF0\x9F",
                                                 "\xC0\xAF",
                                                 "\xED\xA0\x80"};
  std::string s;
  const int n = static_cast<int>(rng() % 40);
  for (int i = 0; i < n; ++i) s += atoms[rng() % atoms.size()];
  return s;
}

TEST(TokFuzz, RandomTextAndIds) {
  KESTREL_REQUIRE_FILE(vectors_dir() + "/ggml-vocab-gpt-2.gguf");
  KESTREL_REQUIRE_FILE(vectors_dir() + "/ggml-vocab-llama-spm.gguf");
  const auto gpt2 = load_gguf_tokenizer(vectors_dir() + "/ggml-vocab-gpt-2.gguf");
  const auto spm = load_gguf_tokenizer(vectors_dir() + "/ggml-vocab-llama-spm.gguf");
  std::mt19937 rng(1234);
  for (int iter = 0; iter < 300; ++iter) {
    const std::string text = random_text(rng);
    for (const Tokenizer* tok : {gpt2.get(), spm.get()}) {
      const Ids ids = tok->encode(text, /*add_special=*/true, /*parse_special=*/false);
      // Neither vocabulary has USER_DEFINED tokens, so without special parsing nothing is cut out
      // and decoding gives back the (sanitized) text exactly; SentencePiece reads a typed '▁' as a
      // space, as sentencepiece itself does.
      std::string want = utf8_sanitize(text);
      if (tok->kind() == TokenizerKind::SPM) {
        for (size_t p; (p = want.find("\xE2\x96\x81")) != std::string::npos;) want.replace(p, 3, " ");
      }
      EXPECT_EQ(tok->decode(ids, /*skip_special=*/true), want);
      expect_stream_matches_decode(*tok, ids);
      const Ids parsed = tok->encode(text, true, true);
      EXPECT_TRUE(utf8_is_valid(tok->decode(parsed)));
    }
    // Arbitrary id sequences (byte tokens in any order) still decode and stream to valid UTF-8.
    Ids ids;
    const int n = static_cast<int>(rng() % 12);
    for (int i = 0; i < n; ++i) ids.push_back(static_cast<int32_t>(rng() % 300));
    for (const Tokenizer* tok : {gpt2.get(), spm.get()}) {
      EXPECT_TRUE(utf8_is_valid(tok->decode(ids)));
      expect_stream_matches_decode(*tok, ids);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// GGUF errors (metadata built in memory)

using B = test::GgufBuilder;

test::GgufEncoded i32s(const std::vector<int32_t>& v) { return B::array_of(GgufValueType::INT32, v); }

std::string from_gguf_error(const std::vector<uint8_t>& image) {
  try {
    const GgufFile f = GgufFile::parse(image.data(), image.size());
    Tokenizer::from_gguf(f);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(TokGguf, UnknownModelOrPreIsAnErrorNamingIt) {
  const std::vector<std::string> tokens = {"a", "b", "ab"};
  EXPECT_NE(from_gguf_error(B().kv("tokenizer.ggml.model", B::str("bert"))
                                .kv("tokenizer.ggml.tokens", B::strings(tokens))
                                .build())
                .find("'bert'"),
            std::string::npos);
  EXPECT_NE(from_gguf_error(B().kv("tokenizer.ggml.model", B::str("gpt2"))
                                .kv("tokenizer.ggml.pre", B::str("mystery-pre"))
                                .kv("tokenizer.ggml.tokens", B::strings(tokens))
                                .kv("tokenizer.ggml.merges", B::strings({"a b"}))
                                .build())
                .find("'mystery-pre'"),
            std::string::npos);
  EXPECT_NE(from_gguf_error(B().kv("tokenizer.ggml.model", B::str("gpt2"))
                                .kv("tokenizer.ggml.tokens", B::strings(tokens))
                                .build())
                .find("merges"),
            std::string::npos);
  EXPECT_NE(from_gguf_error(B().kv("tokenizer.ggml.model", B::str("llama"))
                                .kv("tokenizer.ggml.tokens", B::strings(tokens))
                                .kv("tokenizer.ggml.token_type", i32s({1, 1}))
                                .build())
                .find("token_type"),
            std::string::npos);
}

TEST(TokGguf, SpecialTokenIds) {
  const std::vector<std::string> tokens = {"a", "b", "ab"};
  auto image = [&](uint32_t bos) {
    return B()
        .kv("tokenizer.ggml.model", B::str("gpt2"))
        .kv("tokenizer.ggml.tokens", B::strings(tokens))
        .kv("tokenizer.ggml.merges", B::strings({"a b"}))
        .kv("tokenizer.ggml.bos_token_id", B::u32(bos))
        .build();
  };
  EXPECT_NE(from_gguf_error(image(99)).find("bos_token_id"), std::string::npos);
  const auto none = image(0xFFFFFFFF);  // "no BOS", as llama.cpp writes it
  const GgufFile f = GgufFile::parse(none.data(), none.size());
  EXPECT_EQ(Tokenizer::from_gguf(f)->bos_id(), -1);
  EXPECT_EQ(Tokenizer::from_gguf(f)->encode("ab", true, false), (Ids{2}));
}

TEST(TokGguf, TinyByteLevelVocabulary) {
  // Byte tokens for 'a', 'b', ' ' plus merges "a b" -> "ab" and "Ġ ab" -> "Ġab".
  const std::string sp(byte_level_char(' '));
  const auto image = B().kv("tokenizer.ggml.model", B::str("gpt2"))
                         .kv("tokenizer.ggml.tokens", B::strings({"a", "b", sp, "ab", sp + "ab", "<|end|>"}))
                         .kv("tokenizer.ggml.token_type", i32s({1, 1, 1, 1, 1, 3}))
                         .kv("tokenizer.ggml.merges", B::strings({"a b", sp + " ab"}))
                         .build();
  const GgufFile f = GgufFile::parse(image.data(), image.size());
  const auto tok = Tokenizer::from_gguf(f);
  EXPECT_EQ(tok->encode("ab ab", false, false), (Ids{3, 4}));
  EXPECT_EQ(tok->encode("ab<|end|>", false, true), (Ids{3, 5}));
  EXPECT_TRUE(tok->is_eog(5));  // named <|end|>, even without an eos key
  EXPECT_EQ(tok->bos_id(), -1);
  EXPECT_EQ(tok->decode(Ids{3, 4}), "ab ab");
}

// ---------------------------------------------------------------------------------------------
// tokenizer.json

class TokHfJson : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("kestrel_tok_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  void write(const std::string& name, const std::string& text) {
    std::ofstream(dir_ / name, std::ios::binary) << text;
  }

  // A byte-level vocabulary over 'a', 'b', 'c', ' ' with merges a+b, ab+c, Ġ+ab.
  static nlohmann::json tiny_json(bool pair_merges) {
    using nlohmann::json;
    const std::string sp(byte_level_char(' '));
    json vocab = {{"a", 0}, {"b", 1}, {"c", 2}, {sp, 3}, {"ab", 4}, {"abc", 5}, {sp + "ab", 6}};
    json merges = json::array();
    for (auto [l, r] :
         std::vector<std::pair<std::string, std::string>>{{"a", "b"}, {"ab", "c"}, {sp, "ab"}}) {
      if (pair_merges) {
        merges.push_back(json::array({l, r}));
      } else {
        merges.push_back(l + " " + r);
      }
    }
    json j;
    j["model"] = {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}, {"unk_token", nullptr}};
    j["added_tokens"] = json::array({{{"id", 7}, {"content", "<|eot|>"}, {"special", true}},
                                     {{"id", 8}, {"content", "[USR]"}, {"special", false}}});
    j["normalizer"] = {{"type", "NFC"}};
    j["pre_tokenizer"] = {
        {"type", "Sequence"},
        {"pretokenizers",
         json::array({{{"type", "Split"},
                       {"pattern", {{"Regex", PreTokenizer::gpt2_pattern()}}},
                       {"behavior", "Isolated"},
                       {"invert", false}},
                      {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}})}};
    j["post_processor"] = {{"type", "TemplateProcessing"},
                           {"single", json::array({{{"SpecialToken", {{"id", "<|eot|>"}, {"type_id", 0}}}},
                                                   {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})}};
    j["decoder"] = {{"type", "ByteLevel"}};
    return j;
  }

  std::filesystem::path dir_;
};

TEST_F(TokHfJson, MergesAsStringsOrPairs) {
  for (bool pairs : {false, true}) {
    write("tokenizer.json", tiny_json(pairs).dump());
    const auto tok = Tokenizer::from_hf_dir(dir_.string());
    EXPECT_EQ(tok->n_vocab(), 9);
    EXPECT_EQ(tok->encode("abc ab", false, false), (Ids{5, 6})) << pairs;
    // The post-processor's leading special token is BOS.
    EXPECT_TRUE(tok->add_bos());
    EXPECT_EQ(tok->encode("ab", true, false), (Ids{7, 4}));
    // Non-special added text is always a token; special text only with parse_special.
    EXPECT_EQ(tok->encode("a[USR]<|eot|>", false, false).at(1), 8);
    EXPECT_EQ(tok->encode("a[USR]<|eot|>", false, true), (Ids{0, 8, 7}));
    EXPECT_EQ(tok->decode(Ids{5, 6, 7}, true), "abc ab");
  }
}

TEST_F(TokHfJson, IgnoreMergesUsesWholeWords) {
  nlohmann::json j = tiny_json(false);
  // Without the "ab c" merge, "abc" is reachable only as a whole vocabulary entry.
  j["model"]["merges"] = nlohmann::json::array({"a b", std::string(byte_level_char(' ')) + " ab"});
  write("tokenizer.json", j.dump());
  EXPECT_EQ(Tokenizer::from_hf_dir(dir_.string())->encode("abc", false, false), (Ids{4, 2}));
  j["model"]["ignore_merges"] = true;
  write("tokenizer.json", j.dump());
  EXPECT_EQ(Tokenizer::from_hf_dir(dir_.string())->encode("abc", false, false), (Ids{5}));
}

TEST_F(TokHfJson, UnsupportedPartsAreErrorsNamingThem) {
  auto error_of = [&](const nlohmann::json& j) -> std::string {
    write("tokenizer.json", j.dump());
    try {
      Tokenizer::from_hf_dir(dir_.string());
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  nlohmann::json j = tiny_json(false);
  j["model"]["type"] = "WordPiece";
  EXPECT_NE(error_of(j).find("WordPiece"), std::string::npos);
  j = tiny_json(false);
  j["normalizer"] = {{"type", "Lowercase"}};
  EXPECT_NE(error_of(j).find("Lowercase"), std::string::npos);
  j = tiny_json(false);
  j["pre_tokenizer"] = {{"type", "Metaspace"}};
  EXPECT_NE(error_of(j).find("Metaspace"), std::string::npos);
  std::filesystem::remove(dir_ / "tokenizer.json");
  EXPECT_THROW(Tokenizer::from_hf_dir(dir_.string()), Error);
}

// ---------------------------------------------------------------------------------------------
// SentencePiece tokenizer.model (protobuf written by hand)

std::string proto_key(int field, int wire) { return std::string(1, static_cast<char>(field << 3 | wire)); }
std::string proto_bytes(int field, const std::string& payload) {
  return proto_key(field, 2) + std::string(1, static_cast<char>(payload.size())) + payload;
}
std::string proto_piece(const std::string& text, float score, int type) {
  std::string f(4, '\0');
  std::memcpy(f.data(), &score, 4);
  return proto_bytes(1, proto_bytes(1, text) + proto_key(2, 5) + f + proto_key(3, 0) +
                            std::string(1, static_cast<char>(type)));
}

std::string write_temp(const std::string& name, const std::string& bytes) {
  const std::string path =
      (std::filesystem::temp_directory_path() / (std::to_string(::getpid()) + "_" + name)).string();
  std::ofstream(path, std::ios::binary) << bytes;
  return path;
}

TEST(TokSpmModelFile, TinyBpeModel) {
  const std::string sp = "\xE2\x96\x81";
  // <unk> <s> </s> a b ▁ ab ▁ab; trainer_spec model_type = BPE (2); normalizer add_dummy_prefix = true.
  std::string model = proto_piece("<unk>", 0, 2) + proto_piece("<s>", 0, 3) + proto_piece("</s>", 0, 3) +
                      proto_piece("a", -1, 1) + proto_piece("b", -2, 1) + proto_piece(sp, -3, 1) +
                      proto_piece("ab", -4, 1) + proto_piece(sp + "ab", -5, 1);
  model += proto_bytes(2, proto_key(3, 0) + "\x02");
  model += proto_bytes(3, proto_key(3, 0) + "\x01");
  const std::string path = write_temp("tiny.model", model);
  const auto tok = Tokenizer::from_sentencepiece_model(path);
  EXPECT_EQ(tok->encode("ab ab", true, false), (Ids{1, 7, 7}));
  EXPECT_EQ(tok->decode(Ids{1, 7, 7}, /*skip_special=*/true), "ab ab");
  // Unknown character, no byte pieces: <unk>.
  EXPECT_EQ(tok->encode("c", false, false), (Ids{5, 0}));

  // A Unigram model is refused by name.
  const std::string unigram =
      write_temp("unigram.model", proto_piece("a", 0, 1) + proto_bytes(2, proto_key(3, 0) + "\x01"));
  try {
    Tokenizer::from_sentencepiece_model(unigram);
    ADD_FAILURE() << "expected kestrel::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("UNIGRAM"), std::string::npos) << e.what();
  }
  // Truncated data is an error, not a crash.
  const std::string cut = write_temp("cut.model", model.substr(0, model.size() - 3));
  EXPECT_THROW(Tokenizer::from_sentencepiece_model(cut), Error);
  std::filesystem::remove(path);
  std::filesystem::remove(unigram);
  std::filesystem::remove(cut);
}

// ---------------------------------------------------------------------------------------------
// Speed

TEST(TokSpeed, LongPromptEncodesInMilliseconds) {
  // A ~12 KB prompt (the vector inputs repeated: prose, code-like text, CJK, emoji, digit runs) gives
  // 3,000-7,000 tokens; encoding it must take milliseconds. GPT-2 runs every merge (no ignore_merges).
  KESTREL_REQUIRE_FILE(vectors_dir() + "/ggml-vocab-gpt-2.gguf");
  KESTREL_REQUIRE_FILE(vectors_dir() + "/ggml-vocab-llama-spm.gguf");
  const std::string inp = test::read_file(vectors_dir() + "/ggml-vocab-llama-spm.gguf.inp");
  std::string text;
  while (text.size() < 12000) text += inp;
  const auto bpe = load_gguf_tokenizer(vectors_dir() + "/ggml-vocab-gpt-2.gguf");
  const auto spm = load_gguf_tokenizer(vectors_dir() + "/ggml-vocab-llama-spm.gguf");
  for (const Tokenizer* tok : {bpe.get(), spm.get()}) {
    tok->encode(text, false, false);  // warm-up
    const auto t0 = std::chrono::steady_clock::now();
    const Ids ids = tok->encode(text, false, false);
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    std::printf("[ speed    ] %s: %zu bytes -> %zu tokens in %.2f ms\n",
                tok->kind() == TokenizerKind::SPM ? "spm (llama-spm)" : "bpe (gpt-2)", text.size(),
                ids.size(), ms);
    EXPECT_GT(ids.size(), 2000u);
    EXPECT_LT(ms, 250.0);  // generous for a shared 2-core machine; typically a few ms
  }
}

}  // namespace
}  // namespace kestrel
