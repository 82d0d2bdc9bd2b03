// A weight matrix as a quantized Hugging Face checkpoint stores it (GPTQ, AWQ, FP8), viewed in the
// mapped safetensors files, and the one exact dequantizer of those layouts.
//
// K = in_features, N = out_features; the matrix is W [N, K] (nn.Linear's layout), y = W x. All
// int32 words are read as uint32; P = 32 / bits values per word.
//  - GPTQ v1 (AutoGPTQ qlinear_cuda_old pack / GPTQModel checkpoint_format gptq): qweight int32
//    [K / P, N], q[k, n] = qweight[k / P, n] >> (bits (k % P)) & mask; qzeros int32
//    [n_groups, N / P], zero[g, n] = (qzeros[g, n / P] >> (bits (n % P)) & mask) + 1 (stored minus
//    one); scales [n_groups, N]; g_idx int32 [K] (act order: any map with group_size members per
//    group; qweight rows stay in input order). W[n, k] = float32(scales[g, n]) * (q[k, n] - zero[g, n])
//    with g = g_idx[k].
//  - AWQ GEMM (AutoAWQ WQLinear_GEMM): qweight int32 [K, N / 8] input-major; column n = 8c + j in
//    nibble REV[j] of word c, REV = {0, 4, 1, 5, 2, 6, 3, 7} (packing order {0, 2, 4, 6, 1, 3, 5, 7});
//    qzeros int32 [K / G, N / 8] packed the same way, stored as is; scales [K / G, N].
//    W[n, k] = (q[k, n] - zero[k / G, n]) * float32(scales[k / G, n]).
//  - FP8 (compressed-tensors float-quantized, quant_method fp8): weight float8_e4m3fn [N, K],
//    scales f32 / bf16 / f16 [ceil(N / block_n), ceil(K / block_k)] (per tensor: one block of the
//    whole matrix; per channel: blocks of 1 x K; DeepSeek-V3's weight_scale_inv: 128 x 128, edge
//    blocks partial). W[n, k] = float32(weight[n, k]) * float32(scales[n / block_n, k / block_k]).
// Every product is one float32 multiply (exact for GPTQ / AWQ: an 11-bit fp16 mantissa times a
// small integer), so the values equal transformers' float32 dequantization bit for bit.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"

namespace kestrel {

class SafetensorsCheckpoint;
struct QuantConfig;

enum class QuantFormat : uint8_t { GptqV1, AwqGemm, Fp8 };

struct QuantizedMatrix {
  QuantFormat format = QuantFormat::Fp8;
  std::string name;              // the HF module ("model.layers.0.mlp.down_proj"), for errors
  int64_t n_in = 0, n_out = 0;   // K, N
  int32_t bits = 0;              // GPTQ / AWQ: 4 or 8
  int64_t group_size = 0;        // GPTQ / AWQ: inputs per group (K for one group per row)
  int64_t n_groups = 0;          // GPTQ / AWQ: rows of qzeros and scales
  const uint8_t* qweight = nullptr;  // GPTQ int32 [K / P, N]; AWQ int32 [K, N / 8]
  const uint8_t* qzeros = nullptr;   // int32 [n_groups, N / P]
  const uint8_t* g_idx = nullptr;    // GPTQ int32 [K], values in [0, n_groups); null: k / group_size
  const uint8_t* weight = nullptr;   // FP8 e4m3fn [N, K]
  const uint8_t* scales = nullptr;   // see the layouts above
  GgmlType scale_type = GgmlType::F32;  // F32, F16 or BF16, from the safetensors header
  int64_t block_n = 0, block_k = 0;     // FP8: rows x inputs sharing one scale

  // Scale columns per scale row (FP8: ceil(K / block_k); GPTQ / AWQ: N).
  int64_t scale_cols() const { return format == QuantFormat::Fp8 ? (n_in + block_k - 1) / block_k : n_out; }
};

// Element i of the scales tensor (row-major over scale_cols() columns) as float32, exactly.
float scale_at(const QuantizedMatrix& m, int64_t i);

// Rows [row0, row0 + n_rows) of W as float32, written to out [n_rows, K]. The matrix must have
// passed read_quantized_matrix's checks (reads stay inside the tensors it checked).
void dequantize_rows(const QuantizedMatrix& m, int64_t row0, int64_t n_rows, float* out);

// The quantized matrix of HF module `prefix` in `ckpt` as `cfg` describes it, K = n_in, N = n_out:
// GPTQ prefix.{qweight, qzeros, scales, g_idx}; AWQ prefix.{qweight, qzeros, scales}; FP8
// prefix.weight + prefix.weight_scale (weight_scale_inv for block fp8). `used` receives the
// tensor names read, `bytes` their sizes. Throws kestrel::Error naming the file and tensor for a
// missing tensor, a wrong dtype (int32 words, F32 / F16 / BF16 scales, float8_e4m3fn weights) or
// shape (K or N not a multiple of the packing, scales not one row per group or block), a g_idx
// value outside [0, n_groups), a g_idx other than k / group_size without desc_act, and misaligned
// data. Scale values are not checked (a NaN scale gives NaN weights, as in transformers).
QuantizedMatrix read_quantized_matrix(const SafetensorsCheckpoint& ckpt, const std::string& prefix, const QuantConfig& cfg,
                                      int64_t n_in, int64_t n_out, std::vector<std::string>& used, uint64_t& bytes);

// The quantized matrices of a loaded checkpoint, each with a float32 host copy [N, K] that the
// CPU kernels read. The copies are allocated when a matrix is added (address space only: nothing
// is written) and filled by make_host(), which the CPU backend asks for through
// LlamaModel::ensure_host_weights; a GPU upload dequantizes from the checkpoint instead, so its
// host copies are never touched.
class QuantizedWeights {
 public:
  // Keeps `m` and returns the view of its host copy: type F32, data the copy, quant = the kept
  // matrix.
  WeightView add(QuantizedMatrix m);
  // Dequantizes every matrix into its host copy (once; thread-safe).
  void make_host();
  // Zeroed memory of `bytes` bytes (8-byte aligned) that lives as long as this object: the tensors
  // of matrices quantized at load (model/load_quantize.h), which no file holds.
  uint8_t* hold(size_t bytes);
  size_t size() const { return m_.size(); }

 private:
  struct Entry {
    QuantizedMatrix m;
    std::unique_ptr<float[]> host;  // [N, K]
  };
  std::vector<std::unique_ptr<Entry>> m_;
  std::vector<std::unique_ptr<uint64_t[]>> held_;
  std::mutex mu_;
  bool on_host_ = false;
};

}  // namespace kestrel
