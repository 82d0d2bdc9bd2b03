// The FP8 (W8A8) and INT4 (W4A16) streaming GEMVs' per-block timeline (stream_trace.cuh) over 16
// decoder layers of the Llama-3.1-8B shape at one token, the projections in model order with
// their fused inputs (qkv and gate|up with the residual add + RMSNorm, down with SwiGLU), each
// prefetching the head of the next one's weights (64 KiB a block, as docs/performance.md's
// timelines were taken; the runner's default is 32), captured
// in one CUDA graph as the model's decode step is (attention left out: o reads a fixed input).
// Needs a build with -DKESTREL_STREAM_TRACE=ON; otherwise it says so and returns.
//
// Printed per projection, the means over layers 1..15 of each launch's figures, in us from the
// previous launch's last exit (so negative: before it): the blocks' entries (first and median),
// then the median block's return from griddepcontrol.wait, input formed, first slab landed, last
// slab's products done, and exit; then the 10th and 90th percentile and the last exit (the last
// is the launch's advance), with the rate of the weight bytes over the advance.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "backend/cuda/fp8_ops.h"
#include "backend/cuda/int4_ops.h"
#include "backend/cuda/stream_trace.h"
#include "bench_util.h"

namespace kestrel::bench {

namespace {

struct Proj {
  const char* name;
  int64_t in, out;
};
constexpr Proj kProjs[4] = {{"qkv", 4096, 6144}, {"o", 4096, 4096}, {"gate_up", 4096, 28672}, {"down", 14336, 4096}};
constexpr int kLayers = 16;

double percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[static_cast<size_t>(p * static_cast<double>(v.size() - 1) + 0.5)];
}

// Groups the records into launches (in entry order, a launch's blocks all enter before the next
// launch's first: one block an SM, and the next grid launches only once every block has asked for
// it) and prints the per-projection means.
void report_trace(const char* format, std::vector<cuda::StreamTraceRecord> recs, const double bytes[4]) {
  std::sort(recs.begin(), recs.end(), [](const auto& a, const auto& b) { return a.ns[0] < b.ns[0]; });
  std::vector<std::vector<cuda::StreamTraceRecord>> launches;
  for (const auto& r : recs) {
    if (launches.empty() || launches.back().back().n_out != r.n_out || launches.back().back().k_lines != r.k_lines)
      launches.emplace_back();
    launches.back().push_back(r);
  }
  if (launches.size() != 4 * kLayers) {
    std::printf("streamtrace %s: %zu launches in the records, expected %d\n", format, launches.size(), 4 * kLayers);
    return;
  }
  constexpr int kFigures = 11;
  const char* names[kFigures] = {"entry0", "entry", "ready", "input", "first", "last", "exit", "exit10", "exit90",
                                 "advance", "blocks"};
  double sums[4][kFigures] = {};
  int counts[4] = {};
  // The previous launch's last exit, ns (integers: %globaltimer counts from the epoch, beyond a
  // double's ns resolution).
  unsigned long long t0 = recs.front().ns[0];
  for (size_t c = 0; c < launches.size(); ++c) {
    const auto& L = launches[c];
    std::vector<double> at[cuda::kStreamTracePoints];
    for (const auto& r : L)
      for (int i = 0; i < cuda::kStreamTracePoints; ++i)
        at[i].push_back(static_cast<double>(static_cast<long long>(r.ns[i] - t0)));
    const double last_exit = percentile(at[5], 1.0);
    unsigned long long last_exit_ns = 0;
    for (const auto& r : L) last_exit_ns = std::max(last_exit_ns, r.ns[5]);
    const int p = static_cast<int>(c % 4);
    if (c >= 4) {  // layer 0 starts the graph
      const double f[kFigures] = {percentile(at[0], 0.0), percentile(at[0], 0.5), percentile(at[1], 0.5),
                                  percentile(at[2], 0.5), percentile(at[3], 0.5), percentile(at[4], 0.5),
                                  percentile(at[5], 0.5), percentile(at[5], 0.1), percentile(at[5], 0.9),
                                  last_exit,              static_cast<double>(L.size()) * 1e3};
      for (int i = 0; i < kFigures; ++i) sums[p][i] += f[i];
      ++counts[p];
    }
    t0 = last_exit_ns;
  }
  std::printf("streamtrace %s, 1 token, means over layers 1..%d (us from the previous launch's last exit)\n", format,
              kLayers - 1);
  std::printf("%-8s", "proj");
  for (const char* n : names) std::printf(" %8s", n);
  std::printf(" %9s\n", "TB/s");
  double total = 0.0;
  for (int p = 0; p < 4; ++p) {
    std::printf("%-8s", kProjs[p].name);
    for (int i = 0; i < kFigures; ++i) std::printf(" %8.2f", sums[p][i] / counts[p] / 1e3);
    const double adv = sums[p][9] / counts[p];
    total += adv;
    std::printf(" %9.2f\n", bytes[p] / adv / 1e3);
  }
  std::printf("a layer's four projections: %.1f us\n", total / 1e3);
  std::fflush(stdout);
}

}  // namespace

void bench_stream_trace() {
  if (!cuda::stream_trace_enabled()) {
    std::printf("streamtrace: this build has no timeline (configure with -DKESTREL_STREAM_TRACE=ON)\n");
    return;
  }
  cudaStream_t stream;
  KESTREL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  Buf attn(4096 * 2), qkv_y(6144 * 2), o_y(4096 * 2), gu_y(28672 * 2), down_y(4096 * 2);
  Buf res_a(4096 * 4), res_b(4096 * 4), norm_w(4096 * 2);
  fill_bf16(attn);
  fill_bf16(down_y);
  fill_f32(res_a);
  std::vector<uint16_t> ones(4096, 0x3F80);  // bf16 1.0
  fill(norm_w, ones);
  Buf* ys[4] = {&qkv_y, &o_y, &gu_y, &down_y};
  constexpr int64_t kPrefetch = 64 << 10;

  // The projection p of a layer: the fused input and output as the runner wires them, and the
  // prefetch of the next projection's weights (next: their base, null for the last; its rows of
  // next_row_bytes).
  auto wire = [&](cuda::StreamGemvArgs& a, int p, const void* next, int64_t next_row_bytes) {
    static_cast<cuda::ProjectionOperands&>(a) = {attn.as<bf16>(), kProjs[p].in, nullptr, ys[p]->p, 1,
                                                 kProjs[p].in,    kProjs[p].out, false, false};
    if (p == 0 || p == 2) {
      a.norm_residual_in = (p == 0 ? res_a : res_b).as<float>();
      a.norm_add = (p == 0 ? down_y : o_y).as<bf16>();
      a.norm_weight = norm_w.as<bf16>();
      a.norm_residual_out = (p == 0 ? res_b : res_a).as<float>();
    } else if (p == 3) {
      a.x = gu_y.as<bf16>();
      a.x_stride = 2 * kProjs[3].in;
      a.swiglu = true;
    }
    if (next != nullptr) a.next = cuda::stream_prefetch_of(next, kProjs[(p + 1) % 4].out, next_row_bytes, kPrefetch);
  };
  // launch(i, p, next): weight i (layer i / 4) as projection p; next: weight i + 1's base or null.
  auto run = [&](const char* format, const std::function<void(size_t, int, const void*)>& launch,
                 const std::vector<const void*>& heads, const double bytes[4]) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    KESTREL_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    for (int l = 0; l < kLayers; ++l)
      for (int p = 0; p < 4; ++p) {
        const size_t i = static_cast<size_t>(4 * l + p);
        launch(i, p, i + 1 < heads.size() ? heads[i + 1] : nullptr);
      }
    KESTREL_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    KESTREL_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int i = 0; i < 3; ++i) KESTREL_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    (void)cuda::stream_trace_take();
    cudaEvent_t e0, e1;
    KESTREL_CUDA_CHECK(cudaEventCreate(&e0));
    KESTREL_CUDA_CHECK(cudaEventCreate(&e1));
    KESTREL_CUDA_CHECK(cudaEventRecord(e0, stream));
    KESTREL_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    KESTREL_CUDA_CHECK(cudaEventRecord(e1, stream));
    KESTREL_CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0.0f;
    KESTREL_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    std::printf("streamtrace %s: the graph of %d layers %.1f us (%.1f us a layer)\n", format, kLayers, ms * 1e3,
                ms * 1e3 / kLayers);
    report_trace(format, cuda::stream_trace_take(), bytes);
    KESTREL_CUDA_CHECK(cudaGraphExecDestroy(exec));
    KESTREL_CUDA_CHECK(cudaGraphDestroy(graph));
    KESTREL_CUDA_CHECK(cudaEventDestroy(e0));
    KESTREL_CUDA_CHECK(cudaEventDestroy(e1));
  };

  {  // FP8: codes of random bits, scales 1/256
    std::vector<std::unique_ptr<Buf>> w, scale;
    std::vector<const void*> heads;
    double bytes[4];
    for (int l = 0; l < kLayers; ++l)
      for (int p = 0; p < 4; ++p) {
        bytes[p] = static_cast<double>(kProjs[p].in * kProjs[p].out);
        w.push_back(std::make_unique<Buf>(static_cast<size_t>(kProjs[p].in * kProjs[p].out)));
        fill_bf16(*w.back());
        scale.push_back(std::make_unique<Buf>(static_cast<size_t>(kProjs[p].out) * 4));
        fill(*scale.back(), std::vector<float>(static_cast<size_t>(kProjs[p].out), 1.0f / 256));
        heads.push_back(w.back()->p);
      }
    run(
        "fp8",
        [&](size_t i, int p, const void* next) {
          cuda::StreamGemvFp8Args a;
          wire(a, p, next, kProjs[(p + 1) % 4].in);
          a.w8 = w[i]->as<uint8_t>();
          a.w_scale = scale[i]->as<float>();
          cuda::stream_gemv_w8a8(a, stream);
        },
        heads, bytes);
  }
  {  // INT4 (W4A16), group 128: codes of random bits, scale f16 0x211F (about 0.01), zero 8
    std::vector<std::unique_ptr<Buf>> codes, metas;
    std::vector<const void*> heads;
    double bytes[4];
    for (int l = 0; l < kLayers; ++l)
      for (int p = 0; p < 4; ++p) {
        const size_t code_bytes = static_cast<size_t>(kProjs[p].in * kProjs[p].out) / 2;
        const size_t meta_words = static_cast<size_t>(kProjs[p].out * (kProjs[p].in / 128));
        bytes[p] = static_cast<double>(code_bytes + 4 * meta_words);
        codes.push_back(std::make_unique<Buf>(code_bytes));
        fill_bf16(*codes.back());
        metas.push_back(std::make_unique<Buf>(meta_words * 4));
        fill(*metas.back(), std::vector<uint32_t>(meta_words, cuda::int4_meta_word(0x211F, 8)));
        heads.push_back(codes.back()->p);
      }
    run(
        "int4",
        [&](size_t i, int p, const void* next) {
          cuda::StreamGemvInt4Args a;
          wire(a, p, next, kProjs[(p + 1) % 4].in / 2);
          a.w4.codes = codes[i]->as<uint32_t>();
          a.w4.meta = metas[i]->as<uint32_t>();
          a.w4.n_in = kProjs[p].in;
          a.w4.n_out = kProjs[p].out;
          a.w4.group_size = 128;
          a.w4.scale_f16 = true;
          cuda::stream_gemv_int4(a, stream);
        },
        heads, bytes);
  }
  KESTREL_CUDA_CHECK(cudaStreamDestroy(stream));
}

}  // namespace kestrel::bench
