#include "backend/cuda/gemm.h"

#include <cublasLt.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "backend/cuda/cublaslt_api.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/fp8_ops.h"

namespace kestrel::cuda {

namespace {

const char* status_name(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_LICENSE_ERROR: return "CUBLAS_STATUS_LICENSE_ERROR";
    default: return "unknown cuBLAS status";
  }
}

[[noreturn]] void cublas_fail(cublasStatus_t s, const char* expr, const char* file, int line) {
  throw Error(std::string("cuBLASLt error: ") + status_name(s) + " (" + std::to_string(static_cast<int>(s)) +
              ") from " + expr + " at " + file + ":" + std::to_string(line));
}

}  // namespace

#define KESTREL_CUBLAS_CHECK(expr)                                                    \
  do {                                                                                \
    const cublasStatus_t kestrel_cublas_status_ = (expr);                             \
    if (kestrel_cublas_status_ != CUBLAS_STATUS_SUCCESS)                              \
      cublas_fail(kestrel_cublas_status_, #expr, __FILE__, __LINE__);                 \
  } while (0)

namespace {

// The descriptors and chosen algorithm of one shape; created and destroyed together.
struct GemmPlan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t w = nullptr, x = nullptr, y = nullptr;
  cublasLtMatmulAlgo_t algo{};
  std::vector<cublasLtMatmulAlgo_t> candidates;  // the heuristic's, best first (candidates[0] == first algo)
  bool tuned = false;
  bool split_k_added = false;  // tune() appended the split-K variants of the candidates

  GemmPlan() = default;
  GemmPlan(const GemmPlan&) = delete;
  GemmPlan& operator=(const GemmPlan&) = delete;
  ~GemmPlan() {
    if (y != nullptr) cublaslt_api().MatrixLayoutDestroy(y);
    if (x != nullptr) cublaslt_api().MatrixLayoutDestroy(x);
    if (w != nullptr) cublaslt_api().MatrixLayoutDestroy(w);
    if (desc != nullptr) cublaslt_api().MatmulDescDestroy(desc);
  }
};

struct Preference {
  cublasLtMatmulPreference_t pref = nullptr;
  Preference() { KESTREL_CUBLAS_CHECK(cublaslt_api().MatmulPreferenceCreate(&pref)); }
  ~Preference() { cublaslt_api().MatmulPreferenceDestroy(pref); }
  Preference(const Preference&) = delete;
  Preference& operator=(const Preference&) = delete;
};

}  // namespace

struct Gemm::Impl {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  std::map<std::tuple<int64_t, int64_t, int64_t, int>, std::unique_ptr<GemmPlan>> plans;

  // Fp8::kOuterScales: E4M3 operands with one f32 scale per row of W (A) and per token (B),
  // applied to the product (CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F), bf16 output. cuBLASLt's
  // heuristic finds no algorithm for outer-vector scaling unless the scale pointers are set
  // (cuBLAS 13.1, H200): the first call's are, and run_fp8 sets each call's before it runs.
  // Fp8::kUnscaled: E4M3 operands, no scales (the codes' product), bf16 output.
  enum class Fp8 { kNone, kOuterScales, kUnscaled };
  GemmPlan& plan(GemmOutput out, int64_t n_tokens, int64_t n_in, int64_t n_out, Fp8 fp8_mode = Fp8::kNone,
                 const float* w_scale = nullptr, const float* x_scale = nullptr) {
    const bool fp8 = fp8_mode != Fp8::kNone;
    const auto key = std::make_tuple(n_tokens, n_in, n_out, static_cast<int>(out) + 2 * static_cast<int>(fp8_mode));
    auto it = plans.find(key);
    if (it != plans.end()) return *it->second;
    auto p = std::make_unique<GemmPlan>();
    KESTREL_CUBLAS_CHECK(cublaslt_api().MatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t trans_w = CUBLAS_OP_T, trans_x = CUBLAS_OP_N;
    KESTREL_CUBLAS_CHECK(
        cublaslt_api().MatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &trans_w, sizeof trans_w));
    KESTREL_CUBLAS_CHECK(
        cublaslt_api().MatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &trans_x, sizeof trans_x));
    if (fp8_mode == Fp8::kOuterScales) {
      const cublasLtMatmulMatrixScale_t mode = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
      for (const auto attr : {CUBLASLT_MATMUL_DESC_A_SCALE_MODE, CUBLASLT_MATMUL_DESC_B_SCALE_MODE})
        KESTREL_CUBLAS_CHECK(cublaslt_api().MatmulDescSetAttribute(p->desc, attr, &mode, sizeof mode));
      KESTREL_CUBLAS_CHECK(
          cublaslt_api().MatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &w_scale, sizeof w_scale));
      KESTREL_CUBLAS_CHECK(
          cublaslt_api().MatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &x_scale, sizeof x_scale));
    }
    const cudaDataType_t in_type = fp8 ? CUDA_R_8F_E4M3 : CUDA_R_16BF;
    // Column-major views of the row-major tensors: W is [n_in, n_out] (ld n_in), x is
    // [n_in, n_tokens] (ld n_in), y is [n_out, n_tokens] (ld n_out).
    KESTREL_CUBLAS_CHECK(cublaslt_api().MatrixLayoutCreate(&p->w, in_type, static_cast<uint64_t>(n_in),
                                                    static_cast<uint64_t>(n_out), n_in));
    KESTREL_CUBLAS_CHECK(cublaslt_api().MatrixLayoutCreate(&p->x, in_type, static_cast<uint64_t>(n_in),
                                                    static_cast<uint64_t>(n_tokens), n_in));
    KESTREL_CUBLAS_CHECK(cublaslt_api().MatrixLayoutCreate(&p->y, out == GemmOutput::F32 ? CUDA_R_32F : CUDA_R_16BF,
                                                    static_cast<uint64_t>(n_out), static_cast<uint64_t>(n_tokens),
                                                    n_out));
    Preference pref;
    const uint64_t ws = workspace_bytes;
    KESTREL_CUBLAS_CHECK(cublaslt_api().MatmulPreferenceSetAttribute(pref.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                              &ws, sizeof ws));
    // run() checks 16-byte alignment, so the heuristic may rely on it (and no more).
    const uint32_t align = 16;
    for (const auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                            CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
      KESTREL_CUBLAS_CHECK(cublaslt_api().MatmulPreferenceSetAttribute(pref.pref, attr, &align, sizeof align));
    cublasLtMatmulHeuristicResult_t results[Gemm::kTuneCandidates]{};
    int n_results = 0;
    KESTREL_CUBLAS_CHECK(cublaslt_api().MatmulAlgoGetHeuristic(handle, p->desc, p->w, p->x, p->y, p->y, pref.pref,
                                                        Gemm::kTuneCandidates, results, &n_results));
    if (n_results == 0)
      throw Error("cuBLASLt has no algorithm for the GEMM n_tokens " + std::to_string(n_tokens) + ", n_in " +
                  std::to_string(n_in) + ", n_out " + std::to_string(n_out));
    for (int i = 0; i < n_results; ++i)
      if (results[i].state == CUBLAS_STATUS_SUCCESS) p->candidates.push_back(results[i].algo);
    if (p->candidates.empty()) throw Error("cuBLASLt's heuristic returned no usable algorithm");
    p->algo = p->candidates.front();
    return *plans.emplace(key, std::move(p)).first->second;
  }
};

Gemm::Gemm(size_t workspace_bytes) : impl_(std::make_unique<Impl>()) {
  KESTREL_CUBLAS_CHECK(cublaslt_api().Create(&impl_->handle));
  impl_->workspace_bytes = workspace_bytes;
  if (workspace_bytes > 0) {
    const cudaError_t err = cudaMalloc(&impl_->workspace, workspace_bytes);
    if (err != cudaSuccess) {
      cublaslt_api().Destroy(impl_->handle);
      KESTREL_CUDA_CHECK(err);
    }
  }
}

Gemm::~Gemm() {
  impl_->plans.clear();
  if (impl_->workspace != nullptr) (void)cudaFree(impl_->workspace);
  cublaslt_api().Destroy(impl_->handle);
}

size_t Gemm::cached_shapes() const { return impl_->plans.size(); }

std::vector<cublasLtMatmulAlgo_t> split_k_variants(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                                                   cublasLtMatrixLayout_t w, cublasLtMatrixLayout_t x,
                                                   cublasLtMatrixLayout_t y,
                                                   const std::vector<cublasLtMatmulAlgo_t>& candidates, int64_t n_in,
                                                   size_t workspace_bytes) {
  std::vector<cublasLtMatmulAlgo_t> out;
  for (const cublasLtMatmulAlgo_t& base : candidates) {
    int32_t supported = 0;
    uint32_t schemes = 0, current = 1;
    size_t written = 0;
    if (cublaslt_api().MatmulAlgoCapGetAttribute(&base, CUBLASLT_ALGO_CAP_SPLITK_SUPPORT, &supported, sizeof supported,
                                          &written) != CUBLAS_STATUS_SUCCESS ||
        supported == 0)
      continue;
    if (cublaslt_api().MatmulAlgoCapGetAttribute(&base, CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK, &schemes, sizeof schemes,
                                          &written) != CUBLAS_STATUS_SUCCESS ||
        (schemes & CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE) == 0)
      continue;
    if (cublaslt_api().MatmulAlgoConfigGetAttribute(&base, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &current, sizeof current,
                                             &written) != CUBLAS_STATUS_SUCCESS ||
        current > 1)
      continue;
    for (const int32_t slices : {2, 4, 8}) {
      if (n_in / slices < 256) break;
      cublasLtMatmulAlgo_t v = base;
      const uint32_t scheme = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
      cublasLtMatmulHeuristicResult_t check{};
      if (cublaslt_api().MatmulAlgoConfigSetAttribute(&v, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &slices, sizeof slices) !=
              CUBLAS_STATUS_SUCCESS ||
          cublaslt_api().MatmulAlgoConfigSetAttribute(&v, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &scheme, sizeof scheme) !=
              CUBLAS_STATUS_SUCCESS ||
          cublaslt_api().MatmulAlgoCheck(handle, desc, w, x, y, y, &v, &check) != CUBLAS_STATUS_SUCCESS ||
          check.workspaceSize > workspace_bytes)
        continue;
      out.push_back(v);
    }
  }
  return out;
}

int Gemm::tune(const bf16* x, const bf16* const* ws, size_t n_ws, void* y, GemmOutput out, int64_t n_tokens,
               int64_t n_in, int64_t n_out, cudaStream_t stream, bool split_k) {
  if (n_ws == 0) throw Error("gemm tune: no weight matrices");
  run(x, ws[0], y, out, n_tokens, n_in, n_out, stream);  // validates the arguments, creates the plan
  GemmPlan& p = impl_->plan(out, n_tokens, n_in, n_out);
  if (!p.split_k_added && split_k) {
    const auto extra = split_k_variants(impl_->handle, p.desc, p.w, p.x, p.y, p.candidates, n_in, impl_->workspace_bytes);
    p.candidates.insert(p.candidates.end(), extra.begin(), extra.end());
  }
  p.split_k_added = true;
  if (p.candidates.size() < 2) return 0;
  cudaEvent_t start = nullptr, stop = nullptr;
  KESTREL_CUDA_CHECK(cudaEventCreate(&start));
  KESTREL_CUDA_CHECK(cudaEventCreate(&stop));
  const float alpha = 1.0f, beta = 0.0f;
  std::vector<float> ms(p.candidates.size(), -1.0f);
  try {
    for (size_t c = 0; c < p.candidates.size(); ++c) {
      auto pass = [&]() {
        for (size_t i = 0; i < n_ws; ++i)
          if (cublaslt_api().Matmul(impl_->handle, p.desc, &alpha, ws[i], p.w, x, p.x, &beta, y, p.y, y, p.y,
                             &p.candidates[c], impl_->workspace, impl_->workspace_bytes,
                             stream) != CUBLAS_STATUS_SUCCESS)
            return false;
        return true;
      };
      if (!pass()) continue;  // an algorithm that cannot run this shape is skipped
      KESTREL_CUDA_CHECK(cudaEventRecord(start, stream));
      bool ok = pass() && pass();
      KESTREL_CUDA_CHECK(cudaEventRecord(stop, stream));
      KESTREL_CUDA_CHECK(cudaEventSynchronize(stop));
      if (ok) KESTREL_CUDA_CHECK(cudaEventElapsedTime(&ms[c], start, stop));
    }
  } catch (...) {
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    throw;
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  size_t best = 0;
  for (size_t c = 1; c < ms.size(); ++c)
    if (ms[c] > 0 && (ms[best] <= 0 || ms[c] < ms[best])) best = c;
  if (ms[0] > 0 && ms[best] > 0.97f * ms[0]) best = 0;  // keep the heuristic's choice unless clearly beaten
  p.algo = p.candidates[best];
  p.tuned = true;
  return static_cast<int>(best);
}

void Gemm::run(const bf16* x, const bf16* w, void* y, GemmOutput out, int64_t n_tokens, int64_t n_in, int64_t n_out,
               cudaStream_t stream) {
  if (n_tokens <= 0 || n_in <= 0 || n_out <= 0)
    throw Error("gemm: sizes must be positive (n_tokens " + std::to_string(n_tokens) + ", n_in " +
                std::to_string(n_in) + ", n_out " + std::to_string(n_out) + ")");
  for (const void* ptr : {static_cast<const void*>(x), static_cast<const void*>(w), static_cast<const void*>(y)})
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) throw Error("gemm: operand not 16-byte aligned");
  const GemmPlan& p = impl_->plan(out, n_tokens, n_in, n_out);
  const float alpha = 1.0f, beta = 0.0f;
  KESTREL_CUBLAS_CHECK(cublaslt_api().Matmul(impl_->handle, p.desc, &alpha, w, p.w, x, p.x, &beta, y, p.y, y, p.y, &p.algo,
                                      impl_->workspace, impl_->workspace_bytes, stream));
}

void Gemm::run_fp8_unscaled(const uint8_t* xq, const uint8_t* wq, bf16* y, int64_t n_tokens, int64_t n_in,
                            int64_t n_out, cudaStream_t stream) {
  if (n_tokens <= 0 || n_in <= 0 || n_out <= 0 || n_in % 16 != 0 || n_out % 8 != 0)
    throw Error("gemm fp8 unscaled: sizes must be positive, n_in a multiple of 16 and n_out of 8 (n_tokens " +
                std::to_string(n_tokens) + ", n_in " + std::to_string(n_in) + ", n_out " + std::to_string(n_out) + ")");
  for (const void* ptr : {static_cast<const void*>(xq), static_cast<const void*>(wq), static_cast<const void*>(y)})
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) throw Error("gemm fp8: operand not 16-byte aligned");
  const float alpha = 1.0f, beta = 0.0f;
  const GemmPlan& p = impl_->plan(GemmOutput::Bf16, n_tokens, n_in, n_out, Impl::Fp8::kUnscaled);
  KESTREL_CUBLAS_CHECK(cublaslt_api().Matmul(impl_->handle, p.desc, &alpha, wq, p.w, xq, p.x, &beta, y, p.y, y, p.y,
                                             &p.algo, impl_->workspace, impl_->workspace_bytes, stream));
}

void Gemm::run_fp8(const uint8_t* xq, const float* x_scale, const uint8_t* wq, const float* w_scale, bf16* y,
                   int64_t n_tokens, int64_t n_in, int64_t n_out, cudaStream_t stream) {
  if (n_tokens <= 0 || n_in <= 0 || n_out <= 0 || n_in % 16 != 0)
    throw Error("gemm fp8: sizes must be positive and n_in a multiple of 16 (n_tokens " + std::to_string(n_tokens) +
                ", n_in " + std::to_string(n_in) + ", n_out " + std::to_string(n_out) + ")");
  for (const void* ptr : {static_cast<const void*>(xq), static_cast<const void*>(wq), static_cast<const void*>(y)})
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) throw Error("gemm fp8: operand not 16-byte aligned");
  if (x_scale == nullptr || w_scale == nullptr) throw Error("gemm fp8: missing scales");
  if (fp8_unscaled(n_tokens, n_out)) {
    run_fp8_unscaled(xq, wq, y, n_tokens, n_in, n_out, stream);
    scale_fp8_product(y, x_scale, w_scale, n_tokens, n_out, stream);
    return;
  }
  const float alpha = 1.0f, beta = 0.0f;
  const GemmPlan& p = impl_->plan(GemmOutput::Bf16, n_tokens, n_in, n_out, Impl::Fp8::kOuterScales, w_scale, x_scale);
  KESTREL_CUBLAS_CHECK(
      cublaslt_api().MatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &w_scale, sizeof w_scale));
  KESTREL_CUBLAS_CHECK(
      cublaslt_api().MatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &x_scale, sizeof x_scale));
  KESTREL_CUBLAS_CHECK(cublaslt_api().Matmul(impl_->handle, p.desc, &alpha, wq, p.w, xq, p.x, &beta, y, p.y, y, p.y, &p.algo,
                                      impl_->workspace, impl_->workspace_bytes, stream));
}

}  // namespace kestrel::cuda
