// One pass of the CUDA backend: the architecture's builder (model/archs/) over this runner's
// ForwardOps, each op enqueued on the runner's stream, and the choice of kernel for every
// projection (streaming GEMV, skinny GEMM or cuBLASLt, tuned per decode batch size).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_model_runner.h"
#include "backend/cuda/fp8_ops.h"
#include "core/error.h"

namespace kestrel::cuda_runner {

namespace {
// The op profiler's name for a projection (a string that lives as long as the program).
const char* gemm_label(WeightRole role) {
  switch (role) {
    case WeightRole::Qkv: return "gemm qkv";
    case WeightRole::GateUp: return "gemm gate_up";
    case WeightRole::AttnOut: return "gemm o";
    case WeightRole::Down: return "gemm down";
    default: return "gemm";
  }
}
}  // namespace

cuda::AttentionParams CudaModelRunner::attention_params(const BatchArrays& d, const PassShape& s) const {
  cuda::AttentionParams ap{};
  ap.block_tables = d.block_tables;
  ap.context_lens = d.context_lens;
  ap.query_start = d.query_start;
  ap.token_seq = nullptr;
  ap.positions = d.positions;
  ap.n_tokens = s.n_tokens;
  ap.n_seqs = s.n_seqs;
  ap.max_blocks_per_seq = s.width;
  ap.max_context = s.max_context;
  ap.max_query_len = s.max_query;
  ap.uniform_query_len = s.uniform_query;
  ap.n_head = static_cast<int32_t>(hp_.n_head);
  ap.n_head_kv = static_cast<int32_t>(hp_.n_head_kv);
  ap.head_dim = static_cast<int32_t>(hp_.head_dim);
  ap.block_size = block_size_;
  ap.scale = hp_.softmax_scale();
  const DevMem& ws = pass_row0_ > 0 ? lane_workspace_ : workspace_;  // the second micro-batch's own
  ap.workspace = ws.as<void>();
  ap.workspace_bytes = ws.bytes();
  ap.decode_stages = attn_decode_stages_;
  ap.fp8_decode_key_tile = attn_fp8_decode_key_tile_;
  ap.decode_rows = verify_decode_rows_;
  ap.split_items_per_block = attn_items_per_block_;
  ap.split_min_tiles = attn_min_split_tiles_;
  return ap;
}

void CudaModelRunner::enqueue_forward(const BatchArrays& da, const PassShape& s) {
  // Passes of a few query tokens per sequence (speculative verify steps) are profiled apart from
  // prompt prefill.
  if (prof_ != nullptr)
    prof_->begin(s.max_query == 1 ? "decode" : s.max_query <= kGraphMaxTokensPerSeq ? "verify" : "prefill");
  if (overlaps(s))
    enqueue_micro_batches(da, s);
  else
    enqueue_layers(da, s, 0);
  if (s.sample && s.n_out > 0) {
    cuda::sample_tokens(logits_.as<float>(), reinterpret_cast<const cuda::SampleParams*>(da.sampling), s.n_out,
                        hp_.n_vocab, da.tokens, sample_ws_.as<void>(), stream_);
    mark("sample");
  }
  pass_arrays_ = nullptr;
}

void CudaModelRunner::enqueue_layers(const BatchArrays& da, const PassShape& s, int64_t row0) {
  pass_arrays_ = &da;
  pass_ = s;
  pass_row0_ = row0;
  pass_ap_ = attention_params(da, s);
  // Every pass starts in residual_: a captured graph holds the addresses it was captured with.
  pass_residual_ = residual_.as<float>() + row0 * hp_.n_embd;
  pass_spare_ = residual_alt_.as<float>();  // the fused norm's: one- and two-token passes, never split
  // Decode-only passes rotate q and write K/V inside the decode attention kernel (no RoPE kernel).
  pass_rope_in_attention_ = fused_rope_ && s.max_query == 1 &&
                            cuda::attention_supports_fused_rope(static_cast<int32_t>(hp_.head_dim));
  fp8_pending_ = {};
  arch_.forward(*this, hp_);
  settle_fp8();  // every architecture's last op reads its input through act(): nothing is left
}

bool CudaModelRunner::overlaps(const PassShape& s) const {
  return dbo_min_tokens_ > 0 && s.n_tokens >= dbo_min_tokens_ && s.n_seqs >= 2 && s.uniform_query == 1 &&
         s.rows_identity && s.n_out == s.n_tokens && comm_ == nullptr && role_.first && role_.last &&
         prof_ == nullptr && n_int4_ == 0 && n_gguf_ == 0 && !hp_.mla.enabled() && !hp_.moe.enabled();
}

size_t CudaModelRunner::reserve_micro_batches(const PassShape& s) {
  if (!overlaps(s)) return 0;
  // A half has fewer work items than the whole pass, so the split-KV plan may split its keys where
  // the whole pass's does not: both halves' plans size the lane's workspace, and the caller's
  // reserve_activations the runner's (the first half's).
  size_t bytes = 16;
  for (const int64_t n : {s.n_seqs / 2, s.n_seqs - s.n_seqs / 2}) {
    PassShape half = s;
    half.n_seqs = half.n_tokens = half.n_out = n;
    bytes = std::max(bytes, cuda::attention_workspace_bytes(attention_params(BatchArrays{}, half)));
  }
  if (bytes > lane_workspace_.bytes()) {
    lane_workspace_.reserve(bytes);
    graphs_.clear();
  }
  return bytes;
}

void CudaModelRunner::enqueue_micro_batches(const BatchArrays& da, const PassShape& s) {
  if (lane_stream_ == nullptr) {
    KESTREL_CUDA_CHECK(cudaStreamCreateWithFlags(&lane_stream_, cudaStreamNonBlocking));
    KESTREL_CUDA_CHECK(cudaEventCreateWithFlags(&lane_start_, cudaEventDisableTiming));
    KESTREL_CUDA_CHECK(cudaEventCreateWithFlags(&lane_join_, cudaEventDisableTiming));
    lane_gemm_ = std::make_unique<cuda::Gemm>();
  }
  // One token a sequence: the first h sequences are rows [0, h), the rest [h, n).
  const int64_t h = s.n_seqs / 2;
  PassShape sa = s;
  sa.n_seqs = sa.n_tokens = sa.n_out = h;
  sa.sample = false;
  PassShape sb = sa;
  sb.n_seqs = sb.n_tokens = sb.n_out = s.n_seqs - h;
  // The second half's arrays: views h rows on. Its query_start is the first half's: a uniform
  // run's entries are s x 1, whichever sequence they start from.
  BatchArrays db = da;
  db.slots += h;
  db.ids += h;
  db.positions += h;
  db.context_lens += h;
  db.block_tables += h * s.width;
  db.logits_rows += h;
  db.sampling += h;
  db.tokens += h;
  head_deferred_ = true;
  lane_start_pending_ = true;
  struct Restore {  // the runner's own stream and cuBLASLt handle back, whatever happens
    CudaModelRunner& r;
    bool swapped = false;
    void swap() {
      std::swap(r.stream_, r.lane_stream_);
      std::swap(r.gemm_, r.lane_gemm_);
      swapped = !swapped;
    }
    ~Restore() {
      if (swapped) swap();
      r.pass_row0_ = 0;
      r.head_deferred_ = r.lane_start_pending_ = false;
    }
  } restore{*this};
  enqueue_layers(da, sa, 0);
  start_lane();  // an architecture without attention: the second half after the first
  KESTREL_CUDA_CHECK(cudaStreamWaitEvent(lane_stream_, lane_start_, 0));
  restore.swap();  // the ops below enqueue on lane_stream_ through lane_gemm_
  enqueue_layers(db, sb, h);
  KESTREL_CUDA_CHECK(cudaEventRecord(lane_join_, stream_));
  restore.swap();
  KESTREL_CUDA_CHECK(cudaStreamWaitEvent(stream_, lane_join_, 0));
  pass_row0_ = 0;
  pass_ = s;
  pass_arrays_ = &da;
  logits_head(normed_rows(), s.n_out);  // both halves' normed rows, contiguous
  ++micro_batched_passes_;
  mark("gemm lm_head");
}

void CudaModelRunner::start_lane() {
  if (!lane_start_pending_) return;
  KESTREL_CUDA_CHECK(cudaEventRecord(lane_start_, stream_));
  lane_start_pending_ = false;
}

bf16* CudaModelRunner::act(Act a) {
  if (a != Act::None && fp8_pending_.act == a) settle_fp8();
  return act_buffer(a);
}

bf16* CudaModelRunner::act_buffer(Act a) const {
  switch (a) {
    case Act::None: return nullptr;
    case Act::Qkv: return lane_rows<bf16>(qkv_, hp_.q_dim() + 2 * hp_.kv_dim());
    case Act::Attn: return lane_rows<bf16>(attn_, std::max(hp_.q_dim(), hp_.attn_out_dim()));
    case Act::AttnOut: return lane_rows<bf16>(o_, hp_.n_embd);
    case Act::GateUp: return lane_rows<bf16>(gate_up_, 2 * hp_.n_ff);
    case Act::Down: return lane_rows<bf16>(down_, hp_.n_embd);
    case Act::Normed: return normed_rows();
  }
  return nullptr;
}

void CudaModelRunner::settle_fp8() {
  if (fp8_pending_.act == Act::None) return;
  const PendingFp8Scale p = fp8_pending_;
  fp8_pending_ = {};
  cuda::scale_fp8_product(act_buffer(p.act), p.x_scale, p.w_scale, pass_.n_tokens, p.n_out, stream_);
  mark("scale fp8");
}

CudaModelRunner::PendingFp8Scale CudaModelRunner::take_fp8_pending(Act in) {
  if (in == Act::None || fp8_pending_.act != in) {
    settle_fp8();  // another buffer's: scaled now, before its x scales are overwritten
    return {};
  }
  const PendingFp8Scale p = fp8_pending_;
  fp8_pending_ = {};
  return p;
}

bool CudaModelRunner::fp8_gemm_path(const DeviceWeight& W, int64_t n) const {
  return W.fp8 && !W.in_place() && !uses_stream_gemv_narrow(W, n) &&
         !cuda::skinny_gemm_fp8_supports(n, W.n_in, W.n_out);
}

void CudaModelRunner::gemm_fp8(const DeviceWeight& W, int64_t n, bf16* y, Act out) {
  KESTREL_ASSERT(fp8_pending_.act == Act::None, "CUDA W8A8 GEMM: an unscaled product is still pending");
  // Above kFp8UnscaledMaxTokens a product scaled by a pass of its own (settle_fp8) costs about what
  // the unscaled GEMM saves: deferred there only without a tensor-parallel all-reduce between.
  const bool defer = (out == Act::AttnOut || out == Act::GateUp || out == Act::Down) && W.b.bytes() == 0 &&
                     cuda::fp8_unscaled_deferred(n, W.n_in, W.n_out) &&
                     (n <= cuda::kFp8UnscaledMaxTokens || comm_ == nullptr);
  const float* x_scale = fp8_x_scale();
  if (defer) {
    gemm_->run_fp8_unscaled(fp8_x(), W.w.as<uint8_t>(), y, n, W.n_in, W.n_out, stream_);
    fp8_pending_ = {out, x_scale, W.scale.as<float>(), W.n_out};
    return;
  }
  gemm_->run_fp8(fp8_x(), x_scale, W.w.as<uint8_t>(), W.scale.as<float>(), y, n, W.n_in, W.n_out,
                 stream_);
}

void CudaModelRunner::embed() {
  if (!role_.first) return;  // a later pipeline stage: run() copied the residual stream handed in
  if (embd_q_.in_place()) {
    cuda::gguf_embedding(embd_q_.gguf[0].m, pass_arrays_->ids, pass_.n_tokens, hp_.embd_scale, pass_residual_,
                         stream_, vocab_begin_);
  } else {
    cuda::embedding(embd_.as<bf16>(), pass_arrays_->ids, pass_.n_tokens, hp_.n_embd, hp_.embd_scale, pass_residual_,
                    stream_, vocab_begin_, n_logits_);
  }
  mark("embedding");
  // A tensor-parallel rank wrote zeros for the other ranks' tokens: one nonzero term per row, so
  // the sum is exact.
  if (comm_ != nullptr) {
    comm_->all_reduce_sum(pass_residual_, pass_.n_tokens * hp_.n_embd, CommDtype::F32);
    mark("all-reduce");
  }
}

void CudaModelRunner::all_reduce(Act a) {
  if (comm_ == nullptr) return;
  comm_->all_reduce_sum(act(a), pass_.n_tokens * hp_.n_embd, CommDtype::BF16);
  mark("all-reduce");
}

// residual += add, then y = RMSNorm(residual) * norm_w . W^T: two kernels, or one streaming GEMV
// reading the residual and writing the sum to the other residual buffer (fused_norm_), after which
// the two buffers swap roles.
void CudaModelRunner::add_norm_linear(Act add, WeightId norm, WeightId proj, Act out) {
  const Layer& L = layers_[static_cast<size_t>(proj.layer)];
  const int64_t n = pass_.n_tokens, d = hp_.n_embd;
  const DeviceWeight& W = L[proj.role];
  KESTREL_ASSERT(W.n_in == d, "CUDA backend: a normed projection reads the model width");
  const DevMem& norm_w = L[norm.role].w;
  const DevMem& w = W.w;
  const int64_t n_out = W.n_out;
  const char* what = gemm_label(proj.role);
  bf16* y = act_buffer(out);
  // FP8 and INT4 weights fuse the norm in their streaming GEMV (act-order INT4 gathers x first: not fused).
  const bool narrow = W.fp8 || W.int4;
  const bool streamed = W.in_place() ? false  // GGUF blocks: their own GEMV, the norm a kernel of its own
                        : narrow     ? uses_stream_gemv_narrow(W, n) && W.perm.bytes() == 0
                                     : uses_stream_gemv(n, d, n_out);
  if (!streamed && fp8_gemm_path(W, n) && cuda::fp8_fused_width_supported(d)) {
    // W8A8: the norm writes the GEMM's quantized input, scaling an unscaled product on the way in.
    const PendingFp8Scale p = take_fp8_pending(add);
    cuda::add_rms_norm_fp8(pass_residual_, act_buffer(add), p.x_scale, p.w_scale, norm_w.as<bf16>(),
                           fp8_x(), fp8_x_scale(), n, d, hp_.rms_eps, stream_);
    mark("add_rms_norm");
    gemm_fp8(W, n, act_buffer(out), out);
    mark(what);
  } else if (!fused_norm_ || !streamed) {
    cuda::add_rms_norm(pass_residual_, act(add), norm_w.as<bf16>(), normed_rows(), n, d, hp_.rms_eps, stream_);
    mark("add_rms_norm");
    project_weight(normed_rows(), W, y, n);
    mark(what);
  } else {
    if (residual_alt_.bytes() < static_cast<size_t>(n * d) * 4)
      throw Error("fused norm: the second residual buffer holds fewer than " + std::to_string(n) + " rows");
    cuda::StreamGemvArgs a{cuda::ProjectionOperands{nullptr, d, w.as<bf16>(), y, n, d, n_out, false, false}};
    a.stages = stream_gemv_stages_;
    a.norm_residual_in = pass_residual_;
    a.norm_add = act(add);
    a.norm_weight = norm_w.as<bf16>();
    a.norm_residual_out = pass_spare_;
    a.norm_eps = hp_.rms_eps;
    if (narrow)
      stream_narrow(W, a);
    else
      cuda::stream_gemv(a, stream_);
    std::swap(pass_residual_, pass_spare_);
    mark(what);
  }
  if (W.b.bytes() > 0) cuda::add_bias(y, W.b.as<float>(), n, n_out, stream_);
}

void CudaModelRunner::add_norm(Act add, WeightId norm, Act out) {
  KESTREL_ASSERT(out == Act::Normed, "CUDA add_norm writes Act::Normed");
  const DevMem& w = layers_[static_cast<size_t>(norm.layer)][norm.role].w;
  cuda::add_rms_norm(pass_residual_, act(add), w.as<bf16>(), normed_rows(), pass_.n_tokens, hp_.n_embd, hp_.rms_eps,
                     stream_);
  mark("add_rms_norm");
}

void CudaModelRunner::norm(Act a, WeightId w) {
  const DevMem& nw = layers_[static_cast<size_t>(w.layer)][w.role].w;
  cuda::rms_norm_heads(act(a), pass_.n_tokens, hp_.n_embd, 1, hp_.n_embd, nw.as<bf16>(), hp_.rms_eps, stream_);
  mark("rms_norm");
}

void CudaModelRunner::qk_norm(int32_t layer, Act qkv_act) {
  KESTREL_ASSERT(qkv_act == Act::Qkv, "CUDA qk_norm reads Act::Qkv");
  const Layer& L = layers_[static_cast<size_t>(layer)];
  bf16* qkv = act(qkv_act);
  const int64_t n = pass_.n_tokens, stride = hp_.q_dim() + 2 * hp_.kv_dim();
  cuda::rms_norm_heads(qkv, n, stride, hp_.n_head, hp_.head_dim, L[WeightRole::QNorm].w.as<bf16>(), hp_.rms_eps,
                       stream_);
  cuda::rms_norm_heads(qkv + hp_.q_dim(), n, stride, hp_.n_head_kv, hp_.head_dim, L[WeightRole::KNorm].w.as<bf16>(),
                       hp_.rms_eps, stream_);
  mark("qk_norm");
}

void CudaModelRunner::rope_write_kv(int32_t layer, Act qkv_act) {
  bf16* qkv = act(qkv_act);
  const int64_t qkv_w = hp_.q_dim() + 2 * hp_.kv_dim();
  const bool rotate_half = hp_.rope_style == RopeStyle::RotateHalf;
  // Windowed layers with their own RoPE base (Gemma 3's local layers) take the second table.
  const float* inv_freq = inv_freq_swa_.bytes() > 0 && hp_.layer_window(layer) > 0 ? inv_freq_swa_.as<float>()
                                                                                    : inv_freq_.as<float>();
  if (pass_rope_in_attention_) {  // done by attention(), from the unrotated qkv
    pass_ap_.rope = {qkv, qkv_w, pass_arrays_->slots, inv_freq, hp_.rope_linear_scale,
                     static_cast<int32_t>(hp_.rope_dim), rotate_half};
    return;
  }
  bf16* q_rows = lane_rows<bf16>(q_, hp_.q_dim());
  if (kv_dtype_ == KvDtype::FP8) {
    cuda::rope_write_kv_fused_fp8(qkv, qkv_w, q_rows, pass_arrays_->positions, pass_arrays_->slots, inv_freq,
                                  hp_.rope_linear_scale, pass_.n_tokens, hp_.n_head, hp_.n_head_kv, hp_.head_dim,
                                  hp_.rope_dim, rotate_half, fp8_cache(layer), block_size_, stream_);
  } else {
    cuda::rope_write_kv_fused(qkv, qkv_w, q_rows, pass_arrays_->positions, pass_arrays_->slots, inv_freq,
                              hp_.rope_linear_scale, pass_.n_tokens, hp_.n_head, hp_.n_head_kv, hp_.head_dim,
                              hp_.rope_dim, rotate_half, k_cache_[static_cast<size_t>(layer)].as<bf16>(),
                              v_cache_[static_cast<size_t>(layer)].as<bf16>(), block_size_, stream_);
  }
  mark("rope_write_kv");
}

void CudaModelRunner::attention(int32_t layer, Act qkv, Act out) {
  KESTREL_ASSERT(qkv == Act::Qkv, "CUDA attention reads Act::Qkv");
  pass_ap_.q = lane_rows<bf16>(q_, hp_.q_dim());
  pass_ap_.k_cache = k_cache_[static_cast<size_t>(layer)].as<void>();
  pass_ap_.v_cache = v_cache_[static_cast<size_t>(layer)].as<void>();
  const bool fp8 = kv_dtype_ == KvDtype::FP8;
  pass_ap_.k_scale = fp8 ? k_scale_[static_cast<size_t>(layer)].as<float>() : nullptr;
  pass_ap_.v_scale = fp8 ? v_scale_[static_cast<size_t>(layer)].as<float>() : nullptr;
  pass_ap_.out = act(out);
  pass_ap_.window = static_cast<int32_t>(hp_.layer_window(layer));
  // No prefetch across attention: at batch 1 it is bound by latency, and the projection before it
  // prefetching the next one's weights slowed it (docs/performance.md).
  last_streamed_ = nullptr;
  start_lane();  // the second micro-batch starts here: its projections beside this attention
  cuda::paged_attention(pass_ap_, stream_);
  mark("attention");
}

void CudaModelRunner::linear(Act in, WeightId proj, Act out) {
  const DeviceWeight& W = layers_[static_cast<size_t>(proj.layer)][proj.role];
  const int64_t n = pass_.n_tokens;
  bf16* y = act_buffer(out);
  project_weight(act(in), W, y, n, false, out);
  mark(gemm_label(proj.role));
  if (W.b.bytes() > 0) cuda::add_bias(y, W.b.as<float>(), n, W.n_out, stream_);
}

void CudaModelRunner::swiglu_linear(Act in, WeightId proj, Act out) {
  const DeviceWeight& W = layers_[static_cast<size_t>(proj.layer)][proj.role];
  const int64_t n = pass_.n_tokens;
  if (fp8_gemm_path(W, n) && cuda::fp8_fused_width_supported(W.n_in)) {
    // W8A8: SwiGLU writes the GEMM's quantized input, scaling an unscaled gate|up on the way in.
    const PendingFp8Scale p = take_fp8_pending(in);
    cuda::silu_mul_fp8(act_buffer(in), p.x_scale, p.w_scale, fp8_x(), fp8_x_scale(), n,
                       W.n_in, stream_);
    mark("silu_mul");
    gemm_fp8(W, n, act_buffer(out), out);
    mark("gemm down");
    return;
  }
  project_weight(act(in), W, act_buffer(out), n, /*swiglu=*/true, out);
  mark("gemm down (+silu)");
}

void CudaModelRunner::geglu_linear(Act in, WeightId proj, Act out) {
  const DeviceWeight& W = layers_[static_cast<size_t>(proj.layer)][proj.role];
  const int64_t n = pass_.n_tokens;
  // The projection kernels fuse SwiGLU only: the GeGLU product goes through act_ first.
  bf16* gated = lane_rows<bf16>(act_, hp_.n_ff);
  cuda::gelu_tanh_mul(act(in), gated, n, W.n_in, stream_);
  mark("gelu_mul");
  project_weight(gated, W, act(out), n);
  mark("gemm down");
}

void CudaModelRunner::final_norm_logits(Act add, WeightId norm, WeightId head) {
  KESTREL_ASSERT(norm.role == WeightRole::OutputNorm && head.role == WeightRole::Output, "CUDA backend: final norm");
  if (!role_.last) {  // a pipeline stage before the last hands its residual stream on
    cuda::add_residual(pass_residual_, act(add), hidden_out_.as<float>(), pass_.n_tokens, hp_.n_embd, stream_);
    mark("hand on");
    return;
  }
  if (pass_.n_out == 0) return;
  const int64_t n = pass_.n_tokens, d = hp_.n_embd;
  bf16* h = normed_rows();
  cuda::add_rms_norm(pass_residual_, act(add), out_norm_.as<bf16>(), h, n, d, hp_.rms_eps, stream_);
  // The rows whose logits are wanted: h itself when they are all rows in order, else gathered.
  const bf16* rows = h;
  if (!pass_.rows_identity) {
    cuda::gather_rows(h, pass_arrays_->logits_rows, pass_.n_out, d, logits_in_.as<bf16>(), stream_);
    rows = logits_in_.as<bf16>();
  }
  mark("final norm");
  if (head_deferred_) return;  // a micro-batch: one LM head over both halves (enqueue_micro_batches)
  logits_head(rows, pass_.n_out);
  mark("gemm lm_head");
}

void CudaModelRunner::logits_head(const bf16* rows, int64_t n_out) {
  const DeviceWeight& head_q = lm_head_.bytes() > 0 || head_q_.in_place() ? head_q_ : embd_q_;
  if (head_q.in_place()) {
    project_gguf(rows, head_q, logits_.as<void>(), n_out, false, true);
  } else {
    const bf16* w = lm_head_.bytes() > 0 ? lm_head_.as<bf16>() : embd_.as<bf16>();
    project(rows, w, logits_.as<void>(), true, n_out, hp_.n_embd, n_logits_);
  }
}

// The decode projections at n tokens that go to cuBLASLt: its heuristic's candidates and their
// split-K variants are timed over all layers' weights (Gemm::tune) and the fastest kept (+1.1% at
// batch 64 on the H200 with the heuristic's alone). With CudaTuning::profile_ops the picks are printed.
// Scratch inputs and outputs are the activation buffers (sized for n by reserve_activations);
// their contents do not matter.
void CudaModelRunner::tune_gemms(int64_t n) {
  const int64_t d = hp_.n_embd, qd = hp_.q_dim(), kvd = hp_.kv_dim(), ff = hp_.n_ff, nv = n_logits_;
  auto tune = [&](const bf16* x, const std::vector<const bf16*>& ws, void* y, bool f32_out, int64_t n_in,
                  int64_t n_out) {
    if (ws.empty() || uses_skinny(n, n_in, n_out) || uses_stream_gemv(n, n_in, n_out)) return;
    const int pick = gemm_->tune(x, ws.data(), ws.size(), y, f32_out ? cuda::GemmOutput::F32 : cuda::GemmOutput::Bf16,
                                 n, n_in, n_out, stream_, gemm_split_k_);
    if (prof_ != nullptr)
      std::fprintf(stderr, "gemm tune: %lld x %lld -> %lld: candidate %d\n", static_cast<long long>(n),
                   static_cast<long long>(n_in), static_cast<long long>(n_out), pick);
  };
  // Every layer's weight of the role, or none when some layer lacks it (a mixture-of-experts
  // layer has no dense gate/up): those projections keep cuBLASLt's heuristic pick.
  auto all_layers = [&](WeightRole role) {
    std::vector<const bf16*> ws;
    for (const Layer& L : layers_) {
      // FP8 and int4: not cuBLASLt's bf16 GEMM at these sizes.
      if (L[role].w.bytes() == 0 || L[role].fp8 || L[role].int4) return std::vector<const bf16*>{};
      ws.push_back(L[role].w.as<bf16>());
    }
    return ws;
  };
  tune(h_.as<bf16>(), all_layers(WeightRole::Qkv), qkv_.as<void>(), false, d, qd + 2 * kvd);
  tune(attn_.as<bf16>(), all_layers(WeightRole::AttnOut), o_.as<void>(), false, hp_.attn_out_dim(), d);
  tune(h_.as<bf16>(), all_layers(WeightRole::GateUp), gate_up_.as<void>(), false, d, 2 * ff);
  tune(act_.as<bf16>(), all_layers(WeightRole::Down), down_.as<void>(), false, ff, d);
  // One head matrix: at n_vocab x n_embd it is far larger than the L2 (and tuned in one pass each).
  const bf16* head = lm_head_.bytes() > 0 ? lm_head_.as<bf16>() : embd_.as<bf16>();
  if (role_.last && head != nullptr) tune(logits_in_.as<bf16>(), {head}, logits_.as<void>(), true, d, nv);
}

void CudaModelRunner::project(const bf16* x, const bf16* w, void* y, bool f32_out, int64_t n, int64_t n_in,
                              int64_t n_out, bool swiglu, cudaStream_t stream) {
  const cuda::ProjectionOperands ops{x, swiglu ? 2 * n_in : n_in, w, y, n, n_in, n_out, swiglu, f32_out};
  if (stream == nullptr) stream = stream_;
  if (uses_stream_gemv(n, n_in, n_out)) {
    cuda::StreamGemvArgs a{ops};
    a.stages = stream_gemv_stages_;
    cuda::stream_gemv(a, stream);
    return;
  }
  if (uses_skinny(n, n_in, n_out)) {
    cuda::skinny_gemm(cuda::SkinnyGemmArgs{ops}, stream);
    return;
  }
  // cuBLASLt's workspace and the SwiGLU buffer belong to one stream each.
  const bool side = stream != stream_;
  KESTREL_ASSERT(!side || (stream == side_stream_ && side_gemm_ != nullptr),
                 "CUDA project: another stream than the runner's is the side stream");
  if (swiglu) {
    bf16* buf = side ? side_act_.as<bf16>() : lane_rows<bf16>(act_, hp_.n_ff);
    cuda::silu_mul(x, buf, n, n_in, stream);
    x = buf;
  }
  (side ? side_gemm_ : gemm_)->run(x, w, y, f32_out ? cuda::GemmOutput::F32 : cuda::GemmOutput::Bf16, n, n_in, n_out,
                                   stream);
}

void CudaModelRunner::project_weight(const bf16* x, const DeviceWeight& W, bf16* y, int64_t n, bool swiglu,
                                     Act out) {
  if (W.in_place()) {
    project_gguf(x, W, y, n, swiglu, false);
    return;
  }
  if (W.int4) {
    project_int4(x, W, y, n, swiglu);
    return;
  }
  if (!W.fp8) {
    project(x, W.w.as<bf16>(), y, false, n, W.n_in, W.n_out, swiglu);
    return;
  }
  const int64_t x_stride = swiglu ? 2 * W.n_in : W.n_in;
  if (uses_stream_gemv_narrow(W, n)) {
    stream_narrow(W, cuda::StreamGemvArgs{{x, x_stride, nullptr, y, n, W.n_in, W.n_out, swiglu, false}});
    return;
  }
  if (cuda::skinny_gemm_fp8_supports(n, W.n_in, W.n_out)) {
    cuda::SkinnyFp8Args a;
    static_cast<cuda::ProjectionOperands&>(a) = {x, x_stride, nullptr, y, n, W.n_in, W.n_out, swiglu, false};
    a.w8 = W.w.as<uint8_t>();
    a.w_scale = W.scale.as<float>();
    cuda::skinny_gemm_fp8(a, stream_);
    return;
  }
  if (swiglu) {
    bf16* gated = lane_rows<bf16>(act_, hp_.n_ff);
    cuda::silu_mul(x, gated, n, W.n_in, stream_);
    x = gated;
  }
  settle_fp8();  // the quantization overwrites the x scales a pending product needs
  cuda::quantize_rows_fp8(x, W.n_in, n, W.n_in, fp8_x(), fp8_x_scale(), stream_);
  gemm_fp8(W, n, y, out);
}

cuda::StreamPrefetch CudaModelRunner::chain_prefetch(const DeviceWeight& W) {
  if (stream_prefetch_bytes_ == 0) return {};
  const void* w = W.w.as<void>();
  const int64_t row_bytes = W.fp8 ? W.n_in : W.n_in / 2;  // E4M3 codes, or INT4 codes two a byte
  if (last_streamed_ != nullptr && last_streamed_ != w)
    next_streamed_[last_streamed_] = cuda::stream_prefetch_of(w, W.n_out, row_bytes, stream_prefetch_bytes_);
  last_streamed_ = w;
  const auto it = next_streamed_.find(w);
  return it == next_streamed_.end() ? cuda::StreamPrefetch{} : it->second;
}

void CudaModelRunner::stream_narrow(const DeviceWeight& W, const cuda::StreamGemvArgs& args) {
  cuda::StreamGemvArgs a = args;
  a.next = chain_prefetch(W);
  if (W.fp8) {
    cuda::StreamGemvFp8Args f;
    static_cast<cuda::StreamGemvArgs&>(f) = a;
    f.w8 = W.w.as<uint8_t>();
    f.w_scale = W.scale.as<float>();
    cuda::stream_gemv_w8a8(f, stream_);
    return;
  }
  cuda::StreamGemvInt4Args q;
  static_cast<cuda::StreamGemvArgs&>(q) = a;
  q.stages = stream_gemv_stages_;
  q.w4 = W.int4_matrix();
  q.w4.perm = nullptr;  // x is in the physical order
  cuda::stream_gemv_int4(q, stream_);
}

}  // namespace kestrel::cuda_runner
