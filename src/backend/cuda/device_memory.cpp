#include "backend/cuda/device_memory.h"

#include <algorithm>
#include <cstring>

#include "backend/cpu/matmul.h"
#include "backend/cuda/fill_ops.h"
#include "core/dtype.h"
#include "model/quantized_matrix.h"

namespace kestrel::cuda {

DevMem WeightUploader::matrices(std::span<const WeightView* const> ws) {
  size_t total = 0;
  for (const WeightView* w : ws) {
    if (w->n_in != ws.front()->n_in) throw Error("CUDA upload: stacked matrices differ in width");
    if (w->quant == nullptr && !w->type.self_contained())
      throw Error("CUDA upload: a " + std::string(type_name(w->type.storage)) +
                  " matrix with scales stored apart is not supported");
    total += static_cast<size_t>(w->n_out * w->n_in) * 2;
  }
  DevMem d(total);
  auto* dst = d.as<unsigned char>();
  for (const WeightView* w : ws) {
    const size_t row_bytes = static_cast<size_t>(w->n_in) * 2;
    if (w->random != nullptr) {  // generated weights: made on the device, nothing copied
      fill_random_bf16(reinterpret_cast<__nv_bfloat16*>(dst), w->n_out * w->n_in, 0, *w->random, stream_);
      dst += static_cast<size_t>(w->n_out) * row_bytes;
      continue;
    }
    const int64_t rows_per_stage = std::max<int64_t>(1, static_cast<int64_t>(kStageBytes / row_bytes));
    if (static_cast<size_t>(rows_per_stage) * row_bytes > kStageBytes)
      throw Error("CUDA upload: a row of " + std::to_string(row_bytes) + " bytes exceeds the staging buffer");
    for (int64_t r0 = 0; r0 < w->n_out; r0 += rows_per_stage) {
      const int64_t n_rows = std::min(rows_per_stage, w->n_out - r0);
      Stage& s = stages_[next_++ % stages_.size()];
      KESTREL_CUDA_CHECK(cudaEventSynchronize(s.done));  // its previous copy has finished
      auto* out = static_cast<uint16_t*>(s.host);
      pool_.parallel_for(n_rows, 16, [&](int64_t begin, int64_t end) {
        if (w->quant == nullptr && w->type.storage == GgmlType::BF16) {
          std::memcpy(out + begin * w->n_in, w->row(r0 + begin), static_cast<size_t>(end - begin) * row_bytes);
          return;
        }
        std::vector<float> row(static_cast<size_t>(w->n_in));
        for (int64_t r = begin; r < end; ++r) {
          // A quantized checkpoint's matrix: from its stored tensors, never its host copy.
          if (w->quant != nullptr) {
            dequantize_rows(*w->quant, r0 + r, 1, row.data());
          } else {
            cpu::dequantize_row(w->type.storage, w->row(r0 + r), row.data(), w->n_in);
          }
          uint16_t* o = out + r * w->n_in;
          for (int64_t i = 0; i < w->n_in; ++i) o[i] = fp32_to_bf16(row[static_cast<size_t>(i)]);
        }
      });
      const size_t bytes = static_cast<size_t>(n_rows) * row_bytes;
      KESTREL_CUDA_CHECK(cudaMemcpyAsync(dst, s.host, bytes, cudaMemcpyHostToDevice, stream_));
      KESTREL_CUDA_CHECK(cudaEventRecord(s.done, stream_));
      dst += bytes;
    }
  }
  return d;
}

DevMem upload(const void* host, size_t bytes) {
  DevMem d(bytes);
  KESTREL_CUDA_CHECK(cudaMemcpy(d.as<void>(), host, bytes, cudaMemcpyHostToDevice));
  return d;
}

DevMem upload_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> h(v.size());
  for (size_t i = 0; i < v.size(); ++i) h[i] = fp32_to_bf16(v[i]);
  return upload(h.data(), h.size() * 2);
}

DevMem upload_f32(const std::vector<float>& v) { return upload(v.data(), v.size() * sizeof(float)); }

}  // namespace kestrel::cuda
