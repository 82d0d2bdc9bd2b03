// libFuzzer target for the GGUF reader: every input must either parse or throw kestrel::Error;
// a crash, a sanitizer report, an escaped exception of another type, or an allocation beyond
// -malloc_limit_mb is a bug.
//
//   cmake --preset fuzz && cmake --build build-fuzz -j2 --target fuzz_gguf
//   mkdir -p /tmp/gguf-corpus && cp ../shared/data/stories260K/stories260K.gguf /tmp/gguf-corpus/
//   ./build-fuzz/tests/fuzz/fuzz_gguf -max_len=20000 -malloc_limit_mb=256 -max_total_time=60 \
//       /tmp/gguf-corpus
//
// (A seed cut to -max_len is a truncated file, which still explores the header paths.)
#include <cstddef>
#include <cstdint>

#include "core/error.h"
#include "io/gguf.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const auto f = kestrel::GgufFile::parse(data, size, "fuzz");
    // Read what the parser handed out, so ASan checks every pointer and size it produced.
    volatile uint64_t sink = 0;
    for (const auto& t : f.tensors()) sink = sink + t.data[0] + t.data[t.n_bytes - 1] + t.n_rows();
    for (const auto& kv : f.metadata()) sink = sink + kv.second.array_size() + kv.first.size();
    (void)sink;
  } catch (const kestrel::Error&) {
    // Expected for malformed input.
  }
  return 0;
}
