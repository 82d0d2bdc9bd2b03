// One sequence run from prompt to end: prefill in chunks, then decode token by token, with its KV
// cache in blocks addressed through a block table. The chat command keeps one Session across
// turns so each turn only prefills its new tokens.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "backend/model_runner.h"
#include "memory/block_table.h"
#include "model/llama_weights.h"
#include "sampling/sampler.h"

namespace kestrel {

struct SessionOptions {
  int64_t n_ctx = 4096;        // tokens of KV the session may hold (capped at the model's context)
  int32_t block_size = 16;     // tokens per KV block
  int64_t prefill_chunk = 256; // prompt tokens per forward pass
  int n_threads = 0;           // 0 = all hardware threads
  KvDtype kv_dtype = KvDtype::F16;  // element type of the cached K and V
};

struct GenerateOptions {
  int64_t max_tokens = 256;            // generated tokens at most; < 0 = until the context is full
  SamplingParams sampling;
  std::vector<int32_t> stop_ids;       // end-of-generation tokens (EOS, <|im_end|>, ...)
};

struct GenerateStats {
  int64_t n_prompt = 0;           // tokens prefilled in this call
  int64_t n_generated = 0;
  double prefill_seconds = 0;     // time to first token (prefill + first sample)
  double decode_seconds = 0;      // time for the remaining tokens
  std::string finish_reason;      // "stop" (stop token), "length" (max_tokens or context end), "abort"
  double prefill_tok_per_s() const { return prefill_seconds > 0 ? n_prompt / prefill_seconds : 0; }
  double decode_tok_per_s() const {
    return decode_seconds > 0 && n_generated > 1 ? (n_generated - 1) / decode_seconds : 0;
  }
};

class Session {
 public:
  // runner: the backend to run on, with at least ceil(n_ctx / block_size) KV blocks of
  // opts.block_size tokens; null = a CPU runner made from opts.
  Session(const LlamaModel& model, const SessionOptions& opts, std::unique_ptr<ModelRunner> runner = nullptr);

  // Appends `tokens` to the sequence, then samples up to max_tokens new tokens. on_token is called
  // with each generated id (a stop id is reported and ends generation); returning false aborts.
  // Throws kestrel::Error when the prompt does not fit in the context (nothing is appended then).
  GenerateStats generate(std::span<const int32_t> tokens, const GenerateOptions& opts,
                         const std::function<bool(int32_t)>& on_token);

  // Logits of every position for `tokens` run from an empty sequence: [n, n_vocab], f32.
  std::vector<float> all_logits(std::span<const int32_t> tokens);

  void reset();
  // Drops every token from position n on (their KV slots are overwritten when reused).
  void truncate(int64_t n);
  int64_t n_past() const { return static_cast<int64_t>(tokens_.size()); }
  int64_t n_ctx() const { return n_ctx_; }
  const std::vector<int32_t>& tokens() const { return tokens_; }
  const ModelRunner& runner() const { return *runner_; }

 private:
  // Runs tokens [begin, end) of tokens_ (K/V of [0, begin) cached); returns the last row's logits,
  // or every row's when all_rows.
  std::span<const float> run(int64_t begin, int64_t end, bool all_rows);
  // The flat batch of tokens [begin, end) (views into the member buffers).
  ForwardBatch make_batch(int64_t begin, int64_t end, bool all_rows);

  const LlamaModel& model_;
  SessionOptions opts_;
  int64_t n_ctx_;
  BlockAllocator allocator_{0};
  BlockTable table_;
  std::unique_ptr<ModelRunner> runner_;
  std::vector<int32_t> tokens_;  // the whole sequence so far
  int64_t n_cached_ = 0;         // leading tokens whose K/V are in the cache
  std::vector<int32_t> positions_, logits_rows_, query_start_, context_lens_;
  std::vector<int64_t> slots_;
};

}  // namespace kestrel
