// Options of kestrel_microbench parsed in bench_main.cpp.
#pragma once

namespace kestrel::bench {
// --threads=N: threads of the kernels' pool; 0 = all cores.
extern int g_threads;
}  // namespace kestrel::bench
