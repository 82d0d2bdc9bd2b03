// kestrel_microbench's entry point: Google Benchmark's flags plus two of kestrel's own, taken out
// of argv before benchmark::Initialize sees it:
//   --threads=N      CPU threads of the kernels' pool (default 0: all cores)
//   --cpu-isa=LEVEL  cap the SIMD path: scalar, avx2 or avx512 (default: what the CPU has)
#include <benchmark/benchmark.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "bench_options.h"
#include "core/cpu_features.h"

namespace kestrel::bench {
int g_threads = 0;
}

int main(int argc, char** argv) {
  std::vector<char*> rest;
  for (int i = 0; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (i > 0 && a.starts_with("--threads=")) {
      char* end = nullptr;
      const long v = std::strtol(argv[i] + 10, &end, 10);
      if (end == argv[i] + 10 || *end != '\0' || v < 0 || v > 4096) {
        std::fprintf(stderr, "kestrel_microbench: --threads wants an integer in [0, 4096], got '%s'\n", argv[i] + 10);
        return 2;
      }
      kestrel::bench::g_threads = static_cast<int>(v);
    } else if (i > 0 && a.starts_with("--cpu-isa=")) {
      const auto level = kestrel::parse_simd_level(a.substr(10));
      if (!level) {
        std::fprintf(stderr, "kestrel_microbench: --cpu-isa wants scalar, avx2 or avx512, got '%s'\n", argv[i] + 10);
        return 2;
      }
      kestrel::set_simd_level_cap(*level);
    } else {
      rest.push_back(argv[i]);
    }
  }
  int n = static_cast<int>(rest.size());
  benchmark::Initialize(&n, rest.data());
  if (benchmark::ReportUnrecognizedArguments(n, rest.data())) return 2;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
