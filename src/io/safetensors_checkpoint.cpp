#include "io/safetensors_checkpoint.h"

#include <algorithm>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/mapped_file.h"
#include "io/quoted.h"

namespace kestrel {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";

// Present as any kind of file: a FIFO or a directory in a weight file's place then gets
// SafetensorsFile::open's "not a regular file" error instead of being passed over.
bool is_file(const fs::path& p) {
  std::error_code ec;
  return fs::exists(p, ec);
}

json read_index(const std::string& path) {
  const std::string text = read_regular_file(path);
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    throw Error(path + ": not valid JSON: " + e.what());
  }
}

}  // namespace

SafetensorsCheckpoint::SafetensorsCheckpoint(SafetensorsCheckpoint&&) noexcept = default;
SafetensorsCheckpoint& SafetensorsCheckpoint::operator=(SafetensorsCheckpoint&&) noexcept = default;
SafetensorsCheckpoint::~SafetensorsCheckpoint() = default;

SafetensorsCheckpoint SafetensorsCheckpoint::open_dir(const std::string& dir) {
  SafetensorsCheckpoint c;
  c.dir_ = dir;
  const fs::path root(dir);
  if (is_file(root / kSingleFile)) {
    c.files_.push_back(std::make_unique<SafetensorsFile>(SafetensorsFile::open((root / kSingleFile).string())));
    for (const SafetensorsTensor& t : c.files_[0]->tensors()) c.by_name_.emplace(t.name, Entry{&t, 0});
    return c;
  }
  const std::string index_path = (root / kIndexFile).string();
  if (!is_file(index_path)) {
    std::string msg = dir + ": no " + kSingleFile + " or " + kIndexFile;
    if (is_file(root / "pytorch_model.bin") || is_file(root / "pytorch_model.bin.index.json"))
      msg += " (only PyTorch .bin weights, which kestrel does not read; convert them to safetensors)";
    throw Error(msg);
  }
  const json index = read_index(index_path);
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
    throw Error(index_path + ": missing the object 'weight_map'");
  std::map<std::string, size_t> file_index;  // shard name -> index into files_
  for (const auto& [tensor, shard] : index["weight_map"].items()) {
    if (!shard.is_string())
      throw Error(index_path + ": weight_map entry of tensor " + quoted_name(tensor) + " is not a file name");
    const auto& name = shard.get_ref<const std::string&>();
    // The index may only point at files in its own folder.
    if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos ||
        name.find('\\') != std::string::npos)
      throw Error(index_path + ": weight_map maps tensor " + quoted_name(tensor) + " to " + quoted_name(name) +
                  ", which is not a file name in the folder");
    auto [it, added] = file_index.emplace(name, c.files_.size());
    if (added) {
      const fs::path p = root / name;
      if (!is_file(p))
        throw Error(index_path + ": weight_map maps tensor " + quoted_name(tensor) + " to " + quoted_name(name) +
                    ", which is missing from " + dir);
      c.files_.push_back(std::make_unique<SafetensorsFile>(SafetensorsFile::open(p.string())));
    }
    const SafetensorsFile& f = *c.files_[it->second];
    const SafetensorsTensor* t = f.find(tensor);
    if (t == nullptr)
      throw Error(f.path() + ": has no tensor " + quoted_name(tensor) + ", which " + kIndexFile + " maps to it");
    c.by_name_.emplace(tensor, Entry{t, it->second});
  }
  if (c.files_.empty()) throw Error(index_path + ": weight_map is empty");
  return c;
}

const SafetensorsTensor* SafetensorsCheckpoint::find(std::string_view name) const {
  const auto it = by_name_.find(std::string(name));
  return it == by_name_.end() ? nullptr : it->second.tensor;
}

std::vector<std::string> SafetensorsCheckpoint::names() const {
  std::vector<std::string> out;
  out.reserve(by_name_.size());
  for (const auto& [name, entry] : by_name_) out.push_back(name);
  std::sort(out.begin(), out.end());
  return out;
}

const std::string& SafetensorsCheckpoint::file_of(std::string_view name) const {
  static const std::string kNone;
  const auto it = by_name_.find(std::string(name));
  return it == by_name_.end() ? kNone : files_[it->second.file]->path();
}

}  // namespace kestrel
