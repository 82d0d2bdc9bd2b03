// The safetensors weights of a Hugging Face model folder: one model.safetensors, or shards
// model-0000X-of-0000N.safetensors listed by model.safetensors.index.json.
//
// The index (written by transformers' save_pretrained) is {"metadata": {...}, "weight_map":
// {tensor name: shard file name}}. Each shard named there is mapped once; lookups go through the
// weight map, so a tensor is found in the shard the index names. As in transformers, a folder with
// both a single file and an index uses the single file.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "io/safetensors.h"

namespace kestrel {

class SafetensorsCheckpoint {
 public:
  // Opens the weights of `dir`. Throws kestrel::Error naming the folder or file when there is
  // neither model.safetensors nor model.safetensors.index.json (saying so when only PyTorch .bin
  // weights are there), when the index is not valid JSON or lacks an object "weight_map" of
  // strings, when a shard name is not a plain file name in the folder, when a shard is missing or
  // malformed (SafetensorsFile's errors), or when a shard lacks a tensor the index maps to it.
  static SafetensorsCheckpoint open_dir(const std::string& dir);

  SafetensorsCheckpoint(SafetensorsCheckpoint&&) noexcept;
  SafetensorsCheckpoint& operator=(SafetensorsCheckpoint&&) noexcept;
  ~SafetensorsCheckpoint();

  const std::string& dir() const { return dir_; }
  // The mapped files, in the order the index first names them.
  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const { return files_; }
  size_t n_tensors() const { return by_name_.size(); }
  // Names of all tensors, sorted.
  std::vector<std::string> names() const;

  // The tensor called `name`, or nullptr.
  const SafetensorsTensor* find(std::string_view name) const;
  // The file that holds `name`'s tensor (for messages), or "" when there is none.
  const std::string& file_of(std::string_view name) const;

 private:
  SafetensorsCheckpoint() = default;
  struct Entry {
    const SafetensorsTensor* tensor;
    size_t file;  // index into files_
  };
  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::unordered_map<std::string, Entry> by_name_;
};

}  // namespace kestrel
