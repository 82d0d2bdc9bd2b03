// kestrel tokenize: print the ids of a text, space-separated. Reads only the tokenizer, never the
// weights, so any tokenizer source works (load_tokenizer): a GGUF model or vocab-only GGUF of any
// architecture, a Hugging Face folder, a tokenizer.json or a SentencePiece tokenizer.model.
#include <iostream>

#include "common.h"
#include "tokenizer/tokenizer_source.h"

namespace kestrel::cli {

void register_tokenize(CLI::App& app) {
  struct Args {
    std::string model;
    std::string text;
    bool special = false;
  };
  auto a = std::make_shared<Args>();
  CLI::App* sub = app.add_subcommand("tokenize", "Print the token ids of a text");
  sub->add_option("-m,--model,--tokenizer", a->model,
                  "Tokenizer source: a GGUF file (a model or vocab-only, any architecture), a Hugging "
                  "Face model or tokenizer folder, a tokenizer.json or a tokenizer.model; default: the "
                  "SmolLM2 model from setup");
  sub->add_option("text", a->text, "Text to tokenize")->required();
  sub->add_flag("--special", a->special,
                "Parse special-token text (e.g. <|im_start|>, <s>) into its ids; without it no BOS is added");
  sub->callback([a] {
    const auto tokenizer = load_tokenizer(resolve_model_path(a->model));
    // BOS only when the text asks for it: with --special, "<s>" in the text becomes BOS.
    const auto ids = tokenizer->encode(a->text, /*add_special=*/false, /*parse_special=*/a->special);
    for (size_t i = 0; i < ids.size(); ++i) std::cout << (i ? " " : "") << ids[i];
    std::cout << "\n";
  });
}

}  // namespace kestrel::cli
