// Safetensors reader: round trips through SafetensorsBuilder images, one test per malformed-file
// check (each asserting the phrase its error must contain), truncation and corruption at every
// byte, and the folder layouts of SafetensorsCheckpoint (single file, index + shards).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "hf_configs.h"
#include "io/safetensors.h"
#include "io/safetensors_checkpoint.h"
#include "safetensors_builder.h"
#include "test_util.h"

using namespace kestrel;
using kestrel::test::bytes_of;
using kestrel::test::error_of;
using kestrel::test::SafetensorsBuilder;
using kestrel::test::TempDir;
using json = nlohmann::ordered_json;

namespace {

constexpr const char* kName = "img.safetensors";

SafetensorsFile parse(const std::vector<uint8_t>& img) {
  return SafetensorsFile::parse(img.data(), img.size(), kName);
}

// Succeeds when parsing img throws a kestrel::Error whose message starts with the image name and
// contains phrase. Any other exception escapes and fails the test.
::testing::AssertionResult fails_with(const std::vector<uint8_t>& img, const std::string& phrase) {
  return test::fails_naming(kName, phrase, [&] { parse(img); });
}

// Two tensors, "b" stored first: a [2, 3] F32 matrix and a [4] BF16 vector.
SafetensorsBuilder two_tensors() {
  SafetensorsBuilder b;
  b.f32("b.weight", {2, 3}, {1, 2, 3, 4, 5, 6}).half("a.bias", "BF16", {4}, {0.5f, -1, 2, 1024});
  return b;
}

// two_tensors() with its header edited by `edit`.
std::vector<uint8_t> edited(const std::function<void(json&)>& edit) {
  const SafetensorsBuilder b = two_tensors();
  json h = b.header();
  edit(h);
  return SafetensorsBuilder::image(h.dump(), b.data());
}

}  // namespace

TEST(Safetensors, ReadsTensorsAndMetadata) {
  SafetensorsBuilder::Layout at;
  const auto img = two_tensors().metadata("format", "pt").build(&at);
  const SafetensorsFile f = parse(img);
  EXPECT_EQ(f.path(), kName);
  EXPECT_EQ(f.data_offset(), at.data_offset);
  EXPECT_EQ(f.data_offset() % 8, 0u);  // the builder pads like the reference writer
  ASSERT_EQ(f.tensors().size(), 2u);
  EXPECT_EQ(f.tensors()[0].name, "a.bias");  // sorted by name
  EXPECT_EQ(f.metadata().at("format"), "pt");

  const SafetensorsTensor* w = f.find("b.weight");
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->dtype, SafetensorsDtype::F32);
  EXPECT_EQ(w->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(w->n_elements(), 6);
  EXPECT_EQ(w->n_bytes(), 24u);
  EXPECT_EQ(w->begin, 0u);
  EXPECT_EQ(w->data, img.data() + at.tensor_begin[0]);
  float v[6];
  std::memcpy(v, w->data, sizeof v);
  EXPECT_EQ(v[5], 6.0f);

  const SafetensorsTensor* b = f.find("a.bias");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->dtype, SafetensorsDtype::BF16);
  EXPECT_EQ(b->begin, 24u);
  EXPECT_EQ(b->end, 32u);
  uint16_t h;
  std::memcpy(&h, b->data + 6, 2);
  EXPECT_EQ(bf16_to_fp32(h), 1024.0f);
  EXPECT_EQ(f.find("missing"), nullptr);
}

TEST(Safetensors, AcceptsEveryDtypeScalarsAndEmptyTensors) {
  SafetensorsBuilder b;
  const char* names[] = {"F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL", "F8_E4M3", "F8_E5M2"};
  const size_t sizes[] = {8, 4, 2, 2, 8, 4, 2, 1, 1, 1, 1, 1};
  for (const char* n : names) b.tensor(std::string("t_") + n, n, {3, 2});
  b.tensor("scalar", "F32", {}).tensor("empty", "F16", {0, 5});
  const auto img = b.build();
  const SafetensorsFile f = parse(img);
  for (size_t i = 0; i < std::size(names); ++i) {
    const SafetensorsTensor* t = f.find(std::string("t_") + names[i]);
    ASSERT_NE(t, nullptr) << names[i];
    EXPECT_EQ(safetensors_dtype_name(t->dtype), names[i]);
    EXPECT_EQ(t->n_bytes(), 6 * sizes[i]) << names[i];
  }
  EXPECT_EQ(f.find("scalar")->n_elements(), 1);
  EXPECT_EQ(f.find("scalar")->n_bytes(), 4u);
  EXPECT_EQ(f.find("empty")->n_elements(), 0);
  EXPECT_EQ(to_ggml_type(SafetensorsDtype::BF16), GgmlType::BF16);
  EXPECT_EQ(to_ggml_type(SafetensorsDtype::F16), GgmlType::F16);
  EXPECT_EQ(to_ggml_type(SafetensorsDtype::F32), GgmlType::F32);
  EXPECT_FALSE(to_ggml_type(SafetensorsDtype::F8_E4M3));
}

TEST(Safetensors, AcceptsAnEmptyHeaderObjectAndUnpaddedHeaders) {
  EXPECT_TRUE(parse(SafetensorsBuilder::image("{}", {})).tensors().empty());
  const SafetensorsBuilder b = two_tensors();
  const SafetensorsFile f = parse(SafetensorsBuilder::image(b.header().dump(), b.data()));  // no padding
  EXPECT_EQ(f.tensors().size(), 2u);
}

// ---- one test per malformed case ----

TEST(SafetensorsErrors, FileShorterThanTheLengthField) {
  for (size_t n = 0; n < 8; ++n) EXPECT_TRUE(fails_with(std::vector<uint8_t>(n, 0), "shorter than the 8-byte"));
}

TEST(SafetensorsErrors, HeaderLengthBeyondTheFile) {
  auto img = two_tensors().build();
  const uint64_t n = img.size() - 7;
  std::memcpy(img.data(), &n, 8);
  EXPECT_TRUE(fails_with(img, "header length " + std::to_string(n) + " exceeds the"));
}

TEST(SafetensorsErrors, HeaderLengthOverTheLimit) {
  auto img = two_tensors().build();
  for (const uint64_t n : {uint64_t{100'000'001}, std::numeric_limits<uint64_t>::max()}) {
    std::memcpy(img.data(), &n, 8);
    EXPECT_TRUE(fails_with(img, "exceeds the limit of 100000000 bytes"));
  }
}

TEST(SafetensorsErrors, HeaderNotJson) {
  EXPECT_TRUE(fails_with(SafetensorsBuilder::image("{\"a\": ", {}), "header is not valid JSON"));
  EXPECT_TRUE(fails_with(SafetensorsBuilder::image("", {}), "header is not valid JSON"));
  EXPECT_TRUE(fails_with(SafetensorsBuilder::image("{} x", {}), "header is not valid JSON"));
  EXPECT_TRUE(fails_with(SafetensorsBuilder::image("{\"\xff\": 1}", {}), "header is not valid JSON"));
}

TEST(SafetensorsErrors, HeaderNotAnObject) {
  EXPECT_TRUE(fails_with(SafetensorsBuilder::image("[1, 2]", {}), "header is not a JSON object but array"));
  EXPECT_TRUE(fails_with(SafetensorsBuilder::image("7", {}), "header is not a JSON object but number"));
}

TEST(SafetensorsErrors, DuplicateTensorName) {
  const std::string t = R"({"dtype": "U8", "shape": [1], "data_offsets": [0, 1]})";
  EXPECT_TRUE(fails_with(SafetensorsBuilder::image("{\"x\": " + t + ", \"x\": " + t + "}", {7}),
                         "header names 'x' twice"));
}

TEST(SafetensorsErrors, EntryNotAnObject) {
  EXPECT_TRUE(fails_with(edited([](json& h) { h["b.weight"] = 3; }), "tensor 'b.weight': entry must be an object"));
  // Deep nesting is described, not dumped (dumping would recurse as deep as the header nests).
  std::string deep = "{\"t\": " + std::string(100000, '[') + std::string(100000, ']') + "}";
  EXPECT_TRUE(fails_with(SafetensorsBuilder::image(deep, {}), "entry must be an object, got an array of 1 elements"));
}

TEST(SafetensorsErrors, MissingFields) {
  for (const char* field : {"dtype", "shape", "data_offsets"}) {
    EXPECT_TRUE(fails_with(edited([&](json& h) { h["b.weight"].erase(field); }),
                           std::string("tensor 'b.weight': missing field '") + field + "'"));
  }
}

TEST(SafetensorsErrors, FieldsOfTheWrongType) {
  EXPECT_TRUE(fails_with(edited([](json& h) { h["b.weight"]["dtype"] = 5; }), "field 'dtype' must be a string"));
  EXPECT_TRUE(fails_with(edited([](json& h) { h["b.weight"]["shape"] = "2x3"; }), "field 'shape' must be an array"));
  EXPECT_TRUE(fails_with(edited([](json& h) { h["b.weight"]["shape"] = {2, 3.5}; }),
                         "shape[1] must be an integer, got 3.5"));
  EXPECT_TRUE(fails_with(edited([](json& h) { h["b.weight"]["shape"] = {true}; }), "shape[0] must be an integer"));
  EXPECT_TRUE(fails_with(edited([](json& h) { h["b.weight"]["data_offsets"] = {0}; }),
                         "field 'data_offsets' must be an array [begin, end]"));
  EXPECT_TRUE(fails_with(edited([](json& h) { h["b.weight"]["data_offsets"] = {0, 24, 24}; }),
                         "field 'data_offsets' must be an array [begin, end]"));
  EXPECT_TRUE(fails_with(edited([](json& h) { h["b.weight"]["data_offsets"] = {"0", 24}; }),
                         "data_offsets[0] must be an integer"));
  EXPECT_TRUE(fails_with(edited([](json& h) { h["__metadata__"] = {1, 2}; }), "__metadata__ must be an object"));
  EXPECT_TRUE(fails_with(edited([](json& h) { h["__metadata__"] = {{"format", 1}}; }),
                         "__metadata__ value of 'format' must be a string"));
}

TEST(SafetensorsErrors, UnknownDtype) {
  EXPECT_TRUE(fails_with(edited([](json& h) { h["b.weight"]["dtype"] = "F4"; }),
                         "tensor 'b.weight': unknown dtype 'F4' (known: BOOL, U8"));
  EXPECT_TRUE(fails_with(edited([](json& h) { h["b.weight"]["dtype"] = "f32"; }), "unknown dtype 'f32'"));
}

TEST(SafetensorsErrors, NegativeDimensionOrOffset) {
  EXPECT_TRUE(fails_with(edited([](json& h) { h["b.weight"]["shape"] = {-2, -3}; }),
                         "tensor 'b.weight': shape[0] is negative: -2"));
  EXPECT_TRUE(fails_with(edited([](json& h) { h["b.weight"]["data_offsets"] = {-24, 0}; }),
                         "data_offsets[0] is negative"));
}

TEST(SafetensorsErrors, OverflowingShape) {
  const int64_t big = int64_t{1} << 40;
  EXPECT_TRUE(fails_with(edited([&](json& h) { h["b.weight"]["shape"] = {big, big}; }),
                         "element count of shape [1099511627776,1099511627776] overflows int64"));
  EXPECT_TRUE(fails_with(edited([](json& h) { h["b.weight"]["shape"] = {std::numeric_limits<uint64_t>::max()}; }),
                         "overflows int64"));
  // Fits as an element count, not as bytes: 2^62 F32 elements.
  EXPECT_TRUE(fails_with(edited([](json& h) { h["b.weight"]["shape"] = {int64_t{1} << 62}; }),
                         "byte size of F32 [4611686018427387904] overflows 64 bits"));
}

TEST(SafetensorsErrors, OffsetsEndBeforeTheyBegin) {
  EXPECT_TRUE(fails_with(edited([](json& h) { h["b.weight"]["data_offsets"] = {24, 0}; }),
                         "tensor 'b.weight': data_offsets [24, 0] end before they begin"));
}

TEST(SafetensorsErrors, ByteSizeDoesNotMatchTheShape) {
  EXPECT_TRUE(fails_with(edited([](json& h) { h["b.weight"]["shape"] = {2, 2}; }),
                         "tensor 'b.weight': data_offsets [0, 24] hold 24 bytes, but F32 [2, 2] needs 16"));
  EXPECT_TRUE(fails_with(edited([](json& h) { h["b.weight"]["dtype"] = "F16"; }), "but F16 [2, 3] needs 12"));
}

TEST(SafetensorsErrors, OffsetsPastTheDataSection) {
  EXPECT_TRUE(fails_with(edited([](json& h) { h["a.bias"]["data_offsets"] = {28, 36}; }),
                         "tensor 'a.bias' data_offsets [28, 36] run past the end of the data section, which has 32 bytes"));
}

TEST(SafetensorsErrors, OverlappingTensors) {
  EXPECT_TRUE(fails_with(edited([](json& h) { h["a.bias"]["data_offsets"] = {20, 28}; }),
                         "tensors 'b.weight' (bytes 0..24) and 'a.bias' (from byte 20) overlap"));
  // The same range twice overlaps too; empty tensors overlap nothing.
  EXPECT_TRUE(fails_with(edited([](json& h) {
                           h["b.weight"]["dtype"] = "U8";
                           h["b.weight"]["shape"] = {8};
                           h["b.weight"]["data_offsets"] = {24, 32};
                         }),
                         "overlap in the data section"));
  SafetensorsBuilder b = two_tensors();
  b.tensor("z.empty", "F32", {0});
  json h = b.header();
  h["z.empty"]["data_offsets"] = {4, 4};  // inside b.weight's bytes, but empty
  EXPECT_NO_THROW(parse(SafetensorsBuilder::image(h.dump(), b.data())));
}

TEST(SafetensorsErrors, TruncationAtEveryByteIsAnError) {
  const auto img = two_tensors().metadata("format", "pt").build();
  for (size_t n = 0; n < img.size(); ++n) {
    const std::vector<uint8_t> cut(img.begin(), img.begin() + static_cast<long>(n));
    EXPECT_THROW(parse(cut), Error) << "cut at " << n << " of " << img.size();
  }
  // In the data section the message says what happened.
  const std::vector<uint8_t> cut(img.begin(), img.end() - 1);
  EXPECT_TRUE(fails_with(cut, "truncated or corrupt file: tensor 'a.bias'"));
}

TEST(SafetensorsErrors, CorruptionAtEveryByteGivesErrorOrAValidFile) {
  const auto img = two_tensors().metadata("format", "pt").build();
  for (size_t i = 0; i < img.size(); ++i) {
    for (const uint8_t v : {uint8_t{0}, uint8_t{0xff}, uint8_t{'"'}, uint8_t{'9'}, uint8_t{'-'}, uint8_t{'{'}}) {
      std::vector<uint8_t> bad = img;
      bad[i] = v;
      try {
        const SafetensorsFile f = parse(bad);
        for (const auto& t : f.tensors()) EXPECT_LE(t.data + t.n_bytes(), bad.data() + bad.size());
      } catch (const Error&) {
      }
    }
  }
}

TEST(SafetensorsErrors, NamesAreQuotedSafely) {
  EXPECT_TRUE(fails_with(edited([](json& h) {
                           h["bad\nname"] = h["b.weight"];
                           h.erase("b.weight");
                           h["bad\nname"]["dtype"] = "F3";
                         }),
                         "tensor 'bad\\x0aname': unknown dtype 'F3'"));
}

TEST(SafetensorsFile, OpenMapsTheFileAndNamesItInErrors) {
  TempDir dir;
  const std::string path = dir.write("w.safetensors", bytes_of(two_tensors().build()));
  SafetensorsFile f = SafetensorsFile::open(path);
  EXPECT_EQ(f.path(), path);
  EXPECT_EQ(f.tensors().size(), 2u);
  SafetensorsFile moved = std::move(f);
  float first;
  std::memcpy(&first, moved.find("b.weight")->data, 4);  // the mapping moved with the object
  EXPECT_EQ(first, 1.0f);

  const std::string bad = dir.write("bad.safetensors", "1234");
  EXPECT_NE(error_of([&] { SafetensorsFile::open(bad); }).find(bad + ": truncated or corrupt file"), std::string::npos);
  EXPECT_NE(error_of([&] { SafetensorsFile::open(dir.path() + "/none.safetensors"); }).find("cannot open"),
            std::string::npos);
}

// ---- folders ----

TEST(SafetensorsCheckpoint, SingleFile) {
  TempDir dir;
  dir.write("model.safetensors", bytes_of(two_tensors().build()));
  const auto c = SafetensorsCheckpoint::open_dir(dir.path());
  EXPECT_EQ(c.files().size(), 1u);
  EXPECT_EQ(c.n_tensors(), 2u);
  EXPECT_EQ(c.names(), (std::vector<std::string>{"a.bias", "b.weight"}));
  ASSERT_NE(c.find("b.weight"), nullptr);
  EXPECT_EQ(c.find("b.weight")->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(c.file_of("a.bias"), dir.path() + "/model.safetensors");
  EXPECT_EQ(c.find("nope"), nullptr);
  EXPECT_EQ(c.file_of("nope"), "");
}

TEST(SafetensorsCheckpoint, ShardsThroughTheIndex) {
  TempDir dir;
  dir.write("model-00001-of-00002.safetensors", bytes_of(SafetensorsBuilder().f32("x", {2}, {1, 2}).build()));
  dir.write("model-00002-of-00002.safetensors",
            bytes_of(SafetensorsBuilder().f32("y", {1}, {3}).f32("unlisted", {1}, {4}).build()));
  const nlohmann::json index = {{"metadata", {{"total_size", 12}}},
                                {"weight_map",
                                 {{"x", "model-00001-of-00002.safetensors"},
                                  {"y", "model-00002-of-00002.safetensors"}}}};
  dir.write("model.safetensors.index.json", index.dump());
  const auto c = SafetensorsCheckpoint::open_dir(dir.path());
  EXPECT_EQ(c.files().size(), 2u);
  EXPECT_EQ(c.names(), (std::vector<std::string>{"x", "y"}));  // the index decides
  float y;
  std::memcpy(&y, c.find("y")->data, 4);
  EXPECT_EQ(y, 3.0f);
  EXPECT_EQ(c.file_of("y"), dir.path() + "/model-00002-of-00002.safetensors");
}

TEST(SafetensorsCheckpoint, FolderErrors) {
  TempDir dir;
  auto err = [&] { return error_of([&] { SafetensorsCheckpoint::open_dir(dir.path()); }); };
  EXPECT_NE(err().find("no model.safetensors or model.safetensors.index.json"), std::string::npos) << err();
  dir.write("pytorch_model.bin", "x");
  EXPECT_NE(err().find("only PyTorch .bin weights"), std::string::npos) << err();

  const std::string index = "model.safetensors.index.json";
  dir.write(index, "{not json");
  EXPECT_NE(err().find(index + ": not valid JSON"), std::string::npos) << err();
  dir.write(index, R"({"metadata": {}})");
  EXPECT_NE(err().find("missing the object 'weight_map'"), std::string::npos) << err();
  dir.write(index, R"({"weight_map": {}})");
  EXPECT_NE(err().find("weight_map is empty"), std::string::npos) << err();
  dir.write(index, R"({"weight_map": {"x": 3}})");
  EXPECT_NE(err().find("weight_map entry of tensor 'x' is not a file name"), std::string::npos) << err();
  dir.write(index, R"({"weight_map": {"x": "../model.safetensors"}})");
  EXPECT_NE(err().find("'../model.safetensors', which is not a file name in the folder"), std::string::npos) << err();
  dir.write(index, R"({"weight_map": {"x": "model-00001-of-00002.safetensors"}})");
  EXPECT_NE(err().find("maps tensor 'x' to 'model-00001-of-00002.safetensors', which is missing"), std::string::npos)
      << err();
  dir.write("model-00001-of-00002.safetensors", bytes_of(SafetensorsBuilder().f32("other", {1}, {1}).build()));
  EXPECT_NE(err().find("model-00001-of-00002.safetensors: has no tensor 'x', which model.safetensors.index.json maps"),
            std::string::npos)
      << err();
  dir.write("model-00001-of-00002.safetensors", "short");
  EXPECT_NE(err().find("model-00001-of-00002.safetensors: truncated or corrupt file"), std::string::npos) << err();
}
