#include "core/cpu_features.h"

#include <algorithm>
#include <atomic>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

namespace kestrel {
namespace {

CpuFeatures detect() {
  CpuFeatures f;
#if defined(__x86_64__)
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = c & (1u << 27);
  f.fma = c & (1u << 12);
  f.f16c = c & (1u << 29);
  bool ymm_ok = false, zmm_ok = false;
  if (osxsave) {
    unsigned xlo, xhi;
    __asm__("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
    ymm_ok = (xlo & 0x6u) == 0x6u;
    zmm_ok = (xlo & 0xe6u) == 0xe6u;
  }
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
    f.avx2 = ymm_ok && (b & (1u << 5));
    f.avx512f = zmm_ok && (b & (1u << 16));
    f.avx512bw = zmm_ok && (b & (1u << 30));
    f.avx512vl = zmm_ok && (b & (1u << 31));
    f.avx512vnni = zmm_ok && (c & (1u << 11));
  }
  if (__get_cpuid_count(7, 1, &a, &b, &c, &d)) f.avx_vnni = ymm_ok && (a & (1u << 4));
  if (!ymm_ok) f.fma = f.f16c = false;
#endif
  return f;
}

SimdLevel detect_level() {
  const auto& f = cpu_features();
  SimdLevel level = SimdLevel::Scalar;
  if (f.avx2 && f.fma && f.f16c) level = SimdLevel::Avx2;
  if (level == SimdLevel::Avx2 && f.avx512f && f.avx512bw && f.avx512vl && f.avx512vnni)
    level = SimdLevel::Avx512;
  return level;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = detect();
  return f;
}

namespace {
std::atomic<int> g_simd_cap{static_cast<int>(SimdLevel::Avx512)};
}  // namespace

SimdLevel detected_simd_level() {
  static const SimdLevel level = detect_level();
  return level;
}

SimdLevel simd_level() {
  return std::min(detected_simd_level(), static_cast<SimdLevel>(g_simd_cap.load(std::memory_order_relaxed)));
}

void set_simd_level_cap(SimdLevel cap) { g_simd_cap.store(static_cast<int>(cap), std::memory_order_relaxed); }

std::optional<SimdLevel> parse_simd_level(std::string_view name) {
  if (name == "scalar") return SimdLevel::Scalar;
  if (name == "avx2") return SimdLevel::Avx2;
  if (name == "avx512") return SimdLevel::Avx512;
  return std::nullopt;
}

const char* simd_level_name(SimdLevel level) {
  switch (level) {
    case SimdLevel::Avx512: return "avx512";
    case SimdLevel::Avx2: return "avx2";
    default: return "scalar";
  }
}

std::string cpu_features_string() {
  const auto& f = cpu_features();
  std::string s;
  auto add = [&](bool on, const char* name) {
    if (!on) return;
    if (!s.empty()) s += ' ';
    s += name;
  };
  add(f.avx2, "avx2");
  add(f.fma, "fma");
  add(f.f16c, "f16c");
  add(f.avx512f, "avx512f");
  add(f.avx512bw, "avx512bw");
  add(f.avx512vl, "avx512vl");
  add(f.avx512vnni, "avx512vnni");
  add(f.avx_vnni, "avx_vnni");
  return s;
}

}  // namespace kestrel
