#include "backend/cuda/stream_gemv.cuh"
#include "backend/cuda/stream_gemv_narrow.cuh"
#include "backend/cuda/stream_gemv_w4a16.cuh"
#include "backend/cuda/stream_gemv_w8a8.cuh"

#include <algorithm>
#include <map>
#include <utility>
#include <mutex>
#include <string>

#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/fp8_ops.h"
#include "backend/cuda/int4_ops.h"
#include "backend/cuda/stream_trace.h"

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
// captured with the larger one stays launchable). The limit is the current device's (pipeline
// stages run on several).
template <class Kernel>
void raise_smem_limit(Kernel kernel, size_t bytes) {
  static std::mutex mu;
  static std::map<std::pair<int, const void*>, size_t> limits;
  int dev = 0;
#if !defined(KESTREL_CUDA_EMULATE)
  KESTREL_CUDA_CHECK(cudaGetDevice(&dev));
#endif
  const std::lock_guard<std::mutex> lock(mu);
  size_t& have = limits[{dev, reinterpret_cast<const void*>(kernel)}];
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

// The narrow-weight kernels' layout: rows of row_bytes (a multiple of 512) in chunks of 512.
Layout narrow_layout(int64_t n_tokens, int64_t n_in, int64_t n_out, int64_t row_bytes, int blocks, int stages) {
  Layout l = layout(n_tokens, n_in, n_out, blocks, stages);
  l.smem = stream_gemv_narrow_smem_bytes(static_cast<int>(n_tokens), l.stages, l.k_lines, l.rows_per_block,
                                         static_cast<int>(row_bytes / kNarrowChunkBytes));
  return l;
}

bool narrow_supports(int64_t n_tokens, int64_t n_in, int64_t n_out, int64_t row_bytes, int blocks, int stages) {
  if (n_tokens < 1 || n_tokens > kStreamGemvMaxTokens || n_in <= 0 || n_in % kGemvLine != 0 ||
      n_in > kStreamGemvMaxIn || n_out <= 0 || n_out > 0x7fffffff || row_bytes % kNarrowChunkBytes != 0)
    return false;
  if (stages != 0 && stages != 4 && stages != 6) return false;
  const Layout l = narrow_layout(n_tokens, n_in, n_out, row_bytes, blocks, stages);
  return l.rows_per_block <= kStreamGemvMaxRowsPerBlock && l.smem <= device_shape().max_smem;
}

// The checks stream_gemv makes of the fused norm's operands.
void check_norm_operands(const char* op, const StreamGemvArgs& a) {
  if (a.norm_residual_in == nullptr) return;
  const std::string name(op);
  if (a.swiglu || a.f32_out) throw Error(name + ": the fused input norm is built for bf16 output only");
  if (a.norm_weight == nullptr || a.norm_residual_out == nullptr)
    throw Error(name + ": the fused input norm needs its weight and a residual output");
  if (a.norm_residual_out == a.norm_residual_in)
    throw Error(name + ": the fused input norm's residual output must not be its input");
  for (const void* p : {static_cast<const void*>(a.norm_residual_in), static_cast<const void*>(a.norm_add),
                        static_cast<const void*>(a.norm_weight), static_cast<const void*>(a.norm_residual_out)})
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) throw Error(name + ": norm operand not 16-byte aligned");
}

void launch_narrow(const StreamGemvArgs& a, const uint8_t* w, const void* scale, int meta_shift, bool scale_f16,
                   int64_t row_bytes, const Layout& l, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(l.blocks)), block(kGemvThreads);
  const int no = static_cast<int>(a.n_out), rb = static_cast<int>(row_bytes);
  auto* y = static_cast<__nv_bfloat16*>(a.y);
  auto by_input = [&]<int kM, int kStages>() {
    auto go = [&](auto* k) {
      raise_smem_limit(k, l.smem);
      KESTREL_LAUNCH(k, grid, block, l.smem, stream, a.x, a.x_stride, w, scale, meta_shift, scale_f16, y, no,
                     l.k_lines, rb, l.rows_per_block, a.norm_residual_in, a.norm_add, a.norm_weight,
                     a.norm_residual_out, a.norm_eps);
    };
    if (a.norm_residual_in != nullptr)
      go(&stream_gemv_narrow_kernel<kM, kStages, false, true>);
    else if (a.swiglu)
      go(&stream_gemv_narrow_kernel<kM, kStages, true, false>);
    else
      go(&stream_gemv_narrow_kernel<kM, kStages, false, false>);
  };
  auto by_stages = [&]<int kM>() {
    if (l.stages == 6)
      by_input.template operator()<kM, 6>();
    else
      by_input.template operator()<kM, 4>();
  };
  if (a.n_tokens == 1)
    by_stages.template operator()<1>();
  else
    by_stages.template operator()<2>();
  KESTREL_CUDA_CHECK_LAUNCH();
}

std::string narrow_shape(const StreamGemvArgs& a) {
  return "(n_tokens " + std::to_string(a.n_tokens) + ", n_in " + std::to_string(a.n_in) + ", n_out " +
         std::to_string(a.n_out) + ", blocks " + std::to_string(a.blocks) + ", stages " + std::to_string(a.stages) +
         ")";
}

}  // namespace

static_assert(kStreamGemvMaxIn == int64_t{kGemvMaxKLines} * kGemvLine, "x is loaded in at most kGemvMaxKLines lines");

StreamPrefetch stream_prefetch_of(const void* w, int64_t n_out, int64_t row_bytes, int64_t bytes) {
  StreamPrefetch p;
  if (w == nullptr || n_out <= 0 || row_bytes <= 0 || bytes <= 0) return p;
  const int64_t rows_per_block = ceil_div(n_out, std::min<int64_t>(device_shape().sms, n_out));
  p.base = w;
  p.block_stride = rows_per_block * row_bytes;
  p.total = n_out * row_bytes;
  p.bytes = std::min(bytes, p.block_stride);
  return p;
}

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
  check_norm_operands("stream_gemv", a);
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

namespace kestrel::cuda {

namespace {

Layout w8a8_layout(int64_t n_tokens, int64_t n_in, int64_t n_out, int blocks) {
  const int stages = n_tokens == 1 ? kW8a8Stages1 : kW8a8Stages2;
  Layout l = layout(n_tokens, n_in, n_out, blocks, stages);
  l.smem = stream_gemv_w8a8_smem_bytes(static_cast<int>(n_tokens), stages, l.k_lines, l.rows_per_block);
  return l;
}

}  // namespace

bool stream_gemv_w8a8_supports(int64_t n_tokens, int64_t n_in, int64_t n_out, int blocks) {
  if (n_tokens < 1 || n_tokens > kStreamGemvMaxTokens || n_in <= 0 || n_in % kGemvLine != 0 ||
      n_in > kStreamGemvMaxIn || n_out <= 0 || n_out > 0x7fffffff)
    return false;
  const Layout l = w8a8_layout(n_tokens, n_in, n_out, blocks);
  return l.rows_per_block <= kStreamGemvMaxRowsPerBlock && l.smem <= device_shape().max_smem;
}

void stream_gemv_w8a8(const StreamGemvFp8Args& a, cudaStream_t stream) {
  if (!stream_gemv_w8a8_supports(a.n_tokens, a.n_in, a.n_out, a.blocks))
    throw Error("stream_gemv_w8a8: unsupported shape " + narrow_shape(a));
  if (a.f32_out) throw Error("stream_gemv_w8a8: bf16 output only");
  if (a.w_scale == nullptr) throw Error("stream_gemv_w8a8: no weight scales");
  check_norm_operands("stream_gemv_w8a8", a);
  ProjectionOperands checked = a;
  checked.w = reinterpret_cast<const bf16*>(a.w8);
  check_gemv_operands("stream_gemv_w8a8", checked);
  const Layout l = w8a8_layout(a.n_tokens, a.n_in, a.n_out, a.blocks);
  const dim3 grid(static_cast<unsigned>(l.blocks)), block(kGemvThreads);
  auto* y = static_cast<__nv_bfloat16*>(a.y);
  auto by_input = [&]<int kM, int kStages>() {
    auto go = [&](auto* k) {
      raise_smem_limit(k, l.smem);
      KESTREL_LAUNCH(k, grid, block, l.smem, stream, a.x, a.x_stride, a.w8, a.w_scale, y, static_cast<int>(a.n_out),
                     l.k_lines, l.rows_per_block, a.norm_residual_in, a.norm_add, a.norm_weight, a.norm_residual_out,
                     a.norm_eps, a.next);
    };
    if (a.norm_residual_in != nullptr)
      go(&stream_gemv_w8a8_kernel<kM, kStages, false, true>);
    else if (a.swiglu)
      go(&stream_gemv_w8a8_kernel<kM, kStages, true, false>);
    else
      go(&stream_gemv_w8a8_kernel<kM, kStages, false, false>);
  };
  if (a.n_tokens == 1)
    by_input.template operator()<1, kW8a8Stages1>();
  else
    by_input.template operator()<2, kW8a8Stages2>();
  KESTREL_CUDA_CHECK_LAUNCH();
}

namespace {

Layout w4a16_layout(int64_t n_tokens, int64_t n_in, int64_t n_out, int blocks) {
  Layout l = layout(n_tokens, n_in, n_out, blocks, kW4a16Stages);
  l.smem = stream_gemv_w4a16_smem_bytes(static_cast<int>(n_tokens), kW4a16Stages, l.k_lines, l.rows_per_block);
  return l;
}

// Whether the INT4 matrix takes stream_gemv_w4a16_kernel (groups of 128, the default stages).
bool w4a16_supports(int64_t n_tokens, const Int4Matrix& w, int blocks, int stages) {
  if (stages != 0 || w.perm != nullptr || w.group_size != kW4a16TileCols || n_tokens < 1 ||
      n_tokens > kStreamGemvMaxTokens || w.n_in <= 0 || w.n_in % kGemvLine != 0 || w.n_in > kStreamGemvMaxIn ||
      w.n_out <= 0 || w.n_out > 0x7fffffff)
    return false;
  const Layout l = w4a16_layout(n_tokens, w.n_in, w.n_out, blocks);
  return l.rows_per_block <= kStreamGemvMaxRowsPerBlock && l.smem <= device_shape().max_smem;
}

}  // namespace

bool stream_gemv_int4_supports(int64_t n_tokens, const Int4Matrix& w, int blocks, int stages) {
  if (w4a16_supports(n_tokens, w, blocks, stages)) return true;
  const int64_t g = w.group_size;
  if (w.perm != nullptr || g < 128 || (g & (g - 1)) != 0 || w.n_in % g != 0) return false;
  return narrow_supports(n_tokens, w.n_in, w.n_out, w.n_in / 2, blocks, stages);
}

void stream_gemv_int4(const StreamGemvInt4Args& a, cudaStream_t stream) {
  const Int4Matrix& w = a.w4;
  if (w.n_in != a.n_in || w.n_out != a.n_out) throw Error("stream_gemv_int4: the matrix's shape is not the operands'");
  if (!stream_gemv_int4_supports(a.n_tokens, w, a.blocks, a.stages))
    throw Error("stream_gemv_int4: unsupported shape " + narrow_shape(a) + " or group size " +
                std::to_string(w.group_size) + (w.perm != nullptr ? " with act order" : ""));
  if (a.f32_out) throw Error("stream_gemv_int4: bf16 output only");
  if (w.codes == nullptr || w.meta == nullptr) throw Error("stream_gemv_int4: no codes or meta words");
  check_norm_operands("stream_gemv_int4", a);
  ProjectionOperands checked = a;
  checked.w = reinterpret_cast<const bf16*>(w.codes);
  check_gemv_operands("stream_gemv_int4", checked);
  if (w4a16_supports(a.n_tokens, w, a.blocks, a.stages)) {
    const Layout l = w4a16_layout(a.n_tokens, a.n_in, a.n_out, a.blocks);
    const dim3 grid(static_cast<unsigned>(l.blocks)), block(kGemvThreads);
    auto* y = static_cast<__nv_bfloat16*>(a.y);
    auto by_input = [&]<int kM>() {
      auto go = [&](auto* k) {
        raise_smem_limit(k, l.smem);
        KESTREL_LAUNCH(k, grid, block, l.smem, stream, a.x, a.x_stride, reinterpret_cast<const uint8_t*>(w.codes),
                       w.meta, w.scale_f16, y, static_cast<int>(a.n_out), l.k_lines, l.rows_per_block,
                       a.norm_residual_in, a.norm_add, a.norm_weight, a.norm_residual_out, a.norm_eps, a.next);
      };
      if (a.norm_residual_in != nullptr)
        go(&stream_gemv_w4a16_kernel<kM, kW4a16Stages, false, true>);
      else if (a.swiglu)
        go(&stream_gemv_w4a16_kernel<kM, kW4a16Stages, true, false>);
      else
        go(&stream_gemv_w4a16_kernel<kM, kW4a16Stages, false, false>);
    };
    if (a.n_tokens == 1)
      by_input.template operator()<1>();
    else
      by_input.template operator()<2>();
    KESTREL_CUDA_CHECK_LAUNCH();
    return;
  }
  int shift = 0;
  while ((int64_t{1} << (shift + 1)) < w.group_size) ++shift;  // log2(G / 2)
  const Layout l = narrow_layout(a.n_tokens, a.n_in, a.n_out, a.n_in / 2, a.blocks, a.stages);
  launch_narrow(a, reinterpret_cast<const uint8_t*>(w.codes), w.meta, shift, w.scale_f16,
                                    a.n_in / 2, l, stream);
}

#if defined(KESTREL_STREAM_TRACE) && !defined(KESTREL_CUDA_EMULATE)
bool stream_trace_enabled() { return true; }
std::vector<StreamTraceRecord> stream_trace_take() {
  KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
  unsigned int n = 0;
  KESTREL_CUDA_CHECK(cudaMemcpyFromSymbol(&n, g_stream_trace_count, sizeof n));
  n = std::min(n, kStreamTraceMax);
  std::vector<StreamTraceRecord> records(n);
  if (n > 0)
    KESTREL_CUDA_CHECK(cudaMemcpyFromSymbol(records.data(), g_stream_trace, n * sizeof(StreamTraceRecord)));
  const unsigned int zero = 0;
  KESTREL_CUDA_CHECK(cudaMemcpyToSymbol(g_stream_trace_count, &zero, sizeof zero));
  return records;
}
#else
bool stream_trace_enabled() { return false; }
std::vector<StreamTraceRecord> stream_trace_take() { return {}; }
#endif

}  // namespace kestrel::cuda
