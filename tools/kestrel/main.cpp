// kestrel: the command-line interface (generate, chat, batch, serve, tokenize, bench, plan, perplexity).
#include <CLI/CLI.hpp>

#include <cstdio>
#include <iostream>

#include "common.h"
#include "core/error.h"

namespace {
bool has_subcommand(const CLI::App& app, const std::string& name) {
  for (const auto* sub : app.get_subcommands([](const CLI::App*) { return true; }))
    if (sub->get_name() == name) return true;
  return false;
}
}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"kestrel: LLM inference engine"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "kestrel 0.1.0");
  kestrel::cli::register_generate(app);
  kestrel::cli::register_chat(app);
  kestrel::cli::register_batch(app);
  kestrel::cli::register_tokenize(app);
  kestrel::cli::register_bench(app);
  kestrel::cli::register_plan(app);
  kestrel::cli::register_serve(app);
  kestrel::cli::register_router(app);
  kestrel::cli::register_perplexity(app);
  try {
    if (argc > 1 && argv[1][0] != '-' && !has_subcommand(app, argv[1])) {
      std::cerr << "kestrel: unknown command '" << argv[1]
                << "' (commands: generate, chat, batch, serve, tokenize, bench, plan, perplexity; see kestrel --help)\n";
      return 2;
    }
    app.parse(argc, argv);
    std::cout.flush();
    if (std::fflush(stdout) != 0 || std::ferror(stdout) || !std::cout) {
      std::cerr << "kestrel: error: writing to standard output failed\n";
      return 1;
    }
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::cerr << "kestrel: " << e.what() << " (see kestrel --help)\n";
    return 2;
  } catch (const kestrel::Error& e) {
    std::cerr << "kestrel: error: " << e.what() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "kestrel: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
