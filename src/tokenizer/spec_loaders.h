// Internal: the loaders' file readers, shared between tokenizer_hf.cpp, tokenizer_spm_proto.cpp and
// tokenizer_source.cpp.
#pragma once

#include <string>

#include "tokenizer/tokenizer.h"

namespace kestrel {

// Reads a SentencePiece tokenizer.model (see tokenizer_spm_proto.cpp). Throws kestrel::Error naming
// the file for I/O errors, malformed protobuf or a model type other than BPE.
TokenizerSpec spm_spec_from_model_file(const std::string& path);

// Reads one Hugging Face tokenizer.json (byte-level BPE) on its own: no config files from its folder.
// Throws kestrel::Error naming the file and field as Tokenizer::from_hf_dir does.
TokenizerSpec spec_from_tokenizer_json_file(const std::string& path);

}  // namespace kestrel
