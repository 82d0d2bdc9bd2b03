// The records of the streaming GEMVs' per-block timeline (stream_trace.cuh; a diagnostic build
// with -DKESTREL_STREAM_TRACE=ON), host side.
#pragma once

#include <cstdint>
#include <vector>

namespace kestrel::cuda {

// The points of a block's timeline: entry, after griddepcontrol.wait, input formed, first slab
// landed, last slab's products done, exit.
constexpr int kStreamTracePoints = 6;
constexpr unsigned int kStreamTraceMax = 1u << 16;  // records kept between two takes

struct StreamTraceRecord {
  unsigned long long ns[kStreamTracePoints];  // %globaltimer, ns
  long long cycles[kStreamTracePoints];       // clock64 of the block's SM
  int block, sm, n_out, k_lines;
};

// True in a build with the timeline.
bool stream_trace_enabled();
// The records since the last take (in completion order), and an empty buffer after; empty
// without the timeline. Synchronizes the device.
std::vector<StreamTraceRecord> stream_trace_take();

}  // namespace kestrel::cuda
