// A per-block timeline of the streaming GEMVs (W8A8 and W4A16), for a diagnostic build only
// (cmake -DKESTREL_STREAM_TRACE=ON: stream_gemv.cu alone gets KESTREL_STREAM_TRACE). Thread 0 of
// each block reads %globaltimer (ns, one clock for the whole GPU) and clock64 (its SM's cycles) at
// six points: entry, after griddepcontrol.wait, input formed, first slab landed, last slab's
// products done, exit; at exit it appends the record to a device buffer that stream_trace_take()
// (stream_trace.h) copies out. Without the macro every mark is empty and nothing is recorded.
#pragma once

#include "backend/cuda/device_common.cuh"
#include "backend/cuda/stream_trace.h"

namespace kestrel::cuda {

#if defined(KESTREL_STREAM_TRACE) && !defined(KESTREL_CUDA_EMULATE)
__device__ StreamTraceRecord g_stream_trace[kStreamTraceMax];
__device__ unsigned int g_stream_trace_count;

struct StreamTraceMarks {
  unsigned long long ns[kStreamTracePoints];
  long long cycles[kStreamTracePoints];
  __device__ __forceinline__ void mark(int i) {
    if (threadIdx.x != 0) return;
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    ns[i] = t;
    cycles[i] = clock64();
  }
  __device__ __forceinline__ void finish(int n_out, int k_lines) {
    mark(kStreamTracePoints - 1);
    if (threadIdx.x != 0) return;
    const unsigned int slot = atomicAdd(&g_stream_trace_count, 1u);
    if (slot >= kStreamTraceMax) return;
    StreamTraceRecord& r = g_stream_trace[slot];
    for (int i = 0; i < kStreamTracePoints; ++i) r.ns[i] = ns[i], r.cycles[i] = cycles[i];
    unsigned int sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    r.block = static_cast<int>(blockIdx.x), r.sm = static_cast<int>(sm), r.n_out = n_out, r.k_lines = k_lines;
  }
};
#else
struct StreamTraceMarks {
  __device__ __forceinline__ void mark(int) {}
  __device__ __forceinline__ void finish(int, int) {}
};
#endif

}  // namespace kestrel::cuda
