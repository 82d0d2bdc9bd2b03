#include "backend/cuda/stream_gemv.cuh"

#include <algorithm>
#include <map>
#include <mutex>
#include <string>

#include "backend/cuda/cuda_ops.h"

namespace kestrel::cuda {

namespace {

// The device's SM count and opt-in shared memory per block, asked once (the emulation: 4 SMs and
// the H200's 227 KB).
struct DeviceShape {
  int sms = 4;
  size_t max_smem = 232448;
};
const DeviceShape& device_shape() {
  static const DeviceShape shape = [] {
    DeviceShape s;
#if !defined(KESTREL_CUDA_EMULATE)
    int dev = 0, v = 0;
    KESTREL_CUDA_CHECK(cudaGetDevice(&dev));
    KESTREL_CUDA_CHECK(cudaDeviceGetAttribute(&s.sms, cudaDevAttrMultiProcessorCount, dev));
    KESTREL_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    s.max_smem = static_cast<size_t>(v);
#endif
    return s;
  }();
  return shape;
}

// Raises a kernel's dynamic shared-memory limit to `bytes` if it is below (one instantiation
// serves several shapes: a smaller shape's launch never lowers what a larger one set, so a graph
// captured with the larger one stays launchable).
template <class Kernel>
void raise_smem_limit(Kernel kernel, size_t bytes) {
  static std::mutex mu;
  static std::map<const void*, size_t> limits;
  const std::lock_guard<std::mutex> lock(mu);
  size_t& have = limits[reinterpret_cast<const void*>(kernel)];
  if (bytes <= have) return;
  set_max_dynamic_smem(kernel, bytes);
  have = bytes;
}

struct Layout {
  int blocks = 0, rows_per_block = 0, k_lines = 0, stages = 0;
  size_t smem = 0;
};

Layout layout(int64_t n_tokens, int64_t n_in, int64_t n_out, int blocks, int stages) {
  Layout l;
  l.stages = stages == 0 ? kStreamGemvDefaultStages : stages;
  const int64_t want = blocks > 0 ? blocks : device_shape().sms;
  l.rows_per_block = static_cast<int>(ceil_div(n_out, std::max<int64_t>(1, std::min(want, n_out))));
  l.blocks = static_cast<int>(ceil_div(n_out, l.rows_per_block));
  l.k_lines = static_cast<int>(n_in / kGemvLine);
  l.smem = stream_gemv_smem_bytes(static_cast<int>(n_tokens), l.stages, l.k_lines, l.rows_per_block);
  return l;
}

template <int kM, int kStages>
void launch(const StreamGemvArgs& a, const Layout& l, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(l.blocks)), block(kGemvThreads);
  const int no = static_cast<int>(a.n_out);
  auto go = [&](auto* k) {
    raise_smem_limit(k, l.smem);
    KESTREL_LAUNCH(k, grid, block, l.smem, stream, a.x, a.x_stride, a.w, a.y, no, l.k_lines, l.rows_per_block,
                   a.norm_residual_in, a.norm_add, a.norm_weight, a.norm_residual_out, a.norm_eps);
  };
  if (a.norm_residual_in != nullptr)
    go(&stream_gemv_kernel<kM, kStages, false, false, true>);
  else if (a.swiglu)
    go(&stream_gemv_kernel<kM, kStages, true, false, false>);
  else if (a.f32_out)
    go(&stream_gemv_kernel<kM, kStages, false, true, false>);
  else
    go(&stream_gemv_kernel<kM, kStages, false, false, false>);
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace

static_assert(kStreamGemvMaxIn == int64_t{kGemvMaxKLines} * kGemvLine, "x is loaded in at most kGemvMaxKLines lines");

bool stream_gemv_supports(int64_t n_tokens, int64_t n_in, int64_t n_out, int blocks, int stages) {
  if (n_tokens < 1 || n_tokens > kStreamGemvMaxTokens || n_in <= 0 || n_in % kGemvLine != 0 ||
      n_in > kStreamGemvMaxIn || n_out <= 0 || n_out > 0x7fffffff)
    return false;
  if (stages != 0 && stages != 3 && stages != 4 && stages != 6) return false;
  const Layout l = layout(n_tokens, n_in, n_out, blocks, stages);
  return l.rows_per_block <= kStreamGemvMaxRowsPerBlock && l.smem <= device_shape().max_smem;
}

void stream_gemv(const StreamGemvArgs& a, cudaStream_t stream) {
  if (!stream_gemv_supports(a.n_tokens, a.n_in, a.n_out, a.blocks, a.stages))
    throw Error("stream_gemv: unsupported shape (n_tokens " + std::to_string(a.n_tokens) + ", n_in " +
                std::to_string(a.n_in) + ", n_out " + std::to_string(a.n_out) + ", blocks " +
                std::to_string(a.blocks) + ", stages " + std::to_string(a.stages) + ")");
  if (a.norm_residual_in != nullptr) {
    if (a.swiglu || a.f32_out) throw Error("stream_gemv: the fused input norm is built for bf16 output only");
    if (a.norm_weight == nullptr || a.norm_residual_out == nullptr)
      throw Error("stream_gemv: the fused input norm needs its weight and a residual output");
    if (a.norm_residual_out == a.norm_residual_in)
      throw Error("stream_gemv: the fused input norm's residual output must not be its input");
    for (const void* p : {static_cast<const void*>(a.norm_residual_in), static_cast<const void*>(a.norm_add),
                          static_cast<const void*>(a.norm_weight), static_cast<const void*>(a.norm_residual_out)})
      if (reinterpret_cast<uintptr_t>(p) % 16 != 0) throw Error("stream_gemv: norm operand not 16-byte aligned");
  }
  check_gemv_operands("stream_gemv", a);  // w (and x, unread in the fused mode) aligned, x_stride
  const Layout l = layout(a.n_tokens, a.n_in, a.n_out, a.blocks, a.stages);
  auto by_stages = [&]<int kM>() {
    if (l.stages == 3)
      launch<kM, 3>(a, l, stream);
    else if (l.stages == 6)
      launch<kM, 6>(a, l, stream);
    else
      launch<kM, 4>(a, l, stream);
  };
  if (a.n_tokens == 1)
    by_stages.template operator()<1>();
  else
    by_stages.template operator()<2>();
}

}  // namespace kestrel::cuda
