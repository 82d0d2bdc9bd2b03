// `kestrel_cuda_bench overlap`: whether a decode step's memory-bound attention and its
// compute-bound projections gain from running side by side on two streams, the batch split in two
// halves (micro-batches) whose layer chains are independent. The Llama-3.1-8B layer (32/8 heads,
// d128, FP8 E4M3 weights through Gemm::run_fp8_unscaled: qkv 4096->6144, o 4096->4096, gate|up
// 4096->28672, down 14336->4096) and an FP8 KV cache of block size 16, contexts uniform in
// [1000, 2000) keys (the offline run's 1,000-token prompts and 1,000 outputs). The row kernels
// between the products (norms, SwiGLU, RoPE) are left out. Every figure is microseconds a layer
// over a chain of kLayers layers:
//   full       one stream, all rows: products of R rows, attention over R sequences;
//   halves     one stream, the two halves' chains one layer after the other;
//   2 streams  half A's chain on one stream, half B's on another, B started after A's first qkv;
//              "B high": B's stream at the higher priority;
//   pair       one half's attention beside the other half's four products (no chain), against
//              the two alone.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/gemm.h"
#include "bench_util.h"

namespace kestrel::bench {

namespace {

constexpr int kHeads = 32, kHeadsKv = 8, kHeadDim = 128, kBlock = 16, kLayers = 8;

// One layer of FP8 KV cache for n_seqs decode rows (one query token each).
struct DecodeAttention {
  std::unique_ptr<Buf> q, out, kc, vc, ks, vs, qs, ctx, pos, tab, ws;
  kestrel::cuda::AttentionParams p{};
  double kv_bytes = 0;

  explicit DecodeAttention(int n_seqs) {
    std::vector<int32_t> qsv{0}, ctxv, posv, tables;
    const int max_ctx = 2000, max_blocks = (max_ctx + kBlock - 1) / kBlock;
    int n_blocks = 0;
    for (int s = 0; s < n_seqs; ++s) {
      const int c = 1000 + static_cast<int>(next_u32() % 1000u);
      ctxv.push_back(c);
      posv.push_back(c - 1);
      qsv.push_back(s + 1);
      const int nb = (c + kBlock - 1) / kBlock;
      for (int b = 0; b < max_blocks; ++b) tables.push_back(b < nb ? n_blocks + b : -1);
      n_blocks += nb;
      kv_bytes += 2.0 * c * kHeadsKv * (kHeadDim + 4);
    }
    std::vector<int32_t> perm(static_cast<size_t>(n_blocks));
    for (int i = 0; i < n_blocks; ++i) perm[static_cast<size_t>(i)] = i;
    for (int i = n_blocks - 1; i > 0; --i) std::swap(perm[static_cast<size_t>(i)], perm[next_u32() % (i + 1)]);
    for (auto& t : tables)
      if (t >= 0) t = perm[static_cast<size_t>(t)];
    const size_t rows = static_cast<size_t>(n_blocks) * kHeadsKv * kBlock;
    q = std::make_unique<Buf>(static_cast<size_t>(n_seqs) * kHeads * kHeadDim * 2);
    out = std::make_unique<Buf>(q->bytes);
    kc = std::make_unique<Buf>(rows * kHeadDim);
    vc = std::make_unique<Buf>(rows * kHeadDim);
    ks = std::make_unique<Buf>(rows * 4);
    vs = std::make_unique<Buf>(rows * 4);
    fill_bf16(*q);
    std::vector<uint8_t> codes(kc->bytes);  // magnitudes 2^-3 .. 2^6, no NaN codes
    for (auto& x : codes) {
      const uint32_t r = next_u32();
      x = static_cast<uint8_t>((r & 0x80u) | ((4u + (r >> 8) % 10u) << 3) | (r & 7u));
    }
    kc->upload(codes.data());
    vc->upload(codes.data());
    std::vector<float> scales(rows);
    for (auto& x : scales) x = (1.0f + static_cast<float>(next_u32() % 1024u) / 1024.0f) / 64.0f;
    ks->upload(scales.data());
    vs->upload(scales.data());
    qs = std::make_unique<Buf>(qsv.size() * 4);
    ctx = std::make_unique<Buf>(ctxv.size() * 4);
    pos = std::make_unique<Buf>(posv.size() * 4);
    tab = std::make_unique<Buf>(tables.size() * 4);
    fill(*qs, qsv);
    fill(*ctx, ctxv);
    fill(*pos, posv);
    fill(*tab, tables);
    p.q = q->as<bf16>();
    p.k_cache = kc->p;
    p.v_cache = vc->p;
    p.k_scale = ks->as<float>();
    p.v_scale = vs->as<float>();
    p.block_tables = tab->as<int32_t>();
    p.context_lens = ctx->as<int32_t>();
    p.query_start = qs->as<int32_t>();
    p.positions = pos->as<int32_t>();
    p.out = out->as<bf16>();
    p.n_tokens = n_seqs;
    p.n_seqs = n_seqs;
    p.max_blocks_per_seq = max_blocks;
    p.max_context = max_ctx;
    p.n_head = kHeads;
    p.n_head_kv = kHeadsKv;
    p.head_dim = kHeadDim;
    p.block_size = kBlock;
    p.scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
    p.max_query_len = 1;
    p.uniform_query_len = 1;
    ws = std::make_unique<Buf>(kestrel::cuda::attention_workspace_bytes(p));
    p.workspace = ws->p;
    p.workspace_bytes = ws->bytes;
  }
};

struct Proj {
  int64_t in, out;
};
constexpr Proj kQkv{4096, 6144}, kO{4096, 4096}, kGateUp{4096, 28672}, kDown{14336, 4096};

// The four FP8 weights of a layer and one half's activations and GEMM workspace.
struct Weights {
  Buf qkv{static_cast<size_t>(kQkv.in * kQkv.out)}, o{static_cast<size_t>(kO.in * kO.out)},
      gate_up{static_cast<size_t>(kGateUp.in * kGateUp.out)}, down{static_cast<size_t>(kDown.in * kDown.out)};
  Weights() {
    for (Buf* b : {&qkv, &o, &gate_up, &down}) fill_bf16(*b);  // random codes: a NaN now and then times the same
  }
};
struct Half {
  int64_t rows;
  Buf x, y;
  kestrel::cuda::Gemm gemm;
  explicit Half(int64_t r)
      : rows(r), x(static_cast<size_t>(r * kDown.in)), y(static_cast<size_t>(r * kGateUp.out) * 2) {
    fill_bf16(x);
  }
  void product(const Buf& w, Proj p, cudaStream_t s) {
    gemm.run_fp8_unscaled(x.as<uint8_t>(), w.as<uint8_t>(), y.as<bf16>(), rows, p.in, p.out, s);
  }
  void products(const Weights& w, cudaStream_t s) {
    product(w.qkv, kQkv, s);
    product(w.o, kO, s);
    product(w.gate_up, kGateUp, s);
    product(w.down, kDown, s);
  }
};

// One layer of a half's chain: qkv, attention, o, gate|up, down.
void layer(Half& h, DecodeAttention& a, const Weights& w, cudaStream_t s) {
  h.product(w.qkv, kQkv, s);
  kestrel::cuda::paged_attention(a.p, s);
  h.product(w.o, kO, s);
  h.product(w.gate_up, kGateUp, s);
  h.product(w.down, kDown, s);
}

void bench_rows(int64_t rows) {
  const int64_t half = rows / 2;
  Weights w;
  Half full(rows), ha(half), hb(half);
  DecodeAttention af(static_cast<int>(rows)), aa(static_cast<int>(half)), ab(static_cast<int>(half));
  int lo = 0, hi = 0;
  KESTREL_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
  cudaStream_t s1, s2, s2_high;
  KESTREL_CUDA_CHECK(cudaStreamCreateWithPriority(&s1, cudaStreamNonBlocking, lo));
  KESTREL_CUDA_CHECK(cudaStreamCreateWithPriority(&s2, cudaStreamNonBlocking, lo));
  KESTREL_CUDA_CHECK(cudaStreamCreateWithPriority(&s2_high, cudaStreamNonBlocking, hi));
  cudaEvent_t fork, join1, join2, b_start;
  for (cudaEvent_t* e : {&fork, &join1, &join2, &b_start})
    KESTREL_CUDA_CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
  // fn's work on s1 and s2 ordered after the timing stream's earlier work and before its later.
  auto two = [&](cudaStream_t t2, const std::function<void()>& fn) {
    KESTREL_CUDA_CHECK(cudaEventRecord(fork, nullptr));
    KESTREL_CUDA_CHECK(cudaStreamWaitEvent(s1, fork, 0));
    KESTREL_CUDA_CHECK(cudaStreamWaitEvent(t2, fork, 0));
    fn();
    KESTREL_CUDA_CHECK(cudaEventRecord(join1, s1));
    KESTREL_CUDA_CHECK(cudaEventRecord(join2, t2));
    KESTREL_CUDA_CHECK(cudaStreamWaitEvent(nullptr, join1, 0));
    KESTREL_CUDA_CHECK(cudaStreamWaitEvent(nullptr, join2, 0));
  };
  const std::string tag = std::to_string(rows) + " rows, ctx 1000-1999, FP8 KV + W8A8, ";
  auto per_layer = [](double ms) { return ms / kLayers; };
  const double attn_full = time_ms([&] { kestrel::cuda::paged_attention(af.p, nullptr); });
  const double gemm_full = time_ms([&] { full.products(w, nullptr); });
  const double attn_half = time_ms([&] { kestrel::cuda::paged_attention(aa.p, nullptr); });
  const double gemm_half = time_ms([&] { hb.products(w, nullptr); });
  report("overlap", tag + "attention alone", attn_full, af.kv_bytes, 0);
  report("overlap", tag + "4 products alone", gemm_full, 0, 2.0 * rows * 218.1e6);
  report("overlap", std::to_string(half) + " rows: attention alone", attn_half, aa.kv_bytes, 0);
  report("overlap", std::to_string(half) + " rows: 4 products alone", gemm_half, 0, 2.0 * half * 218.1e6);
  const double pair = time_ms([&] {
    two(s2, [&] {
      kestrel::cuda::paged_attention(aa.p, s1);
      hb.products(w, s2);
    });
  });
  report("overlap", std::to_string(half) + " rows: attention beside products", pair, 0, 0);
  const double pair_high = time_ms([&] {
    two(s2_high, [&] {
      kestrel::cuda::paged_attention(aa.p, s1);
      hb.products(w, s2_high);
    });
  });
  report("overlap", std::to_string(half) + " rows: the same, products high", pair_high, 0, 0);
  const double t_full = time_ms([&] {
    for (int l = 0; l < kLayers; ++l) layer(full, af, w, nullptr);
  });
  report("overlap", tag + "full, a layer", per_layer(t_full), 0, 0);
  const double t_halves = time_ms([&] {
    for (int l = 0; l < kLayers; ++l) {
      layer(ha, aa, w, nullptr);
      layer(hb, ab, w, nullptr);
    }
  });
  report("overlap", tag + "halves one stream, a layer", per_layer(t_halves), 0, 0);
  for (const bool high : {false, true}) {
    cudaStream_t t2 = high ? s2_high : s2;
    const double t = time_ms([&] {
      two(t2, [&] {
        ha.product(w.qkv, kQkv, s1);
        KESTREL_CUDA_CHECK(cudaEventRecord(b_start, s1));
        KESTREL_CUDA_CHECK(cudaStreamWaitEvent(t2, b_start, 0));
        kestrel::cuda::paged_attention(aa.p, s1);
        ha.product(w.o, kO, s1);
        ha.product(w.gate_up, kGateUp, s1);
        ha.product(w.down, kDown, s1);
        for (int l = 1; l < kLayers; ++l) layer(ha, aa, w, s1);
        for (int l = 0; l < kLayers; ++l) layer(hb, ab, w, t2);
      });
    });
    report("overlap", tag + (high ? "2 streams, B high, a layer" : "2 streams, a layer"), per_layer(t), 0, 0);
  }
  std::printf("overlap %lld rows: serial sum %.1f us a layer (attention %.1f + products %.1f)\n",
              static_cast<long long>(rows), (attn_full + gemm_full) * 1e3, attn_full * 1e3, gemm_full * 1e3);
  for (cudaEvent_t e : {fork, join1, join2, b_start}) (void)cudaEventDestroy(e);
  for (cudaStream_t s : {s1, s2, s2_high}) (void)cudaStreamDestroy(s);
}

}  // namespace

void bench_overlap() {
  for (const int64_t rows : {256, 480}) bench_rows(rows);
}

}  // namespace kestrel::bench
