// A ModelRunner wrapper that chooses where the engine samples, for holding the device sampling
// path (ModelRunner::forward_sample: the sampler settings, the uniform, the grammar token masks) to
// the engine's host samplers over the same logits. With on_device, it reports samples_on_device()
// and samples with the inner runner's forward_sample when that runner has one (CUDA), else with
// ModelRunner's host implementation (Sampler::sample_with_uniform, the reference of
// cuda::sample_tokens) over the inner forward(); without, it only forwards, so the engine samples
// on the host.
#pragma once

#include <chrono>
#include <memory>
#include <span>
#include <string>
#include <thread>

#include "backend/model_runner.h"

namespace kestrel::test {

class SamplingRunner final : public ModelRunner {
 public:
  SamplingRunner(std::unique_ptr<ModelRunner> inner, bool on_device) : inner_(std::move(inner)), on_device_(on_device) {}
  std::span<const float> forward(const ForwardBatch& b) override {
    ++host_calls;
    return inner_->forward(b);
  }
  bool samples_on_device() const override { return on_device_; }
  std::span<const int32_t> forward_sample(const ForwardBatch& b, std::span<const RowSampling> rows,
                                          const TokenMaskFill& fill_masks = {}) override {
    ++device_calls;
    for (const RowSampling& r : rows) masked_rows += r.masked;
    TokenMaskFill fill = fill_masks;
    if (fill_delay_s > 0 && fill_masks) {
      ++delayed_fills;
      fill = [&](std::span<uint32_t> masks) {
        std::this_thread::sleep_for(std::chrono::duration<double>(fill_delay_s));
        fill_masks(masks);
      };
    }
    if (inner_->samples_on_device()) return inner_->forward_sample(b, rows, fill);
    return sample_on_host(inner_->forward(b), rows, fill);
  }
  double mask_wait_seconds() const override { return inner_->mask_wait_seconds(); }
  void copy_blocks(std::span<const BlockCopy> copies) override { inner_->copy_blocks(copies); }
  int32_t n_kv_blocks() const override { return inner_->n_kv_blocks(); }
  int32_t block_size() const override { return inner_->block_size(); }
  KvDtype kv_dtype() const override { return inner_->kv_dtype(); }
  int64_t kv_bytes_per_token() const override { return inner_->kv_bytes_per_token(); }
  std::string description() const override {
    return std::string(on_device_ ? "device" : "host") + "-sampling wrapper over " + inner_->description();
  }

  int host_calls = 0, device_calls = 0;
  int64_t masked_rows = 0;  // rows sampled under a token mask
  // Seconds each token-mask fill is held back (a host slower than the device), and the fills held.
  double fill_delay_s = 0;
  int delayed_fills = 0;

 private:
  std::unique_ptr<ModelRunner> inner_;
  bool on_device_;
};

}  // namespace kestrel::test
