// libFuzzer target for the safetensors reader: every input must either parse or throw
// kestrel::Error; a crash, a sanitizer report, an escaped exception of another type, or an
// allocation beyond -malloc_limit_mb is a bug.
//
//   cmake --preset fuzz && cmake --build build-fuzz -j2 --target fuzz_safetensors
//   mkdir -p /tmp/st-corpus && cp build/hf/stories260K_f32/model.safetensors /tmp/st-corpus/
//   ./build-fuzz/tests/fuzz/fuzz_safetensors -max_len=4096 -malloc_limit_mb=256 -max_total_time=60 \
//       /tmp/st-corpus
//
// (build/hf/... is written by the ctest reference_hf_stories260K_f32; a seed cut to -max_len is a
// truncated file, which still explores the header paths.)
#include <cstddef>
#include <cstdint>

#include "core/error.h"
#include "io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const auto f = kestrel::SafetensorsFile::parse(data, size, "fuzz");
    // Read what the parser handed out, so ASan checks every pointer and size it produced.
    volatile uint64_t sink = 0;
    for (const auto& t : f.tensors())
      if (t.n_bytes() > 0) sink = sink + t.data[0] + t.data[t.n_bytes() - 1] + t.shape.size();
    for (const auto& [key, value] : f.metadata()) sink = sink + key.size() + value.size();
    (void)sink;
  } catch (const kestrel::Error&) {
    // Expected for malformed input.
  }
  return 0;
}
