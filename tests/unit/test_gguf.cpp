// GGUF reader: round trips through GgufBuilder images, one test per malformed-file check (each
// asserting the phrase its error must contain), and golden checks on real files whose reference
// values were read with the `gguf` Python package (gguf-py, GGUFReader).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "core/error.h"
#include "gguf_builder.h"
#include "gguf_test_support.h"
#include "io/gguf.h"
#include "test_util.h"

using namespace kestrel;
using kestrel::test::GgufBuilder;
using kestrel::test::GgufEncoded;
using kestrel::test::poke_u32;
using kestrel::test::poke_u64;
using namespace kestrel::test::gguf;
using B = GgufBuilder;
using VT = GgufValueType;

namespace {

// A small model-like image: every tensor type family (plain, half, block-quantized).
GgufBuilder small_model() {
  GgufBuilder b;
  b.kv("general.architecture", B::str("llama"))
      .kv("llama.embedding_length", B::u32(8))
      .kv("tokenizer.ggml.tokens", B::strings({"<unk>", "a", "b"}))
      .kv("tokenizer.ggml.scores", B::array_of<float>(VT::FLOAT32, {0.0f, -1.0f, -2.0f}))
      .tensor("token_embd.weight", {8, 3}, GgmlType::F32)
      .tensor("blk.0.attn_q.weight", {32, 2}, GgmlType::Q8_0)
      .tensor("output_norm.weight", {8}, GgmlType::F16);
  return b;
}

// A vocab-only image: metadata only, ending right after the last value.
GgufBuilder vocab_only() {
  GgufBuilder b;
  b.kv("general.architecture", B::str("llama"))
      .kv("tokenizer.ggml.tokens", B::strings({"<unk>", "<s>", "</s>", "hello"}))
      .kv("tokenizer.ggml.token_type", B::array_of<int32_t>(VT::INT32, {2, 3, 3, 1}))
      .kv("tokenizer.ggml.add_bos_token", B::boolean(true));
  return b;
}

// A temporary file holding bytes; removed when the test ends.
class TempFile {
 public:
  explicit TempFile(const std::vector<uint8_t>& bytes) {
    char name[] = "/tmp/kestrel_gguf_XXXXXX";
    const int fd = ::mkstemp(name);
    EXPECT_GE(fd, 0);
    path_ = name;
    if (fd >= 0) {
      EXPECT_EQ(::write(fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
      ::close(fd);
    }
  }
  ~TempFile() { std::remove(path_.c_str()); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// Valid images

TEST(GgufParse, ReadsEveryScalarType) {
  const auto img = GgufBuilder()
                       .kv("u8", B::u8(255))
                       .kv("i8", B::i8(-128))
                       .kv("u16", B::u16(65535))
                       .kv("i16", B::i16(-32768))
                       .kv("u32", B::u32(4294967295u))
                       .kv("i32", B::i32(-2147483647 - 1))
                       .kv("f32", B::f32(1.5f))
                       .kv("t", B::boolean(true))
                       .kv("f", B::boolean(false))
                       .kv("s", B::str("hello"))
                       .kv("u64", B::u64(std::numeric_limits<uint64_t>::max()))
                       .kv("i64", B::i64(std::numeric_limits<int64_t>::min()))
                       .kv("f64", B::f64(-0.125))
                       .build();
  const GgufFile f = parse(img);
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.metadata().size(), 13u);
  EXPECT_EQ(f.metadata()[0].first, "u8");  // file order is kept
  EXPECT_EQ(f.metadata()[12].first, "f64");
  EXPECT_EQ(f.find("u8")->type, VT::UINT8);
  EXPECT_EQ(f.find("i16")->type, VT::INT16);
  EXPECT_EQ(f.find("f64")->type, VT::FLOAT64);
  EXPECT_EQ(f.get_int("u8"), 255);
  EXPECT_EQ(f.get_int("i8"), -128);
  EXPECT_EQ(f.get_int("u16"), 65535);
  EXPECT_EQ(f.get_int("i16"), -32768);
  EXPECT_EQ(f.get_int("u32"), 4294967295LL);
  EXPECT_EQ(f.get_int("i32"), -2147483648LL);
  EXPECT_EQ(std::get<uint64_t>(f.find("u64")->scalar), std::numeric_limits<uint64_t>::max());
  EXPECT_EQ(f.get_int("i64"), std::numeric_limits<int64_t>::min());
  EXPECT_EQ(f.get_float("f32"), 1.5);
  EXPECT_EQ(f.get_float("f64"), -0.125);
  EXPECT_TRUE(f.get_bool_or("t", false));
  EXPECT_FALSE(f.get_bool_or("f", true));
  EXPECT_EQ(f.get_string("s"), "hello");
  EXPECT_TRUE(f.tensors().empty());
  EXPECT_EQ(f.alignment(), 32u);
}

TEST(GgufParse, ReadsArraysOfEveryType) {
  const auto img =
      GgufBuilder()
          .kv("a.u8", B::array_of<uint8_t>(VT::UINT8, {1, 2, 255}))
          .kv("a.i8", B::array_of<int8_t>(VT::INT8, {-1, 2}))
          .kv("a.u16", B::array_of<uint16_t>(VT::UINT16, {65535}))
          .kv("a.i16", B::array_of<int16_t>(VT::INT16, {-300, 300}))
          .kv("a.u32", B::array_of<uint32_t>(VT::UINT32, {7, 8, 9}))
          .kv("a.i32", B::array_of<int32_t>(VT::INT32, {-7}))
          .kv("a.f32", B::array_of<float>(VT::FLOAT32, {0.5f, -2.0f}))
          .kv("a.bool", B::array_of<uint8_t>(VT::BOOL, {1, 0, 1}))
          .kv("a.str", B::strings({"x", "", "yz"}))
          .kv("a.u64", B::array_of<uint64_t>(VT::UINT64, {1ull << 40}))
          .kv("a.i64", B::array_of<int64_t>(VT::INT64, {-(1ll << 40)}))
          .kv("a.f64", B::array_of<double>(VT::FLOAT64, {3.25}))
          .kv("a.empty", B::array_of<uint32_t>(VT::UINT32, {}))
          .kv("a.nested",
              B::array(VT::ARRAY,
                       {B::array_of<int32_t>(VT::INT32, {1, 2}), B::strings({"p", "q", "r"}),
                        B::array(VT::ARRAY, {B::array_of<uint8_t>(VT::UINT8, {9})})}))
          .build();
  const GgufFile f = parse(img);
  EXPECT_EQ(f.get_int_array("a.u8"), (std::vector<int64_t>{1, 2, 255}));
  EXPECT_EQ(f.get_int_array("a.i8"), (std::vector<int64_t>{-1, 2}));
  EXPECT_EQ(f.get_int_array("a.u16"), (std::vector<int64_t>{65535}));
  EXPECT_EQ(f.get_int_array("a.i16"), (std::vector<int64_t>{-300, 300}));
  EXPECT_EQ(f.get_int_array("a.u32"), (std::vector<int64_t>{7, 8, 9}));
  EXPECT_EQ(f.get_int_array("a.i32"), (std::vector<int64_t>{-7}));
  EXPECT_EQ(f.get_float_array("a.f32"), (std::vector<float>{0.5f, -2.0f}));
  EXPECT_EQ(f.find("a.bool")->bools, (std::vector<uint8_t>{1, 0, 1}));
  EXPECT_EQ(f.get_string_array("a.str"), (std::vector<std::string>{"x", "", "yz"}));
  EXPECT_EQ(f.get_int_array("a.u64"), (std::vector<int64_t>{1ll << 40}));
  EXPECT_EQ(f.get_int_array("a.i64"), (std::vector<int64_t>{-(1ll << 40)}));
  EXPECT_EQ(f.get_float_array("a.f64"), (std::vector<float>{3.25f}));
  EXPECT_EQ(f.get_float_array("a.i32"), (std::vector<float>{-7.0f}));  // integers convert
  EXPECT_EQ(f.find("a.empty")->array_size(), 0u);
  EXPECT_EQ(f.find("a.empty")->array_type, VT::UINT32);

  const GgufValue* n = f.find("a.nested");
  ASSERT_NE(n, nullptr);
  EXPECT_TRUE(n->is_array());
  EXPECT_EQ(n->array_type, VT::ARRAY);
  ASSERT_EQ(n->array_size(), 3u);
  EXPECT_EQ(n->arrays[0].array_type, VT::INT32);
  EXPECT_EQ(n->arrays[0].ints, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(n->arrays[1].strings, (std::vector<std::string>{"p", "q", "r"}));
  ASSERT_EQ(n->arrays[2].array_size(), 1u);
  EXPECT_EQ(n->arrays[2].arrays[0].uints, (std::vector<uint64_t>{9}));
  for (const char* key : {"a.u8", "a.i8", "a.f32", "a.bool", "a.str", "a.f64"})
    EXPECT_GT(f.find(key)->array_size(), 0u) << key;
}

TEST(GgufParse, ReadsTensorsAndPointsIntoTheBuffer) {
  GgufBuilder::Layout at;
  const auto img = small_model().build(&at);
  const GgufFile f = parse(img);
  ASSERT_EQ(f.tensors().size(), 3u);
  EXPECT_EQ(f.data_offset(), at.data_offset);
  EXPECT_EQ(f.data_offset() % 32, 0u);

  const GgufTensorInfo* emb = f.find_tensor("token_embd.weight");
  ASSERT_NE(emb, nullptr);
  EXPECT_EQ(emb->ne, (std::vector<int64_t>{8, 3}));
  EXPECT_EQ(emb->type, GgmlType::F32);
  EXPECT_EQ(emb->n_elements(), 24);
  EXPECT_EQ(emb->n_rows(), 3);
  EXPECT_EQ(emb->n_bytes, 96u);
  EXPECT_EQ(emb->offset, 0u);

  const GgufTensorInfo* q = f.find_tensor("blk.0.attn_q.weight");
  ASSERT_NE(q, nullptr);
  EXPECT_EQ(q->type, GgmlType::Q8_0);
  EXPECT_EQ(q->n_bytes, 2u * 34u);  // one block per row, two rows
  EXPECT_EQ(q->offset, 96u);        // already a multiple of 32

  const GgufTensorInfo* norm = f.find_tensor("output_norm.weight");
  ASSERT_NE(norm, nullptr);
  EXPECT_EQ(norm->type, GgmlType::F16);
  EXPECT_EQ(norm->n_bytes, 16u);
  EXPECT_EQ(norm->offset, 192u);  // 96 + 68 rounded up to 32

  for (size_t i = 0; i < f.tensors().size(); ++i) {
    const auto& t = f.tensors()[i];
    EXPECT_EQ(t.data, img.data() + at.data_offset + at.offset[i]) << t.name;
    EXPECT_EQ(t.data[0], static_cast<uint8_t>(i * 7 + 1)) << t.name;  // the builder's pattern
  }
  EXPECT_EQ(f.find_tensor("missing"), nullptr);
}

TEST(GgufParse, ReadsF32TensorValues) {
  const auto img = GgufBuilder()
                       .tensor("w", {4}, GgmlType::F32, test::f32_bytes({1.0f, -2.5f, 3.0f, 0.0f}))
                       .build();
  const GgufFile f = parse(img);
  EXPECT_EQ(f32_at(f.tensors()[0].data + 4), -2.5f);
}

TEST(GgufParse, AcceptsVersion2) {
  const GgufFile f = parse(small_model().version(2).build());
  EXPECT_EQ(f.version(), 2u);
  EXPECT_EQ(f.tensors().size(), 3u);
}

TEST(GgufParse, HonorsCustomAlignment) {
  GgufBuilder::Layout at;
  auto b = small_model();
  b.alignment(64);
  const auto img = b.build(&at);
  const GgufFile f = parse(img);
  EXPECT_EQ(f.alignment(), 64u);
  EXPECT_EQ(f.data_offset() % 64, 0u);
  EXPECT_EQ(f.find_tensor("blk.0.attn_q.weight")->offset, 128u);
  EXPECT_EQ(f.get_int("general.alignment"), 64);
}

TEST(GgufParse, AcceptsEveryKnownTensorType) {
  for (const GgmlType type :
       {GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q4_0, GgmlType::Q4_1,
        GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q8_0, GgmlType::Q2_K, GgmlType::Q3_K,
        GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K, GgmlType::Q8_K, GgmlType::I8, GgmlType::I32,
        GgmlType::F64}) {
    const auto img = GgufBuilder().tensor("t", {256, 3}, type).build();
    const GgufFile f = parse(img);
    EXPECT_EQ(f.tensors()[0].type, type);
    EXPECT_EQ(f.tensors()[0].n_bytes, 3 * row_bytes(type, 256)) << type_name(type);
  }
}

TEST(GgufParse, AcceptsTensorsStoredOutOfOffsetOrder) {
  GgufBuilder::Layout at;
  auto img =
      GgufBuilder().tensor("a", {8}, GgmlType::F32).tensor("b", {8}, GgmlType::F32).build(&at);
  poke_u64(img, at.offset_at[0], at.offset[1]);  // swap: "a" now follows "b"
  poke_u64(img, at.offset_at[1], at.offset[0]);
  const GgufFile f = parse(img);
  EXPECT_EQ(f.find_tensor("a")->offset, 32u);
  EXPECT_EQ(f.find_tensor("b")->offset, 0u);
}

TEST(GgufParse, LoadsVocabOnlyImageEndingAfterMetadata) {
  const auto img = vocab_only().build();
  const GgufFile f = parse(img);
  EXPECT_TRUE(f.tensors().empty());
  EXPECT_EQ(f.data_offset(), img.size());  // no padding, no data section
  EXPECT_EQ(f.get_string_array("tokenizer.ggml.tokens").size(), 4u);
  EXPECT_TRUE(f.get_bool_or("tokenizer.ggml.add_bos_token", false));

  const auto padded = vocab_only().pad_without_tensors(true).build();
  const GgufFile g = parse(padded);
  EXPECT_EQ(g.data_offset(), padded.size());
  EXPECT_EQ(g.data_offset() % 32, 0u);
}

TEST(GgufParse, KeepsNonUtf8StringsAsBytes) {
  const std::string bytes = "\xff\xfe\xc0 \x80";
  const auto img =
      GgufBuilder().kv("s", B::str(bytes)).kv("tokens", B::strings({bytes, "ok"})).build();
  const GgufFile f = parse(img);
  EXPECT_EQ(f.get_string("s"), bytes);
  EXPECT_EQ(f.get_string_array("tokens")[0], bytes);
}

TEST(GgufParse, AcceptsArraysNestedEightDeep) {
  GgufEncoded v = B::array_of<int32_t>(VT::INT32, {42});
  for (int depth = 1; depth < 8; ++depth) v = B::array(VT::ARRAY, {v});
  const GgufFile f = parse(GgufBuilder().kv("deep", v).build());
  const GgufValue* x = f.find("deep");
  for (int depth = 1; depth < 8; ++depth) x = &x->arrays.at(0);
  EXPECT_EQ(x->ints, (std::vector<int64_t>{42}));
}

TEST(GgufParse, MoveKeepsTensorPointersValid) {
  const auto img = small_model().build();
  GgufFile a = parse(img);
  const uint8_t* p = a.tensors()[0].data;
  GgufFile b = std::move(a);
  EXPECT_EQ(b.tensors()[0].data, p);
  EXPECT_EQ(b.get_string("general.architecture"), "llama");
}

// ---------------------------------------------------------------------------------------------
// Malformed images: one check each, each naming its problem.

TEST(GgufMalformed, TruncatedAtEveryOffset) {
  for (const auto& img : {small_model().build(), vocab_only().build()}) {
    for (size_t n = 0; n < img.size(); ++n) {
      const std::vector<uint8_t> cut(img.begin(), img.begin() + static_cast<ptrdiff_t>(n));
      ASSERT_TRUE(fails_with(cut, "truncated")) << "cut at " << n << " of " << img.size();
    }
  }
}

TEST(GgufMalformed, EmptyImage) {
  EXPECT_TRUE(fails_with({}, "truncated"));
  EXPECT_EQ(error_of([] { GgufFile::parse(nullptr, 0, "x"); }).rfind("x: truncated", 0), 0u);
  EXPECT_EQ(error_of([] { GgufFile::parse(nullptr, 8, "x"); }), "x: null buffer of 8 bytes");
}

TEST(GgufMalformed, BadMagic) {
  auto img = small_model().build();
  img[0] = 'L';
  EXPECT_TRUE(fails_with(img, "bad magic"));
}

TEST(GgufMalformed, UnsupportedVersions) {
  EXPECT_TRUE(fails_with(small_model().version(1).build(), "unsupported GGUF version 1"));
  EXPECT_TRUE(fails_with(small_model().version(0).build(), "unsupported GGUF version 0"));
  EXPECT_TRUE(fails_with(small_model().version(4).build(), "unsupported GGUF version 4"));
  EXPECT_TRUE(fails_with(small_model().version(0x03000000).build(), "big-endian"));
}

TEST(GgufMalformed, AbsurdTensorCount) {
  GgufBuilder::Layout at;
  auto img = small_model().build(&at);
  poke_u64(img, at.tensor_count_at, 1ull << 40);
  EXPECT_TRUE(fails_with(img, "tensor_count 1099511627776"));
  poke_u64(img, at.tensor_count_at, std::numeric_limits<uint64_t>::max());
  EXPECT_TRUE(fails_with(img, "tensor_count"));
}

TEST(GgufMalformed, AbsurdKvCount) {
  GgufBuilder::Layout at;
  auto img = small_model().build(&at);
  poke_u64(img, at.kv_count_at, std::numeric_limits<uint64_t>::max());
  EXPECT_TRUE(fails_with(img, "metadata_kv_count 18446744073709551615"));
  // Each count alone could fit, both together cannot.
  const uint64_t left = img.size() - 24;
  poke_u64(img, at.kv_count_at, left / 13 / 2 + 1);      // a key/value pair takes >= 13 bytes
  poke_u64(img, at.tensor_count_at, left / 24 / 2 + 1);  // a tensor info >= 24
  EXPECT_TRUE(fails_with(img, "cannot both fit"));
}

TEST(GgufMalformed, AbsurdArrayLength) {
  GgufBuilder::Layout at;
  auto img = GgufBuilder().kv("a", B::array_of<uint32_t>(VT::UINT32, {1, 2, 3})).build(&at);
  const size_t count_at = at.value_at[0] + 4 + 4;  // after the type id and the element type
  poke_u64(img, count_at, 1ull << 62);
  EXPECT_TRUE(
      fails_with(img, "value of key 'a': array of UINT32: element count 4611686018427387904"));
  // 4 elements need 16 bytes and only 12 are left, although 4 one-byte elements would fit.
  poke_u64(img, count_at, 4);
  EXPECT_TRUE(fails_with(img, "element count 4"));
}

TEST(GgufMalformed, AbsurdStringArrayLength) {
  GgufBuilder::Layout at;
  auto img = GgufBuilder().kv("tokens", B::strings({"a", "b"})).build(&at);
  const size_t count_at = at.value_at[0] + 4 + 4;
  // 18 bytes are left: room for two strings but not for three length fields.
  poke_u64(img, count_at, 3);
  EXPECT_TRUE(fails_with(img, "value of key 'tokens': array of STRING: element count 3"));
}

TEST(GgufMalformed, AbsurdNestedArrayLength) {
  GgufBuilder::Layout at;
  auto img = GgufBuilder()
                 .kv("nest", B::array(VT::ARRAY, {B::array_of<uint8_t>(VT::UINT8, {1})}))
                 .build(&at);
  poke_u64(img, at.value_at[0] + 8, 1ull << 60);
  EXPECT_TRUE(fails_with(img, "value of key 'nest': array of ARRAY: element count"));
}

TEST(GgufMalformed, AbsurdStringLength) {
  GgufBuilder::Layout at;
  auto img = small_model().build(&at);
  poke_u64(img, at.value_at[0] + 4, 1ull << 63);  // general.architecture's length
  EXPECT_TRUE(fails_with(img, "string length 9223372036854775808"));
  EXPECT_TRUE(fails_with(img, "value of key 'general.architecture'"));
}

TEST(GgufMalformed, AbsurdKeyLength) {
  GgufBuilder::Layout at;
  auto img = small_model().build(&at);
  poke_u64(img, at.key_at[1], 1ull << 50);
  EXPECT_TRUE(fails_with(img, "key of metadata entry #1: string length"));
}

TEST(GgufMalformed, AbsurdTensorNameLength) {
  GgufBuilder::Layout at;
  auto img = small_model().build(&at);
  poke_u64(img, at.tensor_at[2], img.size());
  EXPECT_TRUE(fails_with(img, "name of tensor #2: string length"));
}

TEST(GgufMalformed, NDimsZeroOrAboveFour) {
  EXPECT_TRUE(fails_with(GgufBuilder().tensor_raw("t", {}, 0, {}).build(),
                         "tensor 't': n_dims 0 is outside [1, 4]"));
  EXPECT_TRUE(fails_with(GgufBuilder().tensor_raw("t", {1, 1, 1, 1, 1}, 0, {0, 0, 0, 0}).build(),
                         "n_dims 5"));
  GgufBuilder::Layout at;
  auto img = small_model().build(&at);
  poke_u32(img, at.n_dims_at[0], 0xffffffffu);
  EXPECT_TRUE(fails_with(img, "n_dims 4294967295"));
}

TEST(GgufMalformed, NonPositiveDimensions) {
  EXPECT_TRUE(fails_with(GgufBuilder().tensor_raw("t", {4, 0}, 0, {}).build(),
                         "dimension ne[1] = 0 is not positive"));
  EXPECT_TRUE(fails_with(GgufBuilder().tensor_raw("t", {~0ull}, 0, {}).build(),
                         "ne[0] = -1 is not positive"));
  EXPECT_TRUE(
      fails_with(GgufBuilder().tensor_raw("t", {1ull << 63}, 0, {}).build(), "is not positive"));
}

TEST(GgufMalformed, ElementCountOverflow) {
  EXPECT_TRUE(fails_with(GgufBuilder().tensor_raw("t", {1ull << 32, 1ull << 32}, 0, {}).build(),
                         "element count [4294967296, 4294967296] overflows int64"));
  EXPECT_TRUE(fails_with(GgufBuilder().tensor_raw("t", {1ull << 62, 2, 2}, 0, {}).build(),
                         "overflows int64"));
}

TEST(GgufMalformed, ByteSizeOverflow) {
  // 2^62 F32 elements are a valid count but 2^64 bytes.
  EXPECT_TRUE(fails_with(GgufBuilder().tensor_raw("t", {1ull << 62}, 0, {}).build(),
                         "byte size of F32 [4611686018427387904] overflows"));
  EXPECT_TRUE(fails_with(GgufBuilder().tensor_raw("t", {1ull << 31, 1ull << 31}, 28, {}).build(),
                         "byte size of F64"));
}

TEST(GgufMalformed, UnknownTensorType) {
  EXPECT_TRUE(fails_with(GgufBuilder().tensor_raw("t", {32}, 99, {}).build(),
                         "tensor 't': unknown tensor type 99"));
  EXPECT_TRUE(fails_with(GgufBuilder().tensor_raw("t", {32}, 4, {}).build(),  // removed Q4_2
                         "unknown tensor type 4"));
}

TEST(GgufMalformed, RowNotAMultipleOfTheBlockSize) {
  EXPECT_TRUE(fails_with(GgufBuilder().tensor_raw("t", {33, 2}, 2, {}).build(),
                         "ne[0] = 33 is not a multiple of the Q4_0 block size 32"));
  EXPECT_TRUE(
      fails_with(GgufBuilder().tensor_raw("t", {128}, 14, {}).build(), "Q6_K block size 256"));
}

TEST(GgufMalformed, TensorDataOutOfBounds) {
  GgufBuilder::Layout at;
  auto img = small_model().build(&at);
  poke_u64(img, at.offset_at[2], at.offset[2] + 32);  // last tensor pushed past the end
  EXPECT_TRUE(fails_with(img, "tensor 'output_norm.weight' data is out of bounds"));
  poke_u64(img, at.offset_at[2], std::numeric_limits<uint64_t>::max() - 31);  // aligned, huge
  EXPECT_TRUE(fails_with(img, "out of bounds"));
}

TEST(GgufMalformed, TensorBiggerThanTheFile) {
  // The header is fine, the data section is missing entirely.
  auto img = GgufBuilder().tensor_raw("big", {1024, 1024}, 0, {}).build();
  EXPECT_TRUE(fails_with(img, "tensor 'big' data is out of bounds: 4194304 bytes"));
}

TEST(GgufMalformed, MisalignedTensorOffset) {
  GgufBuilder::Layout at;
  auto img = small_model().build(&at);
  poke_u64(img, at.offset_at[1], at.offset[1] + 4);
  EXPECT_TRUE(fails_with(img, "tensor 'blk.0.attn_q.weight': data offset 100 is misaligned"));
}

TEST(GgufMalformed, OverlappingTensors) {
  GgufBuilder::Layout at;
  auto img = small_model().build(&at);
  poke_u64(img, at.offset_at[1], at.offset[0]);  // attn_q starts where token_embd starts
  EXPECT_TRUE(fails_with(img, "overlap"));
  // token_embd spans 0..96; a tensor at 64 overlaps its tail.
  poke_u64(img, at.offset_at[1], 64);
  EXPECT_TRUE(
      fails_with(img, "tensors 'token_embd.weight' (bytes 0..96) and 'blk.0.attn_q.weight'"));
}

TEST(GgufMalformed, DuplicateMetadataKey) {
  const auto img = GgufBuilder().kv("a", B::u32(1)).kv("b", B::u32(2)).kv("a", B::u32(3)).build();
  EXPECT_TRUE(fails_with(img, "duplicate metadata key 'a'"));
}

TEST(GgufMalformed, DuplicateTensorName) {
  const auto img =
      GgufBuilder().tensor("w", {8}, GgmlType::F32).tensor("w", {8}, GgmlType::F32).build();
  EXPECT_TRUE(fails_with(img, "duplicate tensor name 'w'"));
}

TEST(GgufMalformed, EmptyKey) {
  EXPECT_TRUE(fails_with(GgufBuilder().kv("a", B::u8(1)).kv("", B::u8(1)).build(),
                         "metadata entry #1 has an empty key"));
}

TEST(GgufMalformed, EmptyTensorName) {
  EXPECT_TRUE(fails_with(GgufBuilder().tensor("", {8}, GgmlType::F32).build(),
                         "tensor #0 has an empty name"));
}

TEST(GgufMalformed, BadValueTypeIds) {
  EXPECT_TRUE(fails_with(GgufBuilder().kv("k", B::raw(13, {0, 0, 0, 0})).build(),
                         "bad value type id 13 for key 'k'"));
  EXPECT_TRUE(fails_with(GgufBuilder().kv("k", B::raw(0xffffffffu, {})).build(),
                         "bad value type id 4294967295"));
  EXPECT_TRUE(fails_with(GgufBuilder().kv("k", B::array_raw(13, 0, {})).build(),
                         "bad value type id 13 for array elements in key 'k'"));
  // Inside an array of arrays.
  EXPECT_TRUE(
      fails_with(GgufBuilder().kv("k", B::array(VT::ARRAY, {B::array_raw(42, 0, {})})).build(),
                 "bad value type id 42"));
}

TEST(GgufMalformed, BadBoolByte) {
  EXPECT_TRUE(fails_with(GgufBuilder().kv("flag", B::raw(7, {2})).build(), "bad bool value 2"));
  EXPECT_TRUE(
      fails_with(GgufBuilder().kv("flags", B::array_of<uint8_t>(VT::BOOL, {1, 0, 255})).build(),
                 "bad bool value 255"));
}

TEST(GgufMalformed, BadAlignment) {
  EXPECT_TRUE(fails_with(small_model().alignment(0).build(),
                         "general.alignment 0 is not a nonzero power of two"));
  EXPECT_TRUE(fails_with(small_model().alignment(48).build(), "general.alignment 48"));
  EXPECT_TRUE(fails_with(small_model().kv("general.alignment", B::u64(32)).build(),
                         "general.alignment must be UINT32, not UINT64"));
  EXPECT_TRUE(
      fails_with(small_model().kv("general.alignment", B::str("32")).build(), "must be UINT32"));
}

TEST(GgufMalformed, ArraysNestedTooDeep) {
  GgufEncoded v = B::array_of<int32_t>(VT::INT32, {42});
  for (int depth = 1; depth < 9; ++depth) v = B::array(VT::ARRAY, {v});
  EXPECT_TRUE(
      fails_with(GgufBuilder().kv("deep", v).build(), "key 'deep' nests arrays deeper than 8"));
  // Deep nesting claimed by a short file still ends in an error, not a stack overflow.
  std::vector<uint8_t> payload;
  for (int i = 0; i < 100000; ++i) {
    test::append_le<uint32_t>(payload, 9);
    test::append_le<uint64_t>(payload, 1);
  }
  EXPECT_TRUE(fails_with(GgufBuilder().kv("k", B::raw(9, payload)).build(), "deeper"));
}

TEST(GgufMalformed, EscapesHostileNamesInMessages) {
  const auto img = GgufBuilder().kv("a\nb", B::u8(1)).kv("a\nb", B::u8(1)).build();
  EXPECT_TRUE(fails_with(img, "duplicate metadata key 'a\\x0ab'"));
}

// ---------------------------------------------------------------------------------------------
// Typed getters

TEST(GgufGetters, NameTheKeyOnMismatch) {
  const auto img = GgufBuilder()
                       .kv("n", B::u32(7))
                       .kv("big", B::u64(std::numeric_limits<uint64_t>::max()))
                       .kv("s", B::str("text"))
                       .kv("b", B::boolean(true))
                       .kv("f", B::f32(0.25f))
                       .kv("fa", B::array_of<float>(VT::FLOAT32, {1.0f}))
                       .kv("ua", B::array_of<uint64_t>(VT::UINT64, {1, ~0ull}))
                       .kv("sa", B::strings({"x"}))
                       .build();
  const GgufFile f = parse(img);
  EXPECT_EQ(error_of([&] { f.get_string("n"); }), "img.gguf: key 'n' is UINT32, expected STRING");
  EXPECT_EQ(error_of([&] { f.get_string("missing"); }), "img.gguf: key 'missing' is missing");
  EXPECT_EQ(error_of([&] { f.get_int("s"); }), "img.gguf: key 's' is STRING, expected an integer");
  EXPECT_EQ(error_of([&] { f.get_int("f"); }), "img.gguf: key 'f' is FLOAT32, expected an integer");
  EXPECT_EQ(error_of([&] { f.get_int("b"); }), "img.gguf: key 'b' is BOOL, expected an integer");
  EXPECT_EQ(error_of([&] { f.get_int("big"); }),
            "img.gguf: key 'big' value 18446744073709551615 does not fit in int64");
  EXPECT_EQ(error_of([&] { f.get_int_or("big", 0); }),
            "img.gguf: key 'big' value 18446744073709551615 does not fit in int64");
  EXPECT_EQ(error_of([&] { f.get_int_in("n", 1, 4); }),
            "img.gguf: key 'n' value 7 is outside [1, 4]");
  EXPECT_EQ(f.get_int_in("n", 7, 7), 7);
  EXPECT_EQ(error_of([&] { f.get_float("s"); }), "img.gguf: key 's' is STRING, expected a number");
  EXPECT_EQ(error_of([&] { f.get_float_or("fa", 1.0); }),
            "img.gguf: key 'fa' is ARRAY of FLOAT32, expected a number");
  EXPECT_EQ(error_of([&] { f.get_bool_or("n", false); }),
            "img.gguf: key 'n' is UINT32, expected BOOL");
  EXPECT_EQ(error_of([&] { f.get_string_array("fa"); }),
            "img.gguf: key 'fa' is ARRAY of FLOAT32, expected ARRAY of STRING");
  EXPECT_EQ(error_of([&] { f.get_string_array("s"); }),
            "img.gguf: key 's' is STRING, expected ARRAY of STRING");
  EXPECT_EQ(error_of([&] { f.get_float_array("sa"); }),
            "img.gguf: key 'sa' is ARRAY of STRING, expected an ARRAY of numbers");
  EXPECT_EQ(error_of([&] { f.get_int_array("fa"); }),
            "img.gguf: key 'fa' is ARRAY of FLOAT32, expected an ARRAY of integers");
  EXPECT_EQ(error_of([&] { f.get_int_array("ua"); }),
            "img.gguf: key 'ua' value 18446744073709551615 does not fit in int64");
  EXPECT_EQ(error_of([&] { f.get_int_array("missing"); }), "img.gguf: key 'missing' is missing");
}

TEST(GgufGetters, ConvertAndFallBack) {
  const auto img =
      GgufBuilder().kv("n", B::i16(-3)).kv("f", B::f32(0.25f)).kv("s", B::str("v")).build();
  const GgufFile f = parse(img);
  EXPECT_EQ(f.get_float("n"), -3.0);  // integers are numbers
  EXPECT_EQ(f.get_float("f"), 0.25);
  EXPECT_EQ(f.get_int_or("absent", 11), 11);
  EXPECT_EQ(f.get_int_or("n", 11), -3);
  EXPECT_EQ(f.get_float_or("absent", 2.5), 2.5);
  EXPECT_EQ(f.get_string_or("absent", "fb"), "fb");
  EXPECT_EQ(f.get_string_or("s", "fb"), "v");
  EXPECT_TRUE(f.get_bool_or("absent", true));
  EXPECT_TRUE(f.has("s"));
  EXPECT_FALSE(f.has("absent"));
}

// ---------------------------------------------------------------------------------------------
// Files on disk

TEST(GgufOpen, MapsAFileAndReadsItsTensors) {
  const auto img = small_model().build();
  const TempFile tmp(img);
  const GgufFile f = GgufFile::open(tmp.path());
  EXPECT_EQ(f.path(), tmp.path());
  ASSERT_EQ(f.tensors().size(), 3u);
  for (const auto& t : f.tensors())
    EXPECT_EQ(std::memcmp(t.data, img.data() + f.data_offset() + t.offset, t.n_bytes), 0) << t.name;
}

TEST(GgufOpen, ErrorsNameThePath) {
  EXPECT_EQ(
      error_of([] { GgufFile::open("/nonexistent/x.gguf"); }).rfind("/nonexistent/x.gguf: ", 0),
      0u);
  const TempFile empty({});
  EXPECT_EQ(error_of([&] { GgufFile::open(empty.path()); }).rfind(empty.path() + ": truncated", 0),
            0u);
  auto img = small_model().build();
  img[3] = 'X';
  const TempFile bad(img);
  EXPECT_EQ(error_of([&] { GgufFile::open(bad.path()); }).rfind(bad.path() + ": bad magic", 0), 0u);
}
