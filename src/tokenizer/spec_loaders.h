// Internal: the loaders' file readers, shared between tokenizer_hf.cpp and tokenizer_spm_proto.cpp.
#pragma once

#include <string>

#include "tokenizer/tokenizer.h"

namespace kestrel {

// Reads a SentencePiece tokenizer.model (see tokenizer_spm_proto.cpp). Throws kestrel::Error naming
// the file for I/O errors, malformed protobuf or a model type other than BPE.
TokenizerSpec spm_spec_from_model_file(const std::string& path);

}  // namespace kestrel
