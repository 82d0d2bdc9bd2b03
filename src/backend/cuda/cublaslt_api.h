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

// The entry points, loaded once (thread-safe). Errors: kestrel::Error naming the files tried and
// the loader's message when the library cannot be opened, or the symbol it lacks.
const CublasLtApi& cublaslt_api();

}  // namespace kestrel::cuda
