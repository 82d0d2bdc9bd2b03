#include "test_util.h"

#include "core/env.h"
#include "core/error.h"
#include "io/gguf.h"

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>

namespace kestrel::test {

std::string data_dir() {
  if (auto e = env_var(EnvVar::DataDir)) return *e;
  return KESTREL_DEFAULT_DATA_DIR;
}

std::string model_dir() {
  if (auto e = env_var(EnvVar::ModelDir)) return *e;
  return KESTREL_DEFAULT_MODEL_DIR;
}

std::string stories_path() { return data_dir() + "/stories260K/stories260K.gguf"; }

LoadedModel load_model(const std::string& gguf_path) {
  LoadedModel l;
  l.model = LlamaModel::load_gguf(gguf_path);
  l.tokenizer = Tokenizer::from_gguf(l.model->file());
  return l;
}

std::string kestrel_binary() { return KESTREL_BINARY; }

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

bool file_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

std::string temp_path(const std::string& stem, const std::string& suffix) {
  return (std::filesystem::temp_directory_path() /
          ("kestrel_" + stem + "_" + std::to_string(::getpid()) + suffix))
      .string();
}

std::string write_file(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  return path;
}

int run_command(const std::string& cmd, std::string* out) {
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return -1;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0)
    if (out != nullptr) out->append(buf, n);
  const int status = ::pclose(p);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

}  // namespace kestrel::test

namespace kestrel::test {

std::vector<float> prompt_logits(Engine& engine, const std::vector<int32_t>& ids) {
  Request r;
  r.prompt = ids;
  r.max_tokens = 1;
  r.sampling.temperature = 0;
  r.prompt_logits = true;
  engine.add_request(std::move(r));
  std::vector<float> out;
  while (engine.has_unfinished())
    for (RequestOutput& o : engine.step()) {
      if (!o.prompt_logits.empty()) out = std::move(o.prompt_logits);
      if (o.finished && o.finish_reason == "error") throw Error(o.error);
    }
  return out;
}

std::vector<float> prompt_logits(const LlamaModel& model, const std::vector<int32_t>& ids, EngineConfig config) {
  if (config.max_model_len == 0) config.max_model_len = static_cast<int64_t>(ids.size()) + 1;
  config.max_num_seqs = 1;
  Engine engine(model, nullptr, config);
  return prompt_logits(engine, ids);
}

std::vector<std::vector<int32_t>> run_to_end(Engine& engine, const std::vector<Request>& requests) {
  std::map<RequestId, size_t> index;
  for (size_t i = 0; i < requests.size(); ++i) index[engine.add_request(requests[i])] = i;
  std::vector<std::vector<int32_t>> out(requests.size());
  while (engine.has_unfinished())
    for (const RequestOutput& o : engine.step()) {
      EXPECT_TRUE(!o.finished || o.finish_reason == "stop" || o.finish_reason == "length") << o.error;
      auto& ids = out[index.at(o.id)];
      ids.insert(ids.end(), o.new_token_ids.begin(), o.new_token_ids.end());
    }
  return out;
}

std::vector<std::vector<int32_t>> greedy_ids(Engine& engine, const std::vector<std::vector<int32_t>>& prompts,
                                             int64_t max_tokens) {
  std::vector<Request> requests(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    requests[i].prompt = prompts[i];
    requests[i].max_tokens = max_tokens;
    requests[i].sampling.temperature = 0;
  }
  return run_to_end(engine, requests);
}

int64_t kv_block_bytes(const LoadedModel& loaded, const EngineConfig& config) {
  Engine probe(*loaded.model, loaded.tokenizer.get(), config);
  return probe.stats().kv_bytes_per_token * config.block_size;
}

std::string write_perturbed_gguf(const std::string& src, double rel_noise, uint64_t seed) {
  const std::string text = read_file(src);
  std::vector<uint8_t> bytes(text.begin(), text.end());
  const GgufFile f = GgufFile::open(src);
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  for (const GgufTensorInfo& t : f.tensors()) {
    if (t.type != GgmlType::F32 || t.ne.size() != 2 || t.name.rfind("blk.", 0) != 0) continue;
    uint8_t* at = bytes.data() + f.data_offset() + t.offset;
    for (int64_t i = 0; i < t.n_elements(); ++i) {
      float w;
      std::memcpy(&w, at + 4 * i, 4);
      w = static_cast<float>(w * (1.0 + rel_noise * normal(rng)));
      std::memcpy(at + 4 * i, &w, 4);
    }
  }
  return write_file(temp_path("perturbed_" + std::to_string(seed), ".gguf"), bytes);
}

std::vector<int32_t> eog_ids(const Tokenizer& tok) {
  std::vector<int32_t> ids;
  for (int32_t id = 0; id < tok.n_vocab(); ++id)
    if (tok.is_eog(id)) ids.push_back(id);
  return ids;
}

std::vector<std::string> story_prompts() {
  const char* who[] = {"a little girl named Lily", "a big dog", "a small bird", "a boy named Tim",
                       "an old cat", "a happy frog", "a shy bunny", "a brave knight"};
  const char* what[] = {"Once upon a time, there was ", "One day, ", "In a small town, there lived ",
                        "Long ago, "};
  std::vector<std::string> out;
  for (const char* a : what)
    for (const char* b : who) out.push_back(std::string(a) + b);
  return out;
}

std::vector<float> forward_token_ranges(ModelRunner& runner, const std::vector<std::vector<int32_t>>& prompts,
                                        const std::vector<int32_t>& tables, int32_t blocks_per_seq,
                                        int32_t block_size, const std::vector<int32_t>& from,
                                        const std::vector<int32_t>& to) {
  std::vector<int32_t> ids, pos, qs = {0}, ctx, rows;
  std::vector<int64_t> slots;
  for (size_t s = 0; s < prompts.size(); ++s) {
    const int32_t* table = tables.data() + s * static_cast<size_t>(blocks_per_seq);
    for (int32_t p = from[s]; p < to[s]; ++p) {
      ids.push_back(prompts[s][static_cast<size_t>(p)]);
      pos.push_back(p);
      slots.push_back(static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size);
    }
    qs.push_back(static_cast<int32_t>(ids.size()));
    ctx.push_back(to[s]);
  }
  for (size_t s = prompts.size(); s-- > 0;)
    if (to[s] > from[s]) rows.push_back(qs[s + 1] - 1);
  ForwardBatch b{ids, pos, slots, qs, ctx, tables, blocks_per_seq, rows};
  const std::span<const float> l = runner.forward(b);
  return std::vector<float>(l.begin(), l.end());
}

}  // namespace kestrel::test
