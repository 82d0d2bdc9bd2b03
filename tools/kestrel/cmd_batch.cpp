// kestrel batch: a file of requests (one JSON object per line) run through the serving engine
// together; one result line per request, written and flushed as each completes (error lines first,
// as they are found while reading; then the engine's requests in the order they finish, as
// OpenAI's batch output is ordered: match results by id). A bad line gets an error result and the
// rest of the batch still runs: only unreadable input (exit 1), unwritable output (1), an engine
// failure (1, after an error line for each request still running) or bad flags (2) end the
// command early.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <random>
#include <set>
#include <thread>
#include <unordered_map>

#include "batch_report.h"
#include "batch_request.h"
#include "common.h"
#include "core/error.h"
#include "engine/engine.h"

namespace kestrel::cli {

namespace {
struct BatchArgs {
  std::string model;
  std::string input;
  std::string output;
  std::string stats_json;
  KestrelConfig config;
};

// The whole input ("-" = standard input). Throws kestrel::Error naming the file.
std::string read_input(const std::string& path) {
  std::FILE* f = path == "-" ? stdin : std::fopen(path.c_str(), "rb");
  if (f == nullptr) throw Error(path + ": cannot open for reading: " + std::strerror(errno));
  std::string data;
  char buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) data.append(buf, n);
  const int read_errno = std::ferror(f) ? errno : 0;
  if (f != stdin) std::fclose(f);
  if (read_errno != 0) throw Error(path + ": read failed: " + std::strerror(read_errno));
  return data;
}

std::vector<std::string_view> split_lines(std::string_view data) {
  std::vector<std::string_view> lines;
  while (!data.empty()) {
    const size_t end = data.find('\n');
    lines.push_back(data.substr(0, end));
    data.remove_prefix(end == std::string_view::npos ? data.size() : end + 1);
  }
  return lines;
}

// The output file ("-" = standard output). Every failure is a kestrel::Error naming the file, so a
// full disk ends the run with exit 1 rather than a silently short file.
class ResultFile {
 public:
  explicit ResultFile(const std::string& path)
      : path_(path), file_(path == "-" ? stdout : std::fopen(path.c_str(), "wb")) {
    if (file_ == nullptr) throw Error(path + ": cannot open for writing: " + std::strerror(errno));
  }
  ~ResultFile() {
    if (file_ != nullptr && file_ != stdout) std::fclose(file_);
  }
  ResultFile(const ResultFile&) = delete;
  ResultFile& operator=(const ResultFile&) = delete;

  void write(const std::string& line) {
    if (std::fwrite(line.data(), 1, line.size(), file_) != line.size()) fail();
  }
  // Flushed after each step's results, so a long batch can be watched (and survives a kill).
  void flush() {
    if (std::fflush(file_) != 0) fail();
  }
  void close() {
    flush();
    std::FILE* f = file_;
    file_ = nullptr;
    if (f != stdout && std::fclose(f) != 0) fail();
  }

 private:
  [[noreturn]] void fail() const { throw Error(path_ + ": write failed: " + std::strerror(errno)); }

  std::string path_;
  std::FILE* file_;
};

// A request in the engine: its line, and what has come in for it so far.
struct Running {
  Json id;
  int64_t line_number = 0;  // 1-based
  BatchResult partial;
  std::vector<int32_t> reported_stop_ids;  // stop_token_ids whose id stop_reason reports
};

// The requests of one input file, from submission to their result lines.
class BatchRun {
 public:
  BatchRun(Engine& engine, const PromptFormat& format, ResultFile& out)
      : engine_(engine), format_(format), out_(out), seeds_(std::random_device{}()) {}

  // Parses line i (0-based) and submits it; a line that fails either way gets its error result now.
  void submit(std::string_view line, size_t i) {
    BatchLine parsed = parse_batch_line(line, static_cast<int64_t>(i));
    ++summary_.n_requests;
    Running slot{std::move(parsed.id), static_cast<int64_t>(i) + 1, {}, {}};
    warn(parsed.unknown_fields, slot);
    std::string error = std::move(parsed.error);
    if (parsed.request) {
      try {
        slot.reported_stop_ids = reported_stop_ids(*parsed.request, format_);
        const RequestId rid = engine_.add_request(to_engine_request(*parsed.request, format_, seeds_()));
        running_.emplace(rid, std::move(slot));
        return;
      } catch (const Error& e) {  // the prompt does not fit, an id outside the vocabulary, ...
        error = e.what();
      }
    }
    finish_with_error(slot, error);
  }

  // Steps the engine until every request has finished, writing each result as it completes. An
  // engine failure (not one request's: those end that request) gives every running request an
  // error line, then propagates.
  void run() {
    BatchProgress progress(summary_.n_requests, /*enabled=*/true);
    try {
      while (engine_.has_unfinished()) {
        for (RequestOutput& o : engine_.step()) take(o);
        progress.update(n_done_, engine_.stats().n_generated_tokens);
      }
    } catch (const Error& e) {
      fail_running(std::string("the engine failed: ") + e.what());
      progress.finish(n_done_, engine_.stats().n_generated_tokens);
      throw;
    }
    // Not expected: the engine reports every request's end.
    fail_running("the engine stopped without finishing this request");
    progress.finish(n_done_, engine_.stats().n_generated_tokens);
  }

  BatchSummary& summary() { return summary_; }

 private:
  void take(RequestOutput& o) {
    const auto it = running_.find(o.id);
    if (it == running_.end()) return;
    Running& slot = it->second;
    BatchResult& r = slot.partial;
    r.output_ids.insert(r.output_ids.end(), o.new_token_ids.begin(), o.new_token_ids.end());
    r.text += o.text_delta;
    if (!o.finished) return;
    if (o.finish_reason == "error") {  // the engine ended this request (e.g. non-finite logits)
      finish_with_error(slot, o.error);
    } else {
      r.finish_reason = o.finish_reason;
      r.stop_reason = stop_reason_json(o, slot.reported_stop_ids);
      r.metrics = o.metrics;
      if (!o.beams.empty()) r.cumulative_logprob = o.beams.front().sum_logprobs;
      summary_.add(o.metrics, static_cast<int64_t>(r.output_ids.size()));
      emit(result_json(slot.id, r));
      ++n_done_;
    }
    running_.erase(it);
  }

  void finish_with_error(const Running& slot, const std::string& message) {
    emit(error_json(slot.id, message, slot.line_number));
    ++summary_.n_errors;
    ++n_done_;
  }

  void fail_running(const std::string& message) {
    // In input order, so that the lines of one failure read in the file's order.
    std::vector<const Running*> left;
    for (const auto& [rid, slot] : running_) left.push_back(&slot);
    std::sort(left.begin(), left.end(),
              [](const Running* a, const Running* b) { return a->line_number < b->line_number; });
    for (const Running* slot : left) finish_with_error(*slot, message);
    running_.clear();
  }

  // One line, flushed at once: a long batch can be watched, and a kill loses no finished result.
  void emit(const Json& result) {
    out_.write(to_json_line(result));
    out_.flush();
  }

  void warn(const std::vector<std::string>& unknown_fields, const Running& slot) {
    for (const std::string& field : unknown_fields)
      if (warned_fields_.insert(field).second)
        std::fprintf(stderr, "kestrel batch: warning: ignoring unknown field \"%s\" (first on line %lld)\n",
                     field.c_str(), static_cast<long long>(slot.line_number));
    // Results are matched by id, so a repeated id makes them ambiguous: warn once.
    const auto [first, fresh] = first_line_of_id_.emplace(slot.id.dump(), slot.line_number);
    if (!fresh && !warned_duplicate_id_) {
      warned_duplicate_id_ = true;
      std::fprintf(stderr,
                   "kestrel batch: warning: id %s on line %lld repeats line %lld's (further repeats not reported)\n",
                   first->first.c_str(), static_cast<long long>(slot.line_number),
                   static_cast<long long>(first->second));
    }
  }

  Engine& engine_;
  const PromptFormat& format_;
  ResultFile& out_;
  std::mt19937_64 seeds_;  // for requests without a seed
  std::unordered_map<RequestId, Running> running_;
  int64_t n_done_ = 0;  // requests with a result written
  BatchSummary summary_;
  std::set<std::string> warned_fields_;
  std::unordered_map<std::string, int64_t> first_line_of_id_;  // id as JSON text -> line number
  bool warned_duplicate_id_ = false;
};

void write_stats_json(const std::string& path, const Json& stats) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) throw Error(path + ": cannot open for writing: " + std::strerror(errno));
  const std::string text = stats.dump(2) + "\n";
  const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  if ((std::fclose(f) != 0) || !ok) throw Error(path + ": write failed");
}

void run_batch(const BatchArgs& a) {
  const std::string input = read_input(a.input);
  ResultFile out(a.output);
  LoadedModel lm = load_model(a.model, a.config);
  require_tokenizer(lm, "batch");
  const std::unique_ptr<Engine> engine = make_engine(lm, a.config);
  PromptFormat format = PromptFormat::for_model(*lm.model, *lm.tokenizer);
  format.max_model_len = engine->config().max_model_len;

  // All requests are submitted up front: the engine's waiting queue does the admission.
  const auto t0 = std::chrono::steady_clock::now();
  BatchRun run(*engine, format, out);
  const std::vector<std::string_view> lines = split_lines(input);
  for (size_t i = 0; i < lines.size(); ++i)
    if (!is_blank_line(lines[i])) run.submit(lines[i], i);
  run.run();
  out.close();

  BatchSummary& summary = run.summary();
  summary.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  summary.engine = engine->stats();
  std::fputs(summary.text().c_str(), stderr);
  if (!a.stats_json.empty()) write_stats_json(a.stats_json, summary.to_json());
}
}  // namespace

void register_batch(CLI::App& app) {
  auto a = std::make_shared<BatchArgs>();
  CLI::App* sub = app.add_subcommand(
      "batch", "Run a file of requests (JSON lines) together through the engine; results as they complete");
  sub->add_option("-m,--model", a->model, kModelHelp);
  sub->add_option("-i,--input", a->input,
                  "Requests, one JSON object per line: {\"id\", \"prompt\" or \"messages\", OpenAI sampling "
                  "fields}; - = stdin")
      ->required();
  sub->add_option("-o,--output", a->output,
                  "Results, one JSON object per line, written as each completes (match them by id); - = stdout")
      ->required();
  a->config.add_flags(*sub, EngineMode::Serving);
  sub->add_option("--stats-json", a->stats_json, "Also write the end-of-run summary to this file as JSON");
  sub->callback([a] { run_batch(*a); });
}

}  // namespace kestrel::cli
