// Element types of the KV cache, shared by the planner and the cache itself.
#pragma once

#include <cstdint>
#include <string_view>

namespace kestrel {

// Element type the KV cache is stored in (not the weights' type). The CPU cache stores f32 and
// f16; the planner knows them all.
enum class KvDtype { F32, F16, BF16, FP8, INT8 };

std::string_view kv_dtype_name(KvDtype t);  // "f32", "f16", "bf16", "fp8", "int8"
int64_t kv_dtype_bytes(KvDtype t);          // 4, 2, 2, 1, 1
// Quantized KV (fp8, int8) stores each cached row (one token's K or V of one KV head; MLA: one
// token's latent, and its RoPE key) with its own f32 scale, value = code x scale with
// scale = amax(row) / max code (448 for e4m3, 127 for int8): rows are written once, token by token,
// so a scale fixed per row never needs rewriting. 4 for fp8 and int8, 0 for float types.
int64_t kv_scale_bytes(KvDtype t);
bool kv_dtype_is_quantized(KvDtype t);  // fp8, int8
// "f16" (or "fp16", "float16"), "bf16", "fp8", "int8", "f32"; case-insensitive. Throws
// kestrel::Error("<what>: ...") naming the text and the accepted names otherwise.
KvDtype parse_kv_dtype(std::string_view text, std::string_view what);

}  // namespace kestrel
