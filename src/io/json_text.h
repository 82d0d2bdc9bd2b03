// A JSON value as error messages show it: short, and never by recursion as deep as a hostile file
// nests it (nlohmann's dump recurses once per level and overflows the stack on deep input).
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace kestrel {

// Scalars and flat arrays / objects of at most 8 elements as JSON, cut to 64 characters; other
// arrays and objects described ("an array of N elements").
std::string json_shown(const nlohmann::json& j);

}  // namespace kestrel
