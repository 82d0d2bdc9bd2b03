// CUDA paged attention against a float64 reference written here in plain loops: for token t of
// sequence s at position p and query head h, softmax(q . k_j * scale) over keys j in [0, p] of the
// sequence's cache (through its block table, KV head h / group), times v_j. Batches mix prefill
// chunks (some with a cached prefix) and decode tokens; block tables are shuffled; contexts are not
// multiples of the block size; GQA groups 1, 2, 3, 4, 8, 20, 32 and 72; long decode contexts take the
// split-KV path. Head dims: 64 and 128, the other tensor-core ones (32, 80, 96, 256) and the SIMT
// kernel's (8 = stories260K, 24, 40, 48, 136, 248; and every multiple of 8 up to 256 once).
// Tolerance: relative L2 error <= 4e-3. q, K and V are exact bf16 values in both; the tensor-core
// kernels round the softmax weights to bf16 and all kernels round the output to bf16 (2^-9
// relative each, ~1.5e-3 measured on the emulation).
// FP8 caches (AttentionParams::k_scale / v_scale): the random bf16 cache quantized per row on the
// host (kv_fp8_reference.h); the reference attends the dequantized values (code x scale, exact in
// double) and the bound stays 4e-3: the codes widen to bf16 exactly, and the kernels add only f32
// products by the scales and the bf16 rounding of the V-scaled weights (2^-9 relative).
#include <algorithm>
#include <cstring>
#include <numeric>
#include <string>

#include "cuda_test_util.h"
#include "kv_fp8_reference.h"

namespace kestrel::test {
namespace {

struct SeqSpec {
  int32_t context;  // tokens in the cache after this step
  int32_t q_len;    // this step's tokens: positions context - q_len ... context - 1
};

struct AttnCase {
  const char* name;
  int32_t n_head, n_head_kv, head_dim, block_size;
  std::vector<SeqSpec> seqs;
  float q_range;          // q uniform in [-q_range, q_range]: larger means peakier softmax
  bool pass_max_query_len;
  int32_t max_context_override = 0;  // > 0: pass this max_context (too small, or a graph's too large
                                     // bound) instead of the true one
  int32_t decode_stages = 0;         // AttentionParams::decode_stages
  int32_t window = 0;                // AttentionParams::window (0: none)
  bool fp8 = false;                  // an FP8 cache
  // Magnitudes (the FP8 fragment path's f16 ranges): q head h times q_head_scale[h % size];
  // K and V values times k_scale / v_scale; V row i (in cache order) also times 2^(i * 7 % 25 - 12).
  std::vector<float> q_head_scale = {};
  float k_scale = 1.0f, v_scale = 1.0f;
  bool v_row_spread = false;
  int32_t fp8_key_tile = 0;  // AttentionParams::fp8_decode_key_tile
  // Every sequence has the same q_len: pass it as AttentionParams::uniform_query_len, and require
  // on the prefill kernel (decode_rows off) the output bit for bit equal to the call without it
  // (plan kernel + tile list + decode launch); on the decode kernels (decode_rows, runs of up to
  // kDecodeRowsMaxQuery) each row bit for bit equal to a one-token call of the same sequences at
  // its position; both within the reference's tolerance.
  bool uniform = false;
};

void run_case(const AttnCase& c, std::mt19937& rng) {
  SCOPED_TRACE(c.name);
  const int32_t n_seqs = static_cast<int32_t>(c.seqs.size());
  const int32_t D = c.head_dim, group = c.n_head / c.n_head_kv;
  std::vector<int32_t> query_start{0}, context_lens, positions, token_seq;
  int32_t max_blocks = 0, total_blocks = 0, max_context = 0, max_q = 0;
  for (int32_t s = 0; s < n_seqs; ++s) {
    const SeqSpec& sp = c.seqs[static_cast<size_t>(s)];
    for (int32_t i = 0; i < sp.q_len; ++i) {
      positions.push_back(sp.context - sp.q_len + i);
      token_seq.push_back(s);
    }
    query_start.push_back(query_start.back() + sp.q_len);
    context_lens.push_back(sp.context);
    const int32_t nb = (sp.context + c.block_size - 1) / c.block_size;
    max_blocks = std::max(max_blocks, nb);
    total_blocks += nb;
    max_context = std::max(max_context, sp.context);
    max_q = std::max(max_q, sp.q_len);
  }
  const int64_t n_tokens = query_start.back();
  const int32_t n_blocks = total_blocks + 5;  // some blocks belong to nobody
  std::vector<int32_t> ids(static_cast<size_t>(n_blocks));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  std::vector<int32_t> tables(static_cast<size_t>(n_seqs * max_blocks), -1);
  size_t next = 0;
  for (int32_t s = 0; s < n_seqs; ++s)
    for (int32_t b = 0; b < (context_lens[static_cast<size_t>(s)] + c.block_size - 1) / c.block_size; ++b)
      tables[static_cast<size_t>(s * max_blocks + b)] = ids[next++];

  const size_t cache_n = static_cast<size_t>(n_blocks) * c.n_head_kv * c.block_size * D;
  auto k_cache = random_bf16(cache_n, rng, -c.k_scale, c.k_scale), v_cache = random_bf16(cache_n, rng, -c.v_scale, c.v_scale);
  auto q = random_bf16(static_cast<size_t>(n_tokens * c.n_head * D), rng, -c.q_range, c.q_range);
  if (!c.q_head_scale.empty())
    for (size_t i = 0; i < q.size(); ++i)
      q[i] = to_bf16(from_bf16(q[i]) * c.q_head_scale[i / static_cast<size_t>(D) % static_cast<size_t>(c.n_head) %
                                                      c.q_head_scale.size()]);
  if (c.v_row_spread)
    for (size_t i = 0; i < cache_n; ++i)
      v_cache[i] = to_bf16(std::ldexp(from_bf16(v_cache[i]), static_cast<int>(i / static_cast<size_t>(D) * 7 % 25) - 12));
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  // The values the kernels attend (the reference's K and V): the bf16 cache, or its FP8 rows.
  const Fp8Rows kq = c.fp8 ? quantize_rows_e4m3(k_cache, D) : Fp8Rows{};
  const Fp8Rows vq = c.fp8 ? quantize_rows_e4m3(v_cache, D) : Fp8Rows{};
  std::vector<double> k_val(cache_n), v_val(cache_n);
  if (c.fp8) {
    k_val = dequantize_rows(kq, D);
    v_val = dequantize_rows(vq, D);
  } else {
    for (size_t i = 0; i < cache_n; ++i) k_val[i] = from_bf16(k_cache[i]), v_val[i] = from_bf16(v_cache[i]);
  }

  DeviceBuffer<uint16_t> d_q(q), d_k(k_cache), d_v(v_cache), d_out(q.size());
  DeviceBuffer<uint8_t> d_kq(kq.codes), d_vq(vq.codes);
  DeviceBuffer<float> d_ks(kq.scales), d_vs(vq.scales);
  DeviceBuffer<int32_t> d_tables(tables), d_ctx(context_lens), d_qs(query_start), d_pos(positions), d_seq(token_seq);
  cuda::AttentionParams p{};
  p.q = d_q.bf16();
  p.k_cache = c.fp8 ? static_cast<const void*>(d_kq.get()) : d_k.bf16();
  p.v_cache = c.fp8 ? static_cast<const void*>(d_vq.get()) : d_v.bf16();
  p.k_scale = c.fp8 ? d_ks.get() : nullptr;
  p.v_scale = c.fp8 ? d_vs.get() : nullptr;
  p.block_tables = d_tables.get();
  p.context_lens = d_ctx.get();
  p.query_start = d_qs.get();
  p.token_seq = d_seq.get();
  p.positions = d_pos.get();
  p.out = d_out.bf16();
  p.n_tokens = n_tokens;
  p.n_seqs = n_seqs;
  p.max_blocks_per_seq = max_blocks;
  p.max_context = c.max_context_override > 0 ? c.max_context_override : max_context;
  p.n_head = c.n_head;
  p.n_head_kv = c.n_head_kv;
  p.head_dim = D;
  p.block_size = c.block_size;
  p.scale = scale;
  p.max_query_len = c.pass_max_query_len ? max_q : 0;
  p.decode_stages = c.decode_stages;
  p.fp8_decode_key_tile = c.fp8_key_tile;
  p.window = c.window;
  const size_t ws_bytes = cuda::attention_workspace_bytes(p);
  DeviceBuffer<unsigned char> d_ws(ws_bytes);
  d_ws.poison();
  p.workspace = d_ws.get();
  p.workspace_bytes = ws_bytes;
  d_out.poison();
  cuda::paged_attention(p, nullptr);
  const auto out = bf16_to_f32(d_out.download());
  std::vector<float> rows_out;  // the decode kernels' rows of a uniform case
  if (c.uniform) {
    for (const SeqSpec& sp : c.seqs) ASSERT_EQ(sp.q_len, max_q) << "a uniform case with unequal query runs";
    p.max_query_len = p.uniform_query_len = max_q;
    p.decode_rows = false;
    d_out.poison();
    d_ws.poison();
    cuda::paged_attention(p, nullptr);
    const auto uniform_out = bf16_to_f32(d_out.download());
    size_t differ = 0;
    for (size_t i = 0; i < out.size(); ++i) differ += std::memcmp(&out[i], &uniform_out[i], sizeof(float)) != 0;
    EXPECT_EQ(differ, 0u) << "outputs with uniform_query_len differ from the planned call's";
    // Inconsistent with the batch: an error, nothing launched.
    p.uniform_query_len = max_q + 1;
    EXPECT_THROW(cuda::paged_attention(p, nullptr), Error);
    p.uniform_query_len = max_q;
    if (max_q <= cuda::kDecodeRowsMaxQuery) {
      p.decode_rows = true;
      const size_t rows_ws = cuda::attention_workspace_bytes(p);
      DeviceBuffer<unsigned char> d_rows_ws(rows_ws);
      d_rows_ws.poison();
      p.workspace = d_rows_ws.get();
      p.workspace_bytes = rows_ws;
      d_out.poison();
      cuda::paged_attention(p, nullptr);
      rows_out = bf16_to_f32(d_out.download());
      // Token j of every sequence as a one-token step of the same sequences (same max_context).
      const size_t row_elems = static_cast<size_t>(c.n_head) * D;
      for (int32_t j = 0; j < max_q; ++j) {
        std::vector<int32_t> qs1{0}, pos1, seq1;
        std::vector<uint16_t> q1;
        for (int32_t s = 0; s < n_seqs; ++s) {
          const size_t t = static_cast<size_t>(s * max_q + j);
          qs1.push_back(s + 1);
          pos1.push_back(positions[t]);
          seq1.push_back(s);
          q1.insert(q1.end(), q.begin() + static_cast<std::ptrdiff_t>(t * row_elems),
                    q.begin() + static_cast<std::ptrdiff_t>((t + 1) * row_elems));
        }
        DeviceBuffer<uint16_t> d_q1(q1), d_out1(q1.size());
        DeviceBuffer<int32_t> d_qs1(qs1), d_pos1(pos1), d_seq1(seq1);
        cuda::AttentionParams p1 = p;
        p1.q = d_q1.bf16();
        p1.out = d_out1.bf16();
        p1.query_start = d_qs1.get();
        p1.positions = d_pos1.get();
        p1.token_seq = d_seq1.get();
        p1.n_tokens = n_seqs;
        p1.max_query_len = p1.uniform_query_len = 1;
        const size_t ws1 = cuda::attention_workspace_bytes(p1);
        DeviceBuffer<unsigned char> d_ws1(ws1);
        d_ws1.poison();
        p1.workspace = d_ws1.get();
        p1.workspace_bytes = ws1;
        d_out1.poison();
        cuda::paged_attention(p1, nullptr);
        const auto one = bf16_to_f32(d_out1.download());
        size_t row_differ = 0;
        for (int32_t s = 0; s < n_seqs; ++s)
          row_differ += std::memcmp(one.data() + static_cast<size_t>(s) * row_elems,
                                    rows_out.data() + static_cast<size_t>(s * max_q + j) * row_elems,
                                    row_elems * sizeof(float)) != 0;
        EXPECT_EQ(row_differ, 0u) << "token " << j << " of a run on the decode kernels differs from its one-token step";
      }
    }
    p.uniform_query_len = 0;
  }

  std::vector<double> ref(q.size());
  std::vector<double> w;
  for (int64_t t = 0; t < n_tokens; ++t) {
    const int32_t s = token_seq[static_cast<size_t>(t)], pos = positions[static_cast<size_t>(t)];
    for (int32_t h = 0; h < c.n_head; ++h) {
      const int32_t kvh = h / group;
      const uint16_t* qh = q.data() + (t * c.n_head + h) * D;
      auto key_row = [&](const std::vector<double>& cache, int32_t j) {
        const int64_t blk = tables[static_cast<size_t>(s * max_blocks + j / c.block_size)];
        return cache.data() + ((blk * c.n_head_kv + kvh) * c.block_size + j % c.block_size) * D;
      };
      // Keys [lo, pos]: with a window W, the W most recent ones (the query's own included).
      const int32_t lo = c.window > 0 ? std::max(0, pos + 1 - c.window) : 0;
      w.assign(static_cast<size_t>(pos + 1), 0.0);
      double mx = -INFINITY;
      for (int32_t j = lo; j <= pos; ++j) {
        const double* kj = key_row(k_val, j);
        double dot = 0.0;
        for (int32_t d = 0; d < D; ++d) dot += static_cast<double>(from_bf16(qh[d])) * kj[d];
        w[static_cast<size_t>(j)] = dot * scale;
        mx = std::max(mx, w[static_cast<size_t>(j)]);
      }
      double sum = 0.0;
      for (int32_t j = lo; j <= pos; ++j) sum += (w[static_cast<size_t>(j)] = std::exp(w[static_cast<size_t>(j)] - mx));
      double* o = ref.data() + (t * c.n_head + h) * D;
      for (int32_t j = lo; j <= pos; ++j) {
        const double* vj = key_row(v_val, j);
        for (int32_t d = 0; d < D; ++d) o[d] += w[static_cast<size_t>(j)] / sum * vj[d];
      }
    }
  }
  const double err = rel_error(out, ref);
  EXPECT_LE(err, 4e-3);
  std::printf("  %-44s %s n_tokens %4lld  rel error %.2e\n", c.name, c.fp8 ? "fp8 " : "bf16",
              static_cast<long long>(n_tokens), err);
  if (!rows_out.empty()) {
    const double rows_err = rel_error(rows_out, ref);
    EXPECT_LE(rows_err, 4e-3) << "the decode kernels' rows";
    std::printf("  %-44s %s decode rows      rel error %.2e\n", c.name, c.fp8 ? "fp8 " : "bf16", rows_err);
  }
}

// An FP8 cache on every kernel: prefill, chunked prefill over a cached prefix, decode with split-KV
// (and a graph's max_context bound), GQA and MQA groups with several head chunks, sliding windows,
// both decode stage counts, block sizes that are not powers of two, the tensor-core head dims and
// the SIMT kernel's (8, 40).
TEST(CudaPagedAttention, Fp8CacheMatchesFloat64Reference) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(21);
  std::vector<AttnCase> cases = {
      {"8B shape d128 group 4, prefill + decodes", 32, 8, 128, 16, {{130, 130}, {513, 1}, {64, 1}}, 3.0f, true},
      {"d64 group 3, chunks over cached prefixes", 9, 3, 64, 16, {{37, 37}, {100, 1}, {1, 1}, {70, 13}}, 1.0f, true},
      {"d128, chunk + decode at 2000 / 2500 (split-KV)", 8, 2, 128, 16, {{2000, 5}, {2500, 1}}, 1.0f, true},
      {"d128 decode 3001 keys, graph bound 4096", 8, 2, 128, 16, {{3001, 1}, {65, 1}}, 2.0f, true, 4096},
      {"d128 decode, 3 stages, block size 7", 8, 2, 128, 7, {{700, 1}, {33, 1}}, 2.0f, true, 0, 3},
      {"d128 decode, 2 stages", 8, 2, 128, 16, {{1500, 1}, {150, 1}}, 2.0f, true, 0, 2},
      {"MQA group 32 d64: two decode head chunks", 32, 1, 64, 16, {{40, 9}, {90, 1}}, 1.0f, true},
      {"group 72 d64: two prefill head chunks", 72, 1, 64, 16, {{20, 3}, {33, 1}}, 1.0f, false},
      {"d80 (padded tiles, odd k-steps)", 8, 4, 80, 16, {{90, 40}, {500, 1}}, 1.0f, true},
      {"d96", 8, 2, 96, 16, {{70, 70}, {300, 1}}, 1.0f, true},
      {"d32", 4, 2, 32, 16, {{64, 33}, {190, 1}}, 1.0f, true},
      {"d256 group 4 (Q in shared memory, 32-key prefill tiles)", 4, 1, 256, 16, {{150, 150}, {700, 1}}, 2.0f, true},
      {"stories260K shape d8 (SIMT), mixed", 8, 4, 8, 16, {{40, 40}, {70, 1}, {25, 6}, {1, 1}}, 1.0f, true},
      {"d40 (SIMT) group 3, long decode", 6, 2, 40, 16, {{2049, 1}, {90, 25}}, 2.0f, false},
      {"d64 window 70, decodes split over the window", 8, 2, 64, 8, {{3001, 1}, {130, 1}, {71, 1}}, 2.0f, true},
      {"d128 window 100, prefill 300 in one chunk", 8, 2, 128, 16, {{300, 300}, {513, 1}}, 2.0f, true},
      {"d16 SIMT, window 16, block 4", 4, 2, 16, 4, {{100, 100}, {40, 1}, {60, 7}}, 2.0f, true},
  };
  for (AttnCase& c : cases) {
    c.fp8 = true;
    if (std::string(c.name).find("window") != std::string::npos)
      c.window = c.head_dim == 128 ? 100 : c.head_dim == 64 ? 70 : 16;
    run_case(c, rng);
  }
}

// Verify-step shapes (every sequence 1 + k query tokens): the prefill kernel's tiles from its block
// index, no plan kernel and no decode launch, the same bits as the planned call; and the decode
// kernels with a row an item, each row the bits of its one-token step. Query runs of 2 to 9 tokens, one tile per sequence or several (group 72: one token per tile), split-KV-sized
// contexts, an FP8 cache, a window, the SIMT head dims.
TEST(CudaPagedAttention, UniformQueryRunsGiveThePlannedCallsBits) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(31);
  std::vector<AttnCase> cases = {
      {"SmolLM2 shape, 1 x (1 + 4)", 9, 3, 64, 16, {{300, 5}}, 1.0f, true},
      {"SmolLM2 shape, 1 x (1 + 4), graph bound 4096", 9, 3, 64, 16, {{1100, 5}}, 1.0f, true, 4096},
      {"SmolLM2 shape, 3 x (1 + 8)", 9, 3, 64, 16, {{20, 9}, {9, 9}, {1000, 9}}, 1.0f, true},
      {"MHA d128, block size 7, 2 x 2", 4, 4, 128, 7, {{77, 2}, {200, 2}}, 2.0f, true},
      {"group 72 d64: 3 tiles a sequence", 72, 1, 64, 16, {{20, 3}, {33, 3}}, 1.0f, true},
      {"stories260K shape d8 (SIMT), 2 x 5", 8, 4, 8, 16, {{40, 5}, {70, 5}}, 1.0f, true},
      {"d40 (SIMT) group 3, 2 x 4", 6, 2, 40, 16, {{2049, 4}, {90, 4}}, 2.0f, true},
      {"d64 window 70, 2 x 5", 8, 2, 64, 8, {{3001, 5}, {130, 5}}, 2.0f, true, 0, 0, 70},
  };
  if (!kCudaEmulated)  // a real model's size: the d128 tiles are covered by the MHA case on the emulation
    cases.push_back({"8B shape, 4 x (1 + 4)", 32, 8, 128, 16, {{130, 5}, {513, 5}, {6, 5}, {2000, 5}}, 3.0f, true});
  for (AttnCase c : cases) {
    c.uniform = true;
    run_case(c, rng);
    c.fp8 = true;
    run_case(c, rng);
  }
}

TEST(CudaPagedAttention, MixedBatchesMatchFloat64Reference) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(6);
  const std::vector<AttnCase> cases = {
      {"SmolLM2 shape (group 3, d64), mixed", 9, 3, 64, 16, {{37, 37}, {100, 1}, {1, 1}, {70, 13}, {17, 2}}, 1.0f, true},
      {"Llama-3.1-8B shape (group 4, d128), mixed", 32, 8, 128, 16, {{130, 130}, {513, 1}, {64, 1}}, 3.0f, true},
      {"MHA (group 1, d128), block size 7", 4, 4, 128, 7, {{77, 77}, {200, 1}, {5, 3}}, 2.0f, false},
      {"group 8 (d64), block size 8, cached prefix", 16, 2, 64, 8, {{50, 50}, {300, 31}, {129, 1}}, 1.0f, true},
      {"MQA group 32 (d64): two decode head chunks", 32, 1, 64, 16, {{40, 9}, {90, 1}}, 1.0f, true},
      {"group 72 (d64): two prefill head chunks", 72, 1, 64, 16, {{20, 3}, {33, 1}}, 1.0f, false},
  };
  for (const auto& c : cases) run_case(c, rng);
}

TEST(CudaPagedAttention, LongContextsSplitKv) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(7);
  const std::vector<AttnCase> cases = {
      {"decode only, 3001 and 1500 keys (split-KV)", 8, 2, 128, 16, {{3001, 1}, {1500, 1}}, 3.0f, true},
      {"decode d64 group 3, 2049 keys (split-KV)", 9, 3, 64, 32, {{2049, 1}}, 1.0f, false},
      {"chunk + decode, 2000 and 2500 keys", 8, 2, 128, 16, {{2000, 5}, {2500, 1}}, 1.0f, true},
      // max_context understated: the last split must take the rest of the context.
      {"3001 keys, max_context given as 1000", 8, 2, 128, 16, {{3001, 1}}, 1.0f, true, 1000},
      // max_context overstated, as a CUDA graph's block-table bound: splits sized for 4096 keys.
      {"decodes at 300, 700 and 65 keys, max_context given as 4096", 8, 2, 128, 16, {{300, 1}, {700, 1}, {65, 1}},
       2.0f, true, 4096},
      // One sequence of 2 tiles among several splits: the splits past its tiles have no keys.
      {"65 keys alone, max_context given as 4096 (empty splits)", 8, 1, 128, 16, {{65, 1}}, 2.0f, true, 4096},
  };
  for (const auto& c : cases) run_case(c, rng);
}

// Sliding windows (Mistral, Gemma 3's local layers): a query at position p attends keys
// (p - W, p] only. Windows smaller and larger than a 64-key tile, not multiples of it, starting
// mid-block and mid-tile; prefill chunks whose rows start at different tiles; decodes whose window
// spans one to several split-KV ranges; the tensor-core head dims (64, 128, 256) and the SIMT
// kernel's (16, 40).
TEST(CudaPagedAttention, SlidingWindowsMatchFloat64Reference) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(17);
  std::vector<AttnCase> cases = {
      {"d64 group 3, window 16, mixed", 9, 3, 64, 16, {{37, 37}, {100, 1}, {1, 1}, {70, 13}}, 2.0f, true},
      {"d128 group 4, window 100, prefill 300 in one chunk", 8, 2, 128, 16, {{300, 300}, {513, 1}}, 2.0f, true},
      {"d256 MQA group 4 (Gemma 3 270M), window 512, long decode", 4, 1, 256, 16, {{1500, 1}, {700, 40}}, 2.0f,
       true},
      {"d64, window 70, decodes split over the window", 8, 2, 64, 8, {{3001, 1}, {130, 1}, {71, 1}}, 2.0f, true},
      {"d16 SIMT (mistral-swa-tiny), window 16, block 4", 4, 2, 16, 4, {{100, 100}, {40, 1}, {60, 7}}, 2.0f, true},
      {"d40 SIMT, window 33, long decode", 6, 3, 40, 16, {{2049, 1}, {90, 25}}, 2.0f, false},
  };
  const int32_t windows[] = {16, 100, 512, 70, 16, 33};
  for (size_t i = 0; i < cases.size(); ++i) {
    cases[i].window = windows[i];
    run_case(cases[i], rng);
  }
}

// Many decode sequences with contexts from 1 key to 12 tiles, prefill chunks among them (decode
// blocks with nothing to do, returning before the kernel's griddepcontrol.wait), at the true
// max_context and at a graph's larger bound.
TEST(CudaPagedAttention, ManyDecodesAmongPrefillChunks) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(11);
  std::vector<SeqSpec> seqs;
  std::uniform_int_distribution<int32_t> context(1, 700);
  for (int i = 0; i < 30; ++i) {
    if (i % 10 == 4) seqs.push_back({context(rng) + 20, 20});  // a prefill chunk among the decodes
    seqs.push_back({i == 0 ? 1 : context(rng), 1});
  }
  const std::vector<AttnCase> cases = {
      {"33 sequences, 32/8 heads d128, graph bound 1024", 32, 8, 128, 16, seqs, 2.0f, true, 1024},
      {"33 sequences, 8/2 heads d64, true max_context", 8, 2, 64, 16, seqs, 2.0f, true},
      {"33 sequences, 8/2 heads d40 (SIMT), graph bound 2048", 8, 2, 40, 16, seqs, 2.0f, true, 2048},
  };
  for (const auto& c : cases) run_case(c, rng);
}

// The decode kernel with two and with three K/V stages (three: two tiles loading while one is
// computed) forced, whatever the item count would pick: contexts of 1, 2, 3 and many tiles,
// splits, prefill sequences among the decodes, and the head dims with padded tiles (80) and Q in
// shared memory (256).
TEST(CudaPagedAttention, EachDecodeStageCountMatchesFloat64Reference) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(12);
  for (const int32_t stages : {2, 3}) {
    SCOPED_TRACE("decode_stages " + std::to_string(stages));
    const std::vector<AttnCase> cases = {
        {"d128, 1 to 3 tiles and a prefill chunk", 32, 8, 128, 16, {{1, 1}, {64, 1}, {100, 1}, {150, 1}, {90, 20}},
         2.0f, true, 0, stages},
        {"d128, 3001 and 1500 keys (split-KV)", 8, 2, 128, 16, {{3001, 1}, {1500, 1}}, 2.0f, true, 0, stages},
        {"d128, 65 keys alone, max_context given as 4096", 8, 1, 128, 16, {{65, 1}}, 2.0f, true, 4096, stages},
        {"d64 group 3, block size 7", 9, 3, 64, 7, {{300, 1}, {33, 1}, {700, 1}}, 1.0f, true, 0, stages},
        {"d80 group 2", 8, 4, 80, 16, {{500, 1}, {2, 1}}, 1.0f, true, 0, stages},
        {"d256 group 8", 8, 1, 256, 16, {{400, 1}, {129, 1}}, 2.0f, true, 0, stages},
    };
    for (const auto& c : cases) run_case(c, rng);
  }
}

// The decode kernel's FP8 fragment path (head dims 64 and 128: codes straight into f16 mma
// fragments, S^T and O^T with the heads as the mma's n, paged_attention_fp8.cuh) at each of its
// stage counts and stage sizes (128 and 64 keys), groups of 3 to 32 heads (items of up to 8), splits that end inside a 128-key tile
// (3001 keys), and the f16 ranges it works in: q rows far beyond f16's range (1e6, with K values of 1e-6) and far below it (1e-7, with K
// of 1e6) in one batch, V rows whose scales differ by up to 2^24 (the running V exponent grows
// across tiles and splits), tiny and huge V, masked first tiles of a window.
TEST(CudaPagedAttention, Fp8DecodeFragmentPathMatchesFloat64Reference) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(33);
  for (const auto [stages, key_tile] : {std::pair{2, 128}, std::pair{3, 128}, std::pair{2, 64}, std::pair{3, 64}}) {
    SCOPED_TRACE("decode_stages " + std::to_string(stages) + ", key tile " + std::to_string(key_tile));
    std::vector<AttnCase> cases = {
        {"d128 group 4, 1 to 3 tiles + prefill", 32, 8, 128, 16, {{1, 1}, {64, 1}, {130, 1}, {190, 1}, {90, 20}}, 2.0f,
         true},
        {"d128 group 8 (every head column), 129 and 257 keys", 16, 2, 128, 16, {{129, 1}, {257, 1}}, 2.0f, true},
        {"d128 group 12 (head chunks of 8 and 4)", 24, 2, 128, 16, {{300, 1}, {17, 1}}, 2.0f, true},
        {"d64 MQA group 32 (four head chunks)", 32, 1, 64, 16, {{1000, 1}, {5, 1}}, 1.0f, true},
        {"d128, 3001 and 1500 keys (split-KV)", 8, 2, 128, 16, {{3001, 1}, {1500, 1}}, 2.0f, true},
        {"d64 group 3, block size 7", 9, 3, 64, 7, {{300, 1}, {33, 1}, {700, 1}}, 1.0f, true},
        {"d128 q heads 1e6, 1, 1e-7, 3e5 (beyond f16), K 1e-6", 8, 2, 128, 16, {{700, 1}, {65, 1}}, 1.0f, true},
        {"d64 q heads 1e-7, 2e-6 (below f16 normals), K 1e6", 8, 4, 64, 16, {{400, 1}, {65, 1}}, 1.0f, true},
        {"d64 V row scales spread over 2^24, split", 8, 2, 64, 16, {{2500, 1}, {300, 1}}, 2.0f, true},
        {"d128 V values 1e-30 and K 1e-3", 8, 1, 128, 16, {{500, 1}}, 2.0f, true},
        {"d128 V values 1e30", 8, 1, 128, 16, {{500, 1}}, 2.0f, true},
        {"d64 window 70 (masked first tiles)", 8, 2, 64, 8, {{3001, 1}, {130, 1}}, 2.0f, true},
    };
    for (AttnCase& c : cases) {
      c.fp8 = true;
      c.decode_stages = stages;
      c.fp8_key_tile = key_tile;
      const std::string name = c.name;
      if (name.find("beyond") != std::string::npos) c.q_head_scale = {1e6f, 1.0f, 1e-7f, 3e5f}, c.k_scale = 1e-6f;
      if (name.find("below") != std::string::npos) c.q_head_scale = {1e-7f, 2e-6f}, c.k_scale = 1e6f;
      if (name.find("spread") != std::string::npos) c.v_row_spread = true;
      if (name.find("1e-30") != std::string::npos) c.v_scale = 1e-30f, c.k_scale = 1e-3f;
      if (name.find("1e30") != std::string::npos) c.v_scale = 1e30f;
      if (name.find("window") != std::string::npos) c.window = 70;
      run_case(c, rng);
    }
  }
}

// Head dims other than 64 and 128: the tensor-core kernels' odd k-step count (80: 5 x 16), padded
// tiles (32, 80, 96), Q read from shared memory and 32-key prefill tiles (256), and the SIMT
// kernel (8, 24, 40, 48, 136, 248); prefill chunks longer than one block's tokens, cached
// prefixes, GQA groups 1, 2, 4, 8 and 20 (two head chunks on the SIMT kernel).
TEST(CudaPagedAttention, OtherHeadDimsMatchFloat64Reference) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(8);
  std::vector<AttnCase> cases = {
      {"stories260K shape (d8, group 2), mixed", 8, 4, 8, 16, {{40, 40}, {70, 1}, {25, 6}, {1, 1}, {33, 2}}, 1.0f, true},
      {"d8 MQA group 8, block size 5", 8, 1, 8, 5, {{30, 30}, {17, 1}}, 2.0f, false},
      {"d8 group 20: two head chunks", 20, 1, 8, 16, {{10, 3}, {12, 1}}, 1.0f, true},
      {"d32 MHA, chunk of 70 (two tiles)", 4, 4, 32, 16, {{90, 70}, {50, 1}, {9, 4}}, 1.0f, true},
      {"d32 group 4, block size 8", 8, 2, 32, 8, {{40, 20}, {60, 1}}, 2.0f, true},
      {"Phi-2 shape (d80, MHA), block size 7", 4, 4, 80, 7, {{45, 45}, {100, 1}, {12, 3}}, 2.0f, true},
      {"d80 group 2", 4, 2, 80, 16, {{30, 10}, {64, 1}}, 1.0f, false},
      {"Phi-3 shape (d96, MHA)", 3, 3, 96, 16, {{50, 50}, {80, 1}}, 2.0f, true},
      {"d96 group 4, cached prefix", 8, 2, 96, 16, {{33, 17}, {129, 1}, {2, 2}}, 1.0f, true},
      {"Gemma-2B shape (d256, group 8)", 8, 1, 256, 16, {{40, 40}, {70, 1}}, 2.0f, true},
      {"d256 group 2, chunk of 40 after 35", 4, 2, 256, 16, {{75, 40}, {33, 1}}, 1.0f, true},
      {"d256 MHA, block size 8", 2, 2, 256, 8, {{20, 7}, {5, 1}}, 1.0f, false},
      {"d24 (SIMT) group 4", 8, 2, 24, 16, {{37, 37}, {60, 1}}, 2.0f, true},
      {"d40 (SIMT) MHA, block size 7", 3, 3, 40, 7, {{50, 20}, {31, 1}}, 1.0f, true},
      {"d48 (SIMT) group 2", 4, 2, 48, 16, {{21, 21}, {40, 1}}, 1.0f, false},
      {"d136 (SIMT) group 4", 4, 1, 136, 16, {{30, 9}, {45, 1}}, 1.0f, true},
      {"d248 (SIMT, over 48 KB shared)", 2, 1, 248, 16, {{40, 12}, {20, 1}}, 1.0f, true},
  };
  if (!kCudaEmulated) {  // real-model sizes
    std::vector<SeqSpec> decodes;
    for (int i = 0; i < 48; ++i) decodes.push_back({200 + 37 * i, 1});
    decodes.push_back({700, 300});
    cases.push_back({"stories260K shape, 48 decodes + chunk 300", 8, 4, 8, 16, decodes, 1.0f, true});
    cases.push_back({"Phi-2 shape (d80, 32/32), prefill 1 x 600", 32, 32, 80, 16, {{600, 600}}, 2.0f, true});
    cases.push_back({"Phi-3 shape (d96, 32/32), 48 decodes + chunk 300", 32, 32, 96, 16, decodes, 2.0f, true});
    cases.push_back(
        {"Gemma-7B shape (d256, 16/16), prefill 2 x 300", 16, 16, 256, 16, {{300, 300}, {310, 300}}, 2.0f, true});
    cases.push_back({"d256 group 8, chunk 512 at 1024", 8, 1, 256, 16, {{1024, 512}, {900, 1}}, 2.0f, true});
    cases.push_back({"d40 (SIMT) group 4, 48 decodes + chunk 300", 16, 4, 40, 16, decodes, 1.0f, true});
  }
  for (const auto& c : cases) run_case(c, rng);
}

TEST(CudaPagedAttention, OtherHeadDimsLongContextsSplitKv) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(9);
  std::vector<AttnCase> cases = {
      {"stories260K shape (d8), 2100 and 900 keys", 8, 4, 8, 16, {{2100, 1}, {900, 1}}, 2.0f, true},
      {"d32 group 2, 1300 keys", 4, 2, 32, 16, {{1300, 1}}, 1.0f, true},
      {"Phi-2 shape (d80), 1800 keys", 4, 4, 80, 16, {{1800, 1}}, 2.0f, true},
      {"d96 group 4, chunk + decode, 1500 and 2000 keys", 8, 2, 96, 16, {{1500, 3}, {2000, 1}}, 1.0f, true},
      {"d256 group 8, 2049 keys, block size 32", 8, 1, 256, 32, {{2049, 1}}, 2.0f, false},
      // max_context understated: the last split must take the rest of the context.
      {"d40 (SIMT), 3001 keys, max_context given as 1000", 4, 2, 40, 16, {{3001, 1}}, 1.0f, true, 1000},
      {"d40 (SIMT), 300 and 65 keys, max_context given as 4096", 4, 2, 40, 16, {{300, 1}, {65, 1}}, 1.0f, true, 4096},
      {"d40 (SIMT), 65 keys alone, max_context given as 4096 (empty splits)", 4, 1, 40, 16, {{65, 1}}, 1.0f, true,
       4096},
  };
  if (!kCudaEmulated) {
    cases.push_back({"d256 group 2, 4 decodes at up to 20000 keys", 8, 4, 256, 16,
                     {{20000, 1}, {19000, 1}, {15000, 1}, {20000, 1}}, 3.0f, true});
    cases.push_back({"d8 group 2, 30000 keys", 8, 4, 8, 16, {{30000, 1}}, 3.0f, true});
    cases.push_back({"d80 MHA, 12000 keys", 32, 32, 80, 16, {{12000, 1}}, 3.0f, true});
  }
  for (const auto& c : cases) run_case(c, rng);
}

// Every supported head dim once (the SIMT kernel's four register variants and each tensor-core
// instantiation), prefill and decode in one batch.
TEST(CudaPagedAttention, EverySupportedHeadDim) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(10);
  for (int32_t d = 8; d <= 256; d += 8) {
    ASSERT_TRUE(cuda::attention_supports_head_dim(d)) << d;
    const std::string name = "head_dim " + std::to_string(d);
    run_case({name.c_str(), 4, 2, d, 16, {{20, 5}, {37, 1}}, 1.0f, true}, rng);
  }
}

// Fused RoPE + KV write (AttentionParams::rope): the decode kernel reads q un-rotated from the QKV
// rows and the token's last split writes its k and v into the cache; the output and the whole of
// both caches must be the same bits as rope_write_kv_fused followed by paged_attention. Decode-only
// batches: contexts of 1 key, tile edges, splits (a graph's larger max_context), a padding token
// (slot -1, nothing written), rotate-half and interleaved pairs, a partial rope_dim, linear position
// scaling, two head chunks (group 32: both chunks' last splits write the same bits), head dims 32,
// 64, 80 and 96 (padded tiles), 128 and 256, each with two and three K/V stages.
struct FusedRopeCase {
  const char* name;
  int32_t n_head, n_head_kv, head_dim, block_size, rope_dim;
  bool rotate_half;
  float position_scale;
  std::vector<int32_t> contexts;
  int32_t max_context;  // passed as the bound (>= the largest context)
  int padding_seq;      // this sequence's token has slot -1 (-1: none)
  int32_t decode_stages = 0;
  bool fp8 = false;  // an FP8 cache: rope_write_kv_fused_fp8 then attention, against the fused form
};

void run_fused_rope_case(const FusedRopeCase& c, std::mt19937& rng) {
  SCOPED_TRACE(c.name);
  const int32_t n_seqs = static_cast<int32_t>(c.contexts.size()), D = c.head_dim;
  std::vector<int32_t> query_start{0}, positions;
  int32_t max_blocks = 0, total = 0;
  for (const int32_t ctx : c.contexts) {
    positions.push_back(ctx - 1);
    query_start.push_back(query_start.back() + 1);
    max_blocks = std::max(max_blocks, (ctx + c.block_size - 1) / c.block_size);
    total += (ctx + c.block_size - 1) / c.block_size;
  }
  const int32_t n_blocks = total + 3;
  std::vector<int32_t> ids(static_cast<size_t>(n_blocks));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  std::vector<int32_t> tables(static_cast<size_t>(n_seqs * max_blocks), -1);
  std::vector<int64_t> slots;
  size_t next = 0;
  for (int32_t s = 0; s < n_seqs; ++s) {
    const int32_t ctx = c.contexts[static_cast<size_t>(s)];
    for (int32_t b = 0; b < (ctx + c.block_size - 1) / c.block_size; ++b)
      tables[static_cast<size_t>(s * max_blocks + b)] = ids[next++];
    const int32_t pos = ctx - 1;
    slots.push_back(s == c.padding_seq ? -1
                                       : int64_t{tables[static_cast<size_t>(s * max_blocks + pos / c.block_size)]} *
                                                 c.block_size + pos % c.block_size);
  }
  const int64_t stride = int64_t{c.n_head + 2 * c.n_head_kv} * D + 8;  // rows not packed
  const auto qkv = random_bf16(static_cast<size_t>(n_seqs * stride), rng, -2.0f, 2.0f);
  const size_t cache_n = static_cast<size_t>(n_blocks) * c.n_head_kv * c.block_size * D;
  const auto k_cache = random_bf16(cache_n, rng), v_cache = random_bf16(cache_n, rng);
  std::vector<float> inv_freq(static_cast<size_t>(c.rope_dim / 2));
  for (size_t i = 0; i < inv_freq.size(); ++i)
    inv_freq[i] = static_cast<float>(std::pow(10000.0, -2.0 * static_cast<double>(i) / c.rope_dim));

  DeviceBuffer<uint16_t> d_qkv(qkv), d_q(static_cast<size_t>(n_seqs * c.n_head * D));
  DeviceBuffer<uint16_t> k_a(k_cache), v_a(v_cache), k_b(k_cache), v_b(v_cache);
  const Fp8Rows kq = quantize_rows_e4m3(k_cache, D), vq = quantize_rows_e4m3(v_cache, D);
  DeviceBuffer<uint8_t> kq_a(kq.codes), vq_a(vq.codes), kq_b(kq.codes), vq_b(vq.codes);
  DeviceBuffer<float> ks_a(kq.scales), vs_a(vq.scales), ks_b(kq.scales), vs_b(vq.scales);
  DeviceBuffer<uint16_t> out_a(static_cast<size_t>(n_seqs * c.n_head * D)), out_b(out_a.size());
  DeviceBuffer<int32_t> d_tables(tables), d_qs(query_start), d_pos(positions);
  DeviceBuffer<int64_t> d_slots(slots);
  DeviceBuffer<float> d_freq(inv_freq);
  cuda::AttentionParams p{};
  p.block_tables = d_tables.get();
  p.query_start = d_qs.get();
  p.positions = d_pos.get();
  p.n_tokens = n_seqs;
  p.n_seqs = n_seqs;
  p.max_blocks_per_seq = max_blocks;
  p.max_context = c.max_context;
  p.n_head = c.n_head;
  p.n_head_kv = c.n_head_kv;
  p.head_dim = D;
  p.block_size = c.block_size;
  p.scale = 1.0f / std::sqrt(static_cast<float>(D));
  p.max_query_len = 1;
  p.decode_stages = c.decode_stages;
  const size_t ws_bytes = cuda::attention_workspace_bytes(p);
  DeviceBuffer<unsigned char> d_ws(ws_bytes);
  d_ws.poison();
  p.workspace = d_ws.get();
  p.workspace_bytes = ws_bytes;
  // A: the separate RoPE kernel, then attention.
  if (c.fp8) {
    cuda::rope_write_kv_fused_fp8(d_qkv.bf16(), stride, d_q.bf16(), d_pos.get(), d_slots.get(), d_freq.get(),
                                  c.position_scale, n_seqs, c.n_head, c.n_head_kv, D, c.rope_dim, c.rotate_half,
                                  {kq_a.get(), vq_a.get(), ks_a.get(), vs_a.get()}, c.block_size, nullptr);
    p.k_cache = kq_a.get();
    p.v_cache = vq_a.get();
    p.k_scale = ks_a.get();
    p.v_scale = vs_a.get();
  } else {
    cuda::rope_write_kv_fused(d_qkv.bf16(), stride, d_q.bf16(), d_pos.get(), d_slots.get(), d_freq.get(),
                              c.position_scale, n_seqs, c.n_head, c.n_head_kv, D, c.rope_dim, c.rotate_half,
                              k_a.bf16(), v_a.bf16(), c.block_size, nullptr);
    p.k_cache = k_a.bf16();
    p.v_cache = v_a.bf16();
  }
  p.q = d_q.bf16();
  p.out = out_a.bf16();
  out_a.poison();
  cuda::paged_attention(p, nullptr);
  const auto want = out_a.download();
  const auto want_k = k_a.download(), want_v = v_a.download();
  const auto want_kq = kq_a.download(), want_vq = vq_a.download();
  const auto want_ks = ks_a.download(), want_vs = vs_a.download();
  if (c.fp8) {
    ASSERT_NE(want_kq, kq.codes);  // the step's keys were written
  } else {
    ASSERT_NE(want_k, k_cache);
  }
  // B: fused, on fresh copies of the caches.
  {
    if (c.fp8) {
      p.k_cache = kq_b.get();
      p.v_cache = vq_b.get();
      p.k_scale = ks_b.get();
      p.v_scale = vs_b.get();
    } else {
      k_b.upload(k_cache);
      v_b.upload(v_cache);
      p.k_cache = k_b.bf16();
      p.v_cache = v_b.bf16();
    }
    p.q = nullptr;
    p.out = out_b.bf16();
    p.rope = {d_qkv.bf16(), stride, d_slots.get(), d_freq.get(), c.position_scale, c.rope_dim, c.rotate_half};
    out_b.poison();
    d_ws.poison();
    cuda::paged_attention(p, nullptr);
    EXPECT_EQ(out_b.download(), want);
    if (c.fp8) {
      EXPECT_EQ(kq_b.download(), want_kq);
      EXPECT_EQ(vq_b.download(), want_vq);
      EXPECT_EQ(ks_b.download(), want_ks);  // no NaN: every scale is a positive number
      EXPECT_EQ(vs_b.download(), want_vs);
    } else {
      EXPECT_EQ(k_b.download(), want_k);
      EXPECT_EQ(v_b.download(), want_v);
    }
  }
  // Refused before any launch: an odd or too large rope_dim, a pass that may hold prefill tokens,
  // qkv rows too short for q, k and v.
  for (const int32_t bad_dim : {c.rope_dim - 1, D + 2}) {
    p.rope.rope_dim = bad_dim;
    EXPECT_THROW(cuda::paged_attention(p, nullptr), Error) << bad_dim;
  }
  p.rope.rope_dim = c.rope_dim;
  p.max_query_len = 0;
  EXPECT_THROW(cuda::paged_attention(p, nullptr), Error);
  p.max_query_len = 1;
  p.rope.stride = int64_t{c.n_head + 2 * c.n_head_kv - 1} * D;
  EXPECT_THROW(cuda::paged_attention(p, nullptr), Error);
  p.rope.stride = stride;
  p.rope.slot_mapping = nullptr;
  EXPECT_THROW(cuda::paged_attention(p, nullptr), Error);
  p.rope.slot_mapping = d_slots.get();
  p.rope.qkv = d_qkv.bf16() + 4;  // 8 bytes off: rows not 16-byte aligned
  EXPECT_THROW(cuda::paged_attention(p, nullptr), Error);
}

TEST(CudaPagedAttention, FusedRopeIsRopeThenAttention) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(14);
  const std::vector<FusedRopeCase> cases = {
      {"8B shape d128, rotate-half, graph bound 1024 (splits)", 32, 8, 128, 16, 128, true, 1.0f,
       {1, 64, 65, 300, 700}, 1024, 2},
      {"d64 group 3, interleaved, rope_dim 32, scale 2, block 8", 9, 3, 64, 8, 32, false, 2.0f, {5, 129, 2049}, 2049,
       -1},
      {"MQA group 32 d64 (two head chunks)", 32, 1, 64, 16, 64, true, 1.0f, {40, 90, 1}, 4096, -1},
      {"d80 (padded tiles), rope_dim 64, interleaved", 8, 2, 80, 16, 64, false, 1.0f, {33, 200}, 512, 0},
      {"d96, rotate-half over rope_dim 64 (a partial NeoX rotation)", 8, 2, 96, 16, 64, true, 1.0f, {70, 130}, 256, -1},
      {"d256, rotate-half", 8, 1, 256, 16, 256, true, 1.0f, {3, 700}, 2048, -1},
      {"d32, interleaved", 4, 2, 32, 16, 32, false, 1.0f, {17, 64, 190}, 256, 1},
  };
  // Both K/V stage counts of the decode kernel for each (the item count alone would pick three),
  // with a bf16 and an FP8 cache.
  for (FusedRopeCase c : cases) {
    for (const int32_t stages : {2, 3}) {
      for (const bool fp8 : {false, true}) {
        SCOPED_TRACE("decode_stages " + std::to_string(stages) + (fp8 ? ", fp8 cache" : ", bf16 cache"));
        c.decode_stages = stages;
        c.fp8 = fp8;
        run_fused_rope_case(c, rng);
      }
    }
  }
  EXPECT_FALSE(cuda::attention_supports_fused_rope(40));
  EXPECT_TRUE(cuda::attention_supports_fused_rope(128));
}

TEST(CudaPagedAttention, RejectsUnsupportedShapes) {
  for (int32_t d : {0, 4, 12, 100, 264, 512, -8}) EXPECT_FALSE(cuda::attention_supports_head_dim(d)) << d;
  cuda::AttentionParams p{};
  p.n_tokens = 1;
  p.n_seqs = 1;
  p.n_head = 8;
  p.n_head_kv = 2;
  p.block_size = 16;
  for (int32_t d : {0, 12, 100, 264}) {
    p.head_dim = d;
    EXPECT_THROW(cuda::attention_workspace_bytes(p), Error) << d;
  }
  p.head_dim = 64;
  p.n_head_kv = 3;
  EXPECT_THROW(cuda::attention_workspace_bytes(p), Error);
}

}  // namespace
}  // namespace kestrel::test
