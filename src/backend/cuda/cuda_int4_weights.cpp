// INT4 projections of the CUDA backend (W4A16): GPTQ v1 and AWQ GEMM 4-bit checkpoint matrices
// repacked on the host into int4_ops.h's layout and uploaded, and the kernel choice of a pass.
// The checkpoint formulas are model/quantized_matrix.h's; the codes, scales and zeros are taken
// as stored (no dequantization), so the device weights are exact.
#include <algorithm>
#include <cstring>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_model_runner.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "model/quantized_matrix.h"

namespace kestrel::cuda_runner {

namespace {

uint32_t word_at(const uint8_t* base, int64_t i) {
  uint32_t w;
  std::memcpy(&w, base + i * 4, sizeof w);
  return w;
}
uint16_t half_at(const uint8_t* base, int64_t i) {
  uint16_t h;
  std::memcpy(&h, base + i * 2, sizeof h);
  return h;
}

// The dense projections that may take the int4 path (as the FP8 ones).
bool int4_role(WeightRole r) {
  switch (r) {
    case WeightRole::Qkv: case WeightRole::Q: case WeightRole::K: case WeightRole::V: case WeightRole::AttnOut:
    case WeightRole::GateUp: case WeightRole::Gate: case WeightRole::Up: case WeightRole::Down: return true;
    default: return false;
  }
}

// AWQ: column 8 c + j of a packed word is nibble kAwqReverse[j] (packing order 0, 2, 4, 6, 1, 3, 5, 7).
constexpr int kAwqReverse[8] = {0, 4, 1, 5, 2, 6, 3, 7};

// Codes of rows [n0, n0 + n_rows) of m (n0, n_rows multiples of 8) in input-channel order:
// q [n_rows, K], one code per byte.
void unpack_codes(const QuantizedMatrix& m, int64_t n0, int64_t n_rows, uint8_t* q) {
  const int64_t K = m.n_in, N = m.n_out;
  if (m.format == QuantFormat::GptqV1) {  // qweight [K / 8, N]: nibble k % 8 of word (k / 8, n)
    for (int64_t kw = 0; kw < K / 8; ++kw)
      for (int64_t n = n0; n < n0 + n_rows; ++n) {
        const uint32_t w = word_at(m.qweight, kw * N + n);
        uint8_t* dst = q + (n - n0) * K + 8 * kw;
        for (int i = 0; i < 8; ++i) dst[i] = static_cast<uint8_t>((w >> (4 * i)) & 0xFu);
      }
    return;
  }
  for (int64_t k = 0; k < K; ++k)  // AWQ qweight [K, N / 8]
    for (int64_t c = n0 / 8; c < (n0 + n_rows) / 8; ++c) {
      const uint32_t w = word_at(m.qweight, k * (N / 8) + c);
      for (int j = 0; j < 8; ++j) q[(8 * c + j - n0) * K + k] = static_cast<uint8_t>((w >> (4 * kAwqReverse[j])) & 0xFu);
    }
}

// The zero point z of (group g, row n): GPTQ v1 stores z - 1, AWQ z.
int zero_at(const QuantizedMatrix& m, int64_t g, int64_t n) {
  const uint32_t w = word_at(m.qzeros, g * (m.n_out / 8) + n / 8);
  if (m.format == QuantFormat::GptqV1) return static_cast<int>((w >> (4 * (n % 8))) & 0xFu) + 1;
  return static_cast<int>((w >> (4 * kAwqReverse[n % 8])) & 0xFu);
}

}  // namespace

bool CudaModelRunner::upload_int4(WeightRole role, std::span<const WeightView* const> views, DeviceWeight& dw) {
  if (fp8_weights_ || hp_.mla.enabled() || !int4_role(role) || views.empty()) return false;
  const QuantizedMatrix* first = views[0]->quant;
  if (first == nullptr) return false;
  const int64_t n_in = first->n_in, group = first->group_size;
  int64_t rows = 0;
  std::vector<int32_t> perm;
  for (size_t i = 0; i < views.size(); ++i) {
    const QuantizedMatrix* q = views[i]->quant;
    if (q == nullptr || (q->format != QuantFormat::GptqV1 && q->format != QuantFormat::AwqGemm) || q->bits != 4 ||
        q->n_in != n_in || q->group_size != group || q->scale_type != first->scale_type ||
        (q->scale_type != GgmlType::F16 && q->scale_type != GgmlType::BF16) || q->n_out % 8 != 0)
      return false;
    // Act order: one permutation for the stacked parts (they read the same input).
    std::vector<int32_t> p;
    if (q->g_idx != nullptr) {
      std::vector<int32_t> g_idx(static_cast<size_t>(n_in));
      std::memcpy(g_idx.data(), q->g_idx, g_idx.size() * 4);
      if (!cuda::int4_act_order_perm(g_idx.data(), n_in, group, p)) return false;
    }
    if (i == 0) perm = std::move(p);
    else if (p != perm) return false;
    rows += q->n_out;
  }
  if (!cuda::int4_layout_supports(n_in, rows, group)) return false;

  const int64_t n_groups = n_in / group, words = n_in / 8;
  std::vector<uint32_t> codes(static_cast<size_t>(rows * words)), meta(static_cast<size_t>(rows * n_groups));
  ThreadPool pool(0);
  int64_t at = 0;
  for (const WeightView* v : views) {
    const QuantizedMatrix& m = *v->quant;
    constexpr int64_t kBlock = 64;  // rows per task (a multiple of 8, as AWQ packs 8 columns a word)
    const int64_t n_blocks = (m.n_out + kBlock - 1) / kBlock;
    pool.parallel_for(n_blocks, 1, [&](int64_t b0, int64_t b1) {
      std::vector<uint8_t> q(static_cast<size_t>(kBlock * n_in));
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t n0 = b * kBlock, nr = std::min(kBlock, m.n_out - n0);
        unpack_codes(m, n0, nr, q.data());
        cuda::pack_int4_rows(q.data(), nr, n_in, perm.empty() ? nullptr : perm.data(),
                             codes.data() + (at + n0) * words);
        for (int64_t n = n0; n < n0 + nr; ++n)
          for (int64_t g = 0; g < n_groups; ++g)
            meta[static_cast<size_t>((at + n) * n_groups + g)] =
                cuda::int4_meta_word(half_at(m.scales, g * m.n_out + n), zero_at(m, g, n));
      }
    });
    at += m.n_out;
  }
  dw.w = cuda::upload(codes.data(), codes.size() * 4);
  dw.meta = cuda::upload(meta.data(), meta.size() * 4);
  if (!perm.empty()) dw.perm = cuda::upload(perm.data(), perm.size() * 4);
  dw.n_in = n_in;
  dw.n_out = rows;
  dw.group_size = group;
  dw.scale_f16 = first->scale_type == GgmlType::F16;
  dw.int4 = true;
  ++n_int4_;
  return true;
}

void CudaModelRunner::reserve_int4_scratch() {
  int64_t w_elems = 0, x_elems = 0;
  for (const Layer& L : layers_)
    for (const DeviceWeight& dw : L.by_role) {
      if (!dw.int4) continue;
      w_elems = std::max(w_elems, dw.n_in * dw.n_out);
      if (dw.perm.bytes() > 0) x_elems = std::max(x_elems, cuda::kInt4SkinnyMaxTokens * dw.n_in);
    }
  if (w_elems > 0) int4_w_.reset(static_cast<size_t>(w_elems) * 2);
  if (x_elems > 0) int4_x_.reset(static_cast<size_t>(x_elems) * 2);
}

void CudaModelRunner::project_int4(const bf16* x, const DeviceWeight& W, bf16* y, int64_t n, bool swiglu) {
  const cuda::Int4Matrix m = W.int4_matrix();
  if (uses_stream_gemv_narrow(W, n)) {
    cuda::StreamGemvArgs a{{x, swiglu ? 2 * W.n_in : W.n_in, nullptr, y, n, W.n_in, W.n_out, swiglu, false}};
    if (m.perm != nullptr) {
      cuda::int4_gather_columns(x, a.x_stride, m.perm, n, W.n_in, swiglu, int4_x_.as<bf16>(), stream_);
      a.x = int4_x_.as<bf16>();
      a.x_stride = W.n_in;
      a.swiglu = false;
    }
    stream_narrow(W, a);
    return;
  }
  if (n <= cuda::kInt4SkinnyMaxTokens) {
    cuda::SkinnyInt4Args a;
    static_cast<cuda::ProjectionOperands&>(a) = {x, swiglu ? 2 * W.n_in : W.n_in, nullptr, y, n, W.n_in, W.n_out,
                                                 swiglu, false};
    if (m.perm != nullptr) {
      cuda::int4_gather_columns(x, a.x_stride, m.perm, n, W.n_in, swiglu, int4_x_.as<bf16>(), stream_);
      a.x = int4_x_.as<bf16>();
      a.x_stride = W.n_in;
      a.swiglu = false;
    }
    a.w4 = m;
    cuda::skinny_gemm_int4(a, stream_);
    return;
  }
  cuda::dequantize_int4(m, int4_w_.as<bf16>(), stream_);
  project(x, int4_w_.as<bf16>(), y, false, n, W.n_in, W.n_out, swiglu);
}

}  // namespace kestrel::cuda_runner
