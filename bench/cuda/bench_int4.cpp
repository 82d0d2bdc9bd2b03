// INT4 W4A16 projections (int4_ops.h) in the Llama-3.1-8B shapes, group size 128, beside the bf16
// paths the runner takes for the same shapes: at decode sizes the W4A16 skinny GEMM and its
// variants against cuBLASLt, the bf16 skinny GEMM and the streaming GEMV; at a 2048-token prefill
// the dequantization to bf16 followed by cuBLASLt against cuBLASLt on bf16 weights. Weights rotate
// over copies of at least 400 MB (bench_skinny's reason: W from HBM, not L2); each timing covers
// 16 back-to-back calls. GB/s counts W as stored (int4 codes and meta words, or bf16), x and y
// once; TFLOP/s 2 m n_in n_out.
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "backend/cuda/int4_ops.h"
#include "bench_util.h"
#if !defined(KESTREL_CUDA_NO_GEMM)
#include "backend/cuda/gemm.h"
#endif

namespace kestrel::bench {

void bench_int4() {
#if !defined(KESTREL_CUDA_NO_GEMM)
  kestrel::cuda::Gemm gemm;
  struct S {
    int64_t in, out;
    const char* what;
  };
  constexpr int64_t kGroup = 128;
  for (const S& sh : {S{4096, 6144, "qkv 4096->6144"}, S{4096, 4096, "o 4096->4096"},
                      S{4096, 28672, "gate_up 4096->28672"}, S{14336, 4096, "down 14336->4096"}}) {
    const size_t code_bytes = static_cast<size_t>(sh.in * sh.out) / 2;
    const size_t meta_bytes = static_cast<size_t>(sh.out * (sh.in / kGroup)) * 4;
    const size_t w16_bytes = static_cast<size_t>(sh.in * sh.out) * 2;
    const size_t n4 = std::min<size_t>(16, std::max<size_t>(2, (size_t{400} << 20) / (code_bytes + meta_bytes) + 1));
    const size_t n16 = std::min<size_t>(16, std::max<size_t>(2, (size_t{400} << 20) / w16_bytes + 1));
    std::vector<std::unique_ptr<Buf>> codes, metas, ws16;
    // Scales of about 0.01 (f16 0x211F) and zero 8: finite outputs.
    const std::vector<uint32_t> meta_h(meta_bytes / 4, kestrel::cuda::int4_meta_word(0x211F, 8));
    for (size_t i = 0; i < n4; ++i) {
      codes.push_back(std::make_unique<Buf>(code_bytes));
      fill_bf16(*codes.back());  // random bits: random codes
      metas.push_back(std::make_unique<Buf>(meta_bytes));
      fill(*metas.back(), meta_h);
    }
    for (size_t i = 0; i < n16; ++i) {
      ws16.push_back(std::make_unique<Buf>(w16_bytes));
      fill_bf16(*ws16.back());
    }
    Buf w_deq(w16_bytes);
    for (const int64_t m : {1, 2, 8, 16, 32, 64, 2048}) {
      Buf x(static_cast<size_t>(m * sh.in) * 2), y(static_cast<size_t>(m * sh.out) * 2);
      fill_bf16(x);
      const std::string shape = std::string(sh.what) + " M=" + std::to_string(m);
      const double flops = 2.0 * static_cast<double>(m) * static_cast<double>(sh.in) * static_cast<double>(sh.out);
      const double io = static_cast<double>(x.bytes + y.bytes);
      size_t next = 0;
      constexpr int kCalls = 16;
      const double ms16 = time_ms([&] {
        for (int c = 0; c < kCalls; ++c)
          gemm.run(x.as<bf16>(), ws16[next++ % n16]->as<bf16>(), y.p, kestrel::cuda::GemmOutput::Bf16, m, sh.in, sh.out,
                   nullptr);
      }) / kCalls;
      report("cublaslt bf16", shape, ms16, static_cast<double>(w16_bytes) + io, flops);
      const kestrel::cuda::ProjectionOperands ops{x.as<bf16>(), sh.in, nullptr, y.p, m, sh.in, sh.out, false, false};
      if (m <= 8 && kestrel::cuda::skinny_gemm_supports(m, sh.in, sh.out)) {
        kestrel::cuda::SkinnyGemmArgs a{ops};
        const double ms = time_ms([&] {
          for (int c = 0; c < kCalls; ++c) {
            a.w = ws16[next++ % n16]->as<bf16>();
            kestrel::cuda::skinny_gemm(a, nullptr);
          }
        }) / kCalls;
        report("skinny bf16", shape, ms, static_cast<double>(w16_bytes) + io, flops);
      }
      if (kestrel::cuda::stream_gemv_supports(m, sh.in, sh.out)) {
        kestrel::cuda::StreamGemvArgs a{ops};
        const double ms = time_ms([&] {
          for (int c = 0; c < kCalls; ++c) {
            a.w = ws16[next++ % n16]->as<bf16>();
            kestrel::cuda::stream_gemv(a, nullptr);
          }
        }) / kCalls;
        report("stream bf16", shape, ms, static_cast<double>(w16_bytes) + io, flops);
      }
      kestrel::cuda::Int4Matrix w4;
      w4.n_in = sh.in, w4.n_out = sh.out, w4.group_size = kGroup, w4.scale_f16 = true;
      auto pick = [&](size_t i) {
        w4.codes = codes[i % n4]->as<uint32_t>();
        w4.meta = metas[i % n4]->as<uint32_t>();
      };
      const double w4_bytes = static_cast<double>(code_bytes + meta_bytes);
      for (const int stages : {0, 4, 6}) {  // the streaming GEMVs at one and two tokens (0: the default)
        if (!kestrel::cuda::stream_gemv_int4_supports(m, w4, 0, stages)) continue;
        kestrel::cuda::StreamGemvInt4Args a;
        static_cast<kestrel::cuda::ProjectionOperands&>(a) = ops;
        a.stages = stages;
        const double ms = time_ms([&] {
          for (int c = 0; c < kCalls; ++c) {
            pick(next++);
            a.w4 = w4;
            kestrel::cuda::stream_gemv_int4(a, nullptr);
          }
        }) / kCalls;
        report(stages == 0 ? std::string("int4 stream default") : "int4 stream s" + std::to_string(stages), shape,
               ms, w4_bytes + io, flops);
        if (stages != 0) continue;
        // Each call bringing the head of the next call's codes into L2 (StreamPrefetch), 64 KiB a block.
        const double ms_pf = time_ms([&] {
          for (int c = 0; c < kCalls; ++c) {
            pick(next++);
            a.w4 = w4;
            a.next = kestrel::cuda::stream_prefetch_of(codes[next % n4]->p, sh.out, sh.in / 2, int64_t{64} << 10);
            kestrel::cuda::stream_gemv_int4(a, nullptr);
          }
        }) / kCalls;
        report("int4 stream default pf64", shape, ms_pf, w4_bytes + io, flops);
        a.next = {};
      }
      if (m <= kestrel::cuda::kInt4SkinnyMaxTokens) {
        // (unroll, row groups, warps); the first of each list is the default.
        std::vector<std::tuple<int, int, int>> variants = {{1, 1, 8}, {1, 1, 4}};
        if (m <= 8) variants = {{1, 2, 8}, {2, 1, 4}, {1, 1, 8}, {1, 2, 4}};
        else if (m <= 16) variants = {{1, 1, 8}, {1, 2, 4}, {1, 1, 4}};
        for (const auto& [u, r, wp] : variants) {
          kestrel::cuda::SkinnyInt4Args a;
          static_cast<kestrel::cuda::ProjectionOperands&>(a) = ops;
          a.unroll = u;
          a.row_groups = r;
          a.warps = wp;
          const double ms = time_ms([&] {
            for (int c = 0; c < kCalls; ++c) {
              pick(next++);
              a.w4 = w4;
              kestrel::cuda::skinny_gemm_int4(a, nullptr);
            }
          }) / kCalls;
          report("int4 u" + std::to_string(u) + " r" + std::to_string(r) + " w" + std::to_string(wp), shape, ms,
                 static_cast<double>((m + 31) / 32) * w4_bytes + io, flops);
        }
      }
      if (m >= 64) {
        const double ms = time_ms([&] {
          for (int c = 0; c < kCalls; ++c) {
            pick(next++);
            kestrel::cuda::dequantize_int4(w4, w_deq.as<bf16>(), nullptr);
            gemm.run(x.as<bf16>(), w_deq.as<bf16>(), y.p, kestrel::cuda::GemmOutput::Bf16, m, sh.in, sh.out, nullptr);
          }
        }) / kCalls;
        report("int4 deq+cublas", shape, ms, w4_bytes + io, flops);
        const double ms_deq = time_ms([&] {
          for (int c = 0; c < kCalls; ++c) {
            pick(next++);
            kestrel::cuda::dequantize_int4(w4, w_deq.as<bf16>(), nullptr);
          }
        }) / kCalls;
        report("int4 dequantize", std::string(sh.what), ms_deq, w4_bytes + static_cast<double>(w16_bytes), 0);
      }
    }
  }
#endif
}

}  // namespace kestrel::bench
