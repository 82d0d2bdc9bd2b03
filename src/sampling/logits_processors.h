// The concrete logits processors, and the chain Sampler runs, built from SamplingParams.
//
// Chain order (make_processor_chain), the one llama.cpp's default sampler chain uses:
//   logit_bias -> repetition_penalty -> presence_penalty -> frequency_penalty
//   -> top_k -> top_p -> min_p -> temperature -> (softmax, draw in Sampler)
// Why this order:
// - Bias and penalties edit raw logits of specific ids, so they run while the whole vocabulary is
//   still there, and before truncation, so a penalised token can fall out of the top-k/top-p set.
//   Bias goes first (llama.cpp and vLLM both apply logit_bias before penalties): it is the
//   client's fixed preference, and the penalties then act on the biased logit. The multiplicative
//   repetition penalty runs before the additive ones, as in llama.cpp, so its sign test sees the
//   logit the model (and the bias) gave.
// - Truncation runs before temperature, so the kept set does not depend on temperature: top_p and
//   min_p read the temperature-1 distribution and temperature only reshapes what is kept. vLLM
//   divides by temperature before top-k/top-p/min-p instead, so with temperature != 1 the two
//   engines can keep different sets; we follow llama.cpp because the knobs then act independently.
// - top_k first among the truncations because it is the cheapest cut of a 49152-wide vocabulary
//   (one heap pass) and leaves top_p a short sorted list.
#pragma once

#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "sampling/logits_processor.h"
#include "sampling/sampling_params.h"

namespace kestrel {

// Adds a fixed amount to the logits of chosen ids (OpenAI logit_bias). Ids not in the list
// (already truncated) are ignored.
class LogitBias final : public LogitsProcessor {
 public:
  explicit LogitBias(std::unordered_map<int32_t, float> bias) : bias_(std::move(bias)) {}
  std::string_view name() const override { return "logit_bias"; }
  void apply(CandidateList& candidates, std::span<const int32_t> previous_tokens) const override;

 private:
  std::unordered_map<int32_t, float> bias_;
};

// CTRL repetition penalty (Keskar et al. 2019, arXiv:1909.05858, eq. in sec. 4.1), with
// llama.cpp's handling of negative logits: for each distinct id among the last `last_n` previous
// tokens (-1 = all), logit / penalty if logit > 0, else logit * penalty. Once per id, however
// often it occurs.
class RepetitionPenalty final : public LogitsProcessor {
 public:
  RepetitionPenalty(float penalty, int32_t last_n) : penalty_(penalty), last_n_(last_n) {}
  std::string_view name() const override { return "repetition_penalty"; }
  void apply(CandidateList& candidates, std::span<const int32_t> previous_tokens) const override;

 private:
  float penalty_;
  int32_t last_n_;
};

// OpenAI presence penalty: logit -= penalty for every id that occurs in the previous tokens.
class PresencePenalty final : public LogitsProcessor {
 public:
  explicit PresencePenalty(float penalty) : penalty_(penalty) {}
  std::string_view name() const override { return "presence_penalty"; }
  bool reads_prompt() const override { return false; }
  void apply(CandidateList& candidates, std::span<const int32_t> previous_tokens) const override;

 private:
  float penalty_;
};

// OpenAI frequency penalty: logit -= penalty * (number of times the id occurs in the previous
// tokens).
class FrequencyPenalty final : public LogitsProcessor {
 public:
  explicit FrequencyPenalty(float penalty) : penalty_(penalty) {}
  std::string_view name() const override { return "frequency_penalty"; }
  bool reads_prompt() const override { return false; }
  void apply(CandidateList& candidates, std::span<const int32_t> previous_tokens) const override;

 private:
  float penalty_;
};

// Keeps the k best candidates (rank order: logit, then lower id), leaving them sorted.
// About O(n) on model logits (CandidateList::keep_top).
class TopK final : public LogitsProcessor {
 public:
  explicit TopK(int32_t k) : k_(k) {}
  std::string_view name() const override { return "top_k"; }
  void apply(CandidateList& candidates, std::span<const int32_t> previous_tokens) const override;

 private:
  int32_t k_;
};

// Nucleus (Holtzman et al. 2019, arXiv:1904.09751): keeps the shortest rank-order prefix whose
// softmax mass is >= p (at least one token). Sorts only as far as it needs, growing the sorted
// prefix geometrically, so a peaked distribution over a large vocabulary costs about O(n).
class TopP final : public LogitsProcessor {
 public:
  explicit TopP(float p) : p_(p) {}
  std::string_view name() const override { return "top_p"; }
  void apply(CandidateList& candidates, std::span<const int32_t> previous_tokens) const override;

 private:
  float p_;
};

// Min-p (Nguyen et al. 2024, arXiv:2407.01082): keeps tokens with p >= min_p * p_max, that is
// logit >= max_logit + ln(min_p). No softmax needed.
class MinP final : public LogitsProcessor {
 public:
  explicit MinP(float min_p) : min_p_(min_p) {}
  std::string_view name() const override { return "min_p"; }
  void apply(CandidateList& candidates, std::span<const int32_t> previous_tokens) const override;

 private:
  float min_p_;
};

// Scales logits by 1 / temperature (temperature > 0). It first subtracts the max logit (softmax
// does not change under a shift), so every result is <= 0 and a tiny temperature cannot overflow
// to +inf: afterwards logit_i = (logit_i - max) / temperature.
class Temperature final : public LogitsProcessor {
 public:
  explicit Temperature(float temperature) : temperature_(temperature) {}
  std::string_view name() const override { return "temperature"; }
  void apply(CandidateList& candidates, std::span<const int32_t> previous_tokens) const override;

 private:
  float temperature_;
};

// The processors `params` turns on, in the order documented at the top of this file. Processors
// that are off (top_k 0, top_p 1, ...) are left out. With temperature 0 (greedy) only bias and
// penalties are included: truncation never removes the argmax and temperature does not move it.
// `params` must have passed validate().
std::vector<std::unique_ptr<LogitsProcessor>> make_processor_chain(const SamplingParams& params);

}  // namespace kestrel
