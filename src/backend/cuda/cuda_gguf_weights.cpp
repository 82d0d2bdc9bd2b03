// GGUF quantized matrices kept in their blocks on the device (--cuda-gguf-weights in-place,
// gguf_ops.h): the repack and upload of a projection, the embedding and the LM head, and the
// kernel choice of a pass. The blocks are moved, never dequantized, so the device holds the
// file's bytes; the kernels form the bf16 values the bf16 upload would hold.
#include <algorithm>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_model_runner.h"
#include "core/error.h"
#include "core/thread_pool.h"

namespace kestrel::cuda_runner {

namespace {

// The dense projections that may stay in place (as for FP8 and INT4).
bool gguf_role(WeightRole r) {
  switch (r) {
    case WeightRole::Qkv: case WeightRole::Q: case WeightRole::K: case WeightRole::V: case WeightRole::AttnOut:
    case WeightRole::GateUp: case WeightRole::Gate: case WeightRole::Up: case WeightRole::Down: return true;
    default: return false;
  }
}

bool in_place_type(const WeightView& v) {
  if (v.quant != nullptr || v.random != nullptr || v.data == nullptr) return false;
  const auto t = static_cast<int32_t>(v.type.storage);
  return v.type.self_contained() && cuda::gguf_quant_supported(t) &&
         cuda::gguf_layout_supports(static_cast<cuda::GgufQuant>(t), v.n_in) && v.n_out > 0;
}

}  // namespace

bool CudaModelRunner::upload_gguf(WeightRole role, std::span<const WeightView* const> views, DeviceWeight& dw,
                                  bool any_role) {
  if (!gguf_in_place_ || fp8_weights_ || hp_.mla.enabled() || (!any_role && !gguf_role(role)) || views.empty())
    return false;
  for (const WeightView* v : views)
    if (!in_place_type(*v) || v->n_in != views[0]->n_in) return false;
  const int64_t n_in = views[0]->n_in;
  ThreadPool pool(0);
  int64_t row0 = 0;
  for (size_t i = 0; i < views.size();) {
    // Consecutive parts of one type: one matrix, their rows back to back as in the file.
    size_t j = i + 1;
    while (j < views.size() && views[j]->type.storage == views[i]->type.storage) ++j;
    const auto t = static_cast<cuda::GgufQuant>(static_cast<int32_t>(views[i]->type.storage));
    const int64_t bpr = n_in / cuda::gguf_block_elems(t), body_b = cuda::gguf_body_bytes(t);
    int64_t rows = 0;
    for (size_t p = i; p < j; ++p) rows += views[p]->n_out;
    std::vector<uint8_t> body(static_cast<size_t>(rows * bpr * body_b));
    std::vector<uint16_t> d(cuda::gguf_d_apart(t) ? static_cast<size_t>(rows * bpr) : 0);
    int64_t at = 0;
    for (size_t p = i; p < j; ++p) {
      const WeightView& v = *views[p];
      constexpr int64_t kRows = 256;  // rows per task
      pool.parallel_for((v.n_out + kRows - 1) / kRows, 1, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) {
          const int64_t r0 = b * kRows, nr = std::min(kRows, v.n_out - r0);
          cuda::gguf_repack_rows(t, v.row(r0), nr, n_in, body.data() + (at + r0) * bpr * body_b,
                                 d.empty() ? nullptr : d.data() + (at + r0) * bpr);
        }
      });
      at += v.n_out;
    }
    GgufPart part;
    part.body = cuda::upload(body.data(), body.size());
    if (!d.empty()) part.d = cuda::upload(d.data(), d.size() * 2);
    part.m.type = t;
    part.m.body = part.body.as<uint8_t>();
    part.m.d = d.empty() ? nullptr : part.d.as<uint16_t>();
    part.m.n_in = n_in;
    part.m.n_out = rows;
    part.row0 = row0;
    row0 += rows;
    dw.gguf.push_back(std::move(part));
    ++n_gguf_;
    i = j;
  }
  dw.n_in = n_in;
  dw.n_out = row0;
  if (any_role) return true;
  // The scratch for batches above the GEMV's: the largest in-place projection, dequantized.
  const size_t need = static_cast<size_t>(dw.n_in * dw.n_out) * 2;
  if (need > gguf_w_.bytes()) gguf_w_.reset(need);
  return true;
}

void CudaModelRunner::project_gguf(const bf16* x, const DeviceWeight& W, void* y, int64_t n, bool swiglu,
                                   bool f32_out) {
  const int64_t x_stride = swiglu ? 2 * W.n_in : W.n_in, y_elem = f32_out ? 4 : 2;
  auto gemv = [&](const bf16* xs, void* ys, int64_t rows) {
    for (const GgufPart& p : W.gguf) {
      cuda::GgufGemvArgs a;
      static_cast<cuda::ProjectionOperands&>(a) = {
          xs, x_stride, nullptr, static_cast<unsigned char*>(ys) + p.row0 * y_elem, rows, W.n_in, p.m.n_out, swiglu,
          f32_out};
      a.wq = p.m;
      a.y_stride = W.n_out;
      cuda::gguf_gemv(a, stream_);
    }
  };
  if (n <= cuda::kGgufGemvMaxTokens) {
    gemv(x, y, n);
    return;
  }
  if (f32_out || gguf_w_.bytes() < static_cast<size_t>(W.n_in * W.n_out) * 2) {
    // The LM head (no scratch of its size): slices of the GEMV's token count, each reading W once.
    for (int64_t t0 = 0; t0 < n; t0 += cuda::kGgufGemvMaxTokens)
      gemv(x + t0 * x_stride, static_cast<unsigned char*>(y) + t0 * W.n_out * y_elem,
           std::min(cuda::kGgufGemvMaxTokens, n - t0));
    return;
  }
  for (const GgufPart& p : W.gguf) cuda::dequantize_gguf(p.m, gguf_w_.as<bf16>() + p.row0 * W.n_in, W.n_in, stream_);
  project(x, gguf_w_.as<bf16>(), y, f32_out, n, W.n_in, W.n_out, swiglu);
}

size_t CudaModelRunner::count_weight_bytes() const {
  auto of = [](const DeviceWeight& w) {
    size_t b = w.w.bytes() + w.b.bytes() + w.scale.bytes() + w.meta.bytes() + w.perm.bytes();
    for (const GgufPart& p : w.gguf) b += p.body.bytes() + p.d.bytes();
    return b;
  };
  size_t total = embd_.bytes() + lm_head_.bytes() + out_norm_.bytes() + of(embd_q_) + of(head_q_);
  for (const Layer& L : layers_)
    for (const DeviceWeight& w : L.by_role) total += of(w);
  for (const MlaLayer& m : mla_) total += m.in.bytes() + m.uk_t.bytes() + m.uv.bytes();
  return total;
}

}  // namespace kestrel::cuda_runner
