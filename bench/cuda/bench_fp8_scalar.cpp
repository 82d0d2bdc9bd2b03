// `kestrel_cuda_bench fp8scalar`: cuBLASLt's FP8 E4M3 GEMM without scales at 16-2048 tokens in the
// Llama-3.1-8B projection shapes, each of the heuristic's candidates (up to 16) and their split-K
// variants timed (first = the heuristic's choice, best = the fastest, bf16 and f32 output), beside
// Gemm::run_fp8 itself (up to kFp8UnscaledMaxTokens the heuristic's first choice plus
// scale_fp8_product, above it cuBLASLt's outer-vector scales): the figures behind
// kFp8UnscaledMaxTokens and fp8_unscaled_deferred (gemm.h; docs/performance.md). Weights rotate
// over copies of at least 400 MB; GB/s counts W, x and a bf16 y.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "backend/cuda/cublaslt_api.h"
#include "backend/cuda/gemm.h"
#include "bench_util.h"

namespace kestrel::bench {

using kestrel::cuda::cublaslt_api;

void bench_fp8_scalar() {
  const auto& api = cublaslt_api();
  cublasLtHandle_t h;
  api.Create(&h);
  const size_t ws_bytes = size_t{32} << 20;
  Buf wsb(ws_bytes);
  kestrel::cuda::Gemm gemm;
  struct S {
    int64_t in, out;
    const char* what;
  };
  for (const S& sh : {S{4096, 6144, "qkv"}, S{4096, 4096, "o"}, S{4096, 28672, "gate_up"}, S{14336, 4096, "down"}}) {
    const size_t w8 = static_cast<size_t>(sh.in * sh.out);
    const size_t n_copies = std::min<size_t>(16, std::max<size_t>(2, (size_t{400} << 20) / w8 + 1));
    std::vector<std::unique_ptr<Buf>> ws;
    for (size_t i = 0; i < n_copies; ++i) {
      ws.push_back(std::make_unique<Buf>(w8));
      fill_bf16(*ws.back());
    }
    Buf w_scale(static_cast<size_t>(sh.out) * 4);
    fill(w_scale, std::vector<float>(static_cast<size_t>(sh.out), 1e-3f));
    for (const int64_t m : {16, 32, 64, 128, 256, 512, 1024, 2048}) {
      Buf xq(static_cast<size_t>(m * sh.in)), xs(static_cast<size_t>(m) * 4), y(static_cast<size_t>(m * sh.out) * 4);
      fill_bf16(xq);
      fill(xs, std::vector<float>(static_cast<size_t>(m), 1e-2f));
      const std::string shape = std::string(sh.what) + " M=" + std::to_string(m);
      const double bytes = static_cast<double>(w8 + xq.bytes + m * sh.out * 2);
      const double flops = 2.0 * m * sh.in * sh.out;
      size_t next = 0;
      constexpr int kCalls = 16;
      {
        const double ms = time_ms([&] {
          for (int c = 0; c < kCalls; ++c)
            gemm.run_fp8(xq.as<uint8_t>(), xs.as<float>(), ws[next++ % n_copies]->as<uint8_t>(), w_scale.as<float>(),
                         y.as<bf16>(), m, sh.in, sh.out, nullptr);
        }) / kCalls;
        report("run_fp8", shape, ms, bytes, flops);
      }
      for (const cudaDataType_t dt : {CUDA_R_16BF, CUDA_R_32F}) {
        cublasLtMatmulDesc_t desc;
        api.MatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
        const cublasOperation_t tt = CUBLAS_OP_T, tn = CUBLAS_OP_N;
        api.MatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &tt, sizeof tt);
        api.MatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tn, sizeof tn);
        cublasLtMatrixLayout_t lw, lx, ly;
        api.MatrixLayoutCreate(&lw, CUDA_R_8F_E4M3, sh.in, sh.out, sh.in);
        api.MatrixLayoutCreate(&lx, CUDA_R_8F_E4M3, sh.in, m, sh.in);
        api.MatrixLayoutCreate(&ly, dt, sh.out, m, sh.out);
        cublasLtMatmulPreference_t pref;
        api.MatmulPreferenceCreate(&pref);
        const uint64_t wsz = ws_bytes;
        api.MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsz, sizeof wsz);
        cublasLtMatmulHeuristicResult_t res[16]{};
        int n = 0;
        const cublasStatus_t st = api.MatmulAlgoGetHeuristic(h, desc, lw, lx, ly, ly, pref, 16, res, &n);
        std::vector<cublasLtMatmulAlgo_t> cand;
        for (int i = 0; i < n; ++i)
          if (res[i].state == CUBLAS_STATUS_SUCCESS) cand.push_back(res[i].algo);
        const size_t n_heur = cand.size();
        const auto split = kestrel::cuda::split_k_variants(h, desc, lw, lx, ly, cand, sh.in, ws_bytes);
        cand.insert(cand.end(), split.begin(), split.end());
        double best = 1e9, first = -1;
        size_t best_i = 0;
        const float alpha = 1.0f, beta = 0.0f;
        for (size_t c = 0; c < cand.size(); ++c) {
          bool ok = true;
          const double ms = time_ms([&] {
            for (int k = 0; k < kCalls; ++k)
              ok = ok && api.Matmul(h, desc, &alpha, ws[next++ % n_copies]->p, lw, xq.p, lx, &beta, y.p, ly, y.p, ly,
                                    &cand[c], wsb.p, ws_bytes, nullptr) == CUBLAS_STATUS_SUCCESS;
          }) / kCalls;
          if (!ok) continue;
          if (c == 0) first = ms;
          if (ms < best) best = ms, best_i = c;
        }
        std::printf("%s heuristic status %d, %zu heuristic + %zu split-K candidates\n",
                    dt == CUDA_R_16BF ? "bf16-out" : "f32-out", static_cast<int>(st), n_heur, cand.size() - n_heur);
        if (first > 0) report(std::string("scalar1st ") + (dt == CUDA_R_16BF ? "bf16" : "f32"), shape, first, bytes, flops);
        if (best < 1e9)
          report(std::string("scalarbest ") + (dt == CUDA_R_16BF ? "bf16" : "f32") + " #" + std::to_string(best_i), shape,
                 best, bytes, flops);
        api.MatmulPreferenceDestroy(pref);
        api.MatrixLayoutDestroy(lw);
        api.MatrixLayoutDestroy(lx);
        api.MatrixLayoutDestroy(ly);
        api.MatmulDescDestroy(desc);
      }
    }
  }
  api.Destroy(h);
}

}  // namespace kestrel::bench
