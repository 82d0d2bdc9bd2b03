#include "memory/kv_dtype.h"

#include <cctype>
#include <string>

#include "core/error.h"

namespace kestrel {

std::string_view kv_dtype_name(KvDtype t) {
  switch (t) {
    case KvDtype::F32: return "f32";
    case KvDtype::F16: return "f16";
    case KvDtype::BF16: return "bf16";
    case KvDtype::FP8: return "fp8";
    case KvDtype::INT8: return "int8";
  }
  return "?";
}

int64_t kv_dtype_bytes(KvDtype t) {
  switch (t) {
    case KvDtype::F32: return 4;
    case KvDtype::F16:
    case KvDtype::BF16: return 2;
    case KvDtype::FP8:
    case KvDtype::INT8: return 1;
  }
  return 0;
}

bool kv_dtype_is_quantized(KvDtype t) { return t == KvDtype::FP8 || t == KvDtype::INT8; }

int64_t kv_scale_bytes(KvDtype t) { return kv_dtype_is_quantized(t) ? 4 : 0; }

KvDtype parse_kv_dtype(std::string_view text, std::string_view what) {
  std::string s(text);
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (s == "f32" || s == "fp32" || s == "float32") return KvDtype::F32;
  if (s == "f16" || s == "fp16" || s == "float16") return KvDtype::F16;
  if (s == "bf16" || s == "bfloat16") return KvDtype::BF16;
  if (s == "fp8" || s == "f8" || s == "float8") return KvDtype::FP8;
  if (s == "int8" || s == "i8" || s == "q8") return KvDtype::INT8;
  throw Error(std::string(what) + ": unknown KV dtype '" + std::string(text) +
              "' (choose f16, bf16, fp8, int8 or f32)");
}

}  // namespace kestrel
