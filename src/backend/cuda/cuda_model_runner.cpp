// The Llama forward pass on a CUDA device behind the ModelRunner interface: bf16 weights and KV
// cache in device memory, f32 residual stream, cuBLASLt GEMMs and the kernels of cuda_ops.h.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/cuda_runner.h"
#include "backend/cuda/device_memory.h"
#include "backend/cuda/gemm.h"
#include "backend/cuda/op_profiler.h"
#include "core/error.h"

namespace kestrel {

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

namespace {
using cuda::bf16;
using cuda::DevMem;
using cuda::PinnedMem;
using cuda::upload;
using cuda::upload_bf16;
using cuda::upload_f32;
using cuda::WeightUploader;

// The engine's RowSampling rows go to the device as they are: cuda::SampleParams must match.
static_assert(sizeof(RowSampling) == sizeof(cuda::SampleParams) &&
                  offsetof(RowSampling, temperature) == offsetof(cuda::SampleParams, temperature) &&
                  offsetof(RowSampling, top_k) == offsetof(cuda::SampleParams, top_k) &&
                  offsetof(RowSampling, top_p) == offsetof(cuda::SampleParams, top_p) &&
                  offsetof(RowSampling, min_p) == offsetof(cuda::SampleParams, min_p) &&
                  offsetof(RowSampling, uniform) == offsetof(cuda::SampleParams, uniform),
              "RowSampling and cuda::SampleParams differ in layout");

struct Layer {
  DevMem attn_norm, ffn_norm;      // [n_embd] bf16
  DevMem w_qkv, wo, w_gate_up, w_down;  // bf16, rows as in LlamaLayerWeights; q|k|v and gate|up stacked
  DevMem b_qkv, bo;                // f32 biases (q|k|v stacked, zeros for a missing part) or empty
};

// The device-side index arrays of one batch, carved from one allocation that a single host-to-
// device copy fills (the layout is the same in the pinned staging copy).
struct BatchArrays {
  int64_t* slots = nullptr;         // [n_tokens]
  int32_t* ids = nullptr;           // [n_tokens]
  int32_t* positions = nullptr;     // [n_tokens]
  int32_t* query_start = nullptr;   // [n_seqs + 1]
  int32_t* context_lens = nullptr;  // [n_seqs]
  int32_t* block_tables = nullptr;  // [n_seqs, width]
  int32_t* logits_rows = nullptr;   // [n_out]
  RowSampling* sampling = nullptr;  // [n_out]
  int32_t* tokens = nullptr;        // [n_out] sampled ids (device output)
  size_t bytes = 0;

  // Offsets for the given sizes, from base (nullptr: just the size).
  static BatchArrays layout(unsigned char* base, int64_t n_tokens, int64_t n_seqs, int64_t width, int64_t n_out) {
    BatchArrays a;
    size_t at = 0;
    auto take = [&](size_t bytes) {
      at = (at + 15) / 16 * 16;
      unsigned char* p = base == nullptr ? nullptr : base + at;
      at += bytes;
      return p;
    };
    a.slots = reinterpret_cast<int64_t*>(take(static_cast<size_t>(n_tokens) * 8));
    a.ids = reinterpret_cast<int32_t*>(take(static_cast<size_t>(n_tokens) * 4));
    a.positions = reinterpret_cast<int32_t*>(take(static_cast<size_t>(n_tokens) * 4));
    a.query_start = reinterpret_cast<int32_t*>(take(static_cast<size_t>(n_seqs + 1) * 4));
    a.context_lens = reinterpret_cast<int32_t*>(take(static_cast<size_t>(n_seqs) * 4));
    a.block_tables = reinterpret_cast<int32_t*>(take(static_cast<size_t>(n_seqs * width) * 4));
    a.logits_rows = reinterpret_cast<int32_t*>(take(static_cast<size_t>(n_out) * 4));
    a.sampling = reinterpret_cast<RowSampling*>(take(static_cast<size_t>(n_out) * sizeof(RowSampling)));
    a.bytes = at;  // tokens follow, written by the device only (not part of the upload)
    a.tokens = reinterpret_cast<int32_t*>(take(static_cast<size_t>(n_out) * 4));
    return a;
  }
  template <class T>
  static T* shift(T* p, const unsigned char* from, unsigned char* to) {
    return reinterpret_cast<T*>(to + (reinterpret_cast<const unsigned char*>(p) - from));
  }
};

// Shapes of one enqueued forward pass.
struct PassShape {
  int64_t n_tokens = 0, n_seqs = 0, n_out = 0;
  int32_t width = 0;           // block table row length
  int32_t max_context = 0;     // sizes the split-KV grid (an upper bound is fine)
  int32_t max_query = 0;
  bool rows_identity = false;  // logits rows are all tokens in order
  bool sample = false;         // sample on the device into BatchArrays::tokens
};

// One captured decode step: batch size bucket x block table width bucket.
struct DecodeGraph {
  cudaGraphExec_t exec = nullptr;
  DevMem arrays;               // the device BatchArrays the graph reads
  BatchArrays dev;             // pointers into `arrays`
  ~DecodeGraph() {
    if (exec != nullptr) cudaGraphExecDestroy(exec);
  }
};

class CudaModelRunner final : public ModelRunner {
 public:
  CudaModelRunner(const LlamaModel& model, const RunnerOptions& o)
      : model_(model), hp_(model.hparams()), eager_(o.enforce_eager) {
    if (cuda_device_count() == 0) throw Error("--device cuda: no CUDA device is available");
    if (!cuda::attention_supports_head_dim(static_cast<int32_t>(hp_.head_dim)))
      throw Error("CUDA backend: head_dim " + std::to_string(hp_.head_dim) +
                  " is not supported (a multiple of 8 from 8 to 256)");
    if (o.block_size <= 0) throw Error("block size must be positive");
    KESTREL_CUDA_CHECK(cudaSetDevice(0));
    KESTREL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    cudaDeviceProp prop{};
    KESTREL_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    device_name_ = prop.name;
    gemm_ = std::make_unique<cuda::Gemm>();
    const CudaTuning& t = o.cuda;
    if (t.stream_gemv_stages != 0 && t.stream_gemv_stages != 3 && t.stream_gemv_stages != 4 && t.stream_gemv_stages != 6)
      throw Error("CUDA stream GEMV stages " + std::to_string(t.stream_gemv_stages) + ": 0 (default), 3, 4 or 6");
    if (t.attn_decode_stages != 0 && t.attn_decode_stages != 2 && t.attn_decode_stages != 3)
      throw Error("CUDA decode attention stages " + std::to_string(t.attn_decode_stages) + ": 0 (by batch), 2 or 3");
    skinny_max_tokens_ = std::clamp<int64_t>(t.skinny_max_tokens, 0, cuda::kSkinnyMaxTokens);
    tune_gemms_ = t.gemm_tune;
    gemm_split_k_ = t.gemm_split_k;
    stream_gemv_ = t.stream_gemv;
    stream_gemv_stages_ = t.stream_gemv_stages;
    fused_norm_ = t.fused_norm;
    fused_rope_ = t.fused_rope;
    stream_gemv_min_elems_ = (std::clamp<int64_t>(t.stream_gemv_min_mb, 0, int64_t{1} << 20) << 20) / 2;
    attn_decode_stages_ = t.attn_decode_stages;
    attn_items_per_block_ = static_cast<int32_t>(std::clamp<int64_t>(t.attn_items_per_block, 0, 1 << 20));
    attn_min_split_tiles_ = static_cast<int32_t>(std::clamp<int64_t>(t.attn_min_split_tiles, 0, 1 << 20));
    cuda::set_pdl_enabled(t.pdl);
    if (t.profile_ops) {
      prof_ = std::make_unique<cuda::OpProfiler>(stream_);
      eager_ = true;  // events between the ops of every pass, no graphs
    }
    upload_weights();
    block_size_ = o.block_size;
    allocate_kv(o);
  }

  ~CudaModelRunner() override {
    graphs_.clear();
    if (stream_ != nullptr) {
      cudaStreamSynchronize(stream_);
      cudaStreamDestroy(stream_);
    }
  }

  std::span<const float> forward(const ForwardBatch& b) override;
  bool samples_on_device() const override { return true; }
  std::span<const int32_t> forward_sample(const ForwardBatch& b, std::span<const RowSampling> rows) override;
  void copy_blocks(std::span<const BlockCopy> copies) override;
  int32_t n_kv_blocks() const override { return n_blocks_; }
  int32_t block_size() const override { return block_size_; }
  KvDtype kv_dtype() const override { return KvDtype::BF16; }
  std::string description() const override {
    return "cuda (" + device_name_ + ", bf16 weights, KV bf16 " + std::to_string(n_blocks_) + " blocks, " +
           (eager_ ? "eager" : "CUDA graphs for decode") + ")";
  }

 private:
  void upload_weights();
  void allocate_kv(const RunnerOptions& o);
  // Runs the batch (eagerly or by replaying a graph); leaves logits (and tokens when sampling) on
  // the device and returns where the tokens are.
  const int32_t* run(const ForwardBatch& b, std::span<const RowSampling> rows, bool sample);
  // Sizes every activation buffer for n_tokens rows and n_out logits rows; a reallocation
  // invalidates the captured graphs (they hold the old addresses).
  void reserve_activations(int64_t n_tokens, int64_t n_out, size_t attention_workspace);
  void enqueue_forward(const BatchArrays& d, const PassShape& s);
  // y [n, n_out] = a(x) . W^T: the streaming GEMV where it applies (uses_stream_gemv), else the
  // skinny GEMM for at most skinny_max_tokens_ rows, else cuBLASLt (after silu_mul into act_ when
  // swiglu: x then holds [gate | up] rows of 2 n_in).
  void linear(const bf16* x, const bf16* w, void* y, bool f32_out, int64_t n, int64_t n_in, int64_t n_out,
              bool swiglu = false);
  // Whether linear() takes the skinny GEMM: it beats cuBLASLt on small weights only (H200,
  // bench/cuda: 4096 x 6144 and 4096 x 4096 at up to 8 tokens, by 7-21%); on larger ones (the 8B's
  // gate/up, down and head) cuBLASLt streams at 3.5-4.4 TB/s and the skinny kernel does not.
  bool uses_skinny(int64_t n, int64_t n_in, int64_t n_out) const {
    return n <= skinny_max_tokens_ && n_in * n_out <= kSkinnyMaxWeightElems &&
           cuda::skinny_gemm_supports(n, n_in, n_out);
  }
  // Whether linear() takes the streaming GEMV (one or two tokens, n_in a multiple of 2048, at
  // most 256 rows per SM, weights of 40 MiB or more: the 8B's QKV, gate/up and down projections;
  // CudaTuning::stream_gemv off: never).
  bool uses_stream_gemv(int64_t n, int64_t n_in, int64_t n_out) const {
    return stream_gemv_ && n_in * n_out >= stream_gemv_min_elems_ &&
           cuda::stream_gemv_supports(n, n_in, n_out, 0, stream_gemv_stages_);
  }
  cuda::AttentionParams attention_params(const BatchArrays& d, const PassShape& s) const;
  // Writes the batch (padded to n_seqs_pad sequences and `width` columns when graphed) into the
  // pinned staging buffer in BatchArrays layout; returns the host layout.
  BatchArrays stage(const ForwardBatch& b, std::span<const RowSampling> rows, int64_t n_seqs_pad, int32_t width);

  const LlamaModel& model_;
  const ModelHparams& hp_;
  bool eager_;
  cudaStream_t stream_ = nullptr;
  std::string device_name_;
  std::unique_ptr<cuda::Gemm> gemm_;
  // Token counts up to which the projections use cuda::skinny_gemm instead of cuBLASLt (from the
  // H200 measurements in docs/performance.md; CudaTuning::skinny_max_tokens, 0 = never).
  int64_t skinny_max_tokens_ = 8;
  bool stream_gemv_ = true;
  // Residual add + RMSNorm folded into the streaming GEMV of QKV and gate/up when both take it
  // (one or two tokens), alternating residual_ and residual_alt_ (CudaTuning::fused_norm).
  // H200, the 8B at batch 1: 235.0 tok/s with it, 225.6 without (docs/performance.md).
  bool fused_norm_ = true;
  // 0: the kernel's default, 4 (CudaTuning::stream_gemv_stages 3, 4 or 6; 3: 196.8 against 227.4
  // tok/s). Six stages for gate/up and down alone were faster back to back (54.6 against 56.6 us,
  // 27.6 against 28.1) but not in decode: H200, the 8B at batch 1, 232.8 tok/s against 235.0 with
  // four (docs/performance.md).
  int stream_gemv_stages_ = 0;
  // Decode-only passes: RoPE and the K/V write inside the decode attention kernel
  // (AttentionParams::rope; CudaTuning::fused_rope off: the rope_write_kv kernel).
  bool fused_rope_ = true;
  // Weights under 40 MiB keep the skinny GEMM (CudaTuning::stream_gemv_min_mb): H200, one token,
  // back to back, the 8B's O projection (32 MiB) 10.5 us on the skinny GEMM against 11.3 us streamed; its
  // QKV (48 MiB) 15.6 against 15.1, gate/up 62.2 against 56.0 (docs/performance.md,
  // "H200: projections at one token").
  int64_t stream_gemv_min_elems_ = (int64_t{40} << 20) / 2;
  static constexpr int64_t kSkinnyMaxWeightElems = int64_t{32} << 20;  // 64 MB of bf16
  // Decode batch sizes whose cuBLASLt algorithms were timed (tune_gemms; CudaTuning::gemm_tune).
  bool tune_gemms_ = true;
  // Tuned only up to 64 rows: there it gained 1-2% (batch-64 decode, H200), while tuning the
  // larger, compute-bound decode batches of an offline run cost 7% of its throughput
  // (docs/performance.md): timed alone, the winners did worse inside the real step.
  static constexpr int64_t kTuneMaxTokens = 64;
  std::set<int64_t> tuned_sizes_;
  bool gemm_split_k_ = true;  // split-K variants among the tuned candidates
  // AttentionParams::decode_stages, split_items_per_block, split_min_tiles (CudaTuning).
  int32_t attn_decode_stages_ = 0, attn_items_per_block_ = 0, attn_min_split_tiles_ = 0;
  void tune_gemms(int64_t n);
  std::unique_ptr<cuda::OpProfiler> prof_;  // CudaTuning::profile_ops (op_profiler.h)
  void mark(const char* op) {
    if (prof_ != nullptr) prof_->mark(op);
  }
  DevMem embd_, out_norm_, lm_head_, inv_freq_;
  std::vector<Layer> layers_;
  // KV cache: per layer K and V, [n_blocks, n_head_kv, block_size, head_dim] bf16.
  std::vector<DevMem> k_cache_, v_cache_;
  DevMem cache_ptrs_;  // [2 * n_layer] device pointers, for copy_blocks
  int32_t n_blocks_ = 0;
  int32_t block_size_ = 16;
  // Activations (grown to the largest batch seen).
  int64_t cap_tokens_ = 0, cap_out_ = 0;
  DevMem residual_, residual_alt_, h_, qkv_, q_, attn_, o_, gate_up_, act_, down_, logits_in_, logits_, workspace_, sample_ws_;
  DevMem arrays_;      // the eager path's BatchArrays
  PinnedMem staging_;  // their host copy
  PinnedMem logits_h_;
  PinnedMem tokens_h_;
  // Keyed by (batch size, block table width, samples on the device).
  std::map<std::tuple<int64_t, int32_t, bool>, std::unique_ptr<DecodeGraph>> graphs_;
};

void CudaModelRunner::upload_weights() {
  const auto& W = model_.weights();
  WeightUploader up(stream_);
  embd_ = up.matrices({&W.token_embd});
  lm_head_ = W.tied_output ? DevMem() : up.matrices({&W.output});
  out_norm_ = upload_bf16(W.output_norm);
  layers_.resize(W.layers.size());
  const int64_t qd = hp_.q_dim(), kvd = hp_.kv_dim();
  for (size_t l = 0; l < W.layers.size(); ++l) {
    const auto& L = W.layers[l];
    Layer& d = layers_[l];
    d.attn_norm = upload_bf16(L.attn_norm);
    d.ffn_norm = upload_bf16(L.ffn_norm);
    d.w_qkv = up.matrices({&L.wq, &L.wk, &L.wv});
    d.wo = up.matrices({&L.wo});
    d.w_gate_up = up.matrices({&L.w_gate, &L.w_up});
    d.w_down = up.matrices({&L.w_down});
    if (!L.bq.empty() || !L.bk.empty() || !L.bv.empty()) {
      std::vector<float> b(static_cast<size_t>(qd + 2 * kvd), 0.0f);
      std::copy(L.bq.begin(), L.bq.end(), b.begin());
      std::copy(L.bk.begin(), L.bk.end(), b.begin() + qd);
      std::copy(L.bv.begin(), L.bv.end(), b.begin() + qd + kvd);
      d.b_qkv = upload_f32(b);
    }
    if (!L.bo.empty()) d.bo = upload_f32(L.bo);
  }
  inv_freq_ = upload_f32(rope_inv_freq(hp_, W.rope_freq_factors));
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void CudaModelRunner::allocate_kv(const RunnerOptions& o) {
  const int64_t block_bytes = hp_.n_head_kv * block_size_ * hp_.head_dim * 2;  // one layer's K (or V) block
  const int64_t bytes_per_block = 2 * hp_.n_layer * block_bytes;
  int64_t n = o.n_kv_blocks;
  if (n <= 0) {
    size_t free_b = 0, total_b = 0;
    KESTREL_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    // What the weights left of the allowed share, less 2 GiB for activations, cuBLASLt, the
    // attention workspace and the captured graphs' buffers.
    const double allowed = o.gpu_memory_utilization * static_cast<double>(total_b);
    const double used = static_cast<double>(total_b - free_b);
    const double budget = allowed - used - static_cast<double>(int64_t{2} << 30);
    n = budget > 0 ? static_cast<int64_t>(budget / static_cast<double>(bytes_per_block)) : 0;
    if (n <= 0)
      throw Error("CUDA: no device memory left for the KV cache (weights use " + std::to_string(int64_t(used) >> 20) +
                  " MiB of " + std::to_string(total_b >> 20) + " MiB; --gpu-memory-utilization " +
                  std::to_string(o.gpu_memory_utilization) + ")");
  }
  n_blocks_ = static_cast<int32_t>(std::min<int64_t>(n, INT32_MAX / std::max(1, block_size_)));
  std::vector<void*> ptrs;
  for (int64_t l = 0; l < hp_.n_layer; ++l) {
    k_cache_.emplace_back(static_cast<size_t>(n_blocks_) * static_cast<size_t>(block_bytes));
    v_cache_.emplace_back(static_cast<size_t>(n_blocks_) * static_cast<size_t>(block_bytes));
    ptrs.push_back(k_cache_.back().as<void>());
    ptrs.push_back(v_cache_.back().as<void>());
  }
  cache_ptrs_ = upload(ptrs.data(), ptrs.size() * sizeof(void*));
}

void CudaModelRunner::copy_blocks(std::span<const BlockCopy> copies) {
  if (copies.empty()) return;
  std::vector<int32_t> idx;
  for (const BlockCopy& c : copies) idx.push_back(c.src);
  for (const BlockCopy& c : copies) idx.push_back(c.dst);
  DevMem d = upload(idx.data(), idx.size() * sizeof(int32_t));
  const int64_t block_bytes = hp_.n_head_kv * block_size_ * hp_.head_dim * 2;
  cuda::copy_blocks(cache_ptrs_.as<void* const>(), static_cast<int32_t>(2 * hp_.n_layer), d.as<int32_t>(),
                    d.as<int32_t>() + copies.size(), static_cast<int32_t>(copies.size()), block_bytes, stream_);
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream_));  // d is freed on return
}

void CudaModelRunner::reserve_activations(int64_t n, int64_t n_out, size_t attention_ws) {
  n_out = std::max<int64_t>(1, n_out);
  bool grew = false;
  auto grow = [&](DevMem& m, size_t bytes) {
    if (bytes <= m.bytes()) return;
    m.reserve(bytes);
    grew = true;
  };
  const int64_t d = hp_.n_embd, qd = hp_.q_dim(), kvd = hp_.kv_dim(), ff = hp_.n_ff, nv = hp_.n_vocab;
  if (n > cap_tokens_) {
    grow(residual_, static_cast<size_t>(n * d) * 4);
    // The fused norm's second residual: passes of at most kStreamGemvMaxTokens rows only.
    if (fused_norm_) grow(residual_alt_, static_cast<size_t>(std::min(n, cuda::kStreamGemvMaxTokens) * d) * 4);
    grow(h_, static_cast<size_t>(n * d) * 2);
    grow(qkv_, static_cast<size_t>(n * (qd + 2 * kvd)) * 2);
    grow(q_, static_cast<size_t>(n * qd) * 2);
    grow(attn_, static_cast<size_t>(n * qd) * 2);
    grow(o_, static_cast<size_t>(n * d) * 2);
    grow(gate_up_, static_cast<size_t>(n * 2 * ff) * 2);
    grow(act_, static_cast<size_t>(n * ff) * 2);
    grow(down_, static_cast<size_t>(n * d) * 2);
    cap_tokens_ = std::max(cap_tokens_, n);
  }
  if (n_out > cap_out_) {
    grow(logits_in_, static_cast<size_t>(n_out * d) * 2);
    grow(logits_, static_cast<size_t>(n_out * nv) * 4);
    grow(sample_ws_, std::max<size_t>(16, cuda::sampling_workspace_bytes(n_out, nv)));
    cap_out_ = std::max(cap_out_, n_out);
  }
  grow(workspace_, std::max<size_t>(16, attention_ws));
  if (grew) graphs_.clear();
}

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
  ap.n_head = static_cast<int32_t>(hp_.n_head);
  ap.n_head_kv = static_cast<int32_t>(hp_.n_head_kv);
  ap.head_dim = static_cast<int32_t>(hp_.head_dim);
  ap.block_size = block_size_;
  ap.scale = 1.0f / std::sqrt(static_cast<float>(hp_.head_dim));
  ap.workspace = workspace_.as<void>();
  ap.workspace_bytes = workspace_.bytes();
  ap.decode_stages = attn_decode_stages_;
  ap.split_items_per_block = attn_items_per_block_;
  ap.split_min_tiles = attn_min_split_tiles_;
  return ap;
}

void CudaModelRunner::enqueue_forward(const BatchArrays& da, const PassShape& s) {
  const int64_t n = s.n_tokens;
  const int64_t d = hp_.n_embd, qd = hp_.q_dim(), kvd = hp_.kv_dim(), ff = hp_.n_ff, nv = hp_.n_vocab;
  const int64_t qkv_w = qd + 2 * kvd;
  cuda::AttentionParams ap = attention_params(da, s);
  float* residual = residual_.as<float>();
  bf16* h = h_.as<bf16>();
  bf16* qkv = qkv_.as<bf16>();
  bf16* q = q_.as<bf16>();
  bf16* attn = attn_.as<bf16>();
  bf16* o = o_.as<bf16>();
  bf16* gate_up = gate_up_.as<bf16>();
  bf16* down = down_.as<bf16>();
  const bool rotate_half = hp_.rope_style == RopeStyle::RotateHalf;
  // Decode-only passes rotate q and write K/V inside the decode attention kernel (no RoPE kernel).
  const bool rope_in_attention = fused_rope_ && s.max_query == 1 &&
                                 cuda::attention_supports_fused_rope(static_cast<int32_t>(hp_.head_dim));
  // residual += add, then y = RMSNorm(residual) * norm_w . W^T: two kernels, or one streaming GEMV
  // reading residual and writing the sum to the other residual buffer (fused_norm_), after which
  // the two buffers swap roles.
  float* spare = residual_alt_.as<float>();
  auto norm_linear = [&](const bf16* add, const DevMem& norm_w, const DevMem& w, bf16* y, int64_t n_out,
                         const char* what) {
    if (!fused_norm_ || !uses_stream_gemv(n, d, n_out)) {
      cuda::add_rms_norm(residual, add, norm_w.as<bf16>(), h, n, d, hp_.rms_eps, stream_);
      mark("add_rms_norm");
      linear(h, w.as<bf16>(), y, false, n, d, n_out);
      mark(what);
      return;
    }
    if (residual_alt_.bytes() < static_cast<size_t>(n * d) * 4)
      throw Error("fused norm: the second residual buffer holds fewer than " + std::to_string(n) + " rows");
    cuda::StreamGemvArgs a{cuda::ProjectionOperands{nullptr, d, w.as<bf16>(), y, n, d, n_out, false, false}};
    a.stages = stream_gemv_stages_;
    a.norm_residual_in = residual;
    a.norm_add = add;
    a.norm_weight = norm_w.as<bf16>();
    a.norm_residual_out = spare;
    a.norm_eps = hp_.rms_eps;
    cuda::stream_gemv(a, stream_);
    std::swap(residual, spare);
    mark(what);
  };

  if (prof_ != nullptr) prof_->begin(s.max_query == 1 ? "decode" : "prefill");
  cuda::embedding(embd_.as<bf16>(), da.ids, n, d, residual, stream_);
  mark("embedding");
  for (int64_t l = 0; l < hp_.n_layer; ++l) {
    const Layer& L = layers_[static_cast<size_t>(l)];
    norm_linear(l == 0 ? nullptr : down, L.attn_norm, L.w_qkv, qkv, qkv_w, "gemm qkv");
    if (L.b_qkv.bytes() > 0) cuda::add_bias(qkv, L.b_qkv.as<float>(), n, qkv_w, stream_);
    bf16* kc = k_cache_[static_cast<size_t>(l)].as<bf16>();
    bf16* vc = v_cache_[static_cast<size_t>(l)].as<bf16>();
    if (rope_in_attention) {
      ap.rope = {qkv, qkv_w, da.slots, inv_freq_.as<float>(), hp_.rope_linear_scale, static_cast<int32_t>(hp_.rope_dim),
                 rotate_half};
    } else {
      cuda::rope_write_kv_fused(qkv, qkv_w, q, da.positions, da.slots, inv_freq_.as<float>(), hp_.rope_linear_scale,
                                n, hp_.n_head, hp_.n_head_kv, hp_.head_dim, hp_.rope_dim, rotate_half, kc, vc,
                                block_size_, stream_);
      mark("rope_write_kv");
    }
    ap.q = q;
    ap.k_cache = kc;
    ap.v_cache = vc;
    ap.out = attn;
    cuda::paged_attention(ap, stream_);
    mark("attention");
    linear(attn, L.wo.as<bf16>(), o, false, n, qd, d);
    mark("gemm o");
    if (L.bo.bytes() > 0) cuda::add_bias(o, L.bo.as<float>(), n, d, stream_);
    norm_linear(o, L.ffn_norm, L.w_gate_up, gate_up, 2 * ff, "gemm gate_up");
    linear(gate_up, L.w_down.as<bf16>(), down, false, n, ff, d, /*swiglu=*/true);
    mark("gemm down (+silu)");
  }
  if (s.n_out == 0) return;
  cuda::add_rms_norm(residual, down, out_norm_.as<bf16>(), h, n, d, hp_.rms_eps, stream_);
  // The rows whose logits are wanted: h itself when they are all rows in order, else gathered.
  const bf16* rows = h;
  if (!s.rows_identity) {
    cuda::gather_rows(h, da.logits_rows, s.n_out, d, logits_in_.as<bf16>(), stream_);
    rows = logits_in_.as<bf16>();
  }
  mark("final norm");
  const bf16* head = lm_head_.bytes() > 0 ? lm_head_.as<bf16>() : embd_.as<bf16>();
  linear(rows, head, logits_.as<void>(), true, s.n_out, d, nv);
  mark("gemm lm_head");
  if (s.sample) {
    cuda::sample_tokens(logits_.as<float>(), reinterpret_cast<const cuda::SampleParams*>(da.sampling), s.n_out, nv,
                        da.tokens, sample_ws_.as<void>(), stream_);
    mark("sample");
  }
}

// The decode projections at n tokens that go to cuBLASLt: its heuristic's candidates and their
// split-K variants are timed over all layers' weights (Gemm::tune) and the fastest kept (+1.1% at
// batch 64 on the H200 with the heuristic's alone). With CudaTuning::profile_ops the picks are printed.
// Scratch inputs and outputs are the activation buffers (sized for n by reserve_activations);
// their contents do not matter.
void CudaModelRunner::tune_gemms(int64_t n) {
  const int64_t d = hp_.n_embd, qd = hp_.q_dim(), kvd = hp_.kv_dim(), ff = hp_.n_ff, nv = hp_.n_vocab;
  auto tune = [&](const bf16* x, const std::vector<const bf16*>& ws, void* y, bool f32_out, int64_t n_in,
                  int64_t n_out) {
    if (uses_skinny(n, n_in, n_out) || uses_stream_gemv(n, n_in, n_out)) return;
    const int pick = gemm_->tune(x, ws.data(), ws.size(), y, f32_out ? cuda::GemmOutput::F32 : cuda::GemmOutput::Bf16,
                                 n, n_in, n_out, stream_, gemm_split_k_);
    if (prof_ != nullptr)
      std::fprintf(stderr, "gemm tune: %lld x %lld -> %lld: candidate %d\n", static_cast<long long>(n),
                   static_cast<long long>(n_in), static_cast<long long>(n_out), pick);
  };
  auto all_layers = [&](DevMem Layer::*w) {
    std::vector<const bf16*> ws;
    for (const Layer& L : layers_) ws.push_back((L.*w).as<bf16>());
    return ws;
  };
  tune(h_.as<bf16>(), all_layers(&Layer::w_qkv), qkv_.as<void>(), false, d, qd + 2 * kvd);
  tune(attn_.as<bf16>(), all_layers(&Layer::wo), o_.as<void>(), false, qd, d);
  tune(h_.as<bf16>(), all_layers(&Layer::w_gate_up), gate_up_.as<void>(), false, d, 2 * ff);
  tune(act_.as<bf16>(), all_layers(&Layer::w_down), down_.as<void>(), false, ff, d);
  // One head matrix: at n_vocab x n_embd it is far larger than the L2 (and tuned in one pass each).
  const bf16* head = lm_head_.bytes() > 0 ? lm_head_.as<bf16>() : embd_.as<bf16>();
  tune(logits_in_.as<bf16>(), {head}, logits_.as<void>(), true, d, nv);
}

void CudaModelRunner::linear(const bf16* x, const bf16* w, void* y, bool f32_out, int64_t n, int64_t n_in,
                             int64_t n_out, bool swiglu) {
  const cuda::ProjectionOperands ops{x, swiglu ? 2 * n_in : n_in, w, y, n, n_in, n_out, swiglu, f32_out};
  if (uses_stream_gemv(n, n_in, n_out)) {
    cuda::StreamGemvArgs a{ops};
    a.stages = stream_gemv_stages_;
    cuda::stream_gemv(a, stream_);
    return;
  }
  if (uses_skinny(n, n_in, n_out)) {
    cuda::skinny_gemm(cuda::SkinnyGemmArgs{ops}, stream_);
    return;
  }
  if (swiglu) {
    cuda::silu_mul(x, act_.as<bf16>(), n, n_in, stream_);
    x = act_.as<bf16>();
  }
  gemm_->run(x, w, y, f32_out ? cuda::GemmOutput::F32 : cuda::GemmOutput::Bf16, n, n_in, n_out, stream_);
}

BatchArrays CudaModelRunner::stage(const ForwardBatch& b, std::span<const RowSampling> rows, int64_t n_seqs_pad,
                                   int32_t width) {
  const int64_t n = b.n_tokens(), n_seqs = b.n_seqs();
  const int64_t pad = n_seqs_pad - n_seqs;  // decode padding: one token per padded sequence
  const int64_t n_tok = n + pad;
  const int64_t n_out = static_cast<int64_t>(b.logits_indices.size()) + pad;
  BatchArrays layout = BatchArrays::layout(nullptr, n_tok, n_seqs_pad, width, n_out);
  staging_.reserve(layout.bytes + 16);
  unsigned char* base = staging_.as<unsigned char>();
  BatchArrays h = BatchArrays::layout(base, n_tok, n_seqs_pad, width, n_out);
  std::copy(b.slot_mapping.begin(), b.slot_mapping.end(), h.slots);
  std::copy(b.token_ids.begin(), b.token_ids.end(), h.ids);
  std::copy(b.positions.begin(), b.positions.end(), h.positions);
  std::copy(b.query_start.begin(), b.query_start.end(), h.query_start);
  std::copy(b.context_lens.begin(), b.context_lens.end(), h.context_lens);
  std::copy(b.logits_indices.begin(), b.logits_indices.end(), h.logits_rows);
  for (int64_t i = 0; i < pad; ++i) {
    h.slots[n + i] = -1;  // writes nothing to the cache
    h.ids[n + i] = 0;
    h.positions[n + i] = 0;
    h.query_start[n_seqs + 1 + i] = static_cast<int32_t>(n + i + 1);
    h.context_lens[n_seqs + i] = 1;
    h.logits_rows[static_cast<int64_t>(b.logits_indices.size()) + i] = static_cast<int32_t>(n + i);
  }
  const int64_t bw = b.max_blocks_per_seq;
  if (bw == width) {
    std::copy(b.block_tables.begin(), b.block_tables.end(), h.block_tables);
  } else {
    for (int64_t s = 0; s < n_seqs; ++s) {
      std::copy_n(b.block_tables.begin() + s * bw, bw, h.block_tables + s * width);
      std::fill_n(h.block_tables + s * width + bw, width - bw, 0);
    }
  }
  std::fill_n(h.block_tables + n_seqs * width, pad * width, 0);  // padding reads block 0, slot 0
  std::copy(rows.begin(), rows.end(), h.sampling);
  for (int64_t i = static_cast<int64_t>(rows.size()); i < n_out; ++i) h.sampling[i] = RowSampling{};
  return h;
}

// Batch sizes with a captured decode graph: a decode batch is padded up to the next one.
constexpr int64_t kGraphBatchSizes[] = {1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512};

const int32_t* CudaModelRunner::run(const ForwardBatch& b, std::span<const RowSampling> rows, bool sample) {
  validate_forward_batch(b, hp_.n_vocab, n_blocks_, block_size_);
  const int64_t n = b.n_tokens(), n_seqs = b.n_seqs(), n_out = static_cast<int64_t>(b.logits_indices.size());
  if (sample && static_cast<int64_t>(rows.size()) != n_out)
    throw Error("forward_sample: " + std::to_string(rows.size()) + " sampling rows for " + std::to_string(n_out) +
                " logits rows");
  bool identity = n_out == n;
  for (int64_t i = 0; identity && i < n_out; ++i) identity = b.logits_indices[static_cast<size_t>(i)] == i;
  int32_t max_context = 0, max_query = 0;
  for (int64_t s = 0; s < n_seqs; ++s) {
    max_context = std::max(max_context, b.context_lens[static_cast<size_t>(s)]);
    max_query = std::max(max_query, b.query_start[static_cast<size_t>(s) + 1] - b.query_start[static_cast<size_t>(s)]);
  }

  // Decode steps (one token and one logits row per sequence) replay a captured graph. max_query
  // == 1 as well: a sequence may have no tokens, so n == n_seqs alone would let one with two
  // tokens in.
  const bool decode = n == n_seqs && max_query == 1 && identity;
  const int64_t* bucket = std::find_if(std::begin(kGraphBatchSizes), std::end(kGraphBatchSizes),
                                       [&](int64_t bsz) { return bsz >= n_seqs; });
  if (!eager_ && decode && bucket != std::end(kGraphBatchSizes)) {
    const int64_t bsz = *bucket;
    int32_t width = 16;
    while (width < b.max_blocks_per_seq) width *= 2;
    PassShape s;
    s.n_tokens = s.n_seqs = s.n_out = bsz;
    s.width = width;
    s.max_context = width * block_size_;
    s.max_query = 1;
    s.rows_identity = true;
    s.sample = sample;
    cuda::AttentionParams probe = attention_params(BatchArrays{}, s);
    reserve_activations(bsz, bsz, cuda::attention_workspace_bytes(probe));
    const BatchArrays h = stage(b, rows, bsz, width);
    auto& g = graphs_[{bsz, width, sample}];
    if (g == nullptr && tune_gemms_ && bsz <= kTuneMaxTokens && tuned_sizes_.insert(bsz).second) tune_gemms(bsz);
    if (g == nullptr) {
      // First use of this shape: allocate its arrays, run it eagerly (warming cuBLASLt's
      // algorithm cache outside the capture), then capture it for the next steps.
      g = std::make_unique<DecodeGraph>();
      g->arrays.reset(BatchArrays::layout(nullptr, bsz, bsz, width, bsz).bytes + 16 +
                      static_cast<size_t>(bsz) * 4 + 16);
      g->dev = BatchArrays::layout(g->arrays.as<unsigned char>(), bsz, bsz, width, bsz);
      KESTREL_CUDA_CHECK(cudaMemcpyAsync(g->arrays.as<void>(), staging_.as<void>(), h.bytes, cudaMemcpyHostToDevice,
                                         stream_));
      enqueue_forward(g->dev, s);
      cudaGraph_t graph = nullptr;
      KESTREL_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
      try {
        enqueue_forward(g->dev, s);
      } catch (...) {
        cudaStreamEndCapture(stream_, &graph);
        if (graph != nullptr) cudaGraphDestroy(graph);
        g.reset();
        throw;
      }
      KESTREL_CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
      const cudaError_t err = cudaGraphInstantiate(&g->exec, graph, 0);
      cudaGraphDestroy(graph);
      KESTREL_CUDA_CHECK(err);
      return g->dev.tokens;
    }
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(g->arrays.as<void>(), staging_.as<void>(), h.bytes, cudaMemcpyHostToDevice,
                                       stream_));
    KESTREL_CUDA_CHECK(cudaGraphLaunch(g->exec, stream_));
    return g->dev.tokens;
  }

  PassShape s;
  s.n_tokens = n;
  s.n_seqs = n_seqs;
  s.n_out = n_out;
  s.width = b.max_blocks_per_seq;
  s.max_context = max_context;
  s.max_query = max_query;
  s.rows_identity = identity;
  s.sample = sample;
  cuda::AttentionParams probe = attention_params(BatchArrays{}, s);
  reserve_activations(n, n_out, cuda::attention_workspace_bytes(probe));
  const BatchArrays h = stage(b, rows, n_seqs, s.width);
  arrays_.reserve(BatchArrays::layout(nullptr, n, n_seqs, s.width, n_out).bytes + static_cast<size_t>(n_out) * 4 + 32);
  const BatchArrays d = BatchArrays::layout(arrays_.as<unsigned char>(), n, n_seqs, s.width, n_out);
  KESTREL_CUDA_CHECK(cudaMemcpyAsync(arrays_.as<void>(), staging_.as<void>(), h.bytes, cudaMemcpyHostToDevice, stream_));
  enqueue_forward(d, s);
  return d.tokens;
}

std::span<const float> CudaModelRunner::forward(const ForwardBatch& b) {
  run(b, {}, false);
  const int64_t n_out = static_cast<int64_t>(b.logits_indices.size()), nv = hp_.n_vocab;
  if (n_out == 0) {
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream_));
    if (prof_ != nullptr) prof_->collect();
    return {};
  }
  const size_t logit_bytes = static_cast<size_t>(n_out * nv) * sizeof(float);
  logits_h_.reserve(logit_bytes);
  KESTREL_CUDA_CHECK(cudaMemcpyAsync(logits_h_.as<void>(), logits_.as<void>(), logit_bytes, cudaMemcpyDeviceToHost, stream_));
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream_));
  if (prof_ != nullptr) prof_->collect();
  return {logits_h_.as<const float>(), static_cast<size_t>(n_out * nv)};
}

std::span<const int32_t> CudaModelRunner::forward_sample(const ForwardBatch& b, std::span<const RowSampling> rows) {
  const int32_t* tokens = run(b, rows, true);
  const size_t n_out = b.logits_indices.size();
  if (n_out == 0) {
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream_));
    if (prof_ != nullptr) prof_->collect();
    return {};
  }
  tokens_h_.reserve(n_out * sizeof(int32_t));
  KESTREL_CUDA_CHECK(cudaMemcpyAsync(tokens_h_.as<void>(), tokens, n_out * sizeof(int32_t), cudaMemcpyDeviceToHost, stream_));
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream_));
  if (prof_ != nullptr) prof_->collect();
  return {tokens_h_.as<const int32_t>(), n_out};
}

}  // namespace

std::unique_ptr<ModelRunner> make_cuda_model_runner(const LlamaModel& model, const RunnerOptions& options) {
  return std::make_unique<CudaModelRunner>(model, options);
}

}  // namespace kestrel
