// libFuzzer target for the request path the server and `kestrel batch` share: bytes ->
// parse_request_body -> parse_openai_request (batch, completions and chat rules) -> to_engine_request
// for every prompt -> prompt_text. Only RequestError / kestrel::Error may escape for bad input; a
// crash, a sanitizer report, another exception type or an allocation beyond -malloc_limit_mb is a
// bug. The tokenizer is built here (a small SentencePiece vocabulary with byte fallback and
// ChatML special tokens) and the chat template is a short Jinja one, so no file is needed.
//
//   cmake --preset fuzz && cmake --build build-fuzz -j2 --target fuzz_openai_request
//   ./build-fuzz/tests/fuzz/fuzz_openai_request -max_len=4096 -malloc_limit_mb=512 -max_total_time=60 \
//       tests/fuzz/corpus/openai_request
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "core/error.h"
#include "openai_request.h"

namespace {

using kestrel::cli::PromptFormat;

std::unique_ptr<kestrel::Tokenizer> make_tokenizer() {
  using kestrel::TokenData;
  using kestrel::TokenType;
  kestrel::TokenizerSpec spec;
  spec.kind = kestrel::TokenizerKind::SPM;
  spec.tokens.push_back({"<unk>", 0, TokenType::UNKNOWN});
  spec.tokens.push_back({"<s>", 0, TokenType::CONTROL});
  spec.tokens.push_back({"</s>", 0, TokenType::CONTROL});
  spec.tokens.push_back({"<|im_start|>", 0, TokenType::CONTROL});
  spec.tokens.push_back({"<|im_end|>", 0, TokenType::CONTROL});
  static const char kHex[] = "0123456789ABCDEF";
  for (int b = 0; b < 256; ++b)
    spec.tokens.push_back({std::string("<0x") + kHex[b >> 4] + kHex[b & 15] + ">", 0, TokenType::BYTE});
  const std::string space = "\xE2\x96\x81";  // U+2581, SentencePiece's space
  float score = -1;
  for (const std::string& piece : {space, std::string("a"), std::string("e"), std::string("o"), std::string("t"),
                                   std::string("n"), space + "t", std::string("he"), space + "the", space + "a",
                                   std::string("on"), std::string("ce"), space + "on", space + "once",
                                   std::string("user"), std::string("assistant")})
    spec.tokens.push_back({piece, score--, TokenType::NORMAL});
  spec.add_space_prefix = true;
  spec.add_bos = true;
  spec.bos_id = 1;
  spec.eos_id = 2;
  spec.unk_id = 0;
  return kestrel::Tokenizer::from_spec(std::move(spec));
}

struct Model {
  std::unique_ptr<kestrel::Tokenizer> tokenizer = make_tokenizer();
  PromptFormat format;
  PromptFormat no_template;  // the built-in ChatML format instead of Jinja

  Model() {
    for (PromptFormat* f : {&format, &no_template}) {
      f->tokenizer = tokenizer.get();
      f->n_vocab = tokenizer->n_vocab() + 3;  // padded embedding rows, as some models have
      f->bos_token = "<s>";
      f->eos_token = "</s>";
      f->chat_template = kestrel::ChatTemplate::detect("", /*has_im_start=*/true);
      for (int32_t id = 0; id < tokenizer->n_vocab(); ++id)
        if (tokenizer->is_eog(id)) f->stop_ids.push_back(id);
      f->end_of_turn_id = tokenizer->token_id("<|im_end|>");
    }
    format.template_source =
        "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}<|im_end|>\n"
        "{% if m.role == 'system' and m.content|length > 200 %}{{ raise_exception('system too long') }}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
    format.jinja_template =
        std::make_shared<const kestrel::jinja::Template>(kestrel::jinja::Template::parse(format.template_source));
  }
};

void run(const kestrel::cli::RequestJson& j, kestrel::cli::RequestApi api, const PromptFormat& f) {
  using namespace kestrel::cli;
  try {
    const OpenAiRequest r = parse_openai_request(j, api);
    const size_t n = r.is_chat ? 1 : r.prompts.size();
    for (size_t p = 0; p < n; ++p) {
      const kestrel::Request q = to_engine_request(r, f, 12345, p);
      if (q.prompt.empty()) __builtin_trap();  // to_engine_request promises a prompt
      for (int32_t id : q.prompt)
        if (id < 0 || id >= f.n_vocab) __builtin_trap();
      q.sampling.validate();  // what the engine's Sampler checks again
      volatile size_t sink = prompt_text(r, *f.tokenizer, p).size();
      (void)sink;
    }
  } catch (const kestrel::Error&) {
    // RequestError (a kestrel::Error) and the tokenizer's own errors: bad input, answered with a 400.
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const Model model;
  using namespace kestrel::cli;
  RequestJson j;
  try {
    j = parse_request_body(std::string_view(reinterpret_cast<const char*>(data), size));
  } catch (const RequestError&) {
    return 0;
  }
  volatile size_t sink = shown(j).size();  // every error message shows a value this way
  (void)sink;
  if (!j.is_object()) return 0;
  run(j, RequestApi::Batch, model.format);
  run(j, RequestApi::Completions, model.format);
  run(j, RequestApi::Chat, model.format);
  run(j, RequestApi::Chat, model.no_template);
  return 0;
}
