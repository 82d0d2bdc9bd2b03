// kestrel tokenize: print the ids of a text, space-separated.
#include <iostream>

#include "common.h"

namespace kestrel::cli {

void register_tokenize(CLI::App& app) {
  struct Args {
    std::string model;
    std::string text;
    bool special = false;
  };
  auto a = std::make_shared<Args>();
  CLI::App* sub = app.add_subcommand("tokenize", "Print the token ids of a text");
  sub->add_option("-m,--model", a->model, kModelHelp);
  sub->add_option("text", a->text, "Text to tokenize")->required();
  sub->add_flag("--special", a->special,
                "Parse special-token text (e.g. <|im_start|>, <s>) into its ids; without it no BOS is added");
  sub->callback([a] {
    LoadedModel lm = load_model(a->model, /*quiet=*/true);
    // BOS only when the text asks for it: with --special, "<s>" in the text becomes BOS.
    const auto ids = lm.tokenizer->encode(a->text, /*add_special=*/false, /*parse_special=*/a->special);
    for (size_t i = 0; i < ids.size(); ++i) std::cout << (i ? " " : "") << ids[i];
    std::cout << "\n";
  });
}

}  // namespace kestrel::cli
