#include "backend/cuda/cublaslt_api.h"

#include <dlfcn.h>

#include <string>
#include <type_traits>

#include "core/error.h"

namespace kestrel::cuda {

namespace {

CublasLtApi load() {
  const std::string soname = "libcublasLt.so." + std::to_string(CUBLAS_VER_MAJOR);
  std::string tried = soname;
  void* lib = dlopen(soname.c_str(), RTLD_NOW | RTLD_LOCAL);
  std::string why = lib == nullptr ? dlerror() : "";
#if defined(KESTREL_CUBLASLT_LIBRARY_PATH)
  if (lib == nullptr) {
    tried += ", " + std::string(KESTREL_CUBLASLT_LIBRARY_PATH);
    lib = dlopen(KESTREL_CUBLASLT_LIBRARY_PATH, RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) why += std::string("; ") + dlerror();
  }
#endif
  if (lib == nullptr)
    throw Error("cuBLASLt: cannot load the library (tried " + tried + "): " + why +
                ". Install CUDA " + std::to_string(CUBLAS_VER_MAJOR) +
                "'s cuBLAS or put the folder holding " + soname + " on LD_LIBRARY_PATH");
  auto sym = [&](auto& fn, const char* name) {
    void* p = dlsym(lib, name);
    if (p == nullptr) throw Error(std::string("cuBLASLt: ") + soname + " has no symbol " + name);
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
  };
  CublasLtApi a{};
  sym(a.Create, "cublasLtCreate");
  sym(a.Destroy, "cublasLtDestroy");
  sym(a.Matmul, "cublasLtMatmul");
  sym(a.MatmulAlgoCapGetAttribute, "cublasLtMatmulAlgoCapGetAttribute");
  sym(a.MatmulAlgoCheck, "cublasLtMatmulAlgoCheck");
  sym(a.MatmulAlgoConfigGetAttribute, "cublasLtMatmulAlgoConfigGetAttribute");
  sym(a.MatmulAlgoConfigSetAttribute, "cublasLtMatmulAlgoConfigSetAttribute");
  sym(a.MatmulAlgoGetHeuristic, "cublasLtMatmulAlgoGetHeuristic");
  sym(a.MatmulDescCreate, "cublasLtMatmulDescCreate");
  sym(a.MatmulDescDestroy, "cublasLtMatmulDescDestroy");
  sym(a.MatmulDescSetAttribute, "cublasLtMatmulDescSetAttribute");
  sym(a.MatmulPreferenceCreate, "cublasLtMatmulPreferenceCreate");
  sym(a.MatmulPreferenceDestroy, "cublasLtMatmulPreferenceDestroy");
  sym(a.MatmulPreferenceSetAttribute, "cublasLtMatmulPreferenceSetAttribute");
  sym(a.MatrixLayoutCreate, "cublasLtMatrixLayoutCreate");
  sym(a.MatrixLayoutDestroy, "cublasLtMatrixLayoutDestroy");
  return a;  // the library stays open for the life of the process
}

}  // namespace

const CublasLtApi& cublaslt_api() {
  static const CublasLtApi api = load();
  return api;
}

}  // namespace kestrel::cuda
