// Pipeline-parallel stages of a loaded model: views of a layer range, renumbered from 0.
#include "model/pipeline_parallel.h"

#include <algorithm>
#include <string>

#include "core/error.h"
#include "model/llama_weights.h"

namespace kestrel {

void validate_pipeline_parallel(const ModelHparams& hp, int size) {
  const std::string flag = "--pipeline-parallel-size " + std::to_string(size);
  if (size < 1) throw Error("--pipeline-parallel-size must be at least 1, got " + std::to_string(size));
  if (size == 1) return;
  const bool llama_family = hp.arch == "llama" || hp.arch == "qwen2" || hp.arch == "mistral";
  if (!llama_family || hp.moe.enabled() || hp.mla.enabled() || hp.swa_pattern > 0)
    throw Error("architecture '" + hp.arch + "'" + (hp.moe.enabled() ? " with mixture-of-experts layers" : "") +
                " is not supported with pipeline parallelism (" + flag + "); Llama, Qwen2 and Mistral are");
  if (size > hp.n_layer)
    throw Error(flag + " exceeds the model's layers (" + std::to_string(hp.n_layer) +
                "): every stage needs at least one layer");
}

PipelineStageLayers pipeline_stage_layers(const ModelHparams& hp, int stage, int size) {
  const int64_t base = hp.n_layer / size, extra = hp.n_layer % size;
  PipelineStageLayers s;
  s.begin = stage * base + std::min<int64_t>(stage, extra);
  s.end = s.begin + base + (stage < extra ? 1 : 0);
  return s;
}

std::unique_ptr<LlamaModel> LlamaModel::pipeline_stage(int stage, int size) const {
  validate_pipeline_parallel(hparams_, size);
  if (stage < 0 || stage >= size)
    throw Error("pipeline stage " + std::to_string(stage) + " outside [0, " + std::to_string(size) + ")");
  ensure_host_weights();
  const PipelineStageLayers layers = pipeline_stage_layers(hparams_, stage, size);
  std::unique_ptr<LlamaModel> m(new LlamaModel());
  m->format_ = format_;
  m->path_ = path_;
  m->chat_template_ = chat_template_;
  m->hparams_ = hparams_;
  m->hparams_.n_layer = layers.end - layers.begin;
  m->quant_method_ = quant_method_;
  m->weights_.resize(m->hparams_.n_layer);
  m->weights_.rope_freq_factors = weights_.rope_freq_factors;
  for (size_t ri = 0; ri < kWeightRoleCount; ++ri) {
    const WeightRole role = static_cast<WeightRole>(ri);
    if (const LayerTensor* t = weights_.find({-1, role})) m->weights_.put({-1, role}, *t);
    for (int64_t l = layers.begin; l < layers.end; ++l)
      if (const LayerTensor* t = weights_.find({static_cast<int32_t>(l), role}))
        m->weights_.put({static_cast<int32_t>(l - layers.begin), role}, *t);
  }
  m->weights_.tied_output = weights_.tied_output;
  m->weights_.vocab_begin = weights_.vocab_begin;
  return m;
}

}  // namespace kestrel
