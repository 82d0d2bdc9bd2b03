// The multi-head latent attention kernels (mla_ops.h) against float64 references written here in
// plain loops:
// - mla_attention: for token t of sequence s at position p and head h, softmax(q[t, h] . row_j *
//   scale) over the latent rows j in [0, p] of s's cache (through its shuffled block table), times
//   the rows' first r elements. Batches mix prefill chunks (with cached prefixes) and decode
//   tokens; contexts are not multiples of the block size; forced and chosen split counts, and a
//   graph's overstated max_context. Dims: the hf-tiny models' (r 32, R 8; 4 heads, and 20 heads:
//   two head chunks) and DeepSeek-V2's (r 512, R 64; 16 heads, and 2) at small contexts.
//   Tolerance: relative L2 error <= 4e-3 (q and the rows are exact bf16 values in both; the kernel
//   rounds the softmax weights and the output to bf16, 2^-9 relative each).
// - mla_head_gemm: y_h = x_h . w_h^T per head with strided rows, and the rotated RoPE part beside
//   it, in the decode form (up to 64 tokens, in groups of 16) and the tiled one; relative L2 <= 4e-3 (one bf16
//   rounding of y), untouched elements keep their poison.
// - mla_kv_write: the latent's RMSNorm and the key's RoPE as one cache row at each slot (a negative
//   slot writes nothing; every other element keeps its poison), the low-rank query's RMSNorm;
// - mla_split_kv_b: W_UK^T and W_UV of each head, exact copies of kv_b_proj's elements.
#include <algorithm>
#include <array>
#include <numeric>
#include <string>

#include "backend/cuda/mla_ops.h"
#include "cuda_test_util.h"

namespace kestrel::test {
namespace {

struct SeqSpec {
  int32_t context;  // tokens in the cache after this step
  int32_t q_len;    // this step's tokens: positions context - q_len ... context - 1
};

struct MlaCase {
  const char* name;
  int32_t n_head, r, rope, block_size;
  std::vector<SeqSpec> seqs;
  float q_range;
  int32_t n_splits = 0;              // forced split count (0: chosen)
  int32_t max_context_override = 0;  // > 0: passed instead of the true max_context
  bool pass_max_query_len = true;
};

void run_case(const MlaCase& c, std::mt19937& rng) {
  SCOPED_TRACE(c.name);
  const int32_t n_seqs = static_cast<int32_t>(c.seqs.size());
  const int32_t dk = c.r + c.rope;
  std::vector<int32_t> query_start{0}, positions, token_seq;
  int32_t max_blocks = 0, total_blocks = 0, max_context = 0, max_q = 0;
  for (int32_t s = 0; s < n_seqs; ++s) {
    const SeqSpec& sp = c.seqs[static_cast<size_t>(s)];
    for (int32_t i = 0; i < sp.q_len; ++i) {
      positions.push_back(sp.context - sp.q_len + i);
      token_seq.push_back(s);
    }
    query_start.push_back(query_start.back() + sp.q_len);
    const int32_t nb = (sp.context + c.block_size - 1) / c.block_size;
    max_blocks = std::max(max_blocks, nb);
    total_blocks += nb;
    max_context = std::max(max_context, sp.context);
    max_q = std::max(max_q, sp.q_len);
  }
  const int64_t n_tokens = query_start.back();
  const int32_t n_blocks = total_blocks + 3;  // some blocks belong to nobody
  std::vector<int32_t> ids(static_cast<size_t>(n_blocks));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  std::vector<int32_t> tables(static_cast<size_t>(n_seqs * max_blocks), -1);
  size_t next = 0;
  for (int32_t s = 0; s < n_seqs; ++s)
    for (int32_t b = 0; b < (c.seqs[static_cast<size_t>(s)].context + c.block_size - 1) / c.block_size; ++b)
      tables[static_cast<size_t>(s * max_blocks + b)] = ids[next++];

  const auto cache = random_bf16(static_cast<size_t>(n_blocks) * c.block_size * dk, rng);
  const auto q = random_bf16(static_cast<size_t>(n_tokens * c.n_head * dk), rng, -c.q_range, c.q_range);
  const float scale = 1.0f / std::sqrt(192.0f);

  DeviceBuffer<uint16_t> d_q(q), d_cache(cache), d_out(static_cast<size_t>(n_tokens * c.n_head * c.r));
  DeviceBuffer<int32_t> d_tables(tables), d_qs(query_start), d_pos(positions);
  cuda::MlaAttentionParams p;
  p.q = d_q.bf16();
  p.cache = d_cache.bf16();
  p.block_tables = d_tables.get();
  p.query_start = d_qs.get();
  p.positions = d_pos.get();
  p.out = d_out.bf16();
  p.n_tokens = n_tokens;
  p.n_seqs = n_seqs;
  p.max_blocks_per_seq = max_blocks;
  p.max_context = c.max_context_override > 0 ? c.max_context_override : max_context;
  p.max_query_len = c.pass_max_query_len ? max_q : 0;
  p.n_head = c.n_head;
  p.kv_lora_rank = c.r;
  p.rope_dim = c.rope;
  p.block_size = c.block_size;
  p.scale = scale;
  p.n_splits = c.n_splits;
  const size_t ws_bytes = cuda::mla_attention_workspace_bytes(p);
  EXPECT_LE(ws_bytes, cuda::mla_attention_workspace_bound(n_tokens, c.n_head, c.r, c.rope) +
                          (c.n_splits > 0 ? ws_bytes : 0));
  DeviceBuffer<unsigned char> d_ws(ws_bytes);
  d_ws.poison();
  p.workspace = d_ws.get();
  p.workspace_bytes = ws_bytes;
  d_out.poison();
  cuda::mla_attention(p, nullptr);
  const auto out = bf16_to_f32(d_out.download());

  std::vector<double> ref(out.size(), 0.0), w;
  for (int64_t t = 0; t < n_tokens; ++t) {
    const int32_t s = token_seq[static_cast<size_t>(t)], pos = positions[static_cast<size_t>(t)];
    auto row = [&](int32_t j) {
      const int64_t blk = tables[static_cast<size_t>(s * max_blocks + j / c.block_size)];
      return cache.data() + (blk * c.block_size + j % c.block_size) * dk;
    };
    for (int32_t h = 0; h < c.n_head; ++h) {
      const uint16_t* qh = q.data() + (t * c.n_head + h) * dk;
      w.assign(static_cast<size_t>(pos + 1), 0.0);
      double mx = -INFINITY;
      for (int32_t j = 0; j <= pos; ++j) {
        const uint16_t* kj = row(j);
        double dot = 0.0;
        for (int32_t d = 0; d < dk; ++d) dot += static_cast<double>(from_bf16(qh[d])) * from_bf16(kj[d]);
        w[static_cast<size_t>(j)] = dot * scale;
        mx = std::max(mx, w[static_cast<size_t>(j)]);
      }
      double sum = 0.0;
      for (auto& x : w) sum += (x = std::exp(x - mx));
      double* o = ref.data() + (t * c.n_head + h) * c.r;
      for (int32_t j = 0; j <= pos; ++j) {
        const uint16_t* vj = row(j);
        for (int32_t d = 0; d < c.r; ++d) o[d] += w[static_cast<size_t>(j)] / sum * from_bf16(vj[d]);
      }
    }
  }
  const double err = rel_error(out, ref);
  EXPECT_LE(err, 4e-3);
  std::printf("  %-58s n_tokens %4lld  rel error %.2e\n", c.name, static_cast<long long>(n_tokens), err);
}

TEST(CudaMlaAttention, TinyDimsMatchFloat64Reference) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(31);
  const std::vector<MlaCase> cases = {
      {"r32 R8, 4 heads: prefill, decode, cached prefix", 4, 32, 8, 16, {{37, 37}, {100, 1}, {1, 1}, {70, 13}}, 2.0f},
      {"r32 R8, 4 heads, block size 7, max_query_len unknown", 4, 32, 8, 7, {{20, 5}, {45, 1}, {3, 3}}, 2.0f, 0, 0,
       false},
      {"r32 R8, 20 heads (two head chunks), mixed", 20, 32, 8, 16, {{30, 9}, {90, 1}, {2, 2}}, 1.0f},
      {"r32 R8, 4 heads, decode, 3 splits forced", 4, 32, 8, 16, {{300, 1}, {65, 1}, {1, 1}}, 3.0f, 3},
      {"r32 R8, 4 heads, decode, chosen splits, graph bound 2048", 4, 32, 8, 16, {{200, 1}}, 3.0f, 0, 2048},
      {"r32 R8, 4 heads, 500 keys, max_context given as 100", 4, 32, 8, 16, {{500, 1}}, 1.0f, 0, 100},
      {"r32 R8, 4 heads, peaky softmax", 4, 32, 8, 16, {{64, 1}, {40, 4}}, 8.0f},
  };
  for (const auto& c : cases) run_case(c, rng);
}

TEST(CudaMlaAttention, DeepseekDimsMatchFloat64Reference) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(32);
  std::vector<MlaCase> cases = {
      {"r512 R64, 16 heads: prefill chunk, decodes", 16, 512, 64, 16, {{20, 6}, {45, 1}, {1, 1}}, 0.5f},
      {"r512 R64, 2 heads: one prefill tile of 8 tokens x 2 heads", 2, 512, 64, 16, {{19, 19}}, 0.5f},
      {"r512 R64, 16 heads, decode, 2 splits forced", 16, 512, 64, 16, {{70, 1}}, 0.5f, 2},
  };
  if (!kCudaEmulated) {
    cases.push_back({"r512 R64, 16 heads, long decode (chosen splits)", 16, 512, 64, 16, {{4001, 1}, {700, 1}}, 1.0f});
    cases.push_back({"r512 R64, 128 heads, mixed", 128, 512, 64, 16, {{300, 40}, {1000, 1}, {129, 1}}, 0.5f});
    cases.push_back({"r512 R64, 16 heads, 64 decodes, graph bound 1024", 16, 512, 64, 16,
                     std::vector<SeqSpec>(64, SeqSpec{513, 1}), 1.0f, 0, 1024});
  }
  for (const auto& c : cases) run_case(c, rng);
}

TEST(CudaMlaAttention, UnsupportedDimsAreRefused) {
  KESTREL_REQUIRE_CUDA();
  EXPECT_TRUE(cuda::mla_attention_supports(512, 64));
  EXPECT_TRUE(cuda::mla_attention_supports(32, 8));
  EXPECT_FALSE(cuda::mla_attention_supports(256, 32));
  cuda::MlaAttentionParams p;
  p.n_tokens = 1;
  p.n_seqs = 1;
  p.n_head = 4;
  p.kv_lora_rank = 256;
  p.rope_dim = 32;
  p.block_size = 16;
  std::string e;
  try {
    cuda::mla_attention_workspace_bytes(p);
  } catch (const Error& err) {
    e = err.what();
  }
  EXPECT_NE(e.find("kv_lora_rank 256 with qk_rope_head_dim 32 has no kernel"), std::string::npos) << e;
}

// RoPE of one pair in float64, as the reference of the kernels' rotations.
void rotate_ref(double& x0, double& x1, int32_t pos, float position_scale, float inv_freq) {
  const double angle = static_cast<double>(pos) / position_scale * inv_freq;
  const double a = x0, b = x1;
  x0 = a * std::cos(angle) - b * std::sin(angle);
  x1 = a * std::sin(angle) + b * std::cos(angle);
}

std::vector<float> inv_freqs(int32_t rope, double theta) {
  std::vector<float> f(static_cast<size_t>(rope / 2));
  for (size_t i = 0; i < f.size(); ++i) f[i] = static_cast<float>(std::pow(theta, -2.0 * static_cast<double>(i) / rope));
  return f;
}

struct HeadGemmCase {
  const char* name;
  int64_t n_tokens;
  int32_t n_head, n_in, n_out, rope;
  bool rotate_half;
};

TEST(CudaMlaHeadGemm, MatchesFloat64ReferenceWithTheRopePart) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(33);
  std::vector<HeadGemmCase> cases = {
      {"absorb q, tiny dims (nope 16 -> r 32, R 8), 5 tokens", 5, 4, 16, 32, 8, false},
      {"up-project, tiny dims (r 32 -> v 16), 70 tokens", 70, 4, 32, 16, 0, false},
      {"absorb q, DeepSeek dims (nope 128 -> r 512, R 64), 3 tokens", 3, 2, 128, 512, 64, false},
      {"up-project, DeepSeek dims (r 512 -> v 128), 1 token", 1, 3, 512, 128, 0, false},
      {"odd sizes (n_in 72, n_out 40), rotate-half RoPE 6", 9, 2, 72, 40, 6, true},
      {"absorb q, DeepSeek dims, 16 tokens (one group of the decode form)", 16, 2, 128, 512, 64, false},
      {"up-project, DeepSeek dims, 17 tokens (two groups, the second of one token)", 17, 2, 512, 128, 0, false},
      {"absorb q, DeepSeek dims, 64 tokens (the decode form's most)", 64, 2, 128, 512, 64, false},
      {"up-project, DeepSeek dims, 65 tokens (the tiled form)", 65, 2, 512, 128, 0, false},
  };
  if (!kCudaEmulated) cases.push_back({"absorb q, V2-Lite, 300 tokens", 300, 16, 128, 512, 64, false});
  for (const HeadGemmCase& c : cases) {
    SCOPED_TRACE(c.name);
    // x rows hold each head's n_in inputs then its rope part, then a gap (head strides: multiples of 8).
    const int64_t xh = (c.n_in + c.rope + 15) / 8 * 8, xs = c.n_head * xh + 16;
    const int64_t yh = (c.n_out + c.rope + 15) / 8 * 8, ys = c.n_head * yh + 8;
    const auto x = random_bf16(static_cast<size_t>(c.n_tokens * xs), rng);
    const auto w = random_bf16(static_cast<size_t>(c.n_head) * c.n_out * c.n_in, rng);
    std::vector<int32_t> pos(static_cast<size_t>(c.n_tokens));
    std::uniform_int_distribution<int32_t> pick(0, 5000);
    for (auto& p : pos) p = pick(rng);
    const auto inv = inv_freqs(std::max(c.rope, 2), 10000.0);
    DeviceBuffer<uint16_t> d_x(x), d_w(w), d_y(static_cast<size_t>(c.n_tokens * ys));
    DeviceBuffer<int32_t> d_pos(pos);
    DeviceBuffer<float> d_inv(inv);
    d_y.poison();
    cuda::MlaHeadGemmArgs a;
    a.x = d_x.bf16();
    a.x_stride = xs;
    a.x_head_stride = xh;
    a.w = d_w.bf16();
    a.y = d_y.bf16();
    a.y_stride = ys;
    a.y_head_stride = yh;
    a.n_tokens = c.n_tokens;
    a.n_head = c.n_head;
    a.n_in = c.n_in;
    a.n_out = c.n_out;
    a.rope_dim = c.rope;
    a.positions = d_pos.get();
    a.inv_freq = d_inv.get();
    a.position_scale = 1.0f;
    a.rotate_half = c.rotate_half;
    cuda::mla_head_gemm(a, nullptr);
    const auto yb = d_y.download();
    std::vector<float> got;
    std::vector<double> ref;
    for (int64_t t = 0; t < c.n_tokens; ++t)
      for (int32_t h = 0; h < c.n_head; ++h) {
        const uint16_t* xr = x.data() + t * xs + h * xh;
        for (int32_t o = 0; o < c.n_out; ++o) {
          double s = 0;
          for (int32_t i = 0; i < c.n_in; ++i)
            s += static_cast<double>(from_bf16(xr[i])) * from_bf16(w[static_cast<size_t>((h * c.n_out + o) * c.n_in + i)]);
          ref.push_back(s);
          got.push_back(from_bf16(yb[static_cast<size_t>(t * ys + h * yh + o)]));
        }
        for (int32_t p = 0; p < c.rope / 2; ++p) {
          const int32_t e0 = c.rotate_half ? p : 2 * p, e1 = c.rotate_half ? p + c.rope / 2 : 2 * p + 1;
          double x0 = from_bf16(xr[c.n_in + e0]), x1 = from_bf16(xr[c.n_in + e1]);
          rotate_ref(x0, x1, pos[static_cast<size_t>(t)], 1.0f, inv[static_cast<size_t>(p)]);
          ref.push_back(x0);
          ref.push_back(x1);
          got.push_back(from_bf16(yb[static_cast<size_t>(t * ys + h * yh + c.n_out + e0)]));
          got.push_back(from_bf16(yb[static_cast<size_t>(t * ys + h * yh + c.n_out + e1)]));
        }
        // The gap after each head's outputs keeps its poison.
        for (int64_t e = c.n_out + c.rope; e < yh; ++e) EXPECT_EQ(yb[static_cast<size_t>(t * ys + h * yh + e)], 0xFFFF);
      }
    const double err = rel_error(got, ref);
    EXPECT_LE(err, 4e-3);
    std::printf("  %-58s rel error %.2e\n", c.name, err);
  }
}

TEST(CudaMlaKvWrite, WritesNormedLatentAndRotatedKeyToTheSlotsOnly) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(34);
  struct Case {
    int64_t n_tokens;
    int32_t r, rope, q_lora, block_size;
    bool rotate_half;
  };
  for (const Case& c : {Case{6, 32, 8, 32, 16, false}, Case{5, 512, 64, 0, 16, false}, Case{4, 32, 8, 24, 5, true}}) {
    SCOPED_TRACE("r " + std::to_string(c.r) + " rope " + std::to_string(c.rope) + " q_lora " + std::to_string(c.q_lora));
    const int32_t dk = c.r + c.rope;
    const int64_t kv_stride = c.q_lora + dk + 8;  // [qa | latent | key | gap], as the stacked projection
    const auto in = random_bf16(static_cast<size_t>(c.n_tokens * kv_stride), rng, -2.0f, 2.0f);
    const auto kv_norm = random_bf16(static_cast<size_t>(c.r), rng, 0.5f, 1.5f);
    const auto qa_norm = random_bf16(static_cast<size_t>(std::max(c.q_lora, 1)), rng, 0.5f, 1.5f);
    const int32_t n_blocks = static_cast<int32_t>(c.n_tokens / c.block_size + 3);
    std::vector<int64_t> all(static_cast<size_t>(n_blocks * c.block_size));
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    std::vector<int64_t> slots(all.begin(), all.begin() + c.n_tokens);
    slots[1] = -1;  // a padding token
    std::vector<int32_t> pos(static_cast<size_t>(c.n_tokens));
    std::uniform_int_distribution<int32_t> pick(0, 70000);
    for (auto& p : pos) p = pick(rng);
    const auto inv = inv_freqs(c.rope, 10000.0);
    DeviceBuffer<uint16_t> d_in(in), d_kvn(kv_norm), d_qan(qa_norm),
        d_cache(static_cast<size_t>(n_blocks) * c.block_size * dk), d_qa(static_cast<size_t>(std::max<int64_t>(1, c.n_tokens * c.q_lora)));
    DeviceBuffer<int64_t> d_slots(slots);
    DeviceBuffer<int32_t> d_pos(pos);
    DeviceBuffer<float> d_inv(inv);
    d_cache.poison();
    d_qa.poison();
    cuda::MlaKvWriteArgs a;
    a.kv = d_in.bf16() + c.q_lora;
    a.kv_stride = kv_stride;
    a.kv_norm = d_kvn.bf16();
    if (c.q_lora > 0) {
      a.qa = d_in.bf16();
      a.qa_stride = kv_stride;
      a.qa_norm = d_qan.bf16();
      a.qa_out = d_qa.bf16();
      a.q_lora_rank = c.q_lora;
    }
    a.positions = d_pos.get();
    a.slot_mapping = d_slots.get();
    a.inv_freq = d_inv.get();
    a.rotate_half = c.rotate_half;
    a.n_tokens = c.n_tokens;
    a.kv_lora_rank = c.r;
    a.rope_dim = c.rope;
    a.eps = 1e-6f;
    a.cache = d_cache.bf16();
    a.block_size = c.block_size;
    cuda::mla_kv_write(a, nullptr);
    const auto cache = d_cache.download();
    const auto qa = d_qa.download();

    auto normed = [&](const uint16_t* x, const std::vector<uint16_t>& wt, int32_t n) {
      double ss = 0;
      for (int32_t i = 0; i < n; ++i) ss += static_cast<double>(from_bf16(x[i])) * from_bf16(x[i]);
      const double inv_rms = 1.0 / std::sqrt(ss / n + 1e-6);
      std::vector<double> y(static_cast<size_t>(n));
      for (int32_t i = 0; i < n; ++i) y[static_cast<size_t>(i)] = from_bf16(x[i]) * inv_rms * from_bf16(wt[static_cast<size_t>(i)]);
      return y;
    };
    std::vector<float> got, got_qa;
    std::vector<double> ref, ref_qa;
    std::vector<bool> written(cache.size(), false);
    for (int64_t t = 0; t < c.n_tokens; ++t) {
      const uint16_t* row = in.data() + t * kv_stride;
      if (c.q_lora > 0) {
        const auto y = normed(row, qa_norm, c.q_lora);
        ref_qa.insert(ref_qa.end(), y.begin(), y.end());
        for (int32_t i = 0; i < c.q_lora; ++i) got_qa.push_back(from_bf16(qa[static_cast<size_t>(t * c.q_lora + i)]));
      }
      const int64_t slot = slots[static_cast<size_t>(t)];
      if (slot < 0) continue;
      std::vector<double> y = normed(row + c.q_lora, kv_norm, c.r);
      y.resize(static_cast<size_t>(dk));
      for (int32_t i = 0; i < c.rope; ++i) y[static_cast<size_t>(c.r + i)] = from_bf16(row[c.q_lora + c.r + i]);
      for (int32_t p = 0; p < c.rope / 2; ++p) {
        const int32_t e0 = c.rotate_half ? p : 2 * p, e1 = c.rotate_half ? p + c.rope / 2 : 2 * p + 1;
        rotate_ref(y[static_cast<size_t>(c.r + e0)], y[static_cast<size_t>(c.r + e1)], pos[static_cast<size_t>(t)], 1.0f,
                   inv[static_cast<size_t>(p)]);
      }
      for (int32_t i = 0; i < dk; ++i) {
        written[static_cast<size_t>(slot * dk + i)] = true;
        got.push_back(from_bf16(cache[static_cast<size_t>(slot * dk + i)]));
      }
      ref.insert(ref.end(), y.begin(), y.end());
    }
    EXPECT_LE(rel_error(got, ref), 4e-3);
    if (c.q_lora > 0) EXPECT_LE(rel_error(got_qa, ref_qa), 4e-3);
    for (size_t i = 0; i < cache.size(); ++i)
      if (!written[i]) ASSERT_EQ(cache[i], 0xFFFF) << "stray write at element " << i;
  }
}

TEST(CudaMlaSplitKvB, RearrangesEachHeadsRowsExactly) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(35);
  for (const auto [H, nope, v, r] : {std::array<int64_t, 4>{4, 16, 16, 32}, std::array<int64_t, 4>{3, 128, 128, 512}}) {
    SCOPED_TRACE("heads " + std::to_string(H) + " r " + std::to_string(r));
    const auto kvb = random_bf16(static_cast<size_t>(H * (nope + v) * r), rng);
    DeviceBuffer<uint16_t> d_kvb(kvb), d_uk(static_cast<size_t>(H * r * nope)), d_uv(static_cast<size_t>(H * v * r));
    d_uk.poison();
    d_uv.poison();
    cuda::mla_split_kv_b(d_kvb.bf16(), H, nope, v, r, d_uk.bf16(), d_uv.bf16(), nullptr);
    const auto uk = d_uk.download(), uv = d_uv.download();
    for (int64_t h = 0; h < H; ++h)
      for (int64_t j = 0; j < r; ++j) {
        for (int64_t i = 0; i < nope; ++i)
          ASSERT_EQ(uk[static_cast<size_t>((h * r + j) * nope + i)], kvb[static_cast<size_t>((h * (nope + v) + i) * r + j)]);
        for (int64_t i = 0; i < v; ++i)
          ASSERT_EQ(uv[static_cast<size_t>((h * v + i) * r + j)],
                    kvb[static_cast<size_t>((h * (nope + v) + nope + i) * r + j)]);
      }
  }
}

}  // namespace
}  // namespace kestrel::test
