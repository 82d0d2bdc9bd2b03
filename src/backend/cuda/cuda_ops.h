// Host-side launchers of the CUDA kernels: one op per .cu/.cuh pair under this folder,
// each tested against a CPU reference in tests/backend/. Only src/backend/cuda includes CUDA
// headers. All pointers are device pointers; every launcher enqueues on `stream` and never
// synchronises. bf16 tensors are stored as __nv_bfloat16; accumulation is in f32.
//
// Layouts shared with the CPU backend:
// - activations are row-major [n_tokens, width];
// - the paged KV cache of one layer is [n_blocks, n_head_kv, block_size, head_dim], bf16 (the CPU
//   KvCache's layout), a token's slot is block_id * block_size + offset (slot_mapping);
// - a flat batch is ForwardBatch's: query_start [n_seqs + 1], context_lens [n_seqs] (tokens in
//   the cache after this step, including this step's), block_tables [n_seqs, max_blocks_per_seq],
//   positions [n_tokens].
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace kestrel::cuda {

using bf16 = __nv_bfloat16;

// out[t, :] = table[ids[t], :] * scale (Gemma scales its embeddings by sqrt(n_embd); else 1).
// table [n_vocab, n_embd] bf16; out [n_tokens, n_embd] f32 (the residual stream is kept in f32).
// ids must lie in [0, n_vocab): the device does not check them (the runner checks token ids on
// the host, as CpuModelRunner::check does). A tensor-parallel rank's table holds the rows
// [vocab_begin, vocab_begin + n_rows) of the vocabulary: row t is table[ids[t] - vocab_begin] for
// an id inside, zeros for any other (the ranks' rows are then summed).
void embedding(const bf16* table, const int32_t* ids, int64_t n_tokens, int64_t n_embd, float scale, float* out,
               cudaStream_t stream, int64_t vocab_begin = 0, int64_t n_rows = INT64_MAX);

// In-place RMSNorm of heads: for each row t < n_rows and head h < n_heads, the dim values at
// x + t * row_stride + h * dim = RMSNorm(them) * weight (Gemma 3's QK-norm over the q or k heads
// of a fused QKV row; with n_heads 1 and row_stride dim, a plain per-row norm such as Gemma's
// post-attention and post-FFN norms). x bf16, weight [dim] bf16, f32 arithmetic, one bf16
// rounding of the result. Errors: kestrel::Error when dim <= 0 or row_stride < n_heads * dim.
void rms_norm_heads(bf16* x, int64_t n_rows, int64_t row_stride, int64_t n_heads, int64_t dim, const bf16* weight,
                    float eps, cudaStream_t stream);

// Fused residual add and RMSNorm (Zhang & Sennrich 2019): if add != nullptr, residual += add
// (f32 += bf16); then out = residual / sqrt(mean(residual^2) + eps) * weight.
// residual [n_tokens, dim] f32 (in/out); add [n_tokens, dim] bf16 or null; weight [dim] bf16;
// out [n_tokens, dim] bf16.
void add_rms_norm(float* residual, const bf16* add, const bf16* weight, bf16* out, int64_t n_tokens,
                  int64_t dim, float eps, cudaStream_t stream);
// out = residual + add (f32 + bf16, the sum add_rms_norm makes), [n_tokens, dim]: the residual
// stream a pipeline stage hands on. add may be null (a copy).
void add_residual(const float* residual, const bf16* add, float* out, int64_t n_tokens, int64_t dim,
                  cudaStream_t stream);

// RoPE on q and k (in place), then K and V written into the paged cache at slot_mapping.
// q [n_tokens, n_head, head_dim] bf16; k, v [n_tokens, n_head_kv, head_dim] bf16;
// inv_freq [rope_dim / 2] f32 (theta^(-2i/rope_dim) / freq_factor[i]), positions scaled by
// 1 / position_scale; rotate_half: pair x[i] with x[i + rope_dim/2] (HF), else x[2i], x[2i+1].
// k_cache, v_cache: one layer, [n_blocks, n_head_kv, block_size, head_dim] bf16.
// slot_mapping [n_tokens]: a negative slot (padding) writes nothing to the cache.
// Angles: (position / position_scale) * inv_freq[i] and its sin/cos are computed in double, once per
// token and frequency, then rounded to f32 (as the CPU backend's rope does: in f32 the angle alone
// would be off by up to 4e-3 rad at position 128k); the rotation itself is f32 math.
// Errors: kestrel::Error if rope_dim is odd, not positive or above head_dim, or block_size is not
// positive.
void rope_write_kv(bf16* q, bf16* k, const bf16* v, const int32_t* positions, const int64_t* slot_mapping,
                   const float* inv_freq, float position_scale, int64_t n_tokens, int64_t n_head,
                   int64_t n_head_kv, int64_t head_dim, int64_t rope_dim, bool rotate_half, bf16* k_cache,
                   bf16* v_cache, int32_t block_size, cudaStream_t stream);

// The same for a fused QKV projection: token t's q, k and v are the column slices [0, q_dim),
// [q_dim, q_dim + kv_dim) and [q_dim + kv_dim, q_dim + 2 kv_dim) of row t of qkv, whose rows are
// qkv_stride elements apart (q_dim = n_head * head_dim, kv_dim = n_head_kv * head_dim). q is
// written rotated to q_out [n_tokens, n_head, head_dim] (contiguous, as paged_attention reads it);
// k is rotated into the cache only; qkv is not modified. Errors: those of rope_write_kv, and
// kestrel::Error when qkv_stride < q_dim + 2 kv_dim.
void rope_write_kv_fused(const bf16* qkv, int64_t qkv_stride, bf16* q_out, const int32_t* positions,
                         const int64_t* slot_mapping, const float* inv_freq, float position_scale, int64_t n_tokens,
                         int64_t n_head, int64_t n_head_kv, int64_t head_dim, int64_t rope_dim, bool rotate_half,
                         bf16* k_cache, bf16* v_cache, int32_t block_size, cudaStream_t stream);

// One layer of an FP8 (E4M3) KV cache (kv_fp8.cuh has the format): codes k, v
// [n_blocks, n_head_kv, block_size, head_dim] u8 and one f32 scale per row (a token's k or v of
// one KV head), k_scale, v_scale [n_blocks, n_head_kv, block_size]; value = code x scale.
struct Fp8KvCache {
  uint8_t* k = nullptr;
  uint8_t* v = nullptr;
  float* k_scale = nullptr;
  float* v_scale = nullptr;
};
// rope_write_kv_fused into an FP8 cache: q as there; each token's rotated k and its v, rounded to
// bf16 as the bf16 cache would hold them, quantized per row: scale = amax / 448 (1 for a zero
// row), code = e4m3(x / scale) with round-to-nearest-even and saturation (core/fp8.h). Errors:
// those of rope_write_kv_fused.
void rope_write_kv_fused_fp8(const bf16* qkv, int64_t qkv_stride, bf16* q_out, const int32_t* positions,
                             const int64_t* slot_mapping, const float* inv_freq, float position_scale,
                             int64_t n_tokens, int64_t n_head, int64_t n_head_kv, int64_t head_dim, int64_t rope_dim,
                             bool rotate_half, const Fp8KvCache& cache, int32_t block_size, cudaStream_t stream);

// out[t, i] = silu(gate_up[t, i]) * gate_up[t, n_ff + i]  (SwiGLU; gate and up side by side as
// one fused GEMM writes them). gate_up [n_tokens, 2 * n_ff] bf16; out [n_tokens, n_ff] bf16.
void silu_mul(const bf16* gate_up, bf16* out, int64_t n_tokens, int64_t n_ff, cudaStream_t stream);
// The same with GELU's tanh approximation for silu (GeGLU: Gemma's MLP, transformers'
// gelu_pytorch_tanh): out[t, i] = gelu_tanh(gate_up[t, i]) * gate_up[t, n_ff + i].
void gelu_tanh_mul(const bf16* gate_up, bf16* out, int64_t n_tokens, int64_t n_ff, cudaStream_t stream);

// The longest uniform query run the decode kernels take, a token an item (AttentionParams::decode_rows).
inline constexpr int32_t kDecodeRowsMaxQuery = 16;

// Causal paged attention over a flat batch of prefill chunks and decode tokens (FlashAttention-
// style: tiled over keys with online softmax, no n x n matrix; GQA: n_head / n_head_kv query heads
// share a KV head). Token t of sequence s at position p attends keys [0, p] of s's cache (the CPU
// runner's rule: n_ctx = position + 1), or with a sliding window W keys [max(0, p + 1 - W), p], so
// positions, not context_lens, bound each token's keys.
// q [n_tokens, n_head, head_dim] bf16; out [n_tokens, n_head, head_dim] bf16.
// Sequences with one query token (decode) go to a flash-decoding kernel that splits long contexts
// over several blocks (split-KV) and combines the partial results in a second kernel; the others
// (prefill chunks) to a FlashAttention-2 kernel.
// head_dim: any multiple of 8 from 8 to 256 (attention_supports_head_dim; kestrel::Error
// otherwise); n_head a multiple of n_head_kv. Fast paths (tensor cores, paged_attention.cuh):
// head_dim 32, 64, 80, 96, 128 and 256. The other head dims (8, 16, 24, 40, 48, ...) run on a
// plain f32 kernel (paged_attention_simt.cuh) with the same split-KV plan: exact, but several
// times slower per key than the tensor-core kernels.
// max_query_len lets a decode-only batch skip the prefill launches. token_seq is not read
// (query_start says the same) and may be null. The workspace size depends on the whole parameter
// set: the split-KV partial results scale with n_seqs and the split count, which depends on
// n_seqs, n_head_kv and max_context.
struct AttentionParams {
  const bf16* q;
  const void* k_cache;          // one layer, [n_blocks, n_head_kv, block_size, head_dim] bf16, or
  const void* v_cache;          // E4M3 codes (u8) with k_scale / v_scale
  const int32_t* block_tables;  // [n_seqs, max_blocks_per_seq]
  const int32_t* context_lens;  // [n_seqs]; not read by the kernels (see above), may be null
  const int32_t* query_start;   // [n_seqs + 1]
  const int32_t* token_seq;     // [n_tokens]; not read, may be null
  const int32_t* positions;     // [n_tokens]
  bf16* out;
  int64_t n_tokens;
  int64_t n_seqs;
  int32_t max_blocks_per_seq;
  int32_t max_context;  // max over context_lens (host-known), sizes the split-KV grid (a smaller
                        // value stays correct: the last split takes the rest of the context)
  int32_t n_head;
  int32_t n_head_kv;
  int32_t head_dim;     // a multiple of 8 in [8, 256]
  int32_t block_size;
  float scale;          // 1 / sqrt(head_dim)
  void* workspace;      // 16-byte aligned, at least attention_workspace_bytes(*this) bytes
  size_t workspace_bytes;
  int32_t max_query_len = 0;  // max tokens of one sequence in this batch; 0 = unknown
  // > 0: every sequence has exactly this many query tokens, its own contiguous run (query_start[s]
  // = s x uniform_query_len): speculative verify steps and the decode graphs. With 2 or more, the
  // prefill kernel finds its tiles from its block index (no plan kernel) and the decode kernel,
  // which would have no sequence to work on, is not launched.
  int32_t uniform_query_len = 0;
  int32_t window = 0;         // sliding window in keys (the query's own included); 0 = none
  int32_t decode_stages = 0;  // K/V tile stages of the tensor-core decode kernel, 2 or 3 (3: two
                              // tiles load while one is computed); 0 = chosen by the number of
                              // decode items (paged_attention.cu)
  // Uniform runs of 2 .. kDecodeRowsMaxQuery tokens (verify steps) on the decode kernels, one item
  // per query token, so that each row gets the bits of a one-token step at its position (the
  // sequences' item count sets stages and splits, decode_splits the ranges); false: the prefill
  // kernel (one pass over each tile's keys for all the run's rows).
  bool decode_rows = true;
  int32_t fp8_decode_key_tile = 0;  // keys of a K/V stage of the FP8 decode kernel at head_dim 64
                                    // and 128: 64 or 128; 0 = 64 with two stages, 128 with three
                                    // (paged_attention.cu)
  int32_t split_items_per_block = 0;  // split-KV decode: 0 = the measured rule (paged_attention.cu),
  int32_t split_min_tiles = 0;        // else ceil(k x resident blocks / items) splits of >= t tiles
  // An FP8 cache (Fp8KvCache, kv_fp8.cuh): k_cache / v_cache hold E4M3 codes and these their
  // scales [n_blocks, n_head_kv, block_size] f32; null: a bf16 cache. Both or neither.
  // The kernels widen the codes exactly (to bf16, or to f16 in the decode kernel at head_dim 64 and
  // 128), scale each key's score column by its K scale and each key's softmax weight by its V
  // scale before P V, f32 accumulation.
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  // Fused RoPE + KV write (attention_supports_fused_rope(head_dim), decode-only passes:
  // max_query_len == 1): instead of rope_write_kv_fused before the call, q is read un-rotated from
  // rope.qkv (ignoring q) and rotated in the kernel, and each token's k (rotated) and v are
  // written to its slot of k_cache / v_cache (through const_cast: the caches must be writable)
  // before they are read. The same bits as rope_write_kv_fused followed by paged_attention (with an
  // FP8 cache: as rope_write_kv_fused_fp8, the scales written too).
  struct FusedRope {
    const bf16* qkv = nullptr;        // [n_tokens, *] rows `stride` apart: q, then k, then v heads
    int64_t stride = 0;
    const int64_t* slot_mapping = nullptr;  // [n_tokens]; a negative slot writes nothing
    const float* inv_freq = nullptr;        // [rope_dim / 2]
    float position_scale = 1.0f;
    int32_t rope_dim = 0;
    bool rotate_half = true;
  } rope;
};
// Whether paged_attention can fuse RoPE for this head dim (the tensor-core kernels' head dims).
bool attention_supports_fused_rope(int32_t head_dim);
// Scratch bytes paged_attention needs for these parameters (workspace fields ignored): the prefill
// tile list and the split-KV partial outputs. Deterministic for the same fields. Errors: as
// paged_attention's (head_dim, n_head_kv, block_size).
size_t attention_workspace_bytes(const AttentionParams& p);
// Whether paged_attention takes this head_dim: a multiple of 8 from 8 to 256.
bool attention_supports_head_dim(int32_t head_dim);
void paged_attention(const AttentionParams& p, cudaStream_t stream);

// out[i, :] = in[rows[i], :]: in [*, width] bf16, rows [n_rows] int32 (device, each a valid row of
// in), out [n_rows, width] bf16. Errors: kestrel::Error when n_rows exceeds the launch grid.
void gather_rows(const bf16* in, const int32_t* rows, int64_t n_rows, int64_t width, bf16* out, cudaStream_t stream);

// Test instrument (delayed_copy.cuh): dst = src, bytes apart, by a kernel that lets the next
// kernel launch at once and sleeps delay_ns before it copies (so a PDL-launched kernel that read
// dst before its wait would see the old bytes). Errors: kestrel::Error unless both are 16-byte
// aligned and bytes a multiple of 16.
void delayed_copy(const void* src, void* dst, size_t bytes, unsigned delay_ns, cudaStream_t stream);

// y[t, i] += bias[i] (bias after a projection: Qwen2's q/k/v, HF Llama's attention_bias).
// y [n_tokens, width] bf16 in place; bias [width] f32.
void add_bias(bf16* y, const float* bias, int64_t n_tokens, int64_t width, cudaStream_t stream);

// Copies K and V of whole blocks (copy-on-write): for each i, block dst[i] = block src[i], in
// every cache tensor. layer_caches: a device array of n_caches device pointers (each layer's K and
// its V, in any order), each tensor [n_blocks, ...] of whole blocks of block_bytes bytes;
// src, dst [n_copies] block ids (device). 16-byte aligned tensors when block_bytes % 16 == 0.
void copy_blocks(void* const* layer_caches, int32_t n_caches, const int32_t* src, const int32_t* dst,
                 int32_t n_copies, int64_t block_bytes, cudaStream_t stream);

// Skinny GEMM for decode steps (skinny_gemm.cuh has the design): y = a(x) . W^T for at most
// kSkinnyMaxTokens tokens, streaming W once at close to the memory bandwidth. bf16 operands, f32
// accumulation (mma.sync), one rounding of the output.
// x [n_tokens, *] bf16 with rows x_stride elements apart; a(x) = x[:, 0 .. n_in), or with swiglu
// silu(x[:, 0 .. n_in)) * x[:, n_in .. 2 n_in) rounded to bf16 (silu_mul's result, bit for bit:
// the [gate | up] rows of the fused gate/up projection). w [n_out, n_in] bf16 row-major;
// y [n_tokens, n_out], f32 when f32_out else bf16. x and w 16-byte aligned, n_in and x_stride
// multiples of 8. unroll / warps pick a kernel variant for benchmarks (0 = the default).
// Errors: kestrel::Error for an unsupported shape (skinny_gemm_supports), a bad stride or
// alignment, swiglu with f32_out, or a variant that is not built.
constexpr int64_t kSkinnyMaxTokens = 64;
// The operands of a decode projection, as skinny_gemm takes them.
struct ProjectionOperands {
  const bf16* x = nullptr;
  int64_t x_stride = 0;
  const bf16* w = nullptr;
  void* y = nullptr;
  int64_t n_tokens = 0, n_in = 0, n_out = 0;
  bool swiglu = false;
  bool f32_out = false;
};
struct SkinnyGemmArgs : ProjectionOperands {
  int unroll = 0;
  int warps = 0;
};
bool skinny_gemm_supports(int64_t n_tokens, int64_t n_in, int64_t n_out);
// The operand checks of skinny_gemm (op names the caller in the message): SwiGLU
// input only with bf16 output, x_stride a multiple of 8 and at least a row (2 n_in for SwiGLU), x
// and w 16-byte aligned. Errors: kestrel::Error.
void check_gemv_operands(const char* op, const ProjectionOperands& a);
void skinny_gemm(const SkinnyGemmArgs& args, cudaStream_t stream);

// Streaming GEMV for decode steps of one or two tokens (stream_gemv.cuh has the design): y = a(x) .
// W^T with one block per SM, each streaming a contiguous range of whole rows of W through a
// cp.async ring in shared memory, and its first stages requested before the previous kernel
// finishes (PDL). Operands as for skinny_gemm (ProjectionOperands: x rows x_stride apart, SwiGLU
// input [gate | up] rows of 2 n_in with bf16 output, f32 or bf16 y [n_tokens, n_out]), with
// n_in a multiple of 2048 up to kStreamGemvMaxIn and at most kStreamGemvMaxRowsPerBlock rows per
// block. f32 accumulation; the sum over a row's partial sums is in a fixed order (deterministic).
// blocks (0: the SM count) and stages (0: kStreamGemvDefaultStages; else 3, 4 or 6 stages of 32 KB;
// 3 asks for two blocks per SM)
// are for tests and benchmarks. Errors: kestrel::Error for an unsupported shape
// (stream_gemv_supports), the operand errors of skinny_gemm, or a fused norm with a missing,
// misaligned or aliased operand. Never synchronises.
constexpr int64_t kStreamGemvMaxTokens = 2;
constexpr int64_t kStreamGemvMaxIn = 16384;
constexpr int64_t kStreamGemvMaxRowsPerBlock = 256;
constexpr int kStreamGemvDefaultStages = 4;
// Fused input norm (norm_residual_in set): x is not read; the input is instead h =
// RMSNorm(norm_residual_in + norm_add) * norm_weight rounded to bf16, with add_rms_norm's
// arithmetic but its sum of squares in another order (h may differ by a bf16 ulp),
// and norm_residual_in + norm_add is written to norm_residual_out (another buffer). residual
// [n_tokens, n_in] f32, add [n_tokens, n_in] bf16 or null, weight [n_in] bf16; bf16 output only.
// The head of the weights the next streamed projection reads, brought into L2 by this one once
// its own last bytes are requested, so that memory stays busy between the two kernels (this one's
// tail, the next one's launch, input and first round trip) instead of idling. Block b of this
// kernel prefetches bytes [b x block_stride, min(b x block_stride + bytes, total)) from base: the
// rows the next kernel's block b streams first (stream_prefetch_of). base null: none.
struct StreamPrefetch {
  const void* base = nullptr;
  int64_t block_stride = 0;  // bytes between two blocks' row ranges in the next kernel
  int64_t total = 0;         // bytes of the next weight
  int64_t bytes = 0;         // bytes a block prefetches
};
// The prefetch descriptor of a streamed weight of n_out rows of row_bytes bytes (each streaming
// GEMV gives its blocks ceil(n_out / SMs) whole rows), `bytes` a block (0: none).
StreamPrefetch stream_prefetch_of(const void* w, int64_t n_out, int64_t row_bytes, int64_t bytes);

struct StreamGemvArgs : ProjectionOperands {
  int blocks = 0;
  int stages = 0;
  const float* norm_residual_in = nullptr;
  const bf16* norm_add = nullptr;
  const bf16* norm_weight = nullptr;
  float* norm_residual_out = nullptr;
  float norm_eps = 1e-5f;
  // The next projection's weights, into L2 at this one's end: the FP8 and INT4 (W4A16) kernels
  // only (the bf16 one measured no faster with it).
  StreamPrefetch next = {};
};
bool stream_gemv_supports(int64_t n_tokens, int64_t n_in, int64_t n_out, int blocks = 0, int stages = 0);
void stream_gemv(const StreamGemvArgs& args, cudaStream_t stream);

// Token sampling, one token per logits row, with the CPU Sampler's semantics (src/sampling/) for
// chains without logit_bias and penalties (Sampler::device_compatible()):
// - temperature <= 0 (0 = greedy): the argmax, lowest id on ties;
// - otherwise top_k, then top_p (Holtzman et al. 2019, "The Curious Case of Neural Text
//   Degeneration": the shortest rank-order prefix whose softmax mass, over what top_k kept, is
//   >= top_p), then min_p (Nguyen et al. 2024, "Turning Up the Heat: Min-p Sampling for Creative
//   and Coherent LLM Outputs": keep logit >= max + ln(min_p)), then temperature, then the
//   inverse-CDF draw with `uniform`, in the order the CPU candidate list has at that point: rank
//   order (descending logit, lower id first on ties) when top_k or top_p cut, else id order.
//   top_k <= 0 or >= n_vocab, top_p >= 1 and min_p <= 0 are off, as on the CPU.
// For identical logits and uniform the token is kestrel::Sampler's, except when float rounding
// puts a decision within about 1e-6 of its boundary (the draw's target near a CDF step, a top_p
// prefix mass near top_p, a logit within an ulp of the min_p threshold). Deterministic: the same
// inputs give the same tokens on every run (no floating-point atomics).
// logits [n_rows, n_vocab] f32; params [n_rows]; tokens [n_rows] int32 out: a token id, or -1 for a
// row with a NaN logit, or whose largest logit is +inf or -inf (no distribution; the CPU Sampler
// throws for both). n_vocab <= INT32_MAX. masks: [n_rows, (n_vocab + 31) / 32] uint32, bit id % 32 of
// word id / 32 set = token id allowed (grammar::bitmask_words' layout), read only for the rows with
// params.masked (null when no row has): a disallowed token counts as -inf before the chain, as
// grammar::apply_token_bitmask makes it on the host; the logits are not written.
// workspace: sampling_workspace_bytes(n_rows, n_vocab) bytes (0 today; may be null then).
// Errors: kestrel::Error if n_rows < 0, n_vocab <= 0 or n_vocab > INT32_MAX.
// Algorithm and costs: sampling.cuh.
struct SampleParams {
  float temperature;  // 0 = greedy
  int32_t top_k;      // 0 = off
  float top_p;        // 1 = off
  float min_p;        // 0 = off
  double uniform;     // the draw, in [0, 1): Sampler::take_uniform(); unused when greedy
  int32_t masked;     // 1: the row's mask in `masks` applies
};
size_t sampling_workspace_bytes(int64_t n_rows, int64_t n_vocab);
void sample_tokens(const float* logits, const SampleParams* params, int64_t n_rows, int64_t n_vocab,
                   int32_t* tokens, void* workspace, cudaStream_t stream, const uint32_t* masks = nullptr);

}  // namespace kestrel::cuda
