// cuBLASLt's entry points, loaded with dlopen on first use instead of linked into the binary: a
// process that runs on the CPU never maps the library. Linked, libcublasLt.so.13 cost every run
// about 61 MiB of resident memory (the dynamic loader relocating it at start-up), more than the
// default model's KV cache at 4,096 tokens.
//
// Search order: the library's soname (libcublasLt.so.<CUBLAS_VER_MAJOR>, found through
// LD_LIBRARY_PATH and the loader's cache), then the file CMake found at configure time
// (KESTREL_CUBLASLT_LIBRARY_PATH). Internal to src/backend/cuda.
#pragma once

#include <cublasLt.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kestrel::cuda {

struct CublasLtApi {
  decltype(&cublasLtCreate) Create;
  decltype(&cublasLtDestroy) Destroy;
  decltype(&cublasLtMatmul) Matmul;
  decltype(&cublasLtMatmulAlgoCapGetAttribute) MatmulAlgoCapGetAttribute;
  decltype(&cublasLtMatmulAlgoCheck) MatmulAlgoCheck;
  decltype(&cublasLtMatmulAlgoConfigGetAttribute) MatmulAlgoConfigGetAttribute;
  decltype(&cublasLtMatmulAlgoConfigSetAttribute) MatmulAlgoConfigSetAttribute;
  decltype(&cublasLtMatmulAlgoGetHeuristic) MatmulAlgoGetHeuristic;
  decltype(&cublasLtMatmulDescCreate) MatmulDescCreate;
  decltype(&cublasLtMatmulDescDestroy) MatmulDescDestroy;
  decltype(&cublasLtMatmulDescSetAttribute) MatmulDescSetAttribute;
  decltype(&cublasLtMatmulPreferenceCreate) MatmulPreferenceCreate;
  decltype(&cublasLtMatmulPreferenceDestroy) MatmulPreferenceDestroy;
  decltype(&cublasLtMatmulPreferenceSetAttribute) MatmulPreferenceSetAttribute;
  decltype(&cublasLtMatrixLayoutCreate) MatrixLayoutCreate;
  decltype(&cublasLtMatrixLayoutDestroy) MatrixLayoutDestroy;
};

// The split-K variants (2, 4 and 8 slices of n_in, at least 256 deep each) of the candidates that
// support it and do not split already, reduced in f32 (CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE:
// partial sums in the workspace, then one reduction; not the bf16 in-place or output-type sums),
// each checked by cublasLtMatmulAlgoCheck against the workspace, for the GEMM desc (w, x) -> y.
// A decode GEMM of few tokens has few output tiles (64 x 4096 outputs in 128 x 64 tiles: 32 blocks
// for 132 SMs), so slicing the reduction is how it fills the GPU. Gemm::tune's extra candidates
// (gemm.cpp); also the FP8 candidates benchmark.
std::vector<cublasLtMatmulAlgo_t> split_k_variants(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                                                   cublasLtMatrixLayout_t w, cublasLtMatrixLayout_t x,
                                                   cublasLtMatrixLayout_t y,
                                                   const std::vector<cublasLtMatmulAlgo_t>& candidates, int64_t n_in,
                                                   size_t workspace_bytes);

// The entry points, loaded once (thread-safe). Errors: kestrel::Error naming the files tried and
// the loader's message when the library cannot be opened, or the symbol it lacks.
const CublasLtApi& cublaslt_api();

}  // namespace kestrel::cuda
