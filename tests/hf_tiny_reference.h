// The transformers references of the tiny random-weight Hugging Face folders in
// ../shared/data/hf-tiny (reference.json, described in the folder's README): each prompt's token
// ids, argmax at every position and 32-token greedy continuation. The .npy arrays beside it
// (logits, hidden states) are read with npy.h.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "core/error.h"

namespace kestrel::test {

struct ReferencePrompt {
  std::string name;
  std::vector<int32_t> ids;
  std::vector<int32_t> argmax;  // [L]
  std::vector<int32_t> greedy;  // [32]
  std::vector<double> greedy_margins;  // [32] top-1 minus top-2 logit at each greedy step
  std::string file_prefix;      // "p1_len40": the prefix of this prompt's .npy files
};

// Errors: kestrel::Error when folder/reference.json is missing; nlohmann::json errors when malformed.
inline std::vector<ReferencePrompt> read_reference(const std::string& folder) {
  std::ifstream f(folder + "/reference.json");
  if (!f) throw Error("cannot open " + folder + "/reference.json");
  const nlohmann::json r = nlohmann::json::parse(f);
  std::vector<ReferencePrompt> out;
  for (const nlohmann::json& p : r.at("prompts")) {
    ReferencePrompt rp;
    rp.name = p.at("name");
    rp.ids = p.at("input_ids").get<std::vector<int32_t>>();
    rp.argmax = p.at("argmax_per_position").get<std::vector<int32_t>>();
    rp.greedy = p.at("greedy_continuation").get<std::vector<int32_t>>();
    rp.greedy_margins = p.at("greedy_step_top1_top2_margin").get<std::vector<double>>();
    rp.file_prefix = rp.name + "_len" + std::to_string(rp.ids.size());
    out.push_back(std::move(rp));
  }
  return out;
}

}  // namespace kestrel::test
