#include "spec/drafter.h"

#include "core/error.h"
#include "spec/draft_model_drafter.h"
#include "spec/ngram_drafter.h"

namespace kestrel {

std::unique_ptr<Drafter> make_drafter(const SpeculativeConfig& config, const DrafterContext& context,
                                      DraftModel draft) {
  if (draft.model && config.method != SpecMethod::DraftModel)
    throw Error(std::string("speculative config: a draft model was given but \"method\" is \"") +
                std::string(spec_method_name(config.method)) + "\"");
  switch (config.method) {
    case SpecMethod::Ngram:
      return std::make_unique<NgramDrafter>(config.prompt_lookup_min, config.prompt_lookup_max,
                                            config.adaptive_draft_length ? config.num_speculative_tokens : 0);
    case SpecMethod::DraftModel:
      if (!draft.model)
        throw Error("speculative config: \"method\": \"draft_model\" needs the draft model (" + config.model +
                    ") loaded and given to the engine");
      return std::make_unique<DraftModelDrafter>(context, std::move(draft));
    case SpecMethod::None: break;
  }
  throw Error("speculative config: no method to make a drafter for");
}

}  // namespace kestrel
