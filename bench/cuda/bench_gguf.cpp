// GGUF blocks in place (gguf_ops.h): the decode GEMV of every kept type at 1 and 8 tokens, beside
// the bf16 skinny GEMM on the same shape (the bf16 upload's decode path), in the shapes of
// SmolLM2-135M (gate|up 576 -> 3072), Gemma 3 270M (down 2048 -> 640; its 640-wide matrices are
// Q5_0 / Q8_0) and Llama-3.1-8B (down 14336 -> 4096). Weights rotate over copies of at least
// 400 MB (W from HBM, as in a decode pass whose weights exceed the L2); each timing covers 16
// back-to-back calls. GB/s counts W as stored (the blocks, or bf16), x and y once; the H200's
// HBM3e peak is 4.28 TB/s.
#include <memory>
#include <string>
#include <vector>

#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/gguf_ops.h"
#include "bench_util.h"

namespace kestrel::bench {

void bench_gguf() {
  namespace kc = kestrel::cuda;
  struct S {
    int64_t in, out;
    const char* what;
  };
  const kc::GgufQuant types[] = {kc::GgufQuant::Q4_0, kc::GgufQuant::Q4_1, kc::GgufQuant::Q5_0, kc::GgufQuant::Q8_0,
                                 kc::GgufQuant::Q4_K, kc::GgufQuant::Q5_K, kc::GgufQuant::Q6_K};
  const char* names[] = {"Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"};
  constexpr int kCalls = 16;
  auto copies = [](size_t bytes) { return std::min<size_t>(512, std::max<size_t>(2, (size_t{400} << 20) / bytes + 1)); };
  for (const S& sh : {S{576, 3072, "576->3072"}, S{2048, 640, "2048->640"}, S{14336, 4096, "14336->4096"}}) {
    for (const int64_t m : {1, 8}) {
      Buf x(static_cast<size_t>(m * sh.in) * 2), y(static_cast<size_t>(m * sh.out) * 2);
      fill_bf16(x);
      const double io = static_cast<double>(x.bytes + y.bytes);
      const std::string shape = std::string(sh.what) + " M=" + std::to_string(m);
      size_t next = 0;
      if (kc::skinny_gemm_supports(m, sh.in, sh.out)) {
        const size_t wb = static_cast<size_t>(sh.in * sh.out) * 2, n = copies(wb);
        std::vector<std::unique_ptr<Buf>> ws;
        for (size_t i = 0; i < n; ++i) ws.push_back(std::make_unique<Buf>(wb)), fill_bf16(*ws.back());
        kc::SkinnyGemmArgs a{kc::ProjectionOperands{x.as<bf16>(), sh.in, nullptr, y.p, m, sh.in, sh.out, false, false}};
        const double ms = time_ms([&] {
          for (int c = 0; c < kCalls; ++c) {
            a.w = ws[next++ % n]->as<bf16>();
            kc::skinny_gemm(a, nullptr);
          }
        }) / kCalls;
        report("skinny bf16", shape, ms, static_cast<double>(wb) + io, 0);
      }
      for (size_t ti = 0; ti < 7; ++ti) {
        const kc::GgufQuant t = types[ti];
        if (!kc::gguf_layout_supports(t, sh.in)) continue;
        const int64_t nb = sh.out * sh.in / kc::gguf_block_elems(t);
        const size_t body_b = static_cast<size_t>(nb * kc::gguf_body_bytes(t)), d_b = kc::gguf_d_apart(t) ? nb * 2 : 0;
        const size_t n = copies(body_b + d_b);
        std::vector<std::unique_ptr<Buf>> bodies, ds;
        for (size_t i = 0; i < n; ++i) {
          bodies.push_back(std::make_unique<Buf>(body_b)), fill_bf16(*bodies.back());  // random bits: random blocks
          ds.push_back(std::make_unique<Buf>(std::max<size_t>(d_b, 2))), fill_bf16(*ds.back());
        }
        kc::GgufGemvArgs a;
        static_cast<kc::ProjectionOperands&>(a) = {x.as<bf16>(), sh.in, nullptr, y.p, m, sh.in, sh.out, false, false};
        a.wq.type = t;
        a.wq.n_in = sh.in;
        a.wq.n_out = sh.out;
        const double ms = time_ms([&] {
          for (int c = 0; c < kCalls; ++c) {
            const size_t i = next++ % n;
            a.wq.body = bodies[i]->as<uint8_t>();
            a.wq.d = d_b > 0 ? ds[i]->as<uint16_t>() : nullptr;
            kc::gguf_gemv(a, nullptr);
          }
        }) / kCalls;
        report(std::string("gguf ") + names[ti], shape, ms, static_cast<double>(body_b + d_b) + io, 0);
      }
    }
  }
}

}  // namespace kestrel::bench
