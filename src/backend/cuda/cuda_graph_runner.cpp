// Running a batch on the CUDA backend: the batch staged into pinned memory and copied in one
// transfer, then an eager pass, or for decode steps (every sequence q <= 9 tokens, a logits row
// at each) the replay of a CUDA graph captured per (batch size bucket, q, block table width
// bucket, sampling) with the batch padded to the bucket.
#include <algorithm>
#include <climits>
#include <string>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_model_runner.h"
#include "core/error.h"

namespace kestrel::cuda_runner {

BatchArrays CudaModelRunner::stage(const ForwardBatch& b, std::span<const RowSampling> rows, int64_t n_seqs_pad,
                                   int32_t width, int32_t q) {
  const int64_t n = b.n_tokens(), n_seqs = b.n_seqs();
  const int64_t pad = (n_seqs_pad - n_seqs) * q;  // decode padding: q tokens per padded sequence
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
    h.positions[n + i] = static_cast<int32_t>(i % q);
    h.logits_rows[static_cast<int64_t>(b.logits_indices.size()) + i] = static_cast<int32_t>(n + i);
  }
  for (int64_t i = 0; i < n_seqs_pad - n_seqs; ++i) {
    h.query_start[n_seqs + 1 + i] = static_cast<int32_t>(n + (i + 1) * q);
    h.context_lens[n_seqs + i] = q;
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

BatchArrays CudaModelRunner::run(const ForwardBatch& b, std::span<const RowSampling> rows, bool sample) {
  validate_forward_batch(b, hp_.n_vocab, n_blocks_, block_size_, hp_.kv_lookback());
  const int64_t n = b.n_tokens(), n_seqs = b.n_seqs(), n_out = static_cast<int64_t>(b.logits_indices.size());
  bool identity = n_out == n;
  for (int64_t i = 0; identity && i < n_out; ++i) identity = b.logits_indices[static_cast<size_t>(i)] == i;
  int32_t max_context = 0, max_query = 0, min_query = INT32_MAX;
  for (int64_t s = 0; s < n_seqs; ++s) {
    const int32_t len = b.query_start[static_cast<size_t>(s) + 1] - b.query_start[static_cast<size_t>(s)];
    max_context = std::max(max_context, b.context_lens[static_cast<size_t>(s)]);
    max_query = std::max(max_query, len);
    min_query = std::min(min_query, len);
  }

  // Decode steps replay a captured graph: every sequence has the same q tokens (1, or 1 plus
  // drafts), each with a logits row. (A sequence may have no tokens, so n == n_seqs * q alone
  // would not show that.)
  const int32_t q = max_query;
  const bool decode = n_seqs > 0 && min_query == max_query && q <= kGraphMaxTokensPerSeq && n == n_seqs * q && identity;
  const int64_t* bucket = std::find_if(std::begin(kGraphBatchSizes), std::end(kGraphBatchSizes),
                                       [&](int64_t bsz) { return bsz >= n_seqs; });
  if (!eager_ && decode && bucket != std::end(kGraphBatchSizes)) {
    const int64_t bsz = *bucket, n_tok = bsz * q;
    int32_t width = 16;
    while (width < b.max_blocks_per_seq) width *= 2;
    PassShape s;
    s.n_tokens = s.n_out = n_tok;
    s.n_seqs = bsz;
    s.width = width;
    s.max_context = width * block_size_;
    s.max_query = s.uniform_query = q;
    s.rows_identity = true;
    s.sample = sample;
    cuda::AttentionParams probe = attention_params(BatchArrays{}, s);
    const size_t halves_ws = reserve_micro_batches(s);
    reserve_activations(n_tok, n_tok, std::max(cuda::attention_workspace_bytes(probe), halves_ws));
    hand_in(n, n_tok);
    const BatchArrays h = stage(b, rows, bsz, width, q);
    auto& g = graphs_[{bsz, q, width, sample}];
    if (g == nullptr && tune_gemms_ && n_tok <= kTuneMaxTokens && tuned_sizes_.insert(n_tok).second) tune_gemms(n_tok);
    if (g == nullptr) {
      // First use of this shape: allocate its arrays, run it eagerly (warming cuBLASLt's
      // algorithm cache outside the capture), then capture it for the next steps.
      g = std::make_unique<DecodeGraph>();
      g->arrays.reset(BatchArrays::layout(nullptr, n_tok, bsz, width, n_tok).bytes + 16 +
                      static_cast<size_t>(n_tok) * 4 + 16);
      g->dev = BatchArrays::layout(g->arrays.as<unsigned char>(), n_tok, bsz, width, n_tok);
      KESTREL_CUDA_CHECK(cudaMemcpyAsync(g->arrays.as<void>(), staging_.as<void>(), h.bytes, cudaMemcpyHostToDevice,
                                         stream_));
      meet_ranks();
      enqueue_forward(g->dev, s);
#if defined(KESTREL_CUDA_EMULATE)
      return g->dev;  // no capture on the CPU emulation: replays run the same pass eagerly
#endif
      // A tensor-parallel rank's collectives finish before the capture and instantiation, which
      // may allocate (meet_ranks).
      if (comm_ != nullptr) KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream_));
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
      return g->dev;
    }
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(g->arrays.as<void>(), staging_.as<void>(), h.bytes, cudaMemcpyHostToDevice,
                                       stream_));
    meet_ranks();
#if defined(KESTREL_CUDA_EMULATE)
    enqueue_forward(g->dev, s);
#else
    KESTREL_CUDA_CHECK(cudaGraphLaunch(g->exec, stream_));
#endif
    return g->dev;
  }

  PassShape s;
  s.n_tokens = n;
  s.n_seqs = n_seqs;
  s.n_out = n_out;
  s.width = b.max_blocks_per_seq;
  s.max_context = max_context;
  s.max_query = max_query;
  s.uniform_query = n_seqs > 0 && min_query == max_query && n == n_seqs * max_query ? max_query : 0;
  s.rows_identity = identity;
  s.sample = sample;
  cuda::AttentionParams probe = attention_params(BatchArrays{}, s);
  const size_t halves_ws = reserve_micro_batches(s);
  reserve_activations(n, n_out, std::max(cuda::attention_workspace_bytes(probe), halves_ws));
  hand_in(n, n);
  const BatchArrays h = stage(b, rows, n_seqs, s.width);
  arrays_.reserve(BatchArrays::layout(nullptr, n, n_seqs, s.width, n_out).bytes + static_cast<size_t>(n_out) * 4 + 32);
  const BatchArrays d = BatchArrays::layout(arrays_.as<unsigned char>(), n, n_seqs, s.width, n_out);
  KESTREL_CUDA_CHECK(cudaMemcpyAsync(arrays_.as<void>(), staging_.as<void>(), h.bytes, cudaMemcpyHostToDevice, stream_));
  meet_ranks();
  enqueue_forward(d, s);
  return d;
}

void CudaModelRunner::meet_ranks() {
  if (comm_ != nullptr) comm_->host_barrier();
}

void CudaModelRunner::hand_in(int64_t n, int64_t n_padded) {
  if (role_.first) return;
  const size_t row = static_cast<size_t>(hp_.n_embd) * sizeof(float);
  KESTREL_ASSERT(pass_hidden_in_ != nullptr, "CUDA pipeline stage: no residual stream handed in");
  KESTREL_CUDA_CHECK(cudaMemcpyAsync(residual_.as<void>(), pass_hidden_in_, static_cast<size_t>(n) * row,
                                     cudaMemcpyDeviceToDevice, stream_));
  // Padded decode rows (their own sequences, discarded) start from zeros.
  if (n_padded > n)
    KESTREL_CUDA_CHECK(cudaMemsetAsync(residual_.as<unsigned char>() + static_cast<size_t>(n) * row, 0,
                                       static_cast<size_t>(n_padded - n) * row, stream_));
}

std::span<const float> CudaModelRunner::forward_stage(const ForwardBatch& b, const float* hidden_in) {
  use_device();
  pass_hidden_in_ = hidden_in;
  struct Reset {
    const float*& p;
    ~Reset() { p = nullptr; }
  } reset{pass_hidden_in_};
  if (role_.last) return forward(b);
  run(b, {}, false);
  return {};
}

std::span<const float> CudaModelRunner::forward(const ForwardBatch& b) {
  use_device();
  const int64_t n_out = static_cast<int64_t>(b.logits_indices.size()), nv = n_logits_;
  const size_t logit_bytes = static_cast<size_t>(n_out * nv) * sizeof(float);
  logits_h_.reserve(logit_bytes);  // pinned memory: allocated before the pass (meet_ranks)
  run(b, {}, false);
  if (n_out == 0) {
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream_));
    if (prof_ != nullptr) prof_->collect();
    return {};
  }
  KESTREL_CUDA_CHECK(cudaMemcpyAsync(logits_h_.as<void>(), logits_.as<void>(), logit_bytes, cudaMemcpyDeviceToHost, stream_));
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream_));
  if (prof_ != nullptr) prof_->collect();
  return {logits_h_.as<const float>(), static_cast<size_t>(n_out * nv)};
}

std::span<const int32_t> CudaModelRunner::forward_sample(const ForwardBatch& b, std::span<const RowSampling> rows,
                                                         const TokenMaskFill& fill_masks) {
  const size_t n_out = b.logits_indices.size();
  if (rows.size() != n_out)
    throw Error("forward_sample: " + std::to_string(rows.size()) + " sampling rows for " + std::to_string(n_out) +
                " logits rows");
  if (comm_ != nullptr) throw Error("forward_sample: a tensor-parallel rank holds a slice of the logits");
  const bool masked = std::any_of(rows.begin(), rows.end(), [](const RowSampling& r) { return r.masked != 0; });
  if (masked && !fill_masks) throw Error("forward_sample: a masked sampling row without token masks");
  use_device();
  const BatchArrays d = run(b, rows, !masked);
  if (n_out == 0) {
    KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream_));
    if (prof_ != nullptr) prof_->collect();
    return {};
  }
  if (masked) {
    // The pass is in flight: the masks are computed meanwhile, then go up behind it on the stream.
    const size_t words = (static_cast<size_t>(hp_.n_vocab) + 31) / 32, bytes = n_out * words * sizeof(uint32_t);
    masks_h_.reserve(bytes);
    masks_.reserve(bytes);
    if (layers_done_ == nullptr) {
      KESTREL_CUDA_CHECK(cudaEventCreate(&layers_done_));
      KESTREL_CUDA_CHECK(cudaEventCreate(&masks_ready_));
    }
    KESTREL_CUDA_CHECK(cudaEventRecord(layers_done_, stream_));
    fill_masks(std::span<uint32_t>(masks_h_.as<uint32_t>(), n_out * words));
    KESTREL_CUDA_CHECK(cudaEventRecord(masks_ready_, stream_));
    KESTREL_CUDA_CHECK(cudaMemcpyAsync(masks_.as<void>(), masks_h_.as<void>(), bytes, cudaMemcpyHostToDevice, stream_));
    cuda::sample_tokens(logits_.as<float>(), reinterpret_cast<const cuda::SampleParams*>(d.sampling),
                        static_cast<int64_t>(n_out), hp_.n_vocab, d.tokens, sample_ws_.as<void>(), stream_,
                        masks_.as<uint32_t>());
    mark("sample");
  }
  tokens_h_.reserve(n_out * sizeof(int32_t));
  KESTREL_CUDA_CHECK(
      cudaMemcpyAsync(tokens_h_.as<void>(), d.tokens, n_out * sizeof(int32_t), cudaMemcpyDeviceToHost, stream_));
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream_));
  if (masked) {
    float ms = 0;
    KESTREL_CUDA_CHECK(cudaEventElapsedTime(&ms, layers_done_, masks_ready_));
    mask_wait_s_ += static_cast<double>(ms) / 1e3;
  }
  if (prof_ != nullptr) prof_->collect();
  return {tokens_h_.as<const int32_t>(), n_out};
}

}  // namespace kestrel::cuda_runner
