#include "tokenizer/tokenizer_source.h"

#include <cstring>
#include <filesystem>

#include "core/error.h"
#include "io/gguf.h"
#include "io/mapped_file.h"
#include "tokenizer/spec_loaders.h"

namespace kestrel {

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& path, const GgufFile* open_gguf) {
  namespace fs = std::filesystem;
  if (open_gguf != nullptr) return Tokenizer::from_gguf(*open_gguf);
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (!fs::exists(st)) throw Error(path + ": no such file or folder");
  if (fs::is_directory(st)) return Tokenizer::from_hf_dir(path);

  bool gguf = false;
  {
    // Also rejects a FIFO or device at once (MappedFile accepts regular files only).
    const MappedFile f(path);
    gguf = f.size() >= 4 && std::memcmp(f.data(), "GGUF", 4) == 0;
  }
  if (gguf) return Tokenizer::from_gguf(GgufFile::open(path));
  const std::string ext = fs::path(path).extension().string();
  if (ext == ".json") {
    try {
      return Tokenizer::from_spec(spec_from_tokenizer_json_file(path));
    } catch (const Error& e) {
      const std::string msg = e.what();
      throw Error(msg.rfind(path, 0) == 0 ? msg : path + ": " + msg);
    }
  }
  if (ext == ".model") return Tokenizer::from_sentencepiece_model(path);
  throw Error(path +
              ": not a tokenizer source (a GGUF file, a tokenizer.json, a SentencePiece .model file or "
              "a Hugging Face folder)");
}

}  // namespace kestrel
