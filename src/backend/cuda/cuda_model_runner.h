// The CUDA backend's model runner, shared by its three files: cuda_model_runner.cpp (start-up:
// weight upload, KV sizing, activation buffers), cuda_forward.cpp (the pass: the architecture's
// builder over ForwardOps, projections and their GEMM choice) and cuda_graph_runner.cpp (staging a
// batch, eager passes and captured decode graphs). Internal to src/backend/cuda.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "backend/communicator.h"
#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/device_memory.h"
#include "backend/cuda/fp8_ops.h"
#include "backend/cuda/gemm.h"
#include "backend/cuda/gguf_ops.h"
#include "backend/cuda/int4_ops.h"
#include "backend/cuda/op_profiler.h"
#include "backend/model_runner.h"
#include "model/forward_ops.h"
#include "model/pipeline_parallel.h"

namespace kestrel::cuda_runner {

using cuda::bf16;
using cuda::DevMem;
using cuda::PinnedMem;

// One layer's weights on the device, by role (ModelWeights): a norm as bf16 [d]; a projection as
// bf16 [n_out, n_in], a group's parts stacked under the group's role (q|k|v, gate|up) and not kept
// apart; f32 biases (a group's stacked, zeros for a part without one) or empty.
// A projection's weight on the device: bf16 [n_out, n_in]; or with fp8 E4M3 codes [n_out, n_in]
// and one f32 scale per output row (scale); or with int4 (GPTQ / AWQ 4-bit, int4_ops.h): w the
// codes uint32 [n_out, n_in / 8], meta uint32 [n_out, n_in / group_size], perm int32 [n_in] for
// act order or empty; or with GGUF blocks in place (gguf_ops.h, --cuda-gguf-weights in-place):
// gguf, the parts in row order (a stacked projection's consecutive parts of one type share one),
// and w empty. Bias b [n_out] f32 or empty.
struct GgufPart {
  cuda::GgufMatrix m;  // points into body and d
  cuda::DevMem body, d;
  int64_t row0 = 0;    // its first row in the stacked projection
};
struct DeviceWeight {
  DevMem w, b, scale;
  DevMem meta, perm;
  int64_t n_in = 0, n_out = 0;
  int64_t group_size = 0;  // int4
  bool fp8 = false;
  bool int4 = false;
  bool scale_f16 = true;   // int4: the scales' 16 bits are f16 (else bf16)
  std::vector<GgufPart> gguf;
  bool in_place() const { return !gguf.empty(); }
  cuda::Int4Matrix int4_matrix() const {
    cuda::Int4Matrix m;
    m.codes = w.as<uint32_t>();
    m.meta = meta.as<uint32_t>();
    m.perm = perm.bytes() > 0 ? perm.as<int32_t>() : nullptr;
    m.n_in = n_in, m.n_out = n_out, m.group_size = group_size, m.scale_f16 = scale_f16;
    return m;
  }
};
struct Layer {
  std::array<DeviceWeight, kWeightRoleCount> by_role;
  const DeviceWeight& operator[](WeightRole r) const { return by_role[static_cast<size_t>(r)]; }
  DeviceWeight& operator[](WeightRole r) { return by_role[static_cast<size_t>(r)]; }
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
  int32_t uniform_query = 0;   // > 0: every sequence has this many tokens (AttentionParams::uniform_query_len)
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

// A GPU's UUID as nvidia-smi -L prints it: "GPU-" and the 16 bytes in hex, grouped 8-4-4-4-12.
std::string uuid_text(const cudaUUID_t& uuid);

// Where a runner runs: its device (a CUDA device id), its place in a pipeline when the model is a
// pipeline stage (LlamaModel::pipeline_stage: a stage uploads the token embedding only when first,
// the final norm and LM head only when last), and whether the KV cache waits for
// allocate_kv_blocks (a pipeline sizes its stages' caches together).
// `comm`: a tensor-parallel rank's communicator (the model is then LlamaModel::tensor_parallel_shard;
// null otherwise): the ranks' row-parallel outputs and vocabulary-parallel embedding rows are summed
// through it on the runner's stream (an NcclCommunicator is set to stream() by its owner), and the
// logits are the rank's slice of the vocabulary [n_out, n_vocab / size].
struct CudaPlacement {
  int device = 0;
  PipelineRole role;
  bool kv_later = false;
  Communicator* comm = nullptr;
};

class CudaModelRunner final : public ModelRunner, private ForwardOps {
 public:
  // Errors: kestrel::Error without a device, for an unsupported head_dim or out of memory.
  CudaModelRunner(const LlamaModel& model, const RunnerOptions& o, const CudaPlacement& place = {});
  ~CudaModelRunner() override;

  // Pipeline stages (cuda_pipeline_parallel.cpp). The bytes of one KV block over all the runner's
  // cache tensors; the cache of n blocks (CudaPlacement::kv_later; once).
  int64_t kv_block_bytes() const;
  void allocate_kv_blocks(int64_t n);
  // A stage's pass: a stage after the first takes its residual stream [n_tokens, n_embd] f32 from
  // hidden_in (this device's memory; copied in on stream() behind what is already there); a stage
  // before the last leaves its output residual stream in hidden_out() [n_tokens, n_embd] f32 on
  // stream() and returns at once (nothing synchronized); the last returns forward()'s logits.
  std::span<const float> forward_stage(const ForwardBatch& b, const float* hidden_in);
  const float* hidden_out() const { return hidden_out_.as<const float>(); }
  cudaStream_t stream() const { return stream_; }
  int device() const { return device_; }
  // Makes the runner's device the calling thread's current device (every public call does).
  void use_device() const;

  // Logits [n_out, n_logits()] f32 on the host: the whole vocabulary, or a tensor-parallel rank's
  // slice of it.
  std::span<const float> forward(const ForwardBatch& b) override;
  int64_t n_logits() const { return n_logits_; }
  // Passes enqueued as two micro-batches (CudaTuning::dbo; a captured graph counts once, at capture).
  int64_t micro_batched_passes() const { return micro_batched_passes_; }
  // A tensor-parallel rank holds a slice of the logits: its owner samples on the host.
  bool samples_on_device() const override { return comm_ == nullptr; }
  // Masked rows: the pass runs (its graph replays) without the sampling kernel, fill_masks writes
  // the masks into pinned memory while the device computes the logits, one copy takes them up and
  // the sampling kernel runs after it, outside the graph (cuda_graph_runner.cpp).
  std::span<const int32_t> forward_sample(const ForwardBatch& b, std::span<const RowSampling> rows,
                                          const TokenMaskFill& fill_masks = {}) override;
  void copy_blocks(std::span<const BlockCopy> copies) override;
  // Host swap space (cuda_swap.cpp): pinned memory, copies by cudaMemcpyAsync after the work
  // already on stream_ (device -> host on swap_stream_, host -> device on load_stream_), and
  // stream_ waits for them before its next kernel.
  void allocate_swap_space(int32_t n_blocks) override;
  void swap_out(std::span<const BlockSwap> swaps) override;
  void swap_in(std::span<const BlockSwap> swaps) override;
  void swap_out_in(std::span<const BlockSwap> out, std::span<const BlockSwap> in) override;
  HostCopyTotals host_to_device_totals() override;
  double mask_wait_seconds() const override { return mask_wait_s_; }
  // PCIe Gen5 x16, the H200 SXM's host link: 64 GB/s a direction by the standard; 50e9 taken as
  // what pinned cudaMemcpyAsync reaches (a lead, not measured here).
  double host_link_bytes_per_s() const override { return 50e9; }
  // Disaggregated prefill's K/V through host memory (cuda_kv_transfer.cpp): a block's record is
  // each cache tensor's block bytes in the swap buffer's order (per layer K, V; then the FP8
  // scales per layer K, V); copies on stream_, which is synchronized after them.
  void read_kv_blocks(std::span<const int32_t> blocks, std::span<std::byte> out) const override;
  void write_kv_blocks(std::span<const int32_t> blocks, std::span<const std::byte> in) override;
  // The same blocks device to device between processes on one GPU (CUDA IPC, cuda_kv_transfer.cpp):
  // one handle per cache tensor (each its own cudaMalloc), the peer's tensors mapped once and kept
  // until this runner goes.
  std::string device_uuid() const override { return device_uuid_; }
  KvIpcMemory export_kv_ipc() const override;
  void open_kv_ipc(const KvIpcMemory& peer) const override;
  void copy_kv_blocks_ipc(const KvIpcMemory& peer, std::span<const int32_t> src, std::span<const int32_t> dst) override;
  // copy_kv_blocks_ipc's copy from device memory this process can address: peer_bases[t] is the
  // peer's cache tensor t (cache_tensors() order, the same block bytes as this pool's), with
  // peer_blocks blocks. Tests give another runner's tensors of the same process.
  void copy_kv_blocks_from(std::span<std::byte* const> peer_bases, int32_t peer_blocks, std::span<const int32_t> src,
                           std::span<const int32_t> dst);
  std::vector<std::byte*> cache_tensor_bases() const;
  int32_t n_kv_blocks() const override { return n_blocks_; }
  int32_t block_size() const override { return block_size_; }
  KvDtype kv_dtype() const override { return kv_dtype_; }
  int64_t kv_bytes_per_token() const override;
  std::vector<uint64_t> expert_token_counts() const override;  // cuda_moe_ffn.cpp (synchronises)
  std::string description() const override {
    return "cuda (" + device_name_ +
           (n_int4_ > 0   ? ", int4 W4A16 weights (" + std::to_string(n_int4_) + " projections)"
            : n_gguf_ > 0 ? ", GGUF blocks in place (" + std::to_string(n_gguf_) + " matrices)"
                          : ", bf16 weights") +
           ", weights " + std::to_string(weight_bytes_ >> 10) + " KiB" +
           ", KV " + std::string(kv_dtype_name(kv_dtype_)) + " " + std::to_string(n_blocks_) + " blocks, " +
           (eager_ ? "eager" : "CUDA graphs for decode") + ")";
  }

 private:
  void upload_weights();
  // Layer l's experts and router (cuda_moe_ffn.cpp); marks their roles in `done`.
  void upload_moe(int32_t l, Layer& dl, cuda::WeightUploader& up, std::array<bool, kWeightRoleCount>& done);
  void shared_expert(const Layer& L, const bf16* x, int64_t n, cudaStream_t stream);
  bool reserve_moe(int64_t n_tokens);  // the MoE buffers for n_tokens rows; true when one grew
  // Runs the batch (eagerly or by replaying a graph); leaves logits (and tokens when sampling) on
  // the device and returns the device arrays of the pass (its sampling rows, where the tokens go).
  BatchArrays run(const ForwardBatch& b, std::span<const RowSampling> rows, bool sample);
  // A tensor-parallel rank waits on the host for the other ranks (Communicator::host_barrier)
  // after the pass's allocations and before its first collective is enqueued: a rank allocating
  // device or pinned memory while another's NCCL kernel waits for it can deadlock. Nothing alone.
  void meet_ranks();
  // A pipeline stage after the first: the n rows handed in (pass_hidden_in_) into residual_, rows
  // [n, n_padded) zeroed, on stream_ before the pass.
  void hand_in(int64_t n, int64_t n_padded);
  // Sizes every activation buffer for n_tokens rows and n_out logits rows; a reallocation
  // invalidates the captured graphs (they hold the old addresses).
  void reserve_activations(int64_t n_tokens, int64_t n_out, size_t attention_workspace);
  // Enqueues one pass: the architecture's builder over this runner's ForwardOps (over the whole
  // batch, or as two micro-batches when overlaps(s)), then the sampling kernel when s.sample
  // (cuda_forward.cpp).
  void enqueue_forward(const BatchArrays& d, const PassShape& s);
  // The builder over the rows [row0, row0 + s.n_tokens) of the activation buffers (d: that
  // micro-batch's arrays), on stream_.
  void enqueue_layers(const BatchArrays& d, const PassShape& s, int64_t row0);
  // Dual-batch overlap (CudaTuning::dbo): a decode pass of at least dbo_min_tokens_ one-token
  // rows runs as two micro-batches, the first half of the sequences on stream_ and the second on
  // lane_stream_ (which starts once the first half's first attention is enqueued), so that one
  // half's memory-bound attention runs beside the other's compute-bound projections; each half's
  // final norm writes its rows and one LM head takes all rows after the join. Dense models on one
  // GPU with bf16 or FP8 projections (no INT4 or GGUF scratch, MoE, MLA, tensor or pipeline
  // parallelism, op profiling). The same per-row bits as one pass wherever the GEMMs' algorithms
  // are the same at both row counts (always on the CPU emulation).
  bool overlaps(const PassShape& s) const;
  void enqueue_micro_batches(const BatchArrays& d, const PassShape& s);
  // Sizes the second micro-batch's attention workspace for the pass s when it overlaps (a growth
  // invalidates the captured graphs) and returns the bytes either half's attention needs, for the
  // caller's reserve_activations (the first half runs on workspace_); 0 when s does not overlap.
  size_t reserve_micro_batches(const PassShape& s);
  // The LM head over `n_out` normed rows into logits_ (final_norm_logits's second half).
  void logits_head(const bf16* rows, int64_t n_out);
  // ForwardOps over the pass being enqueued (pass_*): bf16 activations, f32 residual stream.
  void embed() override;
  void add_norm_linear(Act add, WeightId norm, WeightId proj, Act out) override;
  void rope_write_kv(int32_t layer, Act qkv) override;
  void attention(int32_t layer, Act qkv, Act out) override;
  void linear(Act in, WeightId proj, Act out) override;
  void swiglu_linear(Act in, WeightId proj, Act out) override;
  void add_norm(Act add, WeightId norm, Act out) override;
  void norm(Act a, WeightId w) override;
  void qk_norm(int32_t layer, Act qkv) override;
  void geglu_linear(Act in, WeightId proj, Act out) override;
  void moe_ffn(int32_t layer, Act in, Act out) override;  // cuda_moe_ffn.cpp
  void final_norm_logits(Act add, WeightId norm, WeightId head) override;
  // A tensor-parallel rank's partial rows [n, d] bf16 summed over the ranks (comm_); a no-op alone.
  void all_reduce(Act a) override;
  void mla_attention(int32_t layer, Act in, Act out) override;  // cuda_mla.cpp
  // The activation buffer (null for Act::None), its W8A8 product scaled first if it holds one
  // unscaled (fp8_pending_).
  bf16* act(Act a);
  bf16* act_buffer(Act a) const;  // the buffer as it is
  // An unscaled W8A8 product (Gemm::run_fp8_unscaled where fp8_unscaled_deferred holds) left in
  // `act` for the op that reads it next to scale on the way in (add_rms_norm_fp8 for the o and down
  // projections, silu_mul_fp8 for gate|up): the scales it needs, x_scale pointing into
  // fp8_x_scale_. Any other reader, and any quantization that would overwrite x_scale, scales it
  // in place first (settle_fp8).
  struct PendingFp8Scale {
    Act act = Act::None;
    const float* x_scale = nullptr;
    const float* w_scale = nullptr;
    int64_t n_out = 0;
  };
  PendingFp8Scale fp8_pending_;
  void settle_fp8();
  // For a consumer that scales its input `in` on the way in: the pending scales if `in` holds the
  // pending product (then no longer pending), else none (any other pending product settled).
  PendingFp8Scale take_fp8_pending(Act in);
  // Whether an FP8 weight at n tokens takes cuBLASLt's W8A8 GEMM (not the streaming GEMV or the
  // skinny kernel): its input is quantized per token into fp8_x_ first.
  bool fp8_gemm_path(const DeviceWeight& W, int64_t n) const;
  // The W8A8 GEMM of W over fp8_x_ / fp8_x_scale_ (quantized already) into y, the buffer of `out`
  // (or scratch: Act::None): unscaled and pending where fp8_unscaled_deferred holds and `out` is read next by
  // an op that can scale it (AttnOut, GateUp, Down; no bias), else scaled.
  void gemm_fp8(const DeviceWeight& W, int64_t n, bf16* y, Act out);
  // The pass being enqueued: its arrays and shape, its attention parameters, the residual buffer
  // the stream is in now (the fused norm alternates residual_ and residual_alt_), and whether RoPE
  // and the K/V write happen inside decode attention.
  const BatchArrays* pass_arrays_ = nullptr;
  PassShape pass_;
  // The first row of the micro-batch being enqueued: every activation buffer is addressed from it
  // (lane_rows), so the two halves of an overlapped pass write disjoint, contiguous rows.
  int64_t pass_row0_ = 0;
  template <class T>
  T* lane_rows(const DevMem& m, int64_t row_elems) const {
    return m.as<T>() + pass_row0_ * row_elems;
  }
  bf16* normed_rows() const { return lane_rows<bf16>(h_, hp_.n_embd); }
  uint8_t* fp8_x() const {
    return lane_rows<uint8_t>(fp8_x_, std::max({hp_.n_embd, hp_.q_dim(), hp_.attn_out_dim(), hp_.n_ff}));
  }
  float* fp8_x_scale() const { return lane_rows<float>(fp8_x_scale_, 1); }
  // Dual-batch overlap (overlaps()): the flag's threshold (0: off), the second micro-batch's
  // stream, cuBLASLt handle and attention workspace, the event its stream waits on (recorded
  // before the first half's first attention while lane_start_pending_), the join, and whether the
  // final norm leaves the LM head to the joined pass.
  int64_t dbo_min_tokens_ = 0;
  cudaStream_t lane_stream_ = nullptr;
  std::unique_ptr<cuda::Gemm> lane_gemm_;
  DevMem lane_workspace_;
  cudaEvent_t lane_start_ = nullptr, lane_join_ = nullptr;
  bool lane_start_pending_ = false;
  void start_lane();  // records lane_start_ on stream_ if it is pending
  bool head_deferred_ = false;
  int64_t micro_batched_passes_ = 0;
  cuda::AttentionParams pass_ap_{};
  float* pass_residual_ = nullptr;
  float* pass_spare_ = nullptr;
  bool pass_rope_in_attention_ = false;
  // project: y [n, n_out] = a(x) . W^T: the streaming GEMV where it applies (uses_stream_gemv), else the
  // skinny GEMM for at most skinny_max_tokens_ rows, else cuBLASLt (after silu_mul into act_ when
  // swiglu: x then holds [gate | up] rows of 2 n_in).
  // `stream`: null (stream_) or side_stream_ (cuBLASLt through side_gemm_, SwiGLU into side_act_).
  void project(const bf16* x, const bf16* w, void* y, bool f32_out, int64_t n, int64_t n_in, int64_t n_out,
               bool swiglu = false, cudaStream_t stream = nullptr);
  // project() for a dense projection's weight, by its storage: bf16 as project(); FP8 through the
  // narrow streaming GEMV where it applies (uses_stream_gemv_narrow), else the FP8 skinny GEMM for
  // at most kSkinnyFp8MaxTokens rows (W8A16), else the activations quantized
  // per token and cuBLASLt's FP8 GEMM with per-token and per-channel scales (W8A8).
  // `out`: the activation y is (Act::None: scratch), so an FP8 product may stay unscaled there (gemm_fp8).
  void project_weight(const bf16* x, const DeviceWeight& W, bf16* y, int64_t n, bool swiglu = false,
                      Act out = Act::None);
  // project_weight() for an int4 weight (cuda_int4_weights.cpp): the narrow streaming GEMV where it
  // applies (uses_stream_gemv_narrow), else up to kInt4SkinnyMaxTokens rows
  // the W4A16 skinny GEMM (act order: the activations gathered into int4_x_ first); more rows: the
  // weight dequantized into int4_w_ (exactly the bf16 upload's values) and cuBLASLt.
  void project_int4(const bf16* x, const DeviceWeight& W, bf16* y, int64_t n, bool swiglu);
  // Dense projections (QKV, o, gate/up, down) as FP8 E4M3 with per-channel scales, quantized on
  // the device after upload (RunnerOptions::quantize_fp8).
  void quantize_fp8_weights();
  // With fp8_weights_, a dense projection whose stored parts are all FP8 checkpoint matrices with
  // one scale per row (per channel or per tensor) is uploaded as its codes and row scales, exactly;
  // false (nothing uploaded) otherwise.
  bool upload_fp8_codes(WeightRole role, std::span<const WeightView* const> views, DeviceWeight& dw);
  // A dense projection whose stored parts are all GPTQ / AWQ 4-bit matrices with f16 or bf16
  // scales, one group size, one act order and a shape the layout takes (int4_layout_supports) is
  // repacked on the host and uploaded as int4 (cuda_int4_weights.cpp); false (nothing uploaded)
  // otherwise, and then it is dequantized to bf16 as before. Not for MLA models (their projections
  // are restacked as bf16).
  bool upload_int4(WeightRole role, std::span<const WeightView* const> views, DeviceWeight& dw);
  // The int4 projections' buffers: the dequantized weight for cuBLASLt (the largest int4 matrix,
  // bf16) and the act-order gather of at most kInt4SkinnyMaxTokens rows.
  void reserve_int4_scratch();
  // With gguf_in_place_, a dense projection whose stored parts are all GGUF matrices of the types
  // gguf_ops.h keeps (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K) with whole blocks per row is
  // repacked on the host and uploaded in place (cuda_gguf_weights.cpp); false (nothing uploaded)
  // otherwise, and then it is dequantized to bf16 as before. `any_role`: the embedding and LM head.
  bool upload_gguf(WeightRole role, std::span<const WeightView* const> views, DeviceWeight& dw, bool any_role = false);
  // project_weight() for GGUF blocks in place: up to kGgufGemvMaxTokens rows the GEMV per part
  // (each writing its columns of y); more: the parts dequantized into gguf_w_ and cuBLASLt, or for
  // the LM head (f32_out) the GEMV over slices of kGgufGemvMaxTokens rows (no scratch of its size).
  void project_gguf(const bf16* x, const DeviceWeight& W, void* y, int64_t n, bool swiglu, bool f32_out);
  // The bytes of every weight on the device (for description()).
  size_t count_weight_bytes() const;
  // Whether project() takes the skinny GEMM: it beats cuBLASLt on small weights only (H200,
  // bench/cuda: 4096 x 6144 and 4096 x 4096 at up to 8 tokens, by 7-21%); on larger ones (the 8B's
  // gate/up, down and head) cuBLASLt streams at 3.5-4.4 TB/s and the skinny kernel does not.
  bool uses_skinny(int64_t n, int64_t n_in, int64_t n_out) const {
    return n <= skinny_max_tokens_ && n_in * n_out <= kSkinnyMaxWeightElems &&
           cuda::skinny_gemm_supports(n, n_in, n_out);
  }
  // Whether project() takes the streaming GEMV (one or two tokens, n_in a multiple of 2048, at
  // most 256 rows per SM, weights of 40 MiB or more: the 8B's QKV, gate/up and down projections;
  // CudaTuning::stream_gemv off: never).
  bool uses_stream_gemv(int64_t n, int64_t n_in, int64_t n_out) const {
    return stream_gemv_ && n_in * n_out >= stream_gemv_min_elems_ &&
           cuda::stream_gemv_supports(n, n_in, n_out, 0, stream_gemv_stages_);
  }
  // Whether an FP8 or INT4 weight takes a narrow streaming GEMV at n tokens (one or two, n_in a
  // multiple of 2048, INT4 groups of 128 or more; act order gathers x first): every such INT4
  // projection of the 8B, the O projection included, on stream_gemv_int4 (INT4); every
  // such FP8 one on the W8A8 streaming GEMV (stream_gemv_w8a8) unless stream_gemv_fp8_ is off.
  // CudaTuning::stream_gemv off: never.
  bool uses_stream_gemv_narrow(const DeviceWeight& W, int64_t n) const {
    if (!stream_gemv_) return false;
    if (W.fp8) return stream_gemv_fp8_ && cuda::stream_gemv_w8a8_supports(n, W.n_in, W.n_out);
    if (!W.int4) return false;
    cuda::Int4Matrix m = W.int4_matrix();
    m.perm = nullptr;
    return cuda::stream_gemv_int4_supports(n, m, 0, stream_gemv_stages_);
  }
  // The narrow streaming GEMV of W (uses_stream_gemv_narrow) over a's operands and fused input; an
  // act-order INT4 weight's x must already be in the physical order.
  void stream_narrow(const DeviceWeight& W, const cuda::StreamGemvArgs& a);
  // What a narrow streamed projection (FP8 or INT4 weight W) prefetches into L2 at its end: the
  // head of the weight streamed after it in the previous pass (none when unknown, after attention,
  // or with CudaTuning::stream_prefetch_kb 0). Called once per such projection, in pass order: it
  // also records W as the successor of the one before. The order is learned, not assumed, so any
  // architecture's pass is covered; a decode graph is captured after an eager pass of its shape,
  // so it holds the learned order. bf16 weights do not prefetch (one H100, the 8B at batch 1:
  // 181.5 -> 180.8 tok/s with it; FP8 294.4 -> 297.7, INT4 393.5 -> 396.5).
  cuda::StreamPrefetch chain_prefetch(const DeviceWeight& W);
  cuda::AttentionParams attention_params(const BatchArrays& d, const PassShape& s) const;
  // Writes the batch (padded to n_seqs_pad sequences of q tokens and `width` columns when graphed)
  // into the pinned staging buffer in BatchArrays layout; returns the host layout.
  BatchArrays stage(const ForwardBatch& b, std::span<const RowSampling> rows, int64_t n_seqs_pad, int32_t width,
                    int32_t q = 1);

  const LlamaModel& model_;
  const ModelHparams& hp_;
  const Architecture& arch_;
  bool eager_;
  int device_ = 0;
  PipelineRole role_;
  Communicator* comm_ = nullptr;  // CudaPlacement::comm
  // The LM head's rows: n_vocab, or a tensor-parallel rank's slice starting at vocab_begin_ (the
  // embedding table holds the same rows).
  int64_t n_logits_ = 0, vocab_begin_ = 0;
  // forward_stage's input residual stream while its pass is staged; a non-last stage's output
  // [cap_tokens_, n_embd] f32 (a fixed address, for the captured graphs).
  const float* pass_hidden_in_ = nullptr;
  DevMem hidden_out_;
  cudaStream_t stream_ = nullptr;
  std::string device_name_;
  std::string device_uuid_;  // KvIpcMemory::device_uuid's spelling
  // CUDA IPC: this pool's export (made on first use) and the peers' tensors mapped into this
  // process (cudaIpcOpenMemHandle), by their handles; under ipc_mutex_.
  mutable std::mutex ipc_mutex_;
  mutable std::unique_ptr<KvIpcMemory> ipc_export_;
  mutable std::map<std::vector<std::string>, std::vector<std::byte*>> ipc_peers_;
  void close_kv_ipc();
  std::unique_ptr<cuda::Gemm> gemm_;
  // Token counts up to which the projections use cuda::skinny_gemm instead of cuBLASLt (from the
  // H200 measurements in docs/performance.md; CudaTuning::skinny_max_tokens, 0 = never).
  int64_t skinny_max_tokens_ = 9;
  bool stream_gemv_ = true;
  // FP8 weights at one and two tokens on the W8A8 streaming GEMV (CudaTuning::stream_gemv_fp8; off:
  // the W8A16 FP8 skinny GEMM).
  bool stream_gemv_fp8_ = true;
  // Residual add + RMSNorm folded into the streaming GEMV of QKV and gate/up when both take it
  // (one or two tokens), alternating residual_ and residual_alt_ (CudaTuning::fused_norm).
  // H200, the 8B at batch 1: 235.0 tok/s with it, 225.6 without (docs/performance.md).
  bool fused_norm_ = true;
  bool fp8_weights_ = false;  // RunnerOptions::quantize_fp8: the dense projections are FP8
  // 0: the kernel's default, 4 (CudaTuning::stream_gemv_stages 3, 4 or 6; 3: 196.8 against 227.4
  // tok/s). Six stages for gate/up and down alone were faster back to back (54.6 against 56.6 us,
  // 27.6 against 28.1) but not in decode: H200, the 8B at batch 1, 232.8 tok/s against 235.0 with
  // four (docs/performance.md).
  int stream_gemv_stages_ = 0;
  int64_t stream_prefetch_bytes_ = 0;  // CudaTuning::stream_prefetch_kb, in bytes
  const void* last_streamed_ = nullptr;  // the weight of the last streamed projection
  std::map<const void*, cuda::StreamPrefetch> next_streamed_;  // each weight's successor's head
  // Decode-only passes: RoPE and the K/V write inside the decode attention kernel
  // (AttentionParams::rope; CudaTuning::fused_rope off: the rope_write_kv kernel).
  bool fused_rope_ = true;
  bool verify_decode_rows_ = true;  // AttentionParams::decode_rows (CudaTuning::verify_decode_rows)
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
  int32_t attn_fp8_decode_key_tile_ = 0;  // AttentionParams::fp8_decode_key_tile
  void tune_gemms(int64_t n);
  std::unique_ptr<cuda::OpProfiler> prof_;  // CudaTuning::profile_ops (op_profiler.h)
  void mark(const char* op) {
    if (prof_ != nullptr) prof_->mark(op);
  }
  DevMem embd_, out_norm_, lm_head_, inv_freq_;
  DevMem inv_freq_swa_;  // windowed layers' RoPE table when they have their own base (Gemma 3); else empty
  std::vector<Layer> layers_;
  // KV cache: per layer K and V, [n_blocks, n_head_kv, block_size, head_dim] bf16, or with
  // kv_dtype_ FP8 E4M3 codes of that layout and their scales [n_blocks, n_head_kv, block_size] f32
  // in k_scale_, v_scale_ (cuda::Fp8KvCache); with MLA per layer one latent array
  // [n_blocks, block_size, kv_lora_rank + qk_rope] bf16 in k_cache_, no V.
  KvDtype kv_dtype_ = KvDtype::BF16;  // BF16 or FP8 (RunnerOptions::kv_dtype)
  std::vector<DevMem> k_cache_, v_cache_, k_scale_, v_scale_;
  DevMem cache_ptrs_;  // every cache tensor's device pointer (2 per layer, MLA 1), for copy_blocks
  DevMem scale_ptrs_;  // FP8: every scale tensor's device pointer (2 per layer)
  int64_t cache_block_bytes_ = 0;  // one block of one cache tensor (the codes, for FP8)
  int64_t scale_block_bytes_ = 0;  // one block of one FP8 scale tensor; 0 for bf16
  // Every cache tensor's device base and its bytes per block, in the swap buffer's order.
  struct CacheTensor {
    std::byte* device;
    size_t bytes;
  };
  std::vector<CacheTensor> cache_tensors() const;
  void kv_transfer_copy(std::span<const int32_t> blocks, std::byte* host, size_t host_bytes, bool to_host) const;
  // Swap space: [tensor][n_swap_blocks_][its block bytes], the cache tensors in k_cache_ / v_cache_
  // order per layer, then (FP8) the scale tensors likewise; swap_tensors() lists them.
  PinnedMem swap_host_;
  int32_t n_swap_blocks_ = 0;
  cudaStream_t swap_stream_ = nullptr;  // device -> host copies
  cudaStream_t load_stream_ = nullptr;  // host -> device copies
  cudaEvent_t swap_after_pass_ = nullptr, swap_done_ = nullptr, load_done_ = nullptr;
  // [cache tensor]: recorded on swap_stream_ after that tensor's copies out, for load_stream_.
  std::vector<cudaEvent_t> tensor_out_done_;
  // Timing of the host -> device copies: events (with timing) around the last call's copies,
  // read (and added to h2d_) at the next call or by host_to_device_totals().
  cudaEvent_t h2d_start_ = nullptr, h2d_stop_ = nullptr;
  // forward_sample with token masks: the layers' end and the masks' arrival on the stream; the time
  // between them (when the host was the later) is the device's wait for the masks.
  cudaEvent_t layers_done_ = nullptr, masks_ready_ = nullptr;
  double mask_wait_s_ = 0;
  bool h2d_pending_ = false;
  HostCopyTotals h2d_;
  void collect_h2d_timing();
  // A cache tensor's device base, its region of the swap buffer and its bytes per block.
  struct SwapTensor {
    std::byte* device;
    std::byte* host;
    size_t bytes;
  };
  std::vector<SwapTensor> swap_tensors();
  // `n` block pairs from (device, host) on, consecutive on both sides: one copy per tensor.
  struct SwapRun {
    size_t device, host, n;
  };
  std::vector<SwapRun> swap_runs(std::span<const BlockSwap> swaps) const;
  // Tensor t's blocks of `runs`, device -> host (out) or back, on stream s.
  static void copy_runs(const SwapTensor& t, std::span<const SwapRun> runs, bool out, cudaStream_t s);
  // Layer l's FP8 cache (kv_dtype_ FP8).
  cuda::Fp8KvCache fp8_cache(int32_t layer) {
    const auto l = static_cast<size_t>(layer);
    return {k_cache_[l].as<uint8_t>(), v_cache_[l].as<uint8_t>(), k_scale_[l].as<float>(), v_scale_[l].as<float>()};
  }
  int32_t n_blocks_ = 0;
  int32_t block_size_ = 16;
  // Activations (grown to the largest batch seen).
  int64_t cap_tokens_ = 0, cap_out_ = 0;
  DevMem residual_, residual_alt_, h_, qkv_, q_, attn_, o_, gate_up_, act_, down_, logits_in_, logits_, workspace_, sample_ws_;
  // Mixture of experts (cuda_moe_ffn.cpp, moe_ops.h): router logits [n, E (+1)] f32, ids and
  // weights [n, k], the row tiles and their rows, the experts' SwiGLU rows [padded rows, f] and
  // outputs [n k, d], the shared expert's gate|up [n, 2 s] and output [n, d]; expert-usage
  // counters [n_layer, E] u64.
  DevMem moe_logits_, moe_ids_, moe_weights_, moe_tiles_, moe_perm_, moe_act_, moe_y_, moe_sh_gate_up_, moe_sh_y_;
  DevMem moe_counts_;
  DevMem fp8_x_, fp8_x_scale_;
  // int4 projections (upload_int4): how many, the dequantized weight of one for batches above
  // kInt4SkinnyMaxTokens [n_out, n_in] bf16, the act-order gathered activations [64, n_in] bf16.
  int64_t n_int4_ = 0;
  DevMem int4_w_, int4_x_;
  // GGUF blocks in place (RunnerOptions::cuda.gguf_in_place): how many matrices, the token
  // embedding and the LM head when in place (then embd_ / lm_head_ are empty; a tied head is
  // embd_q_), and the dequantized weight of the largest in-place projection for batches above
  // kGgufGemvMaxTokens [n_out, n_in] bf16.
  bool gguf_in_place_ = false;
  int64_t n_gguf_ = 0;
  DeviceWeight embd_q_, head_q_;
  DevMem gguf_w_;
  size_t weight_bytes_ = 0;  // W8A8 GEMMs: the activations as E4M3 [n, n_in] and their per-token scales
  // The shared experts run on side_stream_, beside the router, the routing and the routed experts
  // on stream_ (fork at moe_fork_, join at moe_join_): at decode sizes the routing kernels leave
  // the GPU's bandwidth idle. Created with the first shared expert; the side stream's cuBLASLt
  // workspace and SwiGLU buffer are its own.
  cudaStream_t side_stream_ = nullptr;
  cudaEvent_t moe_fork_ = nullptr, moe_join_ = nullptr;
  std::unique_ptr<cuda::Gemm> side_gemm_;
  DevMem side_act_;
  // Multi-head latent attention (cuda_mla.cpp), per layer: the stacked input projection [QA | KvA]
  // or [Q | KvA] (bf16 [in_rows, n_embd]; the parts' own uploads freed), W_UK^T [H, r, nope] and
  // W_UV [H, v, r] from KvB (bf16; KvB freed).
  struct MlaLayer {
    DevMem in, uk_t, uv;
    int64_t q_rows = 0, in_rows = 0;
  };
  std::vector<MlaLayer> mla_;
  DevMem mla_in_out_, mla_qa_, mla_q_, mla_q_lat_, mla_o_lat_, mla_ws_;
  void prepare_mla();
  bool reserve_mla(int64_t n_tokens);  // grows the MLA buffers for n_tokens rows; true if any grew
  DevMem arrays_;      // the eager path's BatchArrays
  PinnedMem staging_;  // their host copy
  PinnedMem logits_h_;
  PinnedMem tokens_h_;
  PinnedMem masks_h_;  // forward_sample's token masks, [n_out, (n_vocab + 31) / 32], as fill_masks writes them
  DevMem masks_;       // their device copy, read by the sampling kernel
  // Keyed by (batch size, block table width, samples on the device).
  // Keyed by (batch size, tokens per sequence, block table width, samples on the device).
  std::map<std::tuple<int64_t, int32_t, int32_t, bool>, std::unique_ptr<DecodeGraph>> graphs_;
};


// KV blocks of block_bytes that fit on the calling thread's current device beside what is
// allocated there: RunnerOptions::gpu_memory_utilization of its memory, less what is in use and
// 2 GiB for each of the n_runners runners on it (activations, cuBLASLt, the attention workspace,
// captured graphs). block_bytes: one block of all those runners' caches together. Errors:
// kestrel::Error when none fits.
int64_t kv_blocks_that_fit(const RunnerOptions& o, int64_t block_bytes, int n_runners);

// Allocates the KV caches of runners made with CudaPlacement::kv_later (a pipeline's stages, a
// tensor-parallel group's ranks), one block count for all (one block pool): o.n_kv_blocks when
// set, else the fewest that fit on any of their devices, each device's runners' blocks together,
// once all weights are up. Errors: kv_blocks_that_fit's.
void allocate_kv_blocks_together(const RunnerOptions& o, std::span<CudaModelRunner* const> runners);

// Batch sizes with a captured decode graph: a decode batch is padded up to the next one.
inline constexpr int64_t kGraphBatchSizes[] = {1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512};
// Decode steps with up to this many tokens per sequence replay graphs: one sampled token and up to
// 8 drafts to verify (speculative decoding).
inline constexpr int32_t kGraphMaxTokensPerSeq = 9;

}  // namespace kestrel::cuda_runner
