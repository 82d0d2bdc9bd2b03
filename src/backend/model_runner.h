// The backend interface: one forward pass of the model over a flat batch, with the paged KV cache
// the backend owns (host memory for the CPU, device memory for CUDA). The engine drives any backend
// through this and never touches K/V storage itself. A backend runs the model's architecture
// builder (model/forward_ops.h) over its own ForwardOps.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "memory/kv_dtype.h"
#include "memory/kv_manager.h"
#include "model/forward_batch.h"
#include "model/llama_weights.h"

namespace kestrel {

// The CUDA backend's kernel choices, switchable for measuring one against another. The defaults
// are the fastest measured on an H200 (docs/performance.md); the CLI's --cuda-* flags set them
// (tools/kestrel/engine_config.cpp, KestrelConfig, which validates them).
struct CudaTuning {
  bool stream_gemv = true;           // streaming GEMV for one- and two-token projections
  int stream_gemv_stages = 0;        // its pipeline depth: 0 = the kernel's default (4), else 3, 4 or 6
  int64_t stream_gemv_min_mb = 40;   // weights smaller than this (MiB of bf16) keep the skinny GEMM
  // KiB of the next streamed projection's weights each block of an FP8 or INT4 streaming GEMV
  // brings into L2 when its own last bytes are requested (StreamPrefetch); 0 = none. 32: with the
  // input formed sooner (kStreamPreWaitSlabs), batch-1 decode on an H100 was 1.2% (FP8) and 0.5%
  // (INT4) faster than with 64; 0 helped FP8 as much but cost INT4 1.2%; 128 was slower for both.
  int64_t stream_prefetch_kb = 32;
  bool stream_gemv_fp8 = true;       // FP8 weights on the W8A8 streaming GEMV (off: the W8A16 skinny GEMM)
  bool fused_norm = true;            // residual add + RMSNorm inside the streaming GEMV
  bool fused_rope = true;            // decode passes: RoPE + K/V write inside decode attention
  bool verify_decode_rows = true;    // verify steps' attention on the decode kernel, a row an item
  // Dual-batch overlap: decode passes of at least dbo_decode_token_threshold rows run as two
  // micro-batches on two streams, one half's attention beside the other's projections
  // (CudaModelRunner::overlaps).
  bool dbo = false;
  int64_t dbo_decode_token_threshold = 128;
  // Token counts up to which the skinny GEMM runs; 0 = never. 9: a batch-1 verify step of 1 + 8
  // drafts keeps the one-token steps' bits (its token columns are independent; cuBLASLt's are not).
  int64_t skinny_max_tokens = 9;
  bool gemm_tune = true;             // time cuBLASLt's candidates per decode batch size
  bool gemm_split_k = true;          // split-K variants among the timed candidates
  bool pdl = true;                   // programmatic dependent launch between kernels
  int attn_decode_stages = 0;        // decode attention K/V stages: 0 = by batch, else 2 or 3
  int attn_fp8_decode_key_tile = 0;  // keys a stage of FP8-cache decode attention: 0 = by stages, else 64 or 128
  int64_t attn_items_per_block = 0;  // decode attention splits: 0 = the measured rule, else k
  int64_t attn_min_split_tiles = 0;  // KV tiles per split at least: 0 = the measured rule
  bool profile_ops = false;          // time every op (eager: no graphs), print per-op totals and tuning picks
  // GGUF quantized weights (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K) kept in their blocks on the
  // device and dequantized in the kernels (--cuda-gguf-weights in-place), instead of bf16 at upload.
  bool gguf_in_place = false;
};

struct RunnerOptions {
  int32_t block_size = 16;          // tokens per KV block
  int32_t n_kv_blocks = 0;          // blocks in the KV pool; 0 = the backend sizes it (CUDA: from free memory)
  KvDtype kv_dtype = KvDtype::F16;  // element type of the cached K and V (what the backend supports)
  int n_threads = 0;                // CPU threads; 0 = all hardware threads
  double gpu_memory_utilization = 0.9;  // CUDA: fraction of the device's memory weights + KV may use
  bool enforce_eager = false;       // CUDA: never replay decode steps from captured CUDA graphs
  bool populate_kv = false;         // CPU: make the whole KV pool resident at start (KvCache's populate)
  bool quantize_fp8 = false;        // CUDA: dense projections as FP8 E4M3, per-channel scales (--quantization fp8)
  CudaTuning cuda;                  // CUDA: kernel choices
  // Ranks the model is split over (--tensor-parallel-size; model/tensor_parallel.h). CPU: one
  // thread per rank, n_threads shared among them; CUDA: one GPU per rank.
  int tensor_parallel_size = 1;
  // Stages the layers are split over (--pipeline-parallel-size; model/pipeline_parallel.h). CPU:
  // one thread per stage, n_threads shared among them, a step's batch in micro-batches through
  // the stages; not combined with tensor_parallel_size > 1. CUDA: stage s on GPU s (cuda_runner.h).
  int pipeline_parallel_size = 1;
};

// What sampling one logits row on the device needs: a Sampler whose chain has only top_k, top_p,
// min_p and temperature (Sampler::device_compatible), and the uniform draw it would have used
// (Sampler::take_uniform), so the device picks the token the CPU sampler would pick from the
// same logits. A masked row (structured output) first has every token its mask disallows set to
// -inf, as grammar::apply_token_bitmask does on the host; the chain then runs on what is left
// (top_k counts allowed tokens only).
struct RowSampling {
  float temperature = 0.0f;  // 0 = greedy
  int32_t top_k = 0;
  float top_p = 1.0f;
  float min_p = 0.0f;
  double uniform = 0.0;      // in [0, 1)
  int32_t masked = 0;        // 1: the row's token mask (TokenMaskFill) applies
};

// Writes the token masks of one forward_sample call into `masks`: [n_rows, (n_vocab + 31) / 32]
// uint32 words, row i at i * words, bit (id % 32) of word (id / 32) set = token id allowed (the
// layout of grammar::bitmask_words). Only the rows with RowSampling::masked need writing; the
// others are not read. forward_sample calls it once, after the pass over the layers is launched and
// before the sampling, so a backend that runs asynchronously (CUDA) has the host compute the masks
// while the device computes the logits.
using TokenMaskFill = std::function<void(std::span<uint32_t> masks)>;

// A KV pool's device memory as another process on the same GPU maps it (CUDA IPC,
// cudaIpcGetMemHandle / cudaIpcOpenMemHandle): one handle per cache tensor, in the order of the
// read_kv_blocks record (per layer K, V; then FP8 scales per layer K, V), each tensor a
// [n_blocks, ...] array of block_bytes[t] bytes per block starting at its allocation's base.
struct KvIpcMemory {
  std::string device_uuid;               // the exporting GPU, "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (nvidia-smi -L)
  std::vector<std::string> handles;      // cudaIpcMemHandle_t bytes (64 each)
  std::vector<int64_t> block_bytes;      // per tensor: bytes of one block
  int32_t n_blocks = 0;                  // blocks in the exporting pool
};

class ModelRunner {
 public:
  virtual ~ModelRunner() = default;
  // Runs every layer over the batch, writes each token's K and V into its slot, and returns the
  // logits of the rows batch.logits_indices: [logits_indices.size(), n_vocab], f32, host memory,
  // valid until the next call. Errors: kestrel::Error on an inconsistent batch.
  virtual std::span<const float> forward(const ForwardBatch& batch) = 0;
  // Pipelined passes: a runner that keeps several passes in flight (pipeline parallelism: one per
  // stage, so that no stage idles while the host samples and schedules) takes a pass with
  // submit() and returns it with collect(), in submission order. max_passes_in_flight(): how many
  // submitted passes it holds before a collect(); 1 (the default) for runners whose passes run
  // one at a time, where submit() runs forward() and collect() returns its logits. Block
  // operations (copy_blocks, swaps, KV reads and writes), host_to_device_totals() and forward() /
  // forward_sample() are called only with no pass in flight.
  virtual int max_passes_in_flight() const { return 1; }
  // Starts a pass over `batch` behind those in flight; its arrays may change once submit returns
  // (a pipelining runner copies them). Errors: kestrel::Error on an inconsistent batch, at once;
  // the pass's own errors come from its collect().
  virtual void submit(const ForwardBatch& batch);
  // The logits of the oldest pass not yet collected, as forward() returns them, once it is done;
  // valid until the next collect() or forward(). Errors: the pass's; kestrel::Error when no pass
  // is in flight.
  virtual std::span<const float> collect();
  // True when forward_sample() is implemented (the CUDA backend): the logits then never leave the
  // device.
  virtual bool samples_on_device() const { return false; }
  // forward(), then one token per logits row sampled with rows[i]'s settings (rows.size() ==
  // batch.logits_indices.size()), the masked rows under the masks fill_masks writes. Returns the
  // token ids in host memory, valid until the next call; -1 marks a row whose (masked) logits hold
  // a NaN or no finite value. The CUDA backend samples on the device (the logits never leave it);
  // the default samples forward()'s logits on the host with Sampler::sample_with_uniform, the
  // device sampler's reference. Errors: those of forward(); kestrel::Error for a row count that
  // differs from the logits rows, or a masked row without fill_masks.
  virtual std::span<const int32_t> forward_sample(const ForwardBatch& batch, std::span<const RowSampling> rows,
                                                  const TokenMaskFill& fill_masks = {});
  // Copies whole KV blocks (copy-on-write after a fork), in every layer, before the next forward.
  virtual void copy_blocks(std::span<const BlockCopy> copies) = 0;
  // Host swap space for preemption by swap (KvManager::swap_out): n_blocks blocks of the KV pool's
  // geometry and dtype in host memory (CUDA: pinned, so copies run asynchronously). Called once,
  // before any swap. Errors: kestrel::Error when the backend has none or cannot allocate it.
  virtual void allocate_swap_space(int32_t n_blocks);
  // Copies every layer's K/V (and scales) of each swaps[i].device block to host block
  // swaps[i].host (swap_out) or back (swap_in). The engine calls swap_out before the step's
  // copy_blocks and swap_in after them; a backend that copies asynchronously makes the next
  // forward pass wait for them. Errors: kestrel::Error without swap space (the default).
  virtual void swap_out(std::span<const BlockSwap> swaps);
  virtual void swap_in(std::span<const BlockSwap> swaps);
  // swap_out(out) and then swap_in(in), where a block of `in` may be the device block of a pair
  // of `out` (the prefix cache's host tier: a block evicted to the host takes a hit's copy back).
  // A backend with a copy stream per direction overlaps the two, each copy in ordered after the
  // copy out of its own destination (CUDA: per cache tensor). The default runs them in turn.
  virtual void swap_out_in(std::span<const BlockSwap> out, std::span<const BlockSwap> in);
  // Host -> device block copies (swap_in) so far: bytes, and seconds the copies took on the
  // device (CUDA: CUDA events around each call's copies on its copy stream; 0 where not timed).
  // Call it after a pass that waited for the copies (it waits for the last one). For benchmarks.
  struct HostCopyTotals {
    int64_t bytes = 0;
    double seconds = 0;
  };
  virtual HostCopyTotals host_to_device_totals() { return {}; }
  // Bytes per second one direction of the device <-> host link moves, for the swap-or-recompute
  // choice (PreemptionMode::Auto).
  virtual double host_link_bytes_per_s() const { return 0; }
  // Seconds the device has sat idle after forward_sample()'s layers, waiting for fill_masks (the
  // host's token masks), summed since start; 0 where not measured (the host backends).
  virtual double mask_wait_seconds() const { return 0; }
  // Disaggregated prefill (a prefill process's K/V decoded in another): each block of `blocks` as
  // block_size() x kv_bytes_per_token() bytes, in order, into `out`
  // (blocks.size() x that many bytes); write_kv_blocks is the reverse. The CPU's record is
  // KvCache::read_block's (tensor parallel: each rank's, in rank order; pipeline parallel:
  // each stage's, in stage order, which is the one-stage record); a reader of the same model,
  // block size, dtype and parallel layout gets back exactly what was read. Errors: kestrel::Error
  // when the backend cannot (the default) or the span's size is wrong.
  virtual void read_kv_blocks(std::span<const int32_t> blocks, std::span<std::byte> out) const;
  virtual void write_kv_blocks(std::span<const int32_t> blocks, std::span<const std::byte> in);
  // Disaggregated prefill between processes sharing one GPU (CUDA IPC). device_uuid: this
  // runner's GPU as KvIpcMemory::device_uuid spells it, "" when the backend has no IPC (the CPU).
  // export_kv_ipc: this pool's handles (made once). open_kv_ipc: maps a peer's pool into this
  // process (once per distinct export; later calls find the mapping); thread-safe, so a server
  // may map while the engine thread runs passes. copy_kv_blocks_ipc: copies the peer's blocks
  // src[i] into this pool's blocks dst[i] device to device (every cache tensor; runs of
  // consecutive blocks on both sides as one copy each) and waits for the copies; the peer's
  // blocks must not change meanwhile (the producer holds them). Errors: kestrel::Error when the
  // backend has no IPC (the defaults), a handle cannot be opened (another GPU, the CPU emulation,
  // a producer that exited), the peer's tensors differ from this pool's (count or block bytes),
  // or a block id is outside either pool.
  virtual std::string device_uuid() const { return {}; }
  virtual KvIpcMemory export_kv_ipc() const;
  virtual void open_kv_ipc(const KvIpcMemory& peer) const;
  virtual void copy_kv_blocks_ipc(const KvIpcMemory& peer, std::span<const int32_t> src, std::span<const int32_t> dst);
  virtual int32_t n_kv_blocks() const = 0;
  virtual int32_t block_size() const = 0;
  virtual KvDtype kv_dtype() const = 0;
  // Bytes the KV pool holds per token over all layers: kv_bytes_per_token() of the model's
  // geometry in kv_dtype(), the figure `kestrel plan` prints.
  virtual int64_t kv_bytes_per_token() const = 0;
  // "cpu (2 threads, avx512)", "cuda (NVIDIA H200)", for logs.
  virtual std::string description() const = 0;
  // Tokens routed to each expert since start-up, [n_layer * n_expert] row-major (layer-major); empty for a model without MoE layers (dense layers' rows stay 0).
  virtual std::vector<uint64_t> expert_token_counts() const { return {}; }

 protected:
  // forward_sample's host implementation (host_sampling.cpp) over logits [rows.size(), n_vocab] f32,
  // each row masked first where rows[i].masked. Returns the ids, valid until the next call (-1 for
  // a row without a distribution). For wrappers that compute the logits another way (tests).
  std::span<const int32_t> sample_on_host(std::span<const float> logits, std::span<const RowSampling> rows,
                                          const TokenMaskFill& fill_masks);

 private:
  std::span<const float> submitted_;  // the default submit()'s logits, until collect()
  bool has_submitted_ = false;
  std::vector<int32_t> sampled_;
  std::vector<uint32_t> host_masks_;
  std::vector<float> masked_row_;
};

// The CPU backend (src/backend/cpu). options.n_kv_blocks must be positive. Errors: kestrel::Error
// for a weight type the CPU kernels lack, a KV dtype other than f16/f32, or a pool too large for
// memory, validate_tensor_parallel's for options.tensor_parallel_size, validate_pipeline_parallel's
// for options.pipeline_parallel_size, and both above 1 at once.
std::unique_ptr<ModelRunner> make_cpu_model_runner(const LlamaModel& model, const RunnerOptions& options);

}  // namespace kestrel
