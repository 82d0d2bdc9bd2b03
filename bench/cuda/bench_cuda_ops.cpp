// Times the CUDA ops on the GPU (CUDA events around each launch, 5 warm-ups, median of 20) and
// prints, per op and shape, the median time and the rate that bounds it: bytes moved (each input
// read once, each output written once) per second for the memory-bound ops, FLOP/s for attention
// prefill and the GEMMs. Compare with the device's ceilings (H200 here: ~4.3 TB/s copy, ~790
// TFLOP/s bf16 GEMM, docs/performance.md). Random data, never zeros.
// Usage: kestrel_cuda_bench [--attn-decode-stages=0|2|3] [--attn-fp8-decode-stages=0|2|3]
//        [--attn-fp8-decode-key-tile=0|64|128] [--attn-items-per-block=K] [--attn-min-split-tiles=T]
//        [--pdl=on|off] [filter-substring]
// (--attn-fp8-decode-*: the rows with an FP8 cache.)
// The options set the AttentionParams / launch choices the CLI's --cuda-* flags set in kestrel.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/fill_ops.h"
#include "backend/cuda/fp8_ops.h"
#include "backend/cuda/mla_ops.h"
#include "backend/cuda/moe_ops.h"
#if !defined(KESTREL_CUDA_NO_GEMM)
#include "backend/cuda/gemm.h"
#endif
#include "bench_util.h"

namespace {

using namespace kestrel::bench;  // NOLINT: the helpers of bench_util.h

std::string g_filter;
int32_t g_attn_fp8_decode_key_tile = 0;
int32_t g_attn_decode_stages = 0, g_attn_fp8_decode_stages = 0, g_attn_items_per_block = 0, g_attn_min_split_tiles = 0;

bool wanted(const std::string& name) { return g_filter.empty() || name.find(g_filter) != std::string::npos; }

// seqs: (context, q_len) pairs; one layer of KV cache sized to fit them.
// max_context_override > 0: pass that bound (as a CUDA graph does: its block-table width).
// fp8: an FP8 (E4M3) cache, codes of values in about [-1, 1) with a scale per row (the bytes
// counted: d codes + one f32 scale per row).
void bench_attention(const std::string& name, int n_head, int n_head_kv, int d, int block_size,
                     const std::vector<std::pair<int, int>>& seqs, int max_context_override = 0, bool fp8 = false) {
  if (!wanted("attention " + name)) return;
  std::vector<int32_t> qs{0}, ctx, pos, tables;
  int max_blocks = 0, max_ctx = 0, max_q = 0, n_blocks = 0;
  for (auto [c, q] : seqs) {
    max_blocks = std::max(max_blocks, (c + block_size - 1) / block_size);
    max_ctx = std::max(max_ctx, c);
    max_q = std::max(max_q, q);
  }
  double flops = 0, kv_bytes = 0;
  for (auto [c, q] : seqs) {
    for (int i = 0; i < q; ++i) {
      pos.push_back(c - q + i);
      flops += 4.0 * n_head * d * (c - q + i + 1);
    }
    qs.push_back(qs.back() + q);
    ctx.push_back(c);
    const int nb = (c + block_size - 1) / block_size;
    for (int b = 0; b < max_blocks; ++b) tables.push_back(b < nb ? n_blocks + b : -1);
    n_blocks += nb;
    kv_bytes += 2.0 * c * n_head_kv * (fp8 ? d + 4 : d * 2);
  }
  // Scatter the blocks: a real pool hands them out in no particular order.
  std::vector<int32_t> perm(static_cast<size_t>(n_blocks));
  for (int i = 0; i < n_blocks; ++i) perm[static_cast<size_t>(i)] = i;
  for (int i = n_blocks - 1; i > 0; --i) std::swap(perm[static_cast<size_t>(i)], perm[next_u32() % (i + 1)]);
  for (auto& t : tables)
    if (t >= 0) t = perm[static_cast<size_t>(t)];
  const int64_t n_tokens = qs.back();
  const size_t cache_elems = static_cast<size_t>(n_blocks) * n_head_kv * block_size * d;
  Buf q(static_cast<size_t>(n_tokens) * n_head * d * 2), out(q.bytes), kc(cache_elems * 2), vc(cache_elems * 2);
  Buf d_qs(qs.size() * 4), d_ctx(ctx.size() * 4), d_pos(pos.size() * 4), d_tab(tables.size() * 4);
  fill_bf16(q);
  fill_bf16(kc);
  fill_bf16(vc);
  const size_t n_rows = cache_elems / static_cast<size_t>(d);
  Buf ks(n_rows * 4), vs(n_rows * 4);
  if (fp8) {  // codes of magnitude 2^-3 .. 2^6 (no NaN codes), scales near 1 / 64
    std::vector<uint8_t> codes(kc.bytes);  // the bf16-sized buffer, codes in its first half
    for (auto& x : codes) {
      const uint32_t r = next_u32();
      x = static_cast<uint8_t>((r & 0x80u) | ((4u + (r >> 8) % 10u) << 3) | (r & 7u));
    }
    kc.upload(codes.data());
    vc.upload(codes.data());
    std::vector<float> scales(n_rows);
    for (auto& x : scales) x = (1.0f + static_cast<float>(next_u32() % 1024u) / 1024.0f) / 64.0f;
    ks.upload(scales.data());
    vs.upload(scales.data());
  }
  fill(d_qs, qs);
  fill(d_ctx, ctx);
  fill(d_pos, pos);
  fill(d_tab, tables);
  kestrel::cuda::AttentionParams p{};
  p.q = q.as<bf16>();
  p.k_cache = kc.as<bf16>();
  p.v_cache = vc.as<bf16>();
  p.k_scale = fp8 ? ks.as<float>() : nullptr;
  p.v_scale = fp8 ? vs.as<float>() : nullptr;
  p.block_tables = d_tab.as<int32_t>();
  p.context_lens = d_ctx.as<int32_t>();
  p.query_start = d_qs.as<int32_t>();
  p.positions = d_pos.as<int32_t>();
  p.out = out.as<bf16>();
  p.n_tokens = n_tokens;
  p.n_seqs = static_cast<int64_t>(seqs.size());
  p.max_blocks_per_seq = max_blocks;
  p.max_context = max_context_override > 0 ? max_context_override : max_ctx;
  p.decode_stages = fp8 ? g_attn_fp8_decode_stages : g_attn_decode_stages;
  p.fp8_decode_key_tile = g_attn_fp8_decode_key_tile;
  p.split_items_per_block = g_attn_items_per_block;
  p.split_min_tiles = g_attn_min_split_tiles;
  p.n_head = n_head;
  p.n_head_kv = n_head_kv;
  p.head_dim = d;
  p.block_size = block_size;
  p.scale = 1.0f / std::sqrt(static_cast<float>(d));
  p.max_query_len = max_q;
  Buf ws(kestrel::cuda::attention_workspace_bytes(p));
  p.workspace = ws.p;
  p.workspace_bytes = ws.bytes;
  const double ms = time_ms([&] { kestrel::cuda::paged_attention(p, nullptr); });
  const double bytes = kv_bytes + 2.0 * q.bytes;
  report("attention", name, ms, bytes, flops);
}

// 64 rows of Llama 3's 128256 logits. "model-like": N(0, 2) with a few dozen tokens lifted by 6 to
// 12, so that top_k / top_p keep tens of tokens, as on real next-token logits; "flat": U(-1, 1), where
// top_p keeps most of the row (the radix-select path).
void bench_sampling() {
  if (!wanted("sample")) return;
  const int64_t rows = 64, vocab = 128256;
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::uniform_real_distribution<float> flat(-1.0f, 1.0f), lift(6.0f, 12.0f);
  std::vector<float> model_like(static_cast<size_t>(rows * vocab)), uniform(model_like.size());
  for (float& x : model_like) x = normal(rng);
  for (int64_t r = 0; r < rows; ++r)
    for (int i = 0; i < 40; ++i) model_like[static_cast<size_t>(r * vocab + rng() % vocab)] += lift(rng);
  for (float& x : uniform) x = flat(rng);
  Buf logits(model_like.size() * 4), flat_logits(uniform.size() * 4), params(rows * sizeof(kestrel::cuda::SampleParams)),
      tokens(rows * 4);
  fill(logits, model_like);
  fill(flat_logits, uniform);
  struct Case {
    const char* what;
    kestrel::cuda::SampleParams p;
    const Buf* data;
  };
  for (const Case& c : {Case{"greedy", {0.0f, 0, 1.0f, 0.0f, 0.5}, &logits},
                        Case{"temperature 0.8", {0.8f, 0, 1.0f, 0.0f, 0.5}, &logits},
                        Case{"min_p 0.05", {1.0f, 0, 1.0f, 0.05f, 0.5}, &logits},
                        Case{"top_k 50, t 0.7", {0.7f, 50, 1.0f, 0.0f, 0.5}, &logits},
                        Case{"top_p 0.9", {1.0f, 0, 0.9f, 0.0f, 0.5}, &logits},
                        Case{"top_k 40 top_p 0.9 min_p 0.05", {0.7f, 40, 0.9f, 0.05f, 0.5}, &logits},
                        Case{"top_p 0.9, flat (radix)", {1.0f, 0, 0.9f, 0.0f, 0.5}, &flat_logits}}) {
    fill(params, std::vector<kestrel::cuda::SampleParams>(static_cast<size_t>(rows), c.p));
    const double ms = time_ms([&] {
      kestrel::cuda::sample_tokens(c.data->as<float>(), params.as<kestrel::cuda::SampleParams>(), rows, vocab,
                                   tokens.as<int32_t>(), nullptr, nullptr);
    });
    report("sample_tokens", std::string("64 x 128256, ") + c.what, ms, static_cast<double>(rows * vocab * 4), 0);
  }
}

}  // namespace


#if !defined(KESTREL_CUDA_NO_GEMM)
// Decode-step projections of the Llama-3.1-8B shape at few tokens: cuBLASLt against
// kestrel::cuda::skinny_gemm and its variants. Each timed call uses the next of several copies of
// W (at least 400 MB in all), so W comes from HBM as in a model's forward pass, not from the 50 MB
// L2. Each timing covers 16 back-to-back calls (as a forward pass issues them; with PDL the next
// skinny call streams its weights while the previous drains) and reports the time per call.
// GB/s counts W, x and y once. The down projection is timed with the SwiGLU input (cuBLASLt after
// silu_mul; skinny forming it on load) and on a ready activation (both GEMMs alone). At one and
// two tokens, kestrel::cuda::stream_gemv too, with 3, 4 and 6 stages where it applies.
void bench_skinny() {
  using kestrel::cuda::GemmOutput;
  kestrel::cuda::Gemm gemm;
  struct S {
    int64_t in, out;
    bool swiglu, f32;
    const char* what;
  };
  const S shapes[] = {{4096, 6144, false, false, "qkv 4096->6144"},
                      {4096, 4096, false, false, "o 4096->4096"},
                      {4096, 28672, false, false, "gate_up 4096->28672"},
                      {14336, 4096, true, false, "down+swiglu 14336->4096"},
                      {14336, 4096, false, false, "down 14336->4096"},
                      {4096, 128256, false, true, "head 4096->128256 f32"}};
  for (const S& sh : shapes) {
    const size_t w_bytes = static_cast<size_t>(sh.in * sh.out) * 2;
    const size_t n_copies = std::min<size_t>(16, std::max<size_t>(2, (size_t{400} << 20) / w_bytes + 1));
    std::vector<std::unique_ptr<Buf>> ws;
    for (size_t i = 0; i < n_copies; ++i) {
      ws.push_back(std::make_unique<Buf>(w_bytes));
      fill_bf16(*ws.back());
    }
    std::vector<int64_t> ms_list = {1, 4, 8, 16, 32, 64};
    for (const int64_t m : ms_list) {
      const int64_t x_cols = sh.swiglu ? 2 * sh.in : sh.in;
      Buf x(static_cast<size_t>(m * x_cols) * 2), act(static_cast<size_t>(m * sh.in) * 2),
          y(static_cast<size_t>(m * sh.out) * (sh.f32 ? 4 : 2));
      fill_bf16(x);
      const double bytes = static_cast<double>(w_bytes + x.bytes + y.bytes);
      size_t next = 0;
      const std::string shape = std::string(sh.what) + " M=" + std::to_string(m);
      constexpr int kCalls = 16;
      const double ms_cublas = time_ms([&] {
        for (int c = 0; c < kCalls; ++c) {
          const bf16* in = x.as<bf16>();
          if (sh.swiglu) {
            kestrel::cuda::silu_mul(in, act.as<bf16>(), m, sh.in, nullptr);
            in = act.as<bf16>();
          }
          gemm.run(in, ws[next++ % n_copies]->as<bf16>(), y.p, sh.f32 ? GemmOutput::F32 : GemmOutput::Bf16, m,
                   sh.in, sh.out, nullptr);
        }
      }) / kCalls;
      report("cublaslt", shape, ms_cublas, bytes, 0);
      // The weights pointer is set per call (the rotating copies).
      const kestrel::cuda::ProjectionOperands ops{x.as<bf16>(), x_cols, nullptr, y.p, m, sh.in, sh.out, sh.swiglu,
                                                  sh.f32};
      std::vector<std::pair<int, int>> variants = {{0, 0}};
      if (m <= 8) variants = {{4, 8}, {4, 4}, {2, 8}, {2, 4}, {8, 8}, {8, 4}};
      else if (m <= 16) variants = {{4, 8}, {2, 8}};
      else if (m <= 32) variants = {{2, 8}, {1, 8}};
      for (const auto& [u, wp] : variants) {
        kestrel::cuda::SkinnyGemmArgs a{ops};
        a.unroll = u;
        a.warps = wp;
        const double ms = time_ms([&] {
          for (int c = 0; c < kCalls; ++c) {
            a.w = ws[next++ % n_copies]->as<bf16>();
            kestrel::cuda::skinny_gemm(a, nullptr);
          }
        }) / kCalls;
        report("skinny u" + std::to_string(u) + " w" + std::to_string(wp), shape, ms, bytes, 0);
      }
      for (const int stages : {3, 4, 6}) {
        if (!kestrel::cuda::stream_gemv_supports(m, sh.in, sh.out, 0, stages)) continue;
        kestrel::cuda::StreamGemvArgs a{ops};
        a.stages = stages;
        const double ms = time_ms([&] {
          for (int c = 0; c < kCalls; ++c) {
            a.w = ws[next++ % n_copies]->as<bf16>();
            kestrel::cuda::stream_gemv(a, nullptr);
          }
        }) / kCalls;
        report("stream s" + std::to_string(stages), shape, ms, bytes, 0);
      }
    }
  }
}
#endif

#if !defined(KESTREL_CUDA_NO_GEMM)
// FP8 E4M3 weights (per-channel scales) in the Llama-3.1-8B projection shapes: the FP8 skinny GEMM
// (W8A16) at up to 16 tokens with its variants, and from 16 tokens the W8A8 path (per-token
// activation quantization + cuBLASLt's FP8 GEMM with outer-vector scales), beside cuBLASLt's bf16
// GEMM. Weights rotate over copies of at least 400 MB as in bench_skinny; GB/s counts W (one byte
// per weight), x and y; TFLOP/s 2 m n_in n_out.
void bench_fp8() {
  kestrel::cuda::Gemm gemm;
  struct S {
    int64_t in, out;
    const char* what;
  };
  for (const S& sh : {S{4096, 6144, "qkv 4096->6144"}, S{4096, 4096, "o 4096->4096"},
                      S{4096, 28672, "gate_up 4096->28672"}, S{14336, 4096, "down 14336->4096"}}) {
    const size_t w8_bytes = static_cast<size_t>(sh.in * sh.out);
    const size_t n_copies = std::min<size_t>(16, std::max<size_t>(2, (size_t{400} << 20) / w8_bytes + 1));
    std::vector<std::unique_ptr<Buf>> ws, ws16;
    for (size_t i = 0; i < n_copies; ++i) {
      ws.push_back(std::make_unique<Buf>(w8_bytes));
      fill_bf16(*ws.back());
      ws16.push_back(std::make_unique<Buf>(2 * w8_bytes));
      fill_bf16(*ws16.back());
    }
    Buf w_scale(static_cast<size_t>(sh.out) * 4);
    fill(w_scale, std::vector<float>(static_cast<size_t>(sh.out), 1e-3f));
    for (const int64_t m : {1, 2, 4, 8, 16, 64, 512, 4096}) {
      Buf x(static_cast<size_t>(m * sh.in) * 2), y(static_cast<size_t>(m * sh.out) * 2),
          xq(static_cast<size_t>(m * sh.in)), xs(static_cast<size_t>(m) * 4);
      fill_bf16(x);
      const std::string shape = std::string(sh.what) + " M=" + std::to_string(m);
      const double flops = 2.0 * static_cast<double>(m) * static_cast<double>(sh.in) * static_cast<double>(sh.out);
      size_t next = 0;
      constexpr int kCalls = 16;
      const double ms16 = time_ms([&] {
        for (int c = 0; c < kCalls; ++c)
          gemm.run(x.as<bf16>(), ws16[next++ % n_copies]->as<bf16>(), y.p, kestrel::cuda::GemmOutput::Bf16, m, sh.in,
                   sh.out, nullptr);
      }) / kCalls;
      report("cublaslt bf16", shape, ms16, static_cast<double>(2 * w8_bytes + x.bytes + y.bytes), flops);
      if (m <= kestrel::cuda::kSkinnyFp8MaxTokens) {
        std::vector<std::pair<int, int>> variants = {{1, 8}, {2, 8}, {2, 4}};
        if (m <= 8) variants = {{4, 4}, {2, 8}, {4, 8}, {1, 8}, {2, 4}};
        for (const auto& [u, wp] : variants) {
          kestrel::cuda::SkinnyFp8Args a;
          static_cast<kestrel::cuda::ProjectionOperands&>(a) = {x.as<bf16>(), sh.in, nullptr, y.p, m,
                                                                 sh.in,        sh.out, false, false};
          a.w_scale = w_scale.as<float>();
          a.unroll = u;
          a.warps = wp;
          const double ms = time_ms([&] {
            for (int c = 0; c < kCalls; ++c) {
              a.w8 = ws[next++ % n_copies]->as<uint8_t>();
              kestrel::cuda::skinny_gemm_fp8(a, nullptr);
            }
          }) / kCalls;
          report("fp8 skinny u" + std::to_string(u) + " w" + std::to_string(wp), shape, ms,
                 static_cast<double>(w8_bytes + x.bytes + y.bytes), flops);
        }
      }
      // The streaming GEMVs at one and two tokens: bf16 (the path without FP8) and FP8 W8A8.
      if (kestrel::cuda::stream_gemv_supports(m, sh.in, sh.out)) {
        kestrel::cuda::StreamGemvArgs a{{x.as<bf16>(), sh.in, nullptr, y.p, m, sh.in, sh.out, false, false}};
        const double ms = time_ms([&] {
          for (int c = 0; c < kCalls; ++c) {
            a.w = ws16[next++ % n_copies]->as<bf16>();
            kestrel::cuda::stream_gemv(a, nullptr);
          }
        }) / kCalls;
        report("stream bf16", shape, ms, static_cast<double>(2 * w8_bytes + x.bytes + y.bytes), flops);
      }
      // pf: each call brings the head of the next call's weights into L2 (StreamPrefetch), KiB a block.
      for (const int64_t pf : {int64_t{0}, int64_t{64}}) {
        const std::string tag = pf == 0 ? "" : " pf" + std::to_string(pf);
        if (kestrel::cuda::stream_gemv_w8a8_supports(m, sh.in, sh.out)) {
          kestrel::cuda::StreamGemvFp8Args a;
          static_cast<kestrel::cuda::ProjectionOperands&>(a) = {x.as<bf16>(), sh.in, nullptr, y.p, m,
                                                                 sh.in,        sh.out, false, false};
          a.w_scale = w_scale.as<float>();
          const double ms = time_ms([&] {
            for (int c = 0; c < kCalls; ++c) {
              a.w8 = ws[next++ % n_copies]->as<uint8_t>();
              a.next = kestrel::cuda::stream_prefetch_of(ws[next % n_copies]->p, sh.out, sh.in, pf << 10);
              kestrel::cuda::stream_gemv_w8a8(a, nullptr);
            }
          }) / kCalls;
          report("fp8 stream w8a8" + tag, shape, ms, static_cast<double>(w8_bytes + x.bytes + y.bytes), flops);
        }
      }
      if (m >= kestrel::cuda::kSkinnyFp8MaxTokens) {
        const double ms = time_ms([&] {
          for (int c = 0; c < kCalls; ++c) {
            kestrel::cuda::quantize_rows_fp8(x.as<bf16>(), sh.in, m, sh.in, xq.as<uint8_t>(), xs.as<float>(), nullptr);
            gemm.run_fp8(xq.as<uint8_t>(), xs.as<float>(), ws[next++ % n_copies]->as<uint8_t>(), w_scale.as<float>(),
                         y.as<bf16>(), m, sh.in, sh.out, nullptr);
          }
        }) / kCalls;
        report("fp8 w8a8", shape, ms, static_cast<double>(w8_bytes + x.bytes + y.bytes), flops);
      }
    }
  }
}
#endif

// The grouped expert GEMMs of a mixture-of-experts layer in two real shapes, both kernels, at
// decode batch sizes: bytes are the weights of the experts the routing touches (each read once)
// plus the activations. Eight routings (k distinct uniform experts per token) rotate between calls
// so that a batch-1 call does not find its experts in L2.
void bench_moe() {
  struct S {
    const char* what;
    int32_t E, k;
    int64_t d, f;
  };
  for (const S& sh : {S{"deepseek-v2-lite", 64, 6, 2048, 1408}, S{"mixtral-8x7b", 8, 2, 4096, 14336}}) {
    Buf wgu(static_cast<size_t>(sh.E * 2 * sh.f * sh.d) * 2), wd(static_cast<size_t>(sh.E * sh.d * sh.f) * 2);
    kestrel::cuda::fill_random_bf16(wgu.as<bf16>(), static_cast<int64_t>(wgu.bytes / 2), 0, {1, 1e-5f}, nullptr);
    kestrel::cuda::fill_random_bf16(wd.as<bf16>(), static_cast<int64_t>(wd.bytes / 2), 0, {2, 1e-5f}, nullptr);
    for (const int64_t n : {1, 2, 4, 16, 64, 256}) {
      for (const int32_t tile : {0, 8, 16, 32, 64}) {
        constexpr int kRoutings = 8;
        const kestrel::cuda::MoePlan plan = tile == 0 ? kestrel::cuda::moe_plan(n, sh.E, sh.k)
                                                      : kestrel::cuda::moe_plan_tiles(n, sh.E, sh.k, tile);
        // The plan's tile size, and for comparison the sizes next to it.
        if (tile != 0 && (tile == kestrel::cuda::moe_plan(n, sh.E, sh.k).tile_rows || (n <= 4 && tile > 8) ||
                          (n >= 64 && tile < 16)))
          continue;
        Buf x(static_cast<size_t>(n * sh.d) * 2), act(static_cast<size_t>(plan.padded_rows() * sh.f) * 2),
            y(static_cast<size_t>(n * sh.k * sh.d) * 2);
        fill_bf16(x);
        std::vector<std::unique_ptr<Buf>> tiles, perms;
        double touched = 0;
        std::mt19937 rng(static_cast<uint32_t>(n));
        for (int r = 0; r < kRoutings; ++r) {
          std::vector<int32_t> ids;
          std::vector<bool> used(static_cast<size_t>(sh.E), false);
          for (int64_t t = 0; t < n; ++t) {
            std::vector<int32_t> e(static_cast<size_t>(sh.E));
            for (int32_t i = 0; i < sh.E; ++i) e[static_cast<size_t>(i)] = i;
            std::shuffle(e.begin(), e.end(), rng);
            for (int32_t j = 0; j < sh.k; ++j) ids.push_back(e[static_cast<size_t>(j)]), used[static_cast<size_t>(e[static_cast<size_t>(j)])] = true;
          }
          touched += static_cast<double>(std::count(used.begin(), used.end(), true)) / kRoutings;
          Buf d_ids(ids.size() * 4);
          d_ids.upload(ids.data());
          tiles.push_back(std::make_unique<Buf>(static_cast<size_t>(plan.max_tiles) * 4));
          perms.push_back(std::make_unique<Buf>(static_cast<size_t>(plan.padded_rows()) * 4));
          kestrel::cuda::moe_sort(d_ids.as<int32_t>(), n * sh.k, sh.E, plan, tiles.back()->as<int32_t>(),
                                  perms.back()->as<int32_t>(), nullptr, nullptr);
          KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
        }
        const double w_bytes = touched * static_cast<double>(sh.f * sh.d) * 2;  // one [f, d] matrix per expert
        for (const auto kern : {kestrel::cuda::MoeGemmKernel::Tiled, kestrel::cuda::MoeGemmKernel::Skinny}) {
          if (kern == kestrel::cuda::MoeGemmKernel::Skinny && plan.tile_rows != 8) continue;
          const std::string kname = kern == kestrel::cuda::MoeGemmKernel::Skinny ? " skinny" : " tiled";
          const std::string shape = std::string(sh.what) + " n=" + std::to_string(n) + " tile " +
                                    std::to_string(plan.tile_rows) + (tile == 0 ? " (plan)" : "");
          kestrel::cuda::MoeGemmArgs a;
          a.top_k = sh.k;
          a.n_tokens = n;
          a.kernel = kern;
          constexpr int kCalls = 16;
          for (const bool swiglu : {true, false}) {
            a.swiglu = swiglu;
            a.x = swiglu ? x.as<bf16>() : act.as<bf16>();
            a.w = swiglu ? wgu.as<bf16>() : wd.as<bf16>();
            a.y = swiglu ? act.as<bf16>() : y.as<bf16>();
            a.n_in = swiglu ? sh.d : sh.f;
            a.n_out = swiglu ? sh.f : sh.d;
            std::vector<std::pair<int, int>> variants = {{0, 0}};
            if (kern == kestrel::cuda::MoeGemmKernel::Skinny) variants = {{4, 8}, {2, 8}, {4, 4}, {2, 4}};
            for (const auto& [u, wp] : variants) {
              a.skinny_unroll = u;
              a.skinny_warps = wp;
              int next = 0;
              const double ms = time_ms([&] {
                for (int c = 0; c < kCalls; ++c, ++next) {
                  a.tile_expert = tiles[static_cast<size_t>(next % kRoutings)]->as<int32_t>();
                  a.perm = perms[static_cast<size_t>(next % kRoutings)]->as<int32_t>();
                  kestrel::cuda::moe_gemm(a, plan, nullptr);
                }
              }) / kCalls;
              const std::string v = u == 0 ? "" : " u" + std::to_string(u) + "w" + std::to_string(wp);
              report(std::string(swiglu ? "moe gate_up" : "moe down") + kname + v, shape, ms,
                     (swiglu ? 2 : 1) * w_bytes, 0);
            }
          }
        }
      }
    }
  }
}

// DeepSeek-V2-Lite's latent attention at decode (16 heads, r 512, rope 64, blocks of 16): one
// sequence at the batch-1 benchmark's contexts, 64 at 576; each split count the planner may pick
// (0: its own choice). Bytes: the latent rows read once.
void bench_mla_decode() {
  constexpr int32_t H = 16, r = 512, R = 64, bs = 16;
  struct C {
    int64_t seqs;
    int32_t ctx;
  };
  for (const C c : {C{1, 200}, C{1, 2048}, C{64, 576}}) {
    const int32_t width = (c.ctx + bs - 1) / bs;
    Buf q(static_cast<size_t>(c.seqs * H * (r + R)) * 2), cache(static_cast<size_t>(c.seqs * width * bs * (r + R)) * 2),
        out(static_cast<size_t>(c.seqs * H * r) * 2), tables(static_cast<size_t>(c.seqs * width) * 4),
        qs(static_cast<size_t>(c.seqs + 1) * 4), pos(static_cast<size_t>(c.seqs) * 4);
    fill_bf16(q);
    fill_bf16(cache);
    std::vector<int32_t> t(static_cast<size_t>(c.seqs * width)), s(static_cast<size_t>(c.seqs + 1)),
        p(static_cast<size_t>(c.seqs), c.ctx - 1);
    for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<int32_t>(i);
    for (size_t i = 0; i < s.size(); ++i) s[i] = static_cast<int32_t>(i);
    fill(tables, t);
    fill(qs, s);
    fill(pos, p);
    kestrel::cuda::MlaAttentionParams a;
    a.q = q.as<bf16>();
    a.cache = cache.as<bf16>();
    a.block_tables = tables.as<int32_t>();
    a.query_start = qs.as<int32_t>();
    a.positions = pos.as<int32_t>();
    a.out = out.as<bf16>();
    a.n_tokens = c.seqs;
    a.n_seqs = c.seqs;
    a.max_blocks_per_seq = width;
    a.max_context = c.ctx;
    a.max_query_len = 1;
    a.n_head = H;
    a.kv_lora_rank = r;
    a.rope_dim = R;
    a.block_size = bs;
    a.scale = 0.07f;
    Buf ws(kestrel::cuda::mla_attention_workspace_bound(c.seqs, H, r, R));
    a.workspace = ws.p;
    a.workspace_bytes = ws.bytes;
    for (const int32_t splits : {0, 1, 2, 4, 8, 16}) {
      if (splits > (c.ctx + 31) / 32) continue;
      a.n_splits = splits;
      if (kestrel::cuda::mla_attention_workspace_bytes(a) > ws.bytes) continue;
      const double ms = time_ms([&] { kestrel::cuda::mla_attention(a, nullptr); });
      report("mla decode", std::to_string(c.seqs) + " x ctx " + std::to_string(c.ctx) + ", splits " +
                               (splits == 0 ? "auto" : std::to_string(splits)),
             ms, static_cast<double>(c.seqs) * c.ctx * (r + R) * 2, 0);
    }
  }
}

// The small kernels of a MoE layer at decode batch sizes (DeepSeek-V2-Lite: 64 experts, top 6,
// d 2048): routing, sorting, and the combine with the shared expert.
void bench_moe_small_ops() {
  constexpr int32_t E = 64, k = 6;
  constexpr int64_t d = 2048;
  for (const int64_t n : {1, 16, 64}) {
    const kestrel::cuda::MoePlan plan = kestrel::cuda::moe_plan(n, E, k);
    Buf logits(static_cast<size_t>(n * (E + 1)) * 4), ids(static_cast<size_t>(n * k) * 4),
        w(static_cast<size_t>(n * k) * 4), tiles(static_cast<size_t>(plan.max_tiles) * 4),
        perm(static_cast<size_t>(plan.padded_rows()) * 4), y(static_cast<size_t>(n * k * d) * 2),
        sh(static_cast<size_t>(n * d) * 2), out(static_cast<size_t>(n * d) * 2);
    fill_f32(logits);
    fill_bf16(y);
    fill_bf16(sh);
    kestrel::cuda::MoeRouteArgs r;
    r.n_expert = E;
    r.top_k = k;
    r.routed_scale = 1.0f;
    const std::string shape = std::to_string(n) + " tokens, 64 experts top 6";
    report("moe route", shape, time_ms([&] {
             kestrel::cuda::moe_route(logits.as<float>(), E + 1, nullptr, n, r, ids.as<int32_t>(), w.as<float>(), nullptr);
           }), 0, 0);
    report("moe sort", shape, time_ms([&] {
             kestrel::cuda::moe_sort(ids.as<int32_t>(), n * k, E, plan, tiles.as<int32_t>(), perm.as<int32_t>(), nullptr,
                                     nullptr);
           }), 0, 0);
    report(kestrel::cuda::moe_route_sort_fused(n, r) ? "moe route+sort (one kernel)" : "moe route+sort (two)", shape,
           time_ms([&] {
             kestrel::cuda::moe_route_sort(logits.as<float>(), E + 1, nullptr, n, r, plan, ids.as<int32_t>(),
                                           w.as<float>(), tiles.as<int32_t>(), perm.as<int32_t>(), nullptr, nullptr);
           }), 0, 0);
    report("moe combine", shape + ", d 2048", time_ms([&] {
             kestrel::cuda::moe_combine(y.as<bf16>(), ids.as<int32_t>(), w.as<float>(), sh.as<bf16>(), nullptr, E + 1, n,
                                        k, d, out.as<bf16>(), nullptr);
           }), static_cast<double>(y.bytes + sh.bytes + out.bytes), 0);
  }
}

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const std::string& name, int32_t lo, int32_t hi, int32_t& out) {
      if (a.rfind(name + "=", 0) != 0) return false;
      char* end = nullptr;
      const long v = std::strtol(a.c_str() + name.size() + 1, &end, 10);
      if (*end != '\0' || v < lo || v > hi) {
        std::fprintf(stderr, "%s wants an integer in [%d, %d]\n", name.c_str(), lo, hi);
        std::exit(2);
      }
      out = static_cast<int32_t>(v);
      return true;
    };
    if (value("--attn-decode-stages", 0, 3, g_attn_decode_stages) ||
        value("--attn-fp8-decode-stages", 0, 3, g_attn_fp8_decode_stages) ||
        value("--attn-fp8-decode-key-tile", 0, 128, g_attn_fp8_decode_key_tile) ||
        value("--attn-items-per-block", 0, 64, g_attn_items_per_block) ||
        value("--attn-min-split-tiles", 0, 4096, g_attn_min_split_tiles))
      continue;
    if (a == "--pdl=on" || a == "--pdl=off") {
      kestrel::cuda::set_pdl_enabled(a == "--pdl=on");
      continue;
    }
    g_filter = a;
  }
  int n_dev = 0;
  if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
    std::printf("no CUDA device: benchmarks skipped\n");
    return 0;
  }
  cudaDeviceProp prop{};
  KESTREL_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %d SMs, %.0f MB L2\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize / 1e6);
  std::printf("%-16s %-44s %12s\n", "op", "shape", "median");
  try {
    // The machine's copy rate, the roofline that decode figures are set against (H200s differ by a
    // few percent between machines): a 4 GiB device-to-device copy, read + written bytes.
    if (wanted("copy")) {
      const size_t bytes = size_t{4} << 30;
      Buf src(bytes), dst(bytes);
      const double ms = time_ms([&] { KESTREL_CUDA_CHECK(cudaMemcpyAsync(dst.p, src.p, bytes, cudaMemcpyDeviceToDevice)); });
      report("copy", "4 GiB device to device (read + write)", ms, 2.0 * static_cast<double>(bytes), 0);
    }
    // Llama-3.1-8B: 32 query heads, 8 KV heads, head_dim 128; SmolLM2-135M: 9 / 3 / 64.
    bench_attention("prefill 1 x 2048, 32/8 heads, d128", 32, 8, 128, 16, {{2048, 2048}});
    bench_attention("prefill 4 x 512, 32/8 heads, d128", 32, 8, 128, 16, {{512, 512}, {512, 512}, {512, 512}, {512, 512}});
    bench_attention("prefill 1 x 2048, 9/3 heads, d64", 9, 3, 64, 16, {{2048, 2048}});
    bench_attention("chunk 512 at 8192, 32/8, d128", 32, 8, 128, 16, {{8192, 512}});
    bench_attention("decode 1 x ctx 32768, 32/8, d128 (split)", 32, 8, 128, 16, {{32768, 1}});
    {
      std::vector<std::pair<int, int>> s(64, {576, 1});  // kestrel bench --parallel 64 -p 512 -n 128: mean context
      bench_attention("decode 64 x ctx 576, 32/8, d128", 32, 8, 128, 16, s);
      bench_attention("decode 64 x ctx 576 graphed (max_context 1024)", 32, 8, 128, 16, s, 1024);
      s.assign(64, {2048, 1});
      bench_attention("decode 64 x ctx 2048, 32/8, d128", 32, 8, 128, 16, s);
      s.assign(256, {1024, 1});
      bench_attention("decode 256 x ctx 1024, 32/8, d128", 32, 8, 128, 16, s);
      // bf16 against FP8 caches, the same shapes (the FP8 KV cache's acceptance shapes first).
      for (const bool fp8 : {false, true}) {
        const std::string kv = fp8 ? ", fp8 KV" : ", bf16 KV";
        s.assign(64, {4096, 1});
        bench_attention("decode 64 x ctx 4096, 32/8, d128" + kv, 32, 8, 128, 16, s, 0, fp8);
        s.assign(256, {1024, 1});
        bench_attention("decode 256 x ctx 1024, 32/8, d128" + kv, 32, 8, 128, 16, s, 0, fp8);
        s.assign(64, {576, 1});
        bench_attention("decode 64 x ctx 576, 32/8, d128" + kv, 32, 8, 128, 16, s, 0, fp8);
        s.clear();
        for (int i = 0; i < 400; ++i) s.push_back({1000 + (i * 389) % 1000, 1});
        bench_attention("decode 400 x ctx 1000-2000, 32/8, d128" + kv, 32, 8, 128, 16, s, 0, fp8);
        bench_attention("decode 1 x ctx 32768, 32/8, d128" + kv, 32, 8, 128, 16, {{32768, 1}}, 0, fp8);
        s.assign(64, {2048, 1});
        bench_attention("decode 64 x ctx 2048, 9/3, d64" + kv, 9, 3, 64, 16, s, 0, fp8);
        // The prompt passes of the offline batch (1,000-token prompts, 8,192 tokens a pass).
        s.assign(8, {1000, 1000});
        bench_attention("prefill 8 x 1000, 32/8, d128" + kv, 32, 8, 128, 16, s, 0, fp8);
      }
      s.assign(63, {2048, 1});
      s.push_back({4096, 512});
      bench_attention("mixed 63 decodes @2048 + chunk 512 @4096", 32, 8, 128, 16, s);
      // The offline benchmark's steady state: 400 sequences at contexts spread over 1000-2000.
      s.clear();
      for (int i = 0; i < 400; ++i) s.push_back({1000 + (i * 389) % 1000, 1});
      bench_attention("decode 400 x ctx 1000-2000, 32/8, d128", 32, 8, 128, 16, s);
      // Batch 1 in a graph: a 128-token prompt 100 tokens in, block-table width 32 (512 keys).
      bench_attention("decode 1 x ctx 228 graphed (max_context 512)", 32, 8, 128, 16, {{228, 1}}, 512);
    }
    // Other head dims: Phi-2 (32/32, d80), Phi-3-mini (32/32, d96), Gemma-7B (16/16, d256),
    // Gemma-2B (8/1, d256); d8 (stories260K's, the SIMT kernel) and d48 (SIMT) at a large model's
    // head count for a per-key comparison with the tensor-core kernels.
    bench_attention("prefill 1 x 2048, 32/32 heads, d80", 32, 32, 80, 16, {{2048, 2048}});
    bench_attention("prefill 1 x 2048, 32/32 heads, d96", 32, 32, 96, 16, {{2048, 2048}});
    bench_attention("prefill 1 x 2048, 16/16 heads, d256", 16, 16, 256, 16, {{2048, 2048}});
    bench_attention("prefill 1 x 2048, 8/1 heads, d256", 8, 1, 256, 16, {{2048, 2048}});
    bench_attention("prefill 1 x 2048, 32/8 heads, d48 (SIMT)", 32, 8, 48, 16, {{2048, 2048}});
    bench_attention("prefill 1 x 2048, 8/4 heads, d8 (SIMT)", 8, 4, 8, 16, {{2048, 2048}});
    {
      std::vector<std::pair<int, int>> s(64, {576, 1});  // kestrel bench --parallel 64 -p 512 -n 128: mean context
      bench_attention("decode 64 x ctx 576, 32/8, d128", 32, 8, 128, 16, s);
      bench_attention("decode 64 x ctx 576 graphed (max_context 1024)", 32, 8, 128, 16, s, 1024);
      s.assign(64, {2048, 1});
      bench_attention("decode 64 x ctx 2048, 32/32, d96", 32, 32, 96, 16, s);
      bench_attention("decode 64 x ctx 2048, 16/16, d256", 16, 16, 256, 16, s);
      bench_attention("decode 64 x ctx 2048, 32/8, d48 (SIMT)", 32, 8, 48, 16, s);
      bench_attention("decode 64 x ctx 2048, 8/4, d8 (SIMT)", 8, 4, 8, 16, s);
      bench_attention("decode 1 x ctx 32768, 16/16, d256 (split)", 16, 16, 256, 16, {{32768, 1}});
    }
    bench_sampling();
    const int64_t n = 4096;  // tokens of a large prefill batch
    if (wanted("add_rms_norm")) {
      const int64_t dim = 4096;
      Buf res(n * dim * 4), add(n * dim * 2), w(dim * 2), out(n * dim * 2);
      fill_f32(res);
      fill_bf16(add);
      fill_bf16(w);
      const double ms = time_ms([&] {
        kestrel::cuda::add_rms_norm(res.as<float>(), add.as<bf16>(), w.as<bf16>(), out.as<bf16>(), n, dim, 1e-5f, nullptr);
      });
      report("add_rms_norm", "4096 x 4096", ms, n * dim * (4.0 + 4 + 2 + 2), 0);
    }
    if (wanted("silu_mul")) {
      const int64_t n_ff = 14336;
      Buf in(n * 2 * n_ff * 2), out(n * n_ff * 2);
      fill_bf16(in);
      const double ms = time_ms([&] { kestrel::cuda::silu_mul(in.as<bf16>(), out.as<bf16>(), n, n_ff, nullptr); });
      report("silu_mul", "4096 x 14336", ms, n * n_ff * 6.0, 0);
    }
    if (wanted("rope_write_kv")) {
      const int64_t nh = 32, nkv = 8, d = 128;
      Buf q(n * nh * d * 2), k(n * nkv * d * 2), v(k.bytes), kc(k.bytes), vc(k.bytes), pos(n * 4), slots(n * 8),
          inv(d / 2 * 4);
      fill_bf16(q);
      fill_bf16(k);
      fill_bf16(v);
      std::vector<int32_t> hp(static_cast<size_t>(n));
      std::vector<int64_t> hs(static_cast<size_t>(n));
      std::vector<float> hi(static_cast<size_t>(d / 2));
      for (int64_t i = 0; i < n; ++i) hp[static_cast<size_t>(i)] = static_cast<int32_t>(i), hs[static_cast<size_t>(i)] = i;
      for (int64_t i = 0; i < d / 2; ++i) hi[static_cast<size_t>(i)] = static_cast<float>(std::pow(500000.0, -2.0 * i / d));
      fill(pos, hp);
      fill(slots, hs);
      fill(inv, hi);
      const double ms = time_ms([&] {
        kestrel::cuda::rope_write_kv(q.as<bf16>(), k.as<bf16>(), v.as<bf16>(), pos.as<int32_t>(), slots.as<int64_t>(),
                                     inv.as<float>(), 1.0f, n, nh, nkv, d, d, true, kc.as<bf16>(), vc.as<bf16>(), 16,
                                     nullptr);
      });
      report("rope_write_kv", "4096 tokens, 32/8 heads, d128", ms, 2.0 * q.bytes + 4.0 * k.bytes, 0);
    }
#if !defined(KESTREL_CUDA_NO_GEMM)
    if (wanted("gemm")) {
      kestrel::cuda::Gemm gemm;
      struct G {
        int64_t t, in, out;
        kestrel::cuda::GemmOutput o;
        const char* what;
      };
      for (const G g : {G{4096, 4096, 4096, kestrel::cuda::GemmOutput::Bf16, "4096 x 4096 x 4096 (prefill)"},
                        G{4096, 4096, 28672, kestrel::cuda::GemmOutput::Bf16, "4096 x 4096 -> 28672 (gate|up)"},
                        G{1, 4096, 28672, kestrel::cuda::GemmOutput::Bf16, "1 x 4096 -> 28672 (decode)"},
                        G{64, 4096, 28672, kestrel::cuda::GemmOutput::Bf16, "64 x 4096 -> 28672 (decode)"},
                        G{64, 4096, 128256, kestrel::cuda::GemmOutput::F32, "64 x 4096 -> 128256 f32 (logits)"}}) {
        Buf x(g.t * g.in * 2), w(g.out * g.in * 2), y(g.t * g.out * (g.o == kestrel::cuda::GemmOutput::F32 ? 4 : 2));
        fill_bf16(x);
        fill_bf16(w);
        const double ms =
            time_ms([&] { gemm.run(x.as<bf16>(), w.as<bf16>(), y.p, g.o, g.t, g.in, g.out, nullptr); });
        report("gemm", g.what, ms, static_cast<double>(x.bytes + w.bytes + y.bytes), 2.0 * g.t * g.in * g.out);
      }
    }
    if (wanted("skinny")) bench_skinny();
    if (wanted("fp8")) bench_fp8();
    if (wanted("fp8scalar")) kestrel::bench::bench_fp8_scalar();
    if (wanted("overlap")) kestrel::bench::bench_overlap();
    if (wanted("int4")) kestrel::bench::bench_int4();
    if (wanted("gguf")) kestrel::bench::bench_gguf();
    if (wanted("streamtrace")) kestrel::bench::bench_stream_trace();
#endif
    if (wanted("moe")) bench_moe();
    if (wanted("mla")) bench_mla_decode();
    if (wanted("moe small")) bench_moe_small_ops();
    KESTREL_CUDA_CHECK(cudaDeviceSynchronize());
  } catch (const std::exception& e) {
    std::printf("benchmark failed: %s\n", e.what());
    return 1;
  }
  return 0;
}
