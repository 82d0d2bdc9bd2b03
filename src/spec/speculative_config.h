// Speculative decoding's settings, spelled as vLLM's --speculative-config JSON object spells them,
// and the parser that is the one place that checks them.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace kestrel {

enum class SpecMethod {
  None,        // no speculative decoding
  Ngram,       // prompt lookup (NgramDrafter): drafts copied from earlier in the sequence
  DraftModel,  // a smaller model with the same tokenizer (parsed, not yet run by this engine)
};

struct SpeculativeConfig {
  SpecMethod method = SpecMethod::None;
  // Draft tokens proposed and verified per decode step, k in [1, kMaxSpeculativeTokens] when a
  // method is set.
  int32_t num_speculative_tokens = 0;
  // n-gram sizes tried, longest first: the last n tokens of the sequence, n from prompt_lookup_max
  // down to prompt_lookup_min, are looked up earlier in the prompt and output.
  int32_t prompt_lookup_min = 2;
  int32_t prompt_lookup_max = 5;
  // Speculation is off for a step in which more sequences than this run (verifying k extra tokens
  // per sequence pays while decode is memory-bound, at small batches); 0 = never off.
  int32_t disable_by_batch_size = 0;
  // ngram: "draft_length": "adaptive" (the default: each sequence's drafts shrink after a rejection
  // and grow back after full acceptances, NgramDrafter) or "fixed" (always num_speculative_tokens
  // where the match allows, as vLLM's ngram proposer). A kestrel field; vLLM has none.
  bool adaptive_draft_length = true;
  std::string model;  // draft_model: the draft model's path (GGUF file or Hugging Face folder)
  // draft_model: how its weights are quantized at load, as --quantization spells it
  // (parse_quantization: auto, none, fp8, awq, gptq, rtn); vLLM's field of the same name.
  std::string quantization = "auto";

  bool enabled() const { return method != SpecMethod::None && num_speculative_tokens > 0; }
};

// Draft tokens per step at most (bounds the logits rows a sequence adds to a step).
inline constexpr int32_t kMaxSpeculativeTokens = 16;

// Parses vLLM's --speculative-config JSON object: {"method": "ngram" | "draft_model",
// "num_speculative_tokens": K, "prompt_lookup_min": N, "prompt_lookup_max": M,
// "disable_by_batch_size": B, "model": PATH, "quantization": Q, "draft_length": "adaptive" | "fixed"}.
// "method" may be left out when "model" is given
// (draft_model) or when prompt_lookup_* are (ngram). A lone prompt_lookup_min or _max sets the
// other to the same value. Errors: kestrel::Error naming the field and the bad value (not a JSON
// object, an unknown field, a wrong type, K outside [1, 16], N < 1, M < N, B < 0, draft_model
// without "model", "model" or "quantization" with ngram, "draft_length" with draft_model or not
// "adaptive" / "fixed", a Q parse_quantization refuses).
SpeculativeConfig parse_speculative_config(std::string_view json);

// "ngram", "draft_model" or "none".
std::string_view spec_method_name(SpecMethod method);

}  // namespace kestrel
