// The Llama forward pass on a CUDA device behind the ModelRunner interface: bf16 weights and KV
// cache in device memory, f32 residual stream, cuBLASLt GEMMs and the kernels of cuda_ops.h.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "backend/cpu/matmul.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/cuda_runner.h"
#include "backend/cuda/gemm.h"
#include "core/dtype.h"
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

// One device allocation, freed with its owner.
class DevMem {
 public:
  DevMem() = default;
  explicit DevMem(size_t bytes) { reset(bytes); }
  ~DevMem() {
    if (p_ != nullptr) cudaFree(p_);
  }
  DevMem(DevMem&& o) noexcept : p_(o.p_), bytes_(o.bytes_) { o.p_ = nullptr, o.bytes_ = 0; }
  DevMem& operator=(DevMem&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  void reset(size_t bytes) {
    if (p_ != nullptr) cudaFree(p_);
    p_ = nullptr;
    bytes_ = 0;
    if (bytes == 0) return;
    const cudaError_t err = cudaMalloc(&p_, bytes);
    if (err == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      throw Error("CUDA: out of device memory allocating " + std::to_string(bytes >> 20) + " MiB");
    }
    KESTREL_CUDA_CHECK(err);
    bytes_ = bytes;
  }
  // Grows (contents lost) to at least `bytes`.
  void reserve(size_t bytes) {
    if (bytes > bytes_) reset(bytes + bytes / 4);
  }
  template <class T>
  T* as() const {
    return static_cast<T*>(p_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

// Page-locked host memory, for asynchronous copies.
class PinnedMem {
 public:
  ~PinnedMem() {
    if (p_ != nullptr) cudaFreeHost(p_);
  }
  void reserve(size_t bytes) {
    if (bytes <= bytes_) return;
    if (p_ != nullptr) cudaFreeHost(p_);
    p_ = nullptr;
    bytes_ = bytes + bytes / 4;
    KESTREL_CUDA_CHECK(cudaMallocHost(&p_, bytes_));
  }
  template <class T>
  T* as() const {
    return static_cast<T*>(p_);
  }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

// Rows [0, w.n_out) of a weight as bf16 on the host, appended to `out` (dequantized through f32
// for quantized and f16/f32 types; bf16 copied as is).
void append_bf16_rows(const WeightView& w, std::vector<uint16_t>& out) {
  const size_t base = out.size();
  out.resize(base + static_cast<size_t>(w.n_out * w.n_in));
  uint16_t* dst = out.data() + base;
  if (w.type == GgmlType::BF16) {
    std::memcpy(dst, w.data, static_cast<size_t>(w.n_out * w.n_in) * 2);
    return;
  }
  std::vector<float> row(static_cast<size_t>(w.n_in));
  for (int64_t r = 0; r < w.n_out; ++r) {
    cpu::dequantize_row(w.type, w.row(r), row.data(), w.n_in);
    for (int64_t i = 0; i < w.n_in; ++i) dst[r * w.n_in + i] = fp32_to_bf16(row[static_cast<size_t>(i)]);
  }
}

DevMem upload(const void* host, size_t bytes) {
  DevMem d(bytes);
  KESTREL_CUDA_CHECK(cudaMemcpy(d.as<void>(), host, bytes, cudaMemcpyHostToDevice));
  return d;
}

DevMem upload_matrices(std::initializer_list<const WeightView*> ws) {
  std::vector<uint16_t> host;
  for (const WeightView* w : ws) append_bf16_rows(*w, host);
  return upload(host.data(), host.size() * 2);
}

DevMem upload_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> h(v.size());
  for (size_t i = 0; i < v.size(); ++i) h[i] = fp32_to_bf16(v[i]);
  return upload(h.data(), h.size() * 2);
}

DevMem upload_f32(const std::vector<float>& v) { return upload(v.data(), v.size() * sizeof(float)); }

struct Layer {
  DevMem attn_norm, ffn_norm;            // [n_embd] bf16
  DevMem wq, wk, wv, wo, w_gate_up, w_down;  // bf16, rows as in LlamaLayerWeights; gate and up stacked
  DevMem bq, bk, bv, bo;                 // f32 biases or empty
};

class CudaModelRunner final : public ModelRunner {
 public:
  CudaModelRunner(const LlamaModel& model, const RunnerOptions& o) : model_(model), hp_(model.hparams()) {
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
    upload_weights();
    block_size_ = o.block_size;
    allocate_kv(o);
  }

  ~CudaModelRunner() override {
    if (stream_ != nullptr) {
      cudaStreamSynchronize(stream_);
      cudaStreamDestroy(stream_);
    }
  }

  std::span<const float> forward(const ForwardBatch& b) override;
  void copy_blocks(std::span<const BlockCopy> copies) override;
  int32_t n_kv_blocks() const override { return n_blocks_; }
  int32_t block_size() const override { return block_size_; }
  KvDtype kv_dtype() const override { return KvDtype::BF16; }
  std::string description() const override {
    return "cuda (" + device_name_ + ", bf16 weights, KV bf16 " + std::to_string(n_blocks_) + " blocks)";
  }

 private:
  void upload_weights();
  void allocate_kv(const RunnerOptions& o);
  void add_bias(bf16* y, const DevMem& b, int64_t n_tokens, int64_t width);

  const LlamaModel& model_;
  const ModelHparams& hp_;
  cudaStream_t stream_ = nullptr;
  std::string device_name_;
  std::unique_ptr<cuda::Gemm> gemm_;
  DevMem embd_, out_norm_, lm_head_, inv_freq_;
  std::vector<Layer> layers_;
  // KV cache: per layer K and V, [n_blocks, n_head_kv, block_size, head_dim] bf16.
  std::vector<DevMem> k_cache_, v_cache_;
  DevMem cache_ptrs_;  // [2 * n_layer] device pointers, for copy_blocks
  int32_t n_blocks_ = 0;
  int32_t block_size_ = 16;
  // Activations (grown to the largest batch seen).
  DevMem residual_, h_, q_, k_, v_, attn_, o_, gate_up_, act_, down_, logits_in_, logits_, workspace_;
  DevMem meta_;        // the batch's index arrays on the device
  PinnedMem meta_h_;   // their staging copy
  PinnedMem logits_h_;
};

void CudaModelRunner::upload_weights() {
  const auto& W = model_.weights();
  embd_ = upload_matrices({&W.token_embd});
  lm_head_ = W.tied_output ? DevMem() : upload_matrices({&W.output});
  out_norm_ = upload_bf16(W.output_norm);
  layers_.resize(W.layers.size());
  for (size_t l = 0; l < W.layers.size(); ++l) {
    const auto& L = W.layers[l];
    Layer& d = layers_[l];
    d.attn_norm = upload_bf16(L.attn_norm);
    d.ffn_norm = upload_bf16(L.ffn_norm);
    d.wq = upload_matrices({&L.wq});
    d.wk = upload_matrices({&L.wk});
    d.wv = upload_matrices({&L.wv});
    d.wo = upload_matrices({&L.wo});
    d.w_gate_up = upload_matrices({&L.w_gate, &L.w_up});
    d.w_down = upload_matrices({&L.w_down});
    if (!L.bq.empty()) d.bq = upload_f32(L.bq);
    if (!L.bk.empty()) d.bk = upload_f32(L.bk);
    if (!L.bv.empty()) d.bv = upload_f32(L.bv);
    if (!L.bo.empty()) d.bo = upload_f32(L.bo);
  }
  inv_freq_ = upload_f32(rope_inv_freq(hp_, W.rope_freq_factors));
}

void CudaModelRunner::allocate_kv(const RunnerOptions& o) {
  const int64_t block_bytes = hp_.n_head_kv * block_size_ * hp_.head_dim * 2;  // one layer's K (or V) block
  const int64_t bytes_per_block = 2 * hp_.n_layer * block_bytes;
  int64_t n = o.n_kv_blocks;
  if (n <= 0) {
    size_t free_b = 0, total_b = 0;
    KESTREL_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    // What the weights left of the allowed share, less 2 GiB for activations, cuBLASLt and the
    // attention workspace.
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

void CudaModelRunner::add_bias(bf16* y, const DevMem& b, int64_t n_tokens, int64_t width) {
  if (b.bytes() == 0) return;
  cuda::add_bias(y, b.as<float>(), n_tokens, width, stream_);
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

std::span<const float> CudaModelRunner::forward(const ForwardBatch& b) {
  validate_forward_batch(b, hp_.n_vocab, n_blocks_, block_size_);
  const int64_t n = b.n_tokens();
  const int64_t n_seqs = b.n_seqs();
  const int64_t d = hp_.n_embd, qd = hp_.q_dim(), kvd = hp_.kv_dim(), ff = hp_.n_ff, nv = hp_.n_vocab;
  const int64_t n_out = static_cast<int64_t>(b.logits_indices.size());

  // The batch's index arrays, staged in one pinned buffer and copied with one transfer.
  const size_t n_i32 = static_cast<size_t>(n) * 2 + static_cast<size_t>(n_seqs) * 2 + 1 + b.block_tables.size();
  const size_t meta_bytes = static_cast<size_t>(n) * sizeof(int64_t) + n_i32 * sizeof(int32_t);
  meta_h_.reserve(meta_bytes);
  meta_.reserve(meta_bytes);
  auto* slots_h = meta_h_.as<int64_t>();
  std::copy(b.slot_mapping.begin(), b.slot_mapping.end(), slots_h);
  int32_t* i32 = reinterpret_cast<int32_t*>(slots_h + n);
  size_t off = 0;
  auto put = [&](std::span<const int32_t> v) {
    std::copy(v.begin(), v.end(), i32 + off);
    const size_t at = off;
    off += v.size();
    return at;
  };
  const size_t o_ids = put(b.token_ids), o_pos = put(b.positions), o_qs = put(b.query_start),
               o_ctx = put(b.context_lens), o_bt = put(b.block_tables);
  KESTREL_CUDA_CHECK(cudaMemcpyAsync(meta_.as<void>(), meta_h_.as<void>(), meta_bytes, cudaMemcpyHostToDevice, stream_));
  const int64_t* slots = meta_.as<int64_t>();
  const int32_t* dev_i32 = reinterpret_cast<const int32_t*>(slots + n);
  const int32_t* ids = dev_i32 + o_ids;
  const int32_t* positions = dev_i32 + o_pos;
  const int32_t* query_start = dev_i32 + o_qs;
  const int32_t* context_lens = dev_i32 + o_ctx;
  const int32_t* block_tables = dev_i32 + o_bt;

  residual_.reserve(static_cast<size_t>(n * d) * 4);
  h_.reserve(static_cast<size_t>(n * d) * 2);
  q_.reserve(static_cast<size_t>(n * qd) * 2);
  k_.reserve(static_cast<size_t>(n * kvd) * 2);
  v_.reserve(static_cast<size_t>(n * kvd) * 2);
  attn_.reserve(static_cast<size_t>(n * qd) * 2);
  o_.reserve(static_cast<size_t>(n * d) * 2);
  gate_up_.reserve(static_cast<size_t>(n * 2 * ff) * 2);
  act_.reserve(static_cast<size_t>(n * ff) * 2);
  down_.reserve(static_cast<size_t>(n * d) * 2);
  logits_in_.reserve(static_cast<size_t>(std::max<int64_t>(1, n_out) * d) * 2);
  logits_.reserve(static_cast<size_t>(std::max<int64_t>(1, n_out) * nv) * 4);

  int32_t max_context = 0, max_query = 0;
  for (int64_t s = 0; s < n_seqs; ++s) {
    max_context = std::max(max_context, b.context_lens[s]);
    max_query = std::max(max_query, b.query_start[s + 1] - b.query_start[s]);
  }
  cuda::AttentionParams ap{};
  ap.block_tables = block_tables;
  ap.context_lens = context_lens;
  ap.query_start = query_start;
  ap.token_seq = nullptr;
  ap.positions = positions;
  ap.n_tokens = n;
  ap.n_seqs = n_seqs;
  ap.max_blocks_per_seq = b.max_blocks_per_seq;
  ap.max_context = max_context;
  ap.max_query_len = max_query;
  ap.n_head = static_cast<int32_t>(hp_.n_head);
  ap.n_head_kv = static_cast<int32_t>(hp_.n_head_kv);
  ap.head_dim = static_cast<int32_t>(hp_.head_dim);
  ap.block_size = block_size_;
  ap.scale = 1.0f / std::sqrt(static_cast<float>(hp_.head_dim));
  workspace_.reserve(std::max<size_t>(16, cuda::attention_workspace_bytes(ap)));
  ap.workspace = workspace_.as<void>();
  ap.workspace_bytes = workspace_.bytes();

  float* residual = residual_.as<float>();
  bf16* h = h_.as<bf16>();
  bf16* q = q_.as<bf16>();
  bf16* k = k_.as<bf16>();
  bf16* v = v_.as<bf16>();
  bf16* attn = attn_.as<bf16>();
  bf16* o = o_.as<bf16>();
  bf16* gate_up = gate_up_.as<bf16>();
  bf16* act = act_.as<bf16>();
  bf16* down = down_.as<bf16>();
  const bool rotate_half = hp_.rope_style == RopeStyle::RotateHalf;
  const auto bf16_out = cuda::GemmOutput::Bf16;

  cuda::embedding(embd_.as<bf16>(), ids, n, d, residual, stream_);
  for (int64_t l = 0; l < hp_.n_layer; ++l) {
    const Layer& L = layers_[static_cast<size_t>(l)];
    cuda::add_rms_norm(residual, l == 0 ? nullptr : down, L.attn_norm.as<bf16>(), h, n, d, hp_.rms_eps, stream_);
    gemm_->run(h, L.wq.as<bf16>(), q, bf16_out, n, d, qd, stream_);
    gemm_->run(h, L.wk.as<bf16>(), k, bf16_out, n, d, kvd, stream_);
    gemm_->run(h, L.wv.as<bf16>(), v, bf16_out, n, d, kvd, stream_);
    add_bias(q, L.bq, n, qd);
    add_bias(k, L.bk, n, kvd);
    add_bias(v, L.bv, n, kvd);
    bf16* kc = k_cache_[static_cast<size_t>(l)].as<bf16>();
    bf16* vc = v_cache_[static_cast<size_t>(l)].as<bf16>();
    cuda::rope_write_kv(q, k, v, positions, slots, inv_freq_.as<float>(), hp_.rope_linear_scale, n, hp_.n_head,
                        hp_.n_head_kv, hp_.head_dim, hp_.rope_dim, rotate_half, kc, vc, block_size_, stream_);
    ap.q = q;
    ap.k_cache = kc;
    ap.v_cache = vc;
    ap.out = attn;
    cuda::paged_attention(ap, stream_);
    gemm_->run(attn, L.wo.as<bf16>(), o, bf16_out, n, qd, d, stream_);
    add_bias(o, L.bo, n, d);
    cuda::add_rms_norm(residual, o, L.ffn_norm.as<bf16>(), h, n, d, hp_.rms_eps, stream_);
    gemm_->run(h, L.w_gate_up.as<bf16>(), gate_up, bf16_out, n, d, 2 * ff, stream_);
    cuda::silu_mul(gate_up, act, n, ff, stream_);
    gemm_->run(act, L.w_down.as<bf16>(), down, bf16_out, n, ff, d, stream_);
  }
  cuda::add_rms_norm(residual, down, out_norm_.as<bf16>(), h, n, d, hp_.rms_eps, stream_);
  if (n_out == 0) {
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return {};
  }
  // The rows whose logits are wanted: h itself when they are all rows in order, else gathered.
  bool identity = n_out == n;
  for (int64_t i = 0; identity && i < n_out; ++i) identity = b.logits_indices[static_cast<size_t>(i)] == i;
  const bf16* rows = h;
  if (!identity) {
    bf16* dst = logits_in_.as<bf16>();
    for (int64_t i = 0; i < n_out; ++i)
      KESTREL_CUDA_CHECK(cudaMemcpyAsync(dst + i * d, h + static_cast<int64_t>(b.logits_indices[static_cast<size_t>(i)]) * d,
                                         static_cast<size_t>(d) * 2, cudaMemcpyDeviceToDevice, stream_));
    rows = dst;
  }
  const bf16* head = lm_head_.bytes() > 0 ? lm_head_.as<bf16>() : embd_.as<bf16>();
  gemm_->run(rows, head, logits_.as<void>(), cuda::GemmOutput::F32, n_out, d, nv, stream_);
  const size_t logit_bytes = static_cast<size_t>(n_out * nv) * sizeof(float);
  logits_h_.reserve(logit_bytes);
  KESTREL_CUDA_CHECK(cudaMemcpyAsync(logits_h_.as<void>(), logits_.as<void>(), logit_bytes, cudaMemcpyDeviceToHost, stream_));
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream_));
  return {logits_h_.as<const float>(), static_cast<size_t>(n_out * nv)};
}

}  // namespace

std::unique_ptr<ModelRunner> make_cuda_model_runner(const LlamaModel& model, const RunnerOptions& options) {
  return std::make_unique<CudaModelRunner>(model, options);
}

}  // namespace kestrel
