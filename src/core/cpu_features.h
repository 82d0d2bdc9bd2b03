// Run-time detection of the x86 SIMD extensions the kernels can use. Kernels are compiled per ISA
// in *_avx2.cpp / *_avx512.cpp files and chosen here, never with -march=native.
#pragma once

#include <string>

namespace kestrel {

struct CpuFeatures {
  bool avx2 = false;
  bool fma = false;
  bool f16c = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512vnni = false;
  bool avx_vnni = false;
};

// Detected once; the KESTREL_SIMD environment variable ("scalar", "avx2", "avx512") caps the level
// so tests can exercise every path on one machine.
const CpuFeatures& cpu_features();
std::string cpu_features_string();

enum class SimdLevel { Scalar = 0, Avx2 = 1, Avx512 = 2 };
SimdLevel simd_level();
const char* simd_level_name(SimdLevel level);

}  // namespace kestrel
