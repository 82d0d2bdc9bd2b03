// Kernel timeline of any CUDA program, for machines without Nsight Systems: a CUDA injection
// library (loaded by the driver at cuInit when CUDA_INJECTION64_PATH names it, as the Nsight tools
// load theirs) that enables CUPTI's activity records for kernels and, at exit, writes one CSV row
// per kernel execution: "Start (ns)","Duration (ns)","Name" (GPU timestamps in ns, the demangled
// kernel name), the columns of `nsys stats --report cuda_gpu_trace --format csv` that
// scripts/device/kernel_trace.py reads. Kernels launched from CUDA graphs get one row per node.
// Besides, api_trace.csv holds the host's CUDA runtime calls ("API cudaStreamSynchronize", host
// timestamps on the same clock) and the memory copies ("MEMCPY HtoD 65536": direction and bytes,
// GPU timestamps), in the same columns: what the host does between two passes.
// Output: both files in the working directory (an injected library has no command line). Built
// with KERNEL_TRACE_KERNELS=0 (the kestrel_api_trace library) it records the runtime calls and
// copies alone, since kernel records make each graph launch take far longer.
// Source: CUPTI activity API and the injection entry point, CUPTI documentation (CUDA 13).
#include <cupti.h>
#include <cxxabi.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#ifndef KERNEL_TRACE_KERNELS
#define KERNEL_TRACE_KERNELS 1
#endif

namespace {

constexpr size_t kBufferBytes = size_t{8} << 20;

struct Row {
  uint64_t start, end;
  uint32_t name;  // index into names
};

std::mutex mu;
std::vector<Row> rows;
std::vector<Row> api_rows;  // runtime calls and memory copies
std::vector<std::string> names;
std::unordered_map<std::string, uint32_t> name_index;

std::string demangle(const char* mangled) {
  int status = 0;
  char* d = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  std::string out = status == 0 && d != nullptr ? std::string("void ") + d : std::string(mangled);
  std::free(d);
  return out;
}

// The index of a row name (kernel names demangled); called with mu held.
uint32_t intern(const std::string& raw, bool mangled) {
  auto it = name_index.find(raw);
  if (it == name_index.end()) {
    it = name_index.emplace(raw, static_cast<uint32_t>(names.size())).first;
    names.push_back(mangled ? demangle(raw.c_str()) : raw);
  }
  return it->second;
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = *buffer != nullptr ? kBufferBytes : 0;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* rec = nullptr;
  std::lock_guard<std::mutex> lock(mu);
  while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
    if (rec->kind == CUPTI_ACTIVITY_KIND_RUNTIME) {
      const auto* a = reinterpret_cast<const CUpti_ActivityAPI*>(rec);
      const char* cb = nullptr;
      if (cuptiGetCallbackName(CUPTI_CB_DOMAIN_RUNTIME_API, a->cbid, &cb) != CUPTI_SUCCESS || cb == nullptr) cb = "?";
      api_rows.push_back({a->start, a->end, intern(std::string("API ") + cb, false)});
      continue;
    }
    if (rec->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(rec);
      const char* dir = m->copyKind == CUPTI_ACTIVITY_MEMCPY_KIND_HTOD   ? "HtoD"
                        : m->copyKind == CUPTI_ACTIVITY_MEMCPY_KIND_DTOH ? "DtoH"
                        : m->copyKind == CUPTI_ACTIVITY_MEMCPY_KIND_DTOD ? "DtoD"
                                                                          : "other";
      api_rows.push_back({m->start, m->end, intern(std::string("MEMCPY ") + dir + " " + std::to_string(m->bytes), false)});
      continue;
    }
    if (rec->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL && rec->kind != CUPTI_ACTIVITY_KIND_KERNEL) continue;
    const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
    rows.push_back({k->start, k->end, intern(k->name != nullptr ? k->name : "?", true)});
  }
  std::free(buffer);
}

// One CSV of rows; called with mu held.
void write_csv(const char* path, const std::vector<Row>& out, const char* what) {
  FILE* f = std::fopen(path, "w");
  if (f == nullptr) {
    std::fprintf(stderr, "kernel_trace: cannot write %s\n", path);
    return;
  }
  std::fprintf(f, "\"Start (ns)\",\"Duration (ns)\",\"Name\"\n");
  for (const Row& r : out) {
    std::string name;
    for (char c : names[r.name]) name += c == '"' ? std::string("\"\"") : std::string(1, c);
    std::fprintf(f, "%llu,%llu,\"%s\"\n", static_cast<unsigned long long>(r.start),
                 static_cast<unsigned long long>(r.end - r.start), name.c_str());
  }
  std::fclose(f);
  std::fprintf(stderr, "kernel_trace: %zu %s written to %s\n", out.size(), what, path);
}

void write_trace() {
  cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  std::lock_guard<std::mutex> lock(mu);
  write_csv("kernel_trace.csv", rows, "kernels");
  write_csv("api_trace.csv", api_rows, "runtime calls and copies");
}

}  // namespace

// Called by the CUDA driver once, at cuInit, when CUDA_INJECTION64_PATH names this library.
extern "C" int InitializeInjection(void) {
  constexpr bool kernels = KERNEL_TRACE_KERNELS != 0;
  if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS ||
      (kernels && cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS) ||
      cuptiActivityEnable(CUPTI_ACTIVITY_KIND_RUNTIME) != CUPTI_SUCCESS ||
      cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY) != CUPTI_SUCCESS) {
    std::fprintf(stderr, "kernel_trace: CUPTI activity tracing could not be enabled\n");
    return 0;
  }
  std::atexit(write_trace);
  return 1;
}
