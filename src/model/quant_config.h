// The quantization of a Hugging Face checkpoint, from config.json's "quantization_config", and the
// --quantization choice (vLLM's spelling) that is checked against it.
//
// Methods read (field meanings as in vLLM's quantization configs and the producers' own configs):
//  - gptq: AutoGPTQ / GPTQModel v1 layout ("checkpoint_format" gptq or absent): bits 4 or 8,
//    group_size (-1 = one group per row), desc_act, sym, lm_head (false: lm_head unquantized).
//  - awq: AutoAWQ WQLinear_GEMM ("version" gemm): bits ("w_bit") 4, group_size ("q_group_size"),
//    zero_point true, modules_to_not_convert.
//  - fp8 (DeepSeek-V3 / Qwen3-FP8, vLLM Fp8Config): float8_e4m3fn weights ("fmt" e4m3), with
//    weight_block_size [bn, bk] a weight_scale_inv [ceil(N/bn), ceil(K/bk)], without it a
//    per-tensor weight_scale; activation_scheme dynamic; modules_to_not_convert / ignored_layers.
//  - compressed-tensors, format float-quantized (RedHatAI *-FP8 layouts): config_groups whose
//    weights are {type float, num_bits 8, symmetric, strategy tensor | channel | block}, with
//    dynamic or no input_activations; a weight_scale per tensor [1], per channel [N, 1] or per
//    block_structure; ignore (names, or "re:" regular expressions).
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <vector>

namespace kestrel {

// A checkpoint's quantization method (None: float weights).
enum class QuantMethod : uint8_t { None, Gptq, Awq, Fp8 };
// "none", "gptq", "awq", "fp8".
std::string_view quant_method_name(QuantMethod m);

// The --quantization flag: Auto takes what the checkpoint says; the others must agree with it.
// Fp8 on float weights and Rtn (GGUF files only) quantize at load (model/load_quantize.h).
enum class Quantization : uint8_t { Auto, None, Fp8, Awq, Gptq, Rtn };
// "auto", "none", "fp8", "awq", "gptq", "rtn" (and vLLM's "compressed-tensors", read as fp8). Throws
// kestrel::Error naming the value and the supported ones otherwise.
Quantization parse_quantization(std::string_view name);

struct QuantConfig {
  QuantMethod method = QuantMethod::None;
  std::string quant_method;  // as config.json spells it ("compressed-tensors", "fp8", ...), for messages
  // GPTQ / AWQ.
  int32_t bits = 0;          // 4 or 8 (AWQ: 4)
  int64_t group_size = 0;    // inputs per group; -1 = the whole row
  bool desc_act = false;     // GPTQ act order: g_idx is a permuted group map
  bool sym = true;           // GPTQ: symmetric (the zeros are stored either way)
  bool lm_head = false;      // GPTQ: lm_head is quantized too
  // FP8: output rows x inputs sharing one scale; 0 = read the scale's shape (per tensor [1] or
  // per channel [N, 1]).
  int64_t block_n = 0, block_k = 0;
  bool block_scale_inv = false;  // the scale is called weight_scale_inv (quant_method fp8 with blocks)
  // Modules left in float: modules_to_not_convert / ignored_layers / ignore entries.
  std::vector<std::string> not_converted;
  // The "re:" entries of not_converted compiled (PCRE2, anchored at both ends), by from_json;
  // null for the other entries.
  struct Pattern;
  std::vector<std::shared_ptr<const Pattern>> not_converted_re;

  bool quantized() const { return method != QuantMethod::None; }
  // Whether the HF module `prefix` ("model.layers.0.self_attn.q_proj") is listed as left in
  // float: an entry that is a run of its dotted components ("lm_head", "mlp.gate",
  // "model.layers.0"; vLLM's modules_to_not_convert matches substrings, this matches whole
  // components so "mlp.gate" does not take mlp.gate_proj), or a "re:" entry whose regular
  // expression matches all of it (compressed-tensors). Throws kestrel::Error naming the entry when
  // its match exceeds PCRE2's match or depth limit (a catastrophically backtracking pattern).
  bool is_not_converted(const std::string& prefix) const;

  // Reads config["quantization_config"] (absent or null: None). Throws kestrel::Error("<where>:
  // quantization_config: ...") naming the field for an unknown quant_method, an unsupported
  // checkpoint_format (gptq_v2, marlin, ...), bits other than 4 / 8 (AWQ: 4), a group_size of 0 or
  // below -1, an AWQ version other than gemm or without zero_point, an FP8 format other than e4m3,
  // static activation scales, or a compressed-tensors scheme other than 8-bit float weights.
  static QuantConfig from_json(const nlohmann::json& config, const std::string& where);
};

// The checkpoint's config when `requested` agrees with it, or fp8 is requested for a float
// checkpoint (which the GPU backend then quantizes at load: LlamaModel::online_fp8). Throws
// kestrel::Error naming --quantization and both values when they disagree.
QuantConfig resolve_quantization(Quantization requested, const QuantConfig& checkpoint, const std::string& where);

}  // namespace kestrel
