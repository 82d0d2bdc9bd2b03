// GGUF blocks in place (gguf_ops.h): the layout's tables and host repack, and the launchers of
// gguf_gemv.cuh's kernels.
#include "backend/cuda/gguf_gemv.cuh"

#include <cstring>
#include <string>

#include "backend/cuda/gguf_ops.h"

namespace kestrel::cuda {

bool gguf_quant_supported(int32_t type) {
  switch (static_cast<GgufQuant>(type)) {
    case GgufQuant::Q4_0: case GgufQuant::Q4_1: case GgufQuant::Q5_0: case GgufQuant::Q8_0:
    case GgufQuant::Q4_K: case GgufQuant::Q5_K: case GgufQuant::Q6_K: return true;
  }
  return false;
}

int64_t gguf_block_elems(GgufQuant t) {
  return t == GgufQuant::Q4_K || t == GgufQuant::Q5_K || t == GgufQuant::Q6_K ? 256 : 32;
}

// ggml's block sizes: Q4_0 d + 16 qs; Q4_1 d, m + 16 qs; Q5_0 d + 4 qh + 16 qs; Q8_0 d + 32 qs;
// Q4_K d, dmin + 12 scales + 128 qs; Q5_K the same + 32 qh; Q6_K 128 ql + 64 qh + 16 scales + d.
int64_t gguf_block_bytes(GgufQuant t) {
  switch (t) {
    case GgufQuant::Q4_0: return 18;
    case GgufQuant::Q4_1: return 20;
    case GgufQuant::Q5_0: return 22;
    case GgufQuant::Q8_0: return 34;
    case GgufQuant::Q4_K: return 144;
    case GgufQuant::Q5_K: return 176;
    case GgufQuant::Q6_K: return 210;
  }
  return 0;
}

int64_t gguf_body_bytes(GgufQuant t) {
  switch (t) {
    case GgufQuant::Q4_0: return kGgufBody<GgufQuant::Q4_0>;
    case GgufQuant::Q4_1: return kGgufBody<GgufQuant::Q4_1>;
    case GgufQuant::Q5_0: return kGgufBody<GgufQuant::Q5_0>;
    case GgufQuant::Q8_0: return kGgufBody<GgufQuant::Q8_0>;
    case GgufQuant::Q4_K: return kGgufBody<GgufQuant::Q4_K>;
    case GgufQuant::Q5_K: return kGgufBody<GgufQuant::Q5_K>;
    case GgufQuant::Q6_K: return kGgufBody<GgufQuant::Q6_K>;
  }
  return 0;
}

bool gguf_layout_supports(GgufQuant t, int64_t n_in) {
  return gguf_quant_supported(static_cast<int32_t>(t)) && n_in > 0 && n_in % gguf_block_elems(t) == 0 &&
         n_in <= 0x7fffffff;
}

void gguf_repack_rows(GgufQuant t, const uint8_t* src, int64_t n_rows, int64_t n_in, uint8_t* body, uint16_t* d) {
  const int64_t nb = n_rows * (n_in / gguf_block_elems(t)), bb = gguf_block_bytes(t), body_b = gguf_body_bytes(t);
  if (!gguf_d_apart(t)) {
    std::memcpy(body, src, static_cast<size_t>(nb * bb));
    return;
  }
  const int64_t d_at = t == GgufQuant::Q6_K ? 208 : 0;  // where d sits in the GGUF block
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* blk = src + i * bb;
    std::memcpy(d + i, blk + d_at, 2);
    std::memcpy(body + i * body_b, blk + (d_at == 0 ? 2 : 0), static_cast<size_t>(body_b));
  }
}

namespace {

constexpr int kGemvU = 2, kGemvWarps = 8;

std::string shape_of(const GgufMatrix& w) {
  return "type " + std::to_string(static_cast<int>(w.type)) + ", n_in " + std::to_string(w.n_in) + ", n_out " +
         std::to_string(w.n_out);
}

template <GgufQuant T>
void launch_gemv(const GgufGemvArgs& a, int64_t y_stride, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(ceil_div(a.n_out, kSkinnyRows))), block(kGemvWarps * kWarpSize);
  const int nt = static_cast<int>(a.n_tokens), ni = static_cast<int>(a.n_in), no = static_cast<int>(a.n_out);
  if (a.swiglu) {
    auto* k = &gguf_gemv_kernel<T, kGemvU, kGemvWarps, true, false>;
    KESTREL_LAUNCH(k, grid, block, 0, stream, a.x, a.x_stride, a.wq.body, a.wq.d, a.y, y_stride, nt, ni, no);
  } else if (a.f32_out) {
    auto* k = &gguf_gemv_kernel<T, kGemvU, kGemvWarps, false, true>;
    KESTREL_LAUNCH(k, grid, block, 0, stream, a.x, a.x_stride, a.wq.body, a.wq.d, a.y, y_stride, nt, ni, no);
  } else {
    auto* k = &gguf_gemv_kernel<T, kGemvU, kGemvWarps, false, false>;
    KESTREL_LAUNCH(k, grid, block, 0, stream, a.x, a.x_stride, a.wq.body, a.wq.d, a.y, y_stride, nt, ni, no);
  }
  KESTREL_CUDA_CHECK_LAUNCH();
}

template <GgufQuant T>
void launch_dequantize(const GgufMatrix& w, bf16* out, int64_t out_stride, cudaStream_t stream) {
  const int64_t n = w.n_out * (w.n_in / 32);
  const dim3 grid(static_cast<unsigned>(ceil_div(n, 256))), block(256);
  auto* k = &dequantize_gguf_kernel<T>;
  KESTREL_LAUNCH(k, grid, block, 0, stream, w.body, w.d, static_cast<int>(w.n_in), w.n_out, out, out_stride);
  KESTREL_CUDA_CHECK_LAUNCH();
}

template <GgufQuant T>
void launch_embedding(const GgufMatrix& w, const int32_t* ids, int64_t n_tokens, float scale, float* out,
                      int64_t vocab_begin, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(n_tokens)), block(128);
  auto* k = &gguf_embedding_kernel<T>;
  KESTREL_LAUNCH(k, grid, block, 0, stream, w.body, w.d, ids, static_cast<int>(w.n_in), scale, out, vocab_begin,
                 w.n_out);
  KESTREL_CUDA_CHECK_LAUNCH();
}

// f(std::integral_constant-like tag) for the matrix's type.
template <template <GgufQuant> class F, class... Args>
void by_type(GgufQuant t, Args&&... args) {
  switch (t) {
    case GgufQuant::Q4_0: return F<GgufQuant::Q4_0>::run(args...);
    case GgufQuant::Q4_1: return F<GgufQuant::Q4_1>::run(args...);
    case GgufQuant::Q5_0: return F<GgufQuant::Q5_0>::run(args...);
    case GgufQuant::Q8_0: return F<GgufQuant::Q8_0>::run(args...);
    case GgufQuant::Q4_K: return F<GgufQuant::Q4_K>::run(args...);
    case GgufQuant::Q5_K: return F<GgufQuant::Q5_K>::run(args...);
    case GgufQuant::Q6_K: return F<GgufQuant::Q6_K>::run(args...);
  }
}
template <GgufQuant T>
struct Gemv {
  static void run(const GgufGemvArgs& a, int64_t y_stride, cudaStream_t s) { launch_gemv<T>(a, y_stride, s); }
};
template <GgufQuant T>
struct Dequantize {
  static void run(const GgufMatrix& w, bf16* out, int64_t stride, cudaStream_t s) { launch_dequantize<T>(w, out, stride, s); }
};
template <GgufQuant T>
struct Embedding {
  static void run(const GgufMatrix& w, const int32_t* ids, int64_t n, float scale, float* out, int64_t vocab_begin,
                  cudaStream_t s) {
    launch_embedding<T>(w, ids, n, scale, out, vocab_begin, s);
  }
};

void check_matrix(const char* op, const GgufMatrix& w) {
  if (!gguf_layout_supports(w.type, w.n_in) || w.n_out <= 0 || w.n_out > 0x7fffffff)
    throw Error(std::string(op) + ": unsupported matrix (" + shape_of(w) + ")");
  if (w.body == nullptr || (gguf_d_apart(w.type) && w.d == nullptr))
    throw Error(std::string(op) + ": no block data");
  if (reinterpret_cast<uintptr_t>(w.body) % 4 != 0 || reinterpret_cast<uintptr_t>(w.d) % 2 != 0)
    throw Error(std::string(op) + ": block data not aligned");
}

}  // namespace

bool gguf_gemv_supports(int64_t n_tokens, const GgufMatrix& w) {
  return n_tokens >= 1 && n_tokens <= kGgufGemvMaxTokens && gguf_layout_supports(w.type, w.n_in) && w.n_out > 0 &&
         w.n_out <= 0x7fffffff;
}

void gguf_gemv(const GgufGemvArgs& a, cudaStream_t stream) {
  if (!gguf_gemv_supports(a.n_tokens, a.wq) || a.n_in != a.wq.n_in || a.n_out != a.wq.n_out)
    throw Error("gguf_gemv: unsupported shape (n_tokens " + std::to_string(a.n_tokens) + ", " + shape_of(a.wq) + ")");
  check_matrix("gguf_gemv", a.wq);
  const int64_t y_stride = a.y_stride == 0 ? a.n_out : a.y_stride;
  if (y_stride < a.n_out) throw Error("gguf_gemv: y_stride " + std::to_string(y_stride) + " is below n_out");
  ProjectionOperands checked = a;
  checked.w = a.x;  // the weights are checked above
  check_gemv_operands("gguf_gemv", checked);
  by_type<Gemv>(a.wq.type, a, y_stride, stream);
}

void dequantize_gguf(const GgufMatrix& w, bf16* out, int64_t out_stride, cudaStream_t stream) {
  check_matrix("dequantize_gguf", w);
  if (out_stride < w.n_in || out_stride % 4 != 0 || reinterpret_cast<uintptr_t>(out) % 8 != 0)
    throw Error("dequantize_gguf: output stride " + std::to_string(out_stride) + " or alignment unsupported");
  by_type<Dequantize>(w.type, w, out, out_stride, stream);
}

void gguf_embedding(const GgufMatrix& w, const int32_t* ids, int64_t n_tokens, float scale, float* out,
                    cudaStream_t stream, int64_t vocab_begin) {
  check_matrix("gguf_embedding", w);
  if (n_tokens <= 0 || ids == nullptr || out == nullptr)
    throw Error("gguf_embedding: bad shape (n_tokens " + std::to_string(n_tokens) + ")");
  by_type<Embedding>(w.type, w, ids, n_tokens, scale, out, vocab_begin, stream);
}

}  // namespace kestrel::cuda
