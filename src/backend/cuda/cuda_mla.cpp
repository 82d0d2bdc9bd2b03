// Multi-head latent attention on the CUDA backend (DeepSeek-V2, arXiv:2405.04434 sec. 2.1), run
// absorbed as the CPU backend runs it (cpu_mla.cpp): the cache holds per token and layer one row
// [c_KV | k_R] (bf16, r + R elements), head h's query becomes [W_UK_h^T q_nope_h | RoPE(q_rope_h)],
// all heads attend over the latent rows (MQA, the latent as the value), and head h's output is
// W_UV_h times its latent output. Per layer and pass:
//   1. [QA | KvA] (or [Q | KvA]) . x: one projection of the normed input (stacked at load);
//   2. mla_kv_write: RMSNorm of the latent, RoPE of the key, the cache row; RMSNorm of QA's output;
//   3. QB (with a low-rank query);
//   4. mla_head_gemm: q_lat_h = W_UK_h^T q_nope_h per head, the rotated q_rope_h beside it;
//   5. mla_attention over the latent cache -> o_lat [n, H, r];
//   6. mla_head_gemm: out_h = W_UV_h o_lat_h -> Act `out` [n, H * v].
// Prefill runs absorbed too (one kernel for both; the up-projected form would read per-head K/V of
// 2 x 128 x 128 elements per token instead of 576).
#include <algorithm>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_model_runner.h"
#include "backend/cuda/mla_ops.h"
#include "core/error.h"

namespace kestrel::cuda_runner {

using cuda::WeightUploader;

void CudaModelRunner::prepare_mla() {
  const MlaHparams& m = hp_.mla;
  const int64_t H = hp_.n_head, r = m.kv_lora_rank, R = m.qk_rope, nope = m.qk_nope, vd = m.v_head_dim;
  if (!cuda::mla_attention_supports(static_cast<int32_t>(r), static_cast<int32_t>(R)))
    throw Error("CUDA backend: multi-head latent attention with kv_lora_rank " + std::to_string(r) +
                " and qk_rope_head_dim " + std::to_string(R) +
                " has no kernel (supported: 512 with 64, 32 with 8); use --device cpu");
  // The per-head GEMMs read 16-byte chunks of each head's rows.
  if (nope % 8 != 0 || vd % 8 != 0 || R % 8 != 0)
    throw Error("CUDA backend: MLA needs qk_nope_head_dim (" + std::to_string(nope) + "), v_head_dim (" +
                std::to_string(vd) + ") and qk_rope_head_dim (" + std::to_string(R) + ") multiples of 8");
  const ModelWeights& W = model_.weights();
  WeightUploader up(stream_);
  mla_.resize(static_cast<size_t>(hp_.n_layer));
  for (int32_t l = 0; l < static_cast<int32_t>(hp_.n_layer); ++l) {
    Layer& L = layers_[static_cast<size_t>(l)];
    MlaLayer& M = mla_[static_cast<size_t>(l)];
    // The query's first projection and KvA read the same input: one stacked matrix, one GEMM.
    const WeightRole q_role = m.q_lora_rank > 0 ? WeightRole::QA : WeightRole::Q;
    const WeightView* views[2] = {&W.at({l, q_role}).matrix, &W.at({l, WeightRole::KvA}).matrix};
    M.in = up.matrices(views);
    M.q_rows = views[0]->n_out;
    M.in_rows = views[0]->n_out + views[1]->n_out;
    L[q_role] = DeviceWeight{};
    L[WeightRole::KvA] = DeviceWeight{};
    // KvB [H (nope + v), r] -> W_UK^T [H, r, nope] and W_UV [H, v, r], rearranged on the device
    // (generated weights have no host copy to read).
    const WeightView* kvb[1] = {&W.at({l, WeightRole::KvB}).matrix};
    const DevMem kv_b = up.matrices(kvb);
    M.uk_t = DevMem(static_cast<size_t>(H * r * nope) * 2);
    M.uv = DevMem(static_cast<size_t>(H * vd * r) * 2);
    cuda::mla_split_kv_b(kv_b.as<bf16>(), H, nope, vd, r, M.uk_t.as<bf16>(), M.uv.as<bf16>(), stream_);
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream_));  // kv_b is freed at the end of the iteration
    L[WeightRole::KvB] = DeviceWeight{};
  }
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

bool CudaModelRunner::reserve_mla(int64_t n) {
  const MlaHparams& m = hp_.mla;
  const int64_t H = hp_.n_head, r = m.kv_lora_rank, R = m.qk_rope;
  int64_t in_rows = 0;
  for (const MlaLayer& M : mla_) in_rows = std::max(in_rows, M.in_rows);
  bool grew = false;
  auto grow = [&](DevMem& d, size_t bytes) {
    if (bytes <= d.bytes()) return;
    d.reserve(bytes);
    grew = true;
  };
  grow(mla_in_out_, static_cast<size_t>(n * in_rows) * 2);
  if (m.q_lora_rank > 0) {
    grow(mla_qa_, static_cast<size_t>(n * m.q_lora_rank) * 2);
    grow(mla_q_, static_cast<size_t>(n * H * (m.qk_nope + R)) * 2);
  }
  grow(mla_q_lat_, static_cast<size_t>(n * H * (r + R)) * 2);
  grow(mla_o_lat_, static_cast<size_t>(n * H * r) * 2);
  grow(mla_ws_, std::max<size_t>(16, cuda::mla_attention_workspace_bound(n, static_cast<int32_t>(H),
                                                                          static_cast<int32_t>(r), static_cast<int32_t>(R))));
  return grew;
}

void CudaModelRunner::mla_attention(int32_t layer, Act in, Act out) {
  const MlaHparams& m = hp_.mla;
  const Layer& L = layers_[static_cast<size_t>(layer)];
  const MlaLayer& M = mla_[static_cast<size_t>(layer)];
  const int64_t n = pass_.n_tokens, H = hp_.n_head, r = m.kv_lora_rank, R = m.qk_rope, nope = m.qk_nope;
  const int64_t qh = nope + R, vd = m.v_head_dim;
  const bool rotate_half = hp_.rope_style == RopeStyle::RotateHalf;
  bf16* y = act(out);
  KESTREL_ASSERT(y != nullptr && attn_.bytes() >= static_cast<size_t>(n * H * vd) * 2,
                 "CUDA mla_attention: writes Act::Attn, sized for the heads' outputs");

  bf16* proj = mla_in_out_.as<bf16>();
  project(act(in), M.in.as<bf16>(), proj, false, n, hp_.n_embd, M.in_rows);
  mark("gemm mla_in");

  cuda::MlaKvWriteArgs kw;
  kw.kv = proj + M.q_rows;
  kw.kv_stride = M.in_rows;
  kw.kv_norm = L[WeightRole::KvANorm].w.as<bf16>();
  if (m.q_lora_rank > 0) {
    kw.qa = proj;
    kw.qa_stride = M.in_rows;
    kw.qa_norm = L[WeightRole::QANorm].w.as<bf16>();
    kw.qa_out = mla_qa_.as<bf16>();
    kw.q_lora_rank = static_cast<int32_t>(m.q_lora_rank);
  }
  kw.positions = pass_arrays_->positions;
  kw.slot_mapping = pass_arrays_->slots;
  kw.inv_freq = inv_freq_.as<float>();
  kw.position_scale = hp_.rope_linear_scale;
  kw.rotate_half = rotate_half;
  kw.n_tokens = n;
  kw.kv_lora_rank = static_cast<int32_t>(r);
  kw.rope_dim = static_cast<int32_t>(R);
  kw.eps = hp_.rms_eps;
  kw.cache = k_cache_[static_cast<size_t>(layer)].as<bf16>();
  kw.block_size = block_size_;
  cuda::mla_kv_write(kw, stream_);
  mark("mla_kv_write");

  const bf16* q = proj;
  int64_t q_stride = M.in_rows;
  if (m.q_lora_rank > 0) {
    const DeviceWeight& qb = L[WeightRole::QB];
    project(mla_qa_.as<bf16>(), qb.w.as<bf16>(), mla_q_.as<bf16>(), false, n, qb.n_in, qb.n_out);
    mark("gemm q_b");
    q = mla_q_.as<bf16>();
    q_stride = H * qh;
  }

  cuda::MlaHeadGemmArgs absorb;
  absorb.x = q;
  absorb.x_stride = q_stride;
  absorb.x_head_stride = qh;
  absorb.w = M.uk_t.as<bf16>();
  absorb.y = mla_q_lat_.as<bf16>();
  absorb.y_stride = H * (r + R);
  absorb.y_head_stride = r + R;
  absorb.n_tokens = n;
  absorb.n_head = static_cast<int32_t>(H);
  absorb.n_in = static_cast<int32_t>(nope);
  absorb.n_out = static_cast<int32_t>(r);
  absorb.rope_dim = static_cast<int32_t>(R);
  absorb.positions = pass_arrays_->positions;
  absorb.inv_freq = inv_freq_.as<float>();
  absorb.position_scale = hp_.rope_linear_scale;
  absorb.rotate_half = rotate_half;
  cuda::mla_head_gemm(absorb, stream_);
  mark("mla absorb q");

  cuda::MlaAttentionParams ap;
  ap.q = mla_q_lat_.as<bf16>();
  ap.cache = k_cache_[static_cast<size_t>(layer)].as<bf16>();
  ap.block_tables = pass_arrays_->block_tables;
  ap.query_start = pass_arrays_->query_start;
  ap.positions = pass_arrays_->positions;
  ap.out = mla_o_lat_.as<bf16>();
  ap.n_tokens = n;
  ap.n_seqs = pass_.n_seqs;
  ap.max_blocks_per_seq = pass_.width;
  ap.max_context = pass_.max_context;
  ap.max_query_len = pass_.max_query;
  ap.n_head = static_cast<int32_t>(H);
  ap.kv_lora_rank = static_cast<int32_t>(r);
  ap.rope_dim = static_cast<int32_t>(R);
  ap.block_size = block_size_;
  ap.scale = hp_.softmax_scale();
  ap.workspace = mla_ws_.as<void>();
  ap.workspace_bytes = mla_ws_.bytes();
  // The buffer holds any split plan of as many sequences as tokens (reserve_mla); a batch with more
  // sequences than tokens (some without a token this pass) runs unsplit instead.
  if (cuda::mla_attention_workspace_bytes(ap) > ap.workspace_bytes) ap.n_splits = 1;
  cuda::mla_attention(ap, stream_);
  mark("mla attention");

  cuda::MlaHeadGemmArgs uv;
  uv.x = mla_o_lat_.as<bf16>();
  uv.x_stride = H * r;
  uv.x_head_stride = r;
  uv.w = M.uv.as<bf16>();
  uv.y = y;
  uv.y_stride = H * vd;
  uv.y_head_stride = vd;
  uv.n_tokens = n;
  uv.n_head = static_cast<int32_t>(H);
  uv.n_in = static_cast<int32_t>(r);
  uv.n_out = static_cast<int32_t>(vd);
  cuda::mla_head_gemm(uv, stream_);
  mark("mla up-project v");
}

}  // namespace kestrel::cuda_runner
