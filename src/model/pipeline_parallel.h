// How a model splits over the stages of a pipeline (GPipe, Huang et al. 2019; vLLM's
// --pipeline-parallel-size): stage s of N runs a contiguous range of layers, stage 0 also the token
// embedding, the last stage also the final norm and the LM head; the residual stream [n_tokens,
// n_embd] f32 passes from each stage to the next. LlamaModel::pipeline_stage applies it.
#pragma once

#include <cstdint>

#include "model/hparams.h"

namespace kestrel {

// A stage's place in the pipeline, which a backend's ForwardOps read: a stage after the first takes
// the residual stream [n_tokens, n_embd] f32 from the stage before instead of embedding the tokens
// (its builder's embed), a stage before the last hands its residual stream on instead of computing
// logits (its builder's final_norm_logits adds the pending block output and stops). The default is
// the whole model.
struct PipelineRole {
  bool first = true;
  bool last = true;
};

// Stage s's layers [begin, end) of the whole model's numbering.
struct PipelineStageLayers {
  int64_t begin = 0, end = 0;
};

// Throws kestrel::Error, naming --pipeline-parallel-size and the numbers, unless `size` stages can
// split the model: 1 <= size <= n_layer, and an architecture whose layers are all alike (Llama,
// Qwen2, Mistral; Gemma 3's local/global pattern, mixture-of-experts layers and MLA depend on the
// layer's index and are not supported with pipeline parallelism).
void validate_pipeline_parallel(const ModelHparams& hp, int size);

// Stage `stage` of `size`'s layers: n_layer / size each, the first n_layer % size stages one more
// (validate_pipeline_parallel(hp, size) must hold).
PipelineStageLayers pipeline_stage_layers(const ModelHparams& hp, int stage, int size);

}  // namespace kestrel
