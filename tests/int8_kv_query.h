// The query row attention over an INT8 KV cache works with (cpu::quantize_query_q16, ops.h):
// Q x dq in float64, for float64 references of the kernels.
#pragma once

#include <cstdint>
#include <vector>

#include "backend/cpu/ops.h"

namespace kestrel::test {

inline std::vector<double> int8_kv_query(const float* q, int64_t n) {
  std::vector<int8_t> q1(static_cast<size_t>(n)), q2(static_cast<size_t>(n));
  const double dq = cpu::quantize_query_q16(q, n, q1.data(), q2.data());
  std::vector<double> out(static_cast<size_t>(n));
  for (size_t i = 0; i < out.size(); ++i) out[i] = (255.0 * q1[i] + q2[i]) * dq;
  return out;
}

}  // namespace kestrel::test
