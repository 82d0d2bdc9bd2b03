// Loading a tokenizer from wherever one is kept, without loading model weights: the one entry point
// that both the model loader and `kestrel tokenize` use.
#pragma once

#include <memory>
#include <string>

#include "tokenizer/tokenizer.h"

namespace kestrel {

class GgufFile;

// The tokenizer at `path`, which is one of:
//   - a GGUF file (starts with the bytes "GGUF"), a full model or vocab-only, of any
//     general.architecture: only the tokenizer.ggml.* metadata is read (Tokenizer::from_gguf);
//   - a folder: a Hugging Face model or tokenizer folder (Tokenizer::from_hf_dir);
//   - a *.json file: a Hugging Face tokenizer.json on its own (no config files from its folder);
//   - a *.model file: a SentencePiece model (Tokenizer::from_sentencepiece_model).
// `open_gguf`, when not null, is `path` already opened as GGUF (the model loader's), so its metadata
// is not parsed twice. Throws kestrel::Error naming the path for a missing file, a file that is none
// of these, or any error of the loader it picks (an unsupported tokenizer.ggml.model or
// tokenizer.ggml.pre is named with the supported values).
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& path, const GgufFile* open_gguf = nullptr);

}  // namespace kestrel
