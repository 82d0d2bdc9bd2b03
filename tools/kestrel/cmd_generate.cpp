// kestrel generate: complete a prompt, streaming the text to stdout (or one JSON object with
// --json); stats on stderr.
#include <nlohmann/json.hpp>

#include <cstdio>
#include <iostream>

#include "common.h"
#include "core/error.h"
#include "sampling/grammar/constraint.h"
#include "tokenizer/stream_decoder.h"

namespace kestrel::cli {

namespace {
struct GenerateArgs {
  std::string model;
  std::string prompt;
  int64_t n_predict = 256;
  bool json = false;
  std::string dump_logits;
  std::string grammar_file;      // GBNF text
  std::string json_schema_file;  // a JSON Schema
  bool json_any_whitespace = false;
  SamplingFlags sampling;
  KestrelConfig config;
};

// A little-endian float32 .npy file (NumPy format 1.0) of shape [rows, cols].
void write_npy(const std::string& path, const std::vector<float>& data, int64_t rows, int64_t cols) {
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + std::to_string(rows) +
                       ", " + std::to_string(cols) + "), }";
  while ((10 + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) throw Error(path + ": cannot open for writing");
  const uint16_t len = static_cast<uint16_t>(header.size());
  const char magic[8] = {'\x93', 'N', 'U', 'M', 'P', 'Y', 1, 0};
  bool ok = std::fwrite(magic, 1, 8, f) == 8 && std::fwrite(&len, 2, 1, f) == 1 &&
            std::fwrite(header.data(), 1, header.size(), f) == header.size() &&
            std::fwrite(data.data(), sizeof(float), data.size(), f) == data.size();
  ok = std::fclose(f) == 0 && ok;
  if (!ok) throw Error(path + ": write failed");
}

std::string read_text_file(const std::string& path, const std::string& flag) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) throw Error(flag + " " + path + ": cannot open");
  std::string text;
  char buf[65536];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) text.append(buf, n);
  std::fclose(f);
  return text;
}

// The output constraint of --grammar / --json-schema, bound to the model's vocabulary.
std::shared_ptr<const grammar::CompiledGrammar> output_grammar(const GenerateArgs& a, const Tokenizer& tok) {
  if (a.grammar_file.empty() && a.json_schema_file.empty()) return nullptr;
  if (!a.grammar_file.empty() && !a.json_schema_file.empty()) throw Error("--grammar and --json-schema: give one of them");
  const std::string flag = a.grammar_file.empty() ? "--json-schema" : "--grammar";
  const std::string& path = a.grammar_file.empty() ? a.json_schema_file : a.grammar_file;
  grammar::Constraint c;
  c.kind = a.grammar_file.empty() ? grammar::ConstraintKind::JSON_SCHEMA : grammar::ConstraintKind::GBNF;
  c.text = read_text_file(path, flag);
  c.any_whitespace = a.json_any_whitespace;
  try {
    return std::make_shared<const grammar::CompiledGrammar>(grammar::compile_constraint(c),
                                                            grammar::TokenVocab::from_tokenizer(tok));
  } catch (const grammar::GrammarError& e) {
    throw Error(flag + " " + path + ": " + e.what());
  }
}

void run_generate(const GenerateArgs& a) {
  if (a.n_predict < -1) throw Error("-n must be >= 0, or -1 for no limit, got " + std::to_string(a.n_predict));
  const SamplingParams sp = a.sampling.params();
  LoadedModel lm = load_model(a.model, a.config);
  const Tokenizer& tok = require_tokenizer(lm, "generate");
  const std::vector<int32_t> prompt_ids = tok.encode(a.prompt, /*add_special=*/true, /*parse_special=*/true);
  if (prompt_ids.empty()) throw Error("empty prompt: nothing to condition on");
  std::unique_ptr<Engine> engine = make_engine(lm, a.config);

  Request req;
  req.prompt = prompt_ids;
  req.sampling = sp;
  req.stop_ids = stop_ids(tok);
  req.prompt_logits = !a.dump_logits.empty();
  req.grammar = output_grammar(a, tok);
  // -n 0 generates nothing: the engine runs only for --dump-logits, and the one token it samples
  // beside the logits is dropped.
  const bool silent = a.n_predict == 0;
  req.max_tokens = silent ? 1 : a.n_predict;
  // The output continues the prompt: keep a SentencePiece leading space unless nothing precedes it.
  const bool continuation = !(prompt_ids.size() == 1 && prompt_ids[0] == tok.bos_id());
  StreamDecoder stream(tok, /*skip_special=*/false, continuation);
  SingleResult res;
  if (!silent || req.prompt_logits) {
    res = run_single(*engine, std::move(req), [&](const RequestOutput& o) {
      if (a.json || silent) return;
      for (int32_t id : o.new_token_ids) {
        if (tok.is_eog(id)) continue;
        const std::string piece = stream.push(id);
        std::fwrite(piece.data(), 1, piece.size(), stdout);
      }
      std::fflush(stdout);
    });
  } else {
    res.finish_reason = "length";
    res.metrics.n_prompt_tokens = static_cast<int64_t>(prompt_ids.size());
  }
  if (silent) {
    res.output_ids.clear();
    res.metrics.n_output_tokens = 0;
  }
  if (!a.dump_logits.empty())
    write_npy(a.dump_logits, res.prompt_logits, static_cast<int64_t>(prompt_ids.size()), lm.model->hparams().n_vocab);
  if (a.json) {
    std::vector<int32_t> text_ids;
    for (int32_t id : res.output_ids)
      if (!tok.is_eog(id)) text_ids.push_back(id);
    nlohmann::json j;
    j["prompt_ids"] = prompt_ids;
    j["output_ids"] = res.output_ids;
    j["text"] = tok.decode(text_ids, /*skip_special=*/false, continuation);
    j["finish_reason"] = res.finish_reason;
    std::cout << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  } else {
    const std::string tail = stream.flush();
    std::fwrite(tail.data(), 1, tail.size(), stdout);
    std::fputc('\n', stdout);
  }
  std::fflush(stdout);  // the text before the statistics when both go to one pipe
  std::fprintf(stderr,
               "kestrel: prompt %lld tokens, prefill %.1f tok/s; generated %lld tokens, decode %.1f tok/s (%s)\n",
               static_cast<long long>(res.metrics.n_prompt_tokens), res.prefill_tok_per_s(),
               static_cast<long long>(res.metrics.n_output_tokens), res.decode_tok_per_s(), res.finish_reason.c_str());
}
}  // namespace

void register_generate(CLI::App& app) {
  auto a = std::make_shared<GenerateArgs>();
  CLI::App* sub = app.add_subcommand("generate", "Complete a prompt");
  sub->add_option("-m,--model", a->model, kModelHelp);
  sub->add_option("-p,--prompt", a->prompt, "Prompt text")->required();
  sub->add_option("-n,--n-predict", a->n_predict, "Tokens to generate at most (-1: to the end of the context)")
      ->capture_default_str();
  sub->add_flag("--json", a->json, "Print one JSON object {prompt_ids, output_ids, text, finish_reason} instead of streaming");
  sub->add_option("--dump-logits", a->dump_logits,
                  "Also write the logits of every prompt position to this .npy file (float32, [n_prompt, n_vocab])");
  sub->add_option("--grammar", a->grammar_file, "Constrain the output to this GBNF grammar (llama.cpp syntax; rule root)")
      ->check(CLI::ExistingFile);
  sub->add_option("--json-schema", a->json_schema_file, "Constrain the output to JSON valid under this JSON Schema file")
      ->check(CLI::ExistingFile);
  sub->add_flag("--json-any-whitespace", a->json_any_whitespace,
                "With --json-schema: allow whitespace between JSON tokens (default: compact JSON)");
  a->sampling.add_to(*sub);
  a->config.add_flags(*sub, EngineMode::Single);
  a->config.add_prefill_chunk_flag(*sub);
  sub->callback([a] { run_generate(*a); });
}

}  // namespace kestrel::cli
