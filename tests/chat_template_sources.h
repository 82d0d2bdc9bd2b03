// The chat templates the Jinja tests render: the real ones in ../shared/data and models/ (Qwen2,
// Phi-3, SmolLM2) and the ones written for the tests in tests/golden/chat_templates/*.jinja,
// located as tests/golden/chat_templates/expected.json lists them ("data:", "models:", "golden:").
#pragma once

#include <filesystem>
#include <map>
#include <string>

#include <nlohmann/json.hpp>

#include "io/gguf.h"
#include "template/chat_render.h"
#include "test_util.h"

namespace kestrel::test {

// From the build's absolute tests/ path (__FILE__ can be relative, e.g. under ccache's base_dir).
inline std::string chat_golden_dir() {
  return (std::filesystem::path(KESTREL_TEST_SOURCE_DIR) / "golden" / "chat_templates").string();
}

inline nlohmann::ordered_json read_chat_golden_json(const std::string& name) {
  return nlohmann::ordered_json::parse(read_file(chat_golden_dir() + "/" + name));
}

// The file a "data:..." / "models:..." / "golden:..." location names.
inline std::string chat_template_path(const std::string& where) {
  const size_t colon = where.find(':');
  const std::string kind = where.substr(0, colon), rest = where.substr(colon + 1);
  if (kind == "data") return data_dir() + "/" + rest;
  if (kind == "models") return model_dir() + "/" + rest;
  return chat_golden_dir() + "/" + rest;
}

// The template text at a location ("" when the file is missing).
inline std::string load_chat_template(const std::string& where) {
  const std::string path = chat_template_path(where);
  if (!file_exists(path)) return "";
  if (path.size() > 5 && path.substr(path.size() - 5) == ".gguf") {
    return GgufFile::open(path).get_string("tokenizer.chat_template");
  }
  if (path.size() > 5 && path.substr(path.size() - 5) == ".json") {
    return select_chat_template(nlohmann::json::parse(read_file(path)).at("chat_template"), false);
  }
  return read_file(path);
}

// name -> text of every template expected.json lists whose file is present.
inline std::map<std::string, std::string> load_chat_templates() {
  std::map<std::string, std::string> out;
  const auto expected = read_chat_golden_json("expected.json");
  for (const auto& [name, where] : expected.at("templates").items()) {
    std::string text = load_chat_template(where.get<std::string>());
    if (!text.empty()) out[name] = std::move(text);
  }
  return out;
}

}  // namespace kestrel::test
