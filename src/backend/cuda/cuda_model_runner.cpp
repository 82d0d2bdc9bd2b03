// Start-up of the CUDA backend: device and tuning checks, bf16 weights uploaded (GGUF quantized
// matrices dequantized on the host first), the bf16 paged KV cache sized, activation buffers.
#include <algorithm>
#include <climits>
#include <map>
#include <set>
#include <cstddef>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_model_runner.h"
#include "backend/cuda/fp8_ops.h"
#include "backend/cuda/cuda_runner.h"
#include "core/error.h"
#include "backend/kv_geometry.h"
#include "model/quantized_matrix.h"

namespace kestrel {

namespace {
#if defined(KESTREL_CUDA_EMULATE)
constexpr bool kEmulated = true;
#else
constexpr bool kEmulated = false;
#endif
}  // namespace

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

std::unique_ptr<ModelRunner> make_cuda_model_runner(const LlamaModel& model, const RunnerOptions& options) {
  if (options.tensor_parallel_size > 1) {
    // Rank r on GPU r; under the CPU emulation every rank on its one device.
    std::vector<int> devices;
    for (int r = 0; r < options.tensor_parallel_size; ++r) devices.push_back(kEmulated ? 0 : r);
    return make_tensor_parallel_cuda_runner(model, options, devices);
  }
  if (options.pipeline_parallel_size != 1) {
    std::vector<int> devices;
    for (int s = 0; s < options.pipeline_parallel_size; ++s) devices.push_back(s);
    return make_pipeline_parallel_cuda_runner(model, options, devices);
  }
  return std::make_unique<cuda_runner::CudaModelRunner>(model, options);
}

namespace cuda_runner {

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
                  offsetof(RowSampling, uniform) == offsetof(cuda::SampleParams, uniform) &&
                  offsetof(RowSampling, masked) == offsetof(cuda::SampleParams, masked),
              "RowSampling and cuda::SampleParams differ in layout");

CudaModelRunner::CudaModelRunner(const LlamaModel& model, const RunnerOptions& o, const CudaPlacement& place)
    : model_(model),
      hp_(model.hparams()),
      arch_(architecture(model.hparams().arch)),
      eager_(o.enforce_eager),
      device_(place.device),
      role_(place.role),
      comm_(place.comm) {
  const int n_devices = cuda_device_count();
  if (n_devices == 0) throw Error("--device cuda: no CUDA device is available");
  if (device_ < 0 || device_ >= n_devices)
    throw Error("CUDA device " + std::to_string(device_) + " is not visible (" + std::to_string(n_devices) +
                " visible)");
  if (!cuda::attention_supports_head_dim(static_cast<int32_t>(hp_.head_dim)))
    throw Error("CUDA backend: head_dim " + std::to_string(hp_.head_dim) +
                " is not supported (a multiple of 8 from 8 to 256)");
  if (o.block_size <= 0) throw Error("block size must be positive");
  {
    const ModelWeights& W = model.weights();
    const LayerTensor* head = W.find({-1, W.tied_output ? WeightRole::TokenEmbd : WeightRole::Output});
    n_logits_ = head != nullptr ? head->matrix.n_out : hp_.n_vocab;
    vocab_begin_ = W.vocab_begin;
  }
  use_device();
  KESTREL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  cudaDeviceProp prop{};
  KESTREL_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_));
  device_name_ = prop.name;
  device_uuid_ = uuid_text(prop.uuid);
  gemm_ = std::make_unique<cuda::Gemm>();
  const CudaTuning& t = o.cuda;
  if (t.stream_gemv_stages != 0 && t.stream_gemv_stages != 3 && t.stream_gemv_stages != 4 && t.stream_gemv_stages != 6)
    throw Error("CUDA stream GEMV stages " + std::to_string(t.stream_gemv_stages) + ": 0 (default), 3, 4 or 6");
  if (t.attn_decode_stages != 0 && t.attn_decode_stages != 2 && t.attn_decode_stages != 3)
    throw Error("CUDA decode attention stages " + std::to_string(t.attn_decode_stages) + ": 0 (by batch), 2 or 3");
  if (t.attn_fp8_decode_key_tile != 0 && t.attn_fp8_decode_key_tile != 64 && t.attn_fp8_decode_key_tile != 128)
    throw Error("CUDA FP8 decode attention key tile " + std::to_string(t.attn_fp8_decode_key_tile) + ": 0, 64 or 128");
  skinny_max_tokens_ = std::clamp<int64_t>(t.skinny_max_tokens, 0, cuda::kSkinnyMaxTokens);
  tune_gemms_ = t.gemm_tune;
  gemm_split_k_ = t.gemm_split_k;
  stream_gemv_ = t.stream_gemv;
  stream_gemv_fp8_ = t.stream_gemv_fp8;
  stream_gemv_stages_ = t.stream_gemv_stages;
  stream_prefetch_bytes_ = std::clamp<int64_t>(t.stream_prefetch_kb, 0, 1024) << 10;
  fused_norm_ = t.fused_norm;
  fused_rope_ = t.fused_rope;
  verify_decode_rows_ = t.verify_decode_rows;
  if (t.dbo && t.dbo_decode_token_threshold < 2)
    throw Error("--dbo-decode-token-threshold " + std::to_string(t.dbo_decode_token_threshold) + ": at least 2");
  dbo_min_tokens_ = t.dbo ? t.dbo_decode_token_threshold : 0;
  stream_gemv_min_elems_ = (std::clamp<int64_t>(t.stream_gemv_min_mb, 0, int64_t{1} << 20) << 20) / 2;
  attn_decode_stages_ = t.attn_decode_stages;
  attn_fp8_decode_key_tile_ = t.attn_fp8_decode_key_tile;
  attn_items_per_block_ = static_cast<int32_t>(std::clamp<int64_t>(t.attn_items_per_block, 0, 1 << 20));
  attn_min_split_tiles_ = static_cast<int32_t>(std::clamp<int64_t>(t.attn_min_split_tiles, 0, 1 << 20));
  cuda::set_pdl_enabled(t.pdl);
  if (t.profile_ops) {
    prof_ = std::make_unique<cuda::OpProfiler>(stream_);
    eager_ = true;  // events between the ops of every pass, no graphs
  }
  fp8_weights_ = o.quantize_fp8;
  gguf_in_place_ = t.gguf_in_place;
  // The float types all mean the bf16 cache (the engine asks for bf16; a default RunnerOptions says f16).
  if (o.kv_dtype == KvDtype::INT8)
    throw Error("--kv-cache-dtype int8: the CUDA backend's KV cache stores bf16 or fp8");
  kv_dtype_ = o.kv_dtype == KvDtype::FP8 ? KvDtype::FP8 : KvDtype::BF16;
  if (kv_dtype_ == KvDtype::FP8 && hp_.mla.enabled())
    throw Error("--kv-cache-dtype fp8: the CUDA backend keeps an MLA model's latent cache in bf16 (use bf16)");
  upload_weights();
  if (hp_.mla.enabled()) prepare_mla();
  if (fp8_weights_) quantize_fp8_weights();
  weight_bytes_ = count_weight_bytes();
  block_size_ = o.block_size;
  if (!place.kv_later)
    allocate_kv_blocks(o.n_kv_blocks > 0 ? o.n_kv_blocks : kv_blocks_that_fit(o, kv_block_bytes(), 1));
}

void CudaModelRunner::use_device() const { KESTREL_CUDA_CHECK(cudaSetDevice(device_)); }

CudaModelRunner::~CudaModelRunner() {
  cudaSetDevice(device_);
  close_kv_ipc();
  graphs_.clear();
  for (cudaStream_t s : {swap_stream_, load_stream_}) {
    if (s == nullptr) continue;
    cudaStreamSynchronize(s);
    cudaStreamDestroy(s);
  }
  for (cudaEvent_t e : {swap_after_pass_, swap_done_, load_done_, h2d_start_, h2d_stop_, layers_done_, masks_ready_})
    if (e != nullptr) cudaEventDestroy(e);
  for (cudaEvent_t e : tensor_out_done_) cudaEventDestroy(e);
  if (lane_stream_ != nullptr) {
    cudaStreamSynchronize(lane_stream_);
    cudaStreamDestroy(lane_stream_);
  }
  for (cudaEvent_t e : {lane_start_, lane_join_})
    if (e != nullptr) cudaEventDestroy(e);
  if (side_stream_ != nullptr) {
    cudaStreamSynchronize(side_stream_);
    cudaStreamDestroy(side_stream_);
  }
  for (cudaEvent_t e : {moe_fork_, moe_join_})
    if (e != nullptr) cudaEventDestroy(e);
  if (stream_ != nullptr) {
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
}

void CudaModelRunner::upload_weights() {
  const ModelWeights& W = model_.weights();
  WeightUploader up(stream_);
  auto matrix = [&](const WeightView& w) {
    const WeightView* one[1] = {&w};
    return up.matrices(one);
  };
  // In place (--cuda-gguf-weights in-place): the embedding and the LM head too, where their type allows.
  auto head_or_embd = [&](WeightRole role, DevMem& bf16_copy, DeviceWeight& in_place) {
    const WeightView* one[1] = {&W.at({-1, role}).matrix};
    if (!upload_gguf(role, one, in_place, /*any_role=*/true)) bf16_copy = up.matrices(one);
  };
  // A pipeline stage holds the embedding when first (or last, as a tied LM head), the final norm
  // and the LM head when last.
  if (role_.first || (role_.last && W.tied_output)) head_or_embd(WeightRole::TokenEmbd, embd_, embd_q_);
  if (role_.last && !W.tied_output) head_or_embd(WeightRole::Output, lm_head_, head_q_);
  if (role_.last) out_norm_ = upload_bf16(W.at({-1, WeightRole::OutputNorm}).vector);
  layers_.resize(static_cast<size_t>(hp_.n_layer));
  for (int32_t l = 0; l < static_cast<int32_t>(hp_.n_layer); ++l) {
    Layer& d = layers_[static_cast<size_t>(l)];
    std::array<bool, kWeightRoleCount> stacked{};  // parts uploaded within their group
    for (size_t r = 0; r < kWeightRoleCount; ++r) {
      const auto group = static_cast<WeightRole>(r);
      const std::span<const WeightRole> roles = parts(group);
      if (roles.size() < 2) continue;
      std::vector<const LayerTensor*> ts;
      for (WeightRole p : roles)
        if (const LayerTensor* t = W.find({l, p}); t != nullptr && t->matrix.n_out > 0) ts.push_back(t);
      if (ts.size() != roles.size()) continue;
      std::vector<const WeightView*> views;
      DeviceWeight& dw = d[group];
      dw.n_in = ts[0]->matrix.n_in;
      bool any_bias = false;
      for (const LayerTensor* t : ts) {
        views.push_back(&t->matrix);
        dw.n_out += t->matrix.n_out;
        any_bias = any_bias || !t->bias.empty();
      }
      if (!upload_fp8_codes(group, views, dw) && !upload_int4(group, views, dw) && !upload_gguf(group, views, dw))
        dw.w = up.matrices(views);
      if (any_bias) {
        std::vector<float> b(static_cast<size_t>(dw.n_out), 0.0f);
        int64_t at = 0;
        for (const LayerTensor* t : ts) {
          std::copy(t->bias.begin(), t->bias.end(), b.begin() + at);
          at += t->matrix.n_out;
        }
        dw.b = upload_f32(b);
      }
      for (WeightRole p : roles) stacked[static_cast<size_t>(p)] = true;
    }
    if (hp_.moe.is_moe_layer(l)) upload_moe(l, d, up, stacked);
    for (size_t r = 0; r < kWeightRoleCount; ++r) {
      const LayerTensor* t = W.find({l, static_cast<WeightRole>(r)});
      if (t == nullptr || stacked[r]) continue;
      DeviceWeight& dw = d.by_role[r];
      if (t->matrix.n_out == 0) {
        dw.w = upload_bf16(t->vector);
        dw.n_out = static_cast<int64_t>(t->vector.size());
        continue;
      }
      const WeightView* one[1] = {&t->matrix};
      dw.n_in = t->matrix.n_in;
      dw.n_out = t->matrix.n_out;
      const auto role = static_cast<WeightRole>(r);
      if (!upload_fp8_codes(role, one, dw) && !upload_int4(role, one, dw) && !upload_gguf(role, one, dw))
        dw.w = matrix(t->matrix);
      if (!t->bias.empty()) dw.b = upload_f32(t->bias);
    }
  }
  reserve_int4_scratch();
  inv_freq_ = upload_f32(rope_inv_freq(hp_, W.rope_freq_factors));
  if (hp_.rope_theta_swa > 0) inv_freq_swa_ = upload_f32(rope_inv_freq(hp_, hp_.rope_theta_swa, {}));
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

// The dense projections quantize_fp8_weights covers.
static bool fp8_role(WeightRole r) {
  switch (r) {
    case WeightRole::Qkv: case WeightRole::Q: case WeightRole::K: case WeightRole::V: case WeightRole::AttnOut:
    case WeightRole::GateUp: case WeightRole::Gate: case WeightRole::Up: case WeightRole::Down: return true;
    default: return false;
  }
}

bool CudaModelRunner::upload_fp8_codes(WeightRole role, std::span<const WeightView* const> views, DeviceWeight& dw) {
  if (!fp8_weights_ || !fp8_role(role) || views.empty()) return false;
  const int64_t n_in = views[0]->n_in;
  int64_t rows = 0;
  for (const WeightView* v : views) {
    const QuantizedMatrix* q = v->quant;
    if (q == nullptr || q->format != QuantFormat::Fp8 || q->block_k < n_in || v->n_in != n_in || n_in % 16 != 0)
      return false;  // not FP8 with one scale per row (block scales are dequantized and requantized per row)
    rows += v->n_out;
  }
  DevMem codes(static_cast<size_t>(rows * n_in));
  std::vector<float> scale(static_cast<size_t>(rows));
  int64_t at = 0;
  for (const WeightView* v : views) {
    const QuantizedMatrix& q = *v->quant;
    KESTREL_CUDA_CHECK(cudaMemcpy(codes.as<uint8_t>() + at * n_in, q.weight, static_cast<size_t>(v->n_out * n_in),
                                  cudaMemcpyHostToDevice));
    for (int64_t r = 0; r < v->n_out; ++r) scale[static_cast<size_t>(at + r)] = scale_at(q, (r / q.block_n) * q.scale_cols());
    at += v->n_out;
  }
  dw.w = std::move(codes);
  dw.scale = upload_f32(scale);
  dw.fp8 = true;
  return true;
}

void CudaModelRunner::quantize_fp8_weights() {
  for (Layer& L : layers_)
    for (const WeightRole r : {WeightRole::Qkv, WeightRole::Q, WeightRole::K, WeightRole::V, WeightRole::AttnOut,
                               WeightRole::GateUp, WeightRole::Gate, WeightRole::Up, WeightRole::Down}) {
      DeviceWeight& dw = L[r];
      // Absent, already FP8 (upload_fp8_codes), or not a shape the FP8 kernels take.
      if (dw.w.bytes() == 0 || dw.fp8 || dw.int4 || dw.n_in % 16 != 0) continue;
      DevMem q(static_cast<size_t>(dw.n_out * dw.n_in));
      dw.scale.reset(static_cast<size_t>(dw.n_out) * 4);
      cuda::quantize_rows_fp8(dw.w.as<bf16>(), dw.n_in, dw.n_out, dw.n_in, q.as<uint8_t>(), dw.scale.as<float>(),
                              stream_);
      KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream_));  // before the bf16 copy is freed
      dw.w = std::move(q);
      dw.fp8 = true;
    }
}

// The cache tensors (per layer K and V, or with MLA the one latent array, kv_geometry) and the
// bytes of one block of each (of the codes, for FP8), and of one block of an FP8 scale tensor.
static int64_t n_cache_tensors(const ModelHparams& hp) { return kv_geometry(hp).is_mla() ? hp.n_layer : 2 * hp.n_layer; }
static int64_t cache_block_bytes(const ModelHparams& hp, int32_t block_size, KvDtype dtype) {
  const KvGeometry g = kv_geometry(hp);
  return (g.is_mla() ? g.kv_lora_rank + g.rope_dim : g.n_head_kv * g.head_dim) * block_size * kv_dtype_bytes(dtype);
}
static int64_t scale_block_bytes(const ModelHparams& hp, int32_t block_size, KvDtype dtype) {
  return kv_geometry(hp).n_head_kv * block_size * kv_scale_bytes(dtype);
}

int64_t CudaModelRunner::kv_block_bytes() const {
  return n_cache_tensors(hp_) *
         (cache_block_bytes(hp_, block_size_, kv_dtype_) + scale_block_bytes(hp_, block_size_, kv_dtype_));
}

int64_t kv_blocks_that_fit(const RunnerOptions& o, int64_t block_bytes, int n_runners) {
  size_t free_b = 0, total_b = 0;
  KESTREL_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  // What the weights left of the allowed share, less the runners' 2 GiB each.
  const double allowed = o.gpu_memory_utilization * static_cast<double>(total_b);
  const double used = static_cast<double>(total_b - free_b);
  const double budget = allowed - used - static_cast<double>(n_runners) * static_cast<double>(int64_t{2} << 30);
  const int64_t n = budget > 0 ? static_cast<int64_t>(budget / static_cast<double>(block_bytes)) : 0;
  if (n <= 0)
    throw Error("CUDA: no device memory left for the KV cache (weights use " + std::to_string(int64_t(used) >> 20) +
                " MiB of " + std::to_string(total_b >> 20) + " MiB; --gpu-memory-utilization " +
                std::to_string(o.gpu_memory_utilization) + ")");
  return n;
}

void allocate_kv_blocks_together(const RunnerOptions& o, std::span<CudaModelRunner* const> runners) {
  int64_t n = o.n_kv_blocks;
  if (n <= 0) {
    std::map<int, std::pair<int64_t, int>> per_device;  // device -> (bytes of a block of its runners, runners)
    for (const CudaModelRunner* r : runners) {
      auto& d = per_device[r->device()];
      d.first += r->kv_block_bytes();
      d.second += 1;
    }
    for (const auto& [device, d] : per_device) {
      KESTREL_CUDA_CHECK(cudaSetDevice(device));
      const int64_t fit = kv_blocks_that_fit(o, d.first, d.second);
      n = n <= 0 ? fit : std::min(n, fit);
    }
  }
  for (CudaModelRunner* r : runners) r->allocate_kv_blocks(n);
}

void CudaModelRunner::allocate_kv_blocks(int64_t n) {
  KESTREL_ASSERT(k_cache_.empty() && n > 0, "CUDA: KV cache allocated twice or empty");
  use_device();
  const int64_t block_bytes = cache_block_bytes(hp_, block_size_, kv_dtype_);
  const int64_t scale_bytes = scale_block_bytes(hp_, block_size_, kv_dtype_);  // 0 for bf16
  const bool has_v = !kv_geometry(hp_).is_mla();
  cache_block_bytes_ = block_bytes;
  scale_block_bytes_ = scale_bytes;
  n_blocks_ = static_cast<int32_t>(std::min<int64_t>(n, INT32_MAX / std::max(1, block_size_)));
  std::vector<void*> ptrs, scale_ptrs;
  for (int64_t l = 0; l < hp_.n_layer; ++l) {
    k_cache_.emplace_back(static_cast<size_t>(n_blocks_) * static_cast<size_t>(block_bytes));
    ptrs.push_back(k_cache_.back().as<void>());
    if (!has_v) continue;
    v_cache_.emplace_back(static_cast<size_t>(n_blocks_) * static_cast<size_t>(block_bytes));
    ptrs.push_back(v_cache_.back().as<void>());
    if (scale_bytes == 0) continue;
    for (auto* scales : {&k_scale_, &v_scale_}) {
      scales->emplace_back(static_cast<size_t>(n_blocks_) * static_cast<size_t>(scale_bytes));
      scale_ptrs.push_back(scales->back().as<void>());
    }
  }
  cache_ptrs_ = upload(ptrs.data(), ptrs.size() * sizeof(void*));
  if (!scale_ptrs.empty()) scale_ptrs_ = upload(scale_ptrs.data(), scale_ptrs.size() * sizeof(void*));
}

void CudaModelRunner::copy_blocks(std::span<const BlockCopy> copies) {
  if (copies.empty()) return;
  use_device();
  std::vector<int32_t> idx;
  for (const BlockCopy& c : copies) idx.push_back(c.src);
  for (const BlockCopy& c : copies) idx.push_back(c.dst);
  DevMem d = upload(idx.data(), idx.size() * sizeof(int32_t));
  const int64_t block_bytes = cache_block_bytes(hp_, block_size_, kv_dtype_);
  const int64_t scale_bytes = scale_block_bytes(hp_, block_size_, kv_dtype_);
  const auto n_caches = static_cast<int32_t>(n_cache_tensors(hp_));
  const int32_t n = static_cast<int32_t>(copies.size());
  // One launch copies every block at once. A step's copies are ordered, though: a block a copy
  // reads may be released by that copy and taken as a later copy's destination (the pool reuses
  // it within the step). Then the copies go one launch each, in order, on the stream.
  const std::set<int32_t> sources(idx.begin(), idx.begin() + n);
  const bool ordered = std::any_of(copies.begin(), copies.end(), [&](const BlockCopy& c) { return sources.count(c.dst) != 0; });
  const int32_t* src = d.as<int32_t>();
  const int32_t* dst = src + n;
  // Copies i .. i + count - 1, codes and (FP8) their scales.
  auto copy = [&](int32_t i, int32_t count) {
    cuda::copy_blocks(cache_ptrs_.as<void* const>(), n_caches, src + i, dst + i, count, block_bytes, stream_);
    if (scale_bytes > 0)
      cuda::copy_blocks(scale_ptrs_.as<void* const>(), n_caches, src + i, dst + i, count, scale_bytes, stream_);
  };
  if (!ordered) {
    copy(0, n);
  } else {
    for (int32_t i = 0; i < n; ++i) copy(i, 1);
  }
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
  const int64_t d = hp_.n_embd, qd = hp_.q_dim(), kvd = hp_.kv_dim(), ff = hp_.n_ff, nv = n_logits_;
  if (n > cap_tokens_) {
    grow(residual_, static_cast<size_t>(n * d) * 4);
    if (!role_.last) grow(hidden_out_, static_cast<size_t>(n * d) * 4);
    // The fused norm's second residual: passes of at most kStreamGemvMaxTokens rows only.
    if (fused_norm_) grow(residual_alt_, static_cast<size_t>(std::min(n, cuda::kStreamGemvMaxTokens) * d) * 4);
    grow(h_, static_cast<size_t>(n * d) * 2);
    grow(qkv_, static_cast<size_t>(n * (qd + 2 * kvd)) * 2);
    grow(q_, static_cast<size_t>(n * qd) * 2);
    grow(attn_, static_cast<size_t>(n * std::max(qd, hp_.attn_out_dim())) * 2);
    grow(o_, static_cast<size_t>(n * d) * 2);
    grow(gate_up_, static_cast<size_t>(n * 2 * ff) * 2);
    grow(act_, static_cast<size_t>(n * ff) * 2);
    grow(down_, static_cast<size_t>(n * d) * 2);
    if (fp8_weights_) {
      grow(fp8_x_, static_cast<size_t>(n * std::max({d, qd, hp_.attn_out_dim(), ff})));
      grow(fp8_x_scale_, static_cast<size_t>(n) * 4);
    }
    if (hp_.mla.enabled() && reserve_mla(n)) grew = true;
    grew = reserve_moe(n) || grew;
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

int64_t CudaModelRunner::kv_bytes_per_token() const {
  return kestrel::kv_bytes_per_token(kv_geometry(hp_), kv_dtype_);
}

}  // namespace cuda_runner

}  // namespace kestrel
