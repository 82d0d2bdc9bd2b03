// Run-time detection of the x86 SIMD extensions the kernels can use. Kernels are compiled per ISA
// in *_avx2.cpp / *_avx512.cpp files and chosen here, never with -march=native.
#pragma once

#include <optional>
#include <string>
#include <string_view>

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

// Detected once.
const CpuFeatures& cpu_features();
std::string cpu_features_string();

enum class SimdLevel { Scalar = 0, Avx2 = 1, Avx512 = 2 };
// The best level the CPU supports (detected once).
SimdLevel detected_simd_level();
// The level the kernels use: the detected one, capped by set_simd_level_cap (the CLI's --cpu-isa,
// for measuring each path on one machine). Set the cap before the first forward pass: the kernel
// tables are chosen per call, so changing it mid-run mixes paths.
SimdLevel simd_level();
void set_simd_level_cap(SimdLevel cap);
const char* simd_level_name(SimdLevel level);
// "scalar", "avx2", "avx512"; std::nullopt for anything else.
std::optional<SimdLevel> parse_simd_level(std::string_view name);

}  // namespace kestrel
