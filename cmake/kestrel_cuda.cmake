# The CUDA backend's targets (included from the top-level CMakeLists.txt when KESTREL_CUDA is on):
#   kestrel_cuda      static library: every .cu and .cpp of src/backend/cuda (nvcc, sm_90a): the op
#                     kernels, the cuBLASLt GEMM wrapper, and whatever else lives there (a model
#                     runner); links kestrel_lib (KESTREL_CUDA_CORE_TARGET).
#                     With KESTREL_CUDA_OPS_ONLY (no kestrel_lib), only the ops: each .cu with a .cuh
#                     of the same name (one op per pair), cuda_check.cpp, gemm.cpp, and the one file
#                     of kestrel_lib they need (src/core/error.cpp).
#   kestrel_cuda_emu  the ops' .cu files compiled by the host compiler against the CPU emulation
#                     (src/backend/cuda/emulate.h), for tests on machines without a GPU.
# So an op's .cu/.cuh may depend on core/error.h only.
# Kept out of kestrel_lib: kestrel_lib never includes a CUDA header (docs/architecture.md).

if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  # Hopper only: sm_90a machine code (wgmma/setmaxnreg capable), no PTX; CMake passes it to nvcc
  # as --generate-code=arch=compute_90a,code=[sm_90a]. Override with -DCMAKE_CUDA_ARCHITECTURES=...
  set(CMAKE_CUDA_ARCHITECTURES 90a-real)
endif()
enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)
# C++20 for nvcc too. CMake 3.25 knows no CUDA20 flag for nvcc (and, with CXX_STANDARD_REQUIRED,
# would refuse to generate), so it is taught the flag here; newer CMake versions define it.
if(NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
  set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
  set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
endif()
set(CMAKE_CUDA_STANDARD 20)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)
set(CMAKE_CUDA_EXTENSIONS OFF)

file(GLOB KESTREL_CUDA_KERNEL_SOURCES CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/src/backend/cuda/*.cu)
file(GLOB KESTREL_CUDA_HOST_SOURCES CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/src/backend/cuda/*.cpp)
list(FILTER KESTREL_CUDA_HOST_SOURCES EXCLUDE REGEX "/emulate[a-z_]*\\.cpp$")  # the emulation's own files
# A per-block timeline of the FP8 and INT4 streaming GEMVs (stream_trace.cuh), for diagnosis only:
# stream_gemv.cu alone is compiled with it (so turning it on rebuilds one file), and
# `kestrel_cuda_bench streamtrace` prints it.
option(KESTREL_STREAM_TRACE "Record the streaming GEMVs' per-block timeline (a diagnostic build)" OFF)
if(KESTREL_STREAM_TRACE)
  set_source_files_properties(${CMAKE_SOURCE_DIR}/src/backend/cuda/stream_gemv.cu PROPERTIES
                              COMPILE_DEFINITIONS KESTREL_STREAM_TRACE=1)
endif()
# NCCL (tensor parallelism's communicator, nccl_communicator.cpp): only its header at build time;
# the library is loaded with dlopen when a tensor-parallel runner starts on GPUs, by soname and then
# at the path found here. Without the header the communicator is left out (KESTREL_HAS_NCCL unset)
# and tensor parallelism on GPUs is an error.
find_path(KESTREL_NCCL_INCLUDE nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
find_library(KESTREL_NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR})
if(NOT KESTREL_NCCL_INCLUDE OR NOT KESTREL_CUDA_CORE_TARGET)
  list(FILTER KESTREL_CUDA_HOST_SOURCES EXCLUDE REGEX "/nccl_communicator\\.cpp$")
endif()
set(KESTREL_CUDA_OP_SOURCES "")
foreach(cu ${KESTREL_CUDA_KERNEL_SOURCES})
  string(REGEX REPLACE "\\.cu$" ".cuh" cuh ${cu})
  if(EXISTS ${cuh})
    list(APPEND KESTREL_CUDA_OP_SOURCES ${cu})
  endif()
endforeach()
if(NOT KESTREL_CUDA_CORE_TARGET)
  set(KESTREL_CUDA_KERNEL_SOURCES ${KESTREL_CUDA_OP_SOURCES})
  list(FILTER KESTREL_CUDA_HOST_SOURCES INCLUDE REGEX "/(cuda_check|gemm|cublaslt_api)\\.cpp$")
endif()

# cuBLASLt: the toolkit's, else one named by KESTREL_CUBLAS_ROOT (a folder with include/cublasLt.h
# and lib/libcublasLt.so*, as the nvidia-cublas Python wheel lays it out). Only its header is used
# at build time: gemm.cpp calls it through cublaslt_api.cpp, which loads the library with dlopen on
# first use (a CPU run never maps it), by soname and then at the path found here. Without it the
# GEMM wrapper is left out and KESTREL_CUDA_NO_GEMM is defined; the kernels still build.
set(KESTREL_CUBLAS_ROOT "" CACHE PATH "cuBLAS outside the CUDA toolkit (include/, lib/)")
set(kestrel_cublaslt_include "")
set(kestrel_cublaslt_library "")
if(TARGET CUDA::cublasLt)
  get_target_property(kestrel_cublaslt_library CUDA::cublasLt IMPORTED_LOCATION)
  set(kestrel_cublaslt_include ${CUDAToolkit_INCLUDE_DIRS})
elseif(KESTREL_CUBLAS_ROOT)
  find_library(KESTREL_CUBLASLT_LIBRARY NAMES cublasLt libcublasLt.so.13 libcublasLt.so.12
               HINTS ${KESTREL_CUBLAS_ROOT}/lib NO_DEFAULT_PATH)
  find_path(KESTREL_CUBLASLT_INCLUDE cublasLt.h HINTS ${KESTREL_CUBLAS_ROOT}/include NO_DEFAULT_PATH)
  if(KESTREL_CUBLASLT_LIBRARY AND KESTREL_CUBLASLT_INCLUDE)
    set(kestrel_cublaslt_library ${KESTREL_CUBLASLT_LIBRARY})
    set(kestrel_cublaslt_include ${KESTREL_CUBLASLT_INCLUDE})
  endif()
endif()
if(NOT kestrel_cublaslt_include)
  message(WARNING "cuBLASLt not found: kestrel_cuda is built without the GEMM wrapper (gemm.cpp)")
  list(FILTER KESTREL_CUDA_HOST_SOURCES EXCLUDE REGEX "/(gemm|cublaslt_api)\\.cpp$")
endif()

add_library(kestrel_cuda STATIC ${KESTREL_CUDA_KERNEL_SOURCES} ${KESTREL_CUDA_HOST_SOURCES})
target_include_directories(kestrel_cuda PUBLIC ${CMAKE_SOURCE_DIR}/src)
target_link_libraries(kestrel_cuda PUBLIC CUDA::cudart_static ${CMAKE_DL_LIBS})
target_compile_definitions(kestrel_cuda PUBLIC KESTREL_HAS_CUDA=1
                           $<$<NOT:$<BOOL:${kestrel_cublaslt_include}>>:KESTREL_CUDA_NO_GEMM=1>)
if(kestrel_cublaslt_include)
  target_include_directories(kestrel_cuda PRIVATE ${kestrel_cublaslt_include})
  if(kestrel_cublaslt_library)
    set_source_files_properties(${CMAKE_SOURCE_DIR}/src/backend/cuda/cublaslt_api.cpp PROPERTIES
                                COMPILE_DEFINITIONS KESTREL_CUBLASLT_LIBRARY_PATH="${kestrel_cublaslt_library}")
  endif()
endif()
# -lineinfo: source lines in ncu and compute-sanitizer reports, no effect on the code.
target_compile_options(kestrel_cuda PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-lineinfo>
                       $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra>)
if(KESTREL_CUDA_CORE_TARGET)
  target_link_libraries(kestrel_cuda PUBLIC ${KESTREL_CUDA_CORE_TARGET})
else()
  target_sources(kestrel_cuda PRIVATE ${CMAKE_SOURCE_DIR}/src/core/error.cpp)
endif()

if(KESTREL_NCCL_INCLUDE AND KESTREL_CUDA_CORE_TARGET)
  target_include_directories(kestrel_cuda PRIVATE ${KESTREL_NCCL_INCLUDE})
  target_compile_definitions(kestrel_cuda PRIVATE KESTREL_HAS_NCCL=1)
  if(KESTREL_NCCL_LIBRARY)
    get_filename_component(kestrel_nccl_real ${KESTREL_NCCL_LIBRARY} REALPATH)
    set_source_files_properties(${CMAKE_SOURCE_DIR}/src/backend/cuda/nccl_communicator.cpp PROPERTIES
                                COMPILE_DEFINITIONS KESTREL_NCCL_LIBRARY_PATH="${kestrel_nccl_real}")
  endif()
endif()

if(KESTREL_CUDA_EMULATION)
  # Each .cu file compiled as C++ through a one-line wrapper (a source file has one language).
  set(emu_sources ${CMAKE_SOURCE_DIR}/src/backend/cuda/emulate.cpp)
  foreach(cu ${KESTREL_CUDA_OP_SOURCES})
    get_filename_component(name ${cu} NAME_WE)
    set(wrapper ${CMAKE_BINARY_DIR}/cuda_emu/${name}_emu.cpp)
    file(CONFIGURE OUTPUT ${wrapper} CONTENT "#include \"${cu}\"\n")
    list(APPEND emu_sources ${wrapper})
  endforeach()
  add_library(kestrel_cuda_emu STATIC ${emu_sources})
  target_include_directories(kestrel_cuda_emu PUBLIC ${CMAKE_SOURCE_DIR}/src ${CUDAToolkit_INCLUDE_DIRS})
  target_compile_definitions(kestrel_cuda_emu PUBLIC KESTREL_CUDA_EMULATE=1)
  # The kernels reinterpret bf16 rows as 16-byte vectors, as CUDA code does; the host compiler
  # must not optimise on type-based aliasing. The GNU attributes CUDA's headers spell __global__
  # and friends with are unknown to the host compiler.
  target_compile_options(kestrel_cuda_emu PUBLIC -fno-strict-aliasing PRIVATE -Wno-attributes)
  target_link_libraries(kestrel_cuda_emu PUBLIC ${KESTREL_CUDA_CORE_TARGET})
  # The whole CUDA backend (the model runner over the emulated kernels) on the CPU: the runtime
  # calls it makes defined on the host (emulate_runtime.cpp), a plain-loop GEMM in cuBLASLt's place
  # (emulate_gemm.cpp), no CUDA runtime linked. For the whole-forward test in kestrel_cuda_emu_tests.
  if(KESTREL_CUDA_CORE_TARGET)
    set(runner_dir ${CMAKE_SOURCE_DIR}/src/backend/cuda)
    add_library(kestrel_cuda_runner_emu STATIC
      ${runner_dir}/cuda_model_runner.cpp ${runner_dir}/cuda_forward.cpp ${runner_dir}/cuda_graph_runner.cpp
      ${runner_dir}/cuda_moe_ffn.cpp ${runner_dir}/cuda_swap.cpp ${runner_dir}/cuda_kv_transfer.cpp
      ${runner_dir}/cuda_mla.cpp ${runner_dir}/cuda_int4_weights.cpp ${runner_dir}/cuda_gguf_weights.cpp
      ${runner_dir}/device_memory.cpp ${runner_dir}/op_profiler.cpp ${runner_dir}/cuda_pipeline_parallel.cpp
      ${runner_dir}/cuda_tensor_parallel.cpp
      ${runner_dir}/emulate_gemm.cpp ${runner_dir}/emulate_runtime.cpp)
    target_compile_options(kestrel_cuda_runner_emu PRIVATE -Wno-attributes)
    target_link_libraries(kestrel_cuda_runner_emu PUBLIC kestrel_cuda_emu)
  endif()
endif()

# Timings of the ops on a GPU (scripts/device/cuda_tests.sh runs it with KESTREL_CUDA_BENCH=1).
if(KESTREL_BENCH)
  add_executable(kestrel_cuda_bench ${CMAKE_SOURCE_DIR}/bench/cuda/bench_cuda_ops.cpp
                 ${CMAKE_SOURCE_DIR}/bench/cuda/bench_int4.cpp ${CMAKE_SOURCE_DIR}/bench/cuda/bench_gguf.cpp
                 ${CMAKE_SOURCE_DIR}/bench/cuda/bench_fp8_scalar.cpp ${CMAKE_SOURCE_DIR}/bench/cuda/bench_overlap.cpp
                 ${CMAKE_SOURCE_DIR}/bench/cuda/bench_stream_trace.cpp)
  target_link_libraries(kestrel_cuda_bench PRIVATE kestrel_cuda)
endif()

# A kernel timeline for machines without Nsight Systems (tools/kernel_trace): a CUDA injection
# library over CUPTI, loaded by the driver when CUDA_INJECTION64_PATH names it. kestrel_api_trace
# is the same without kernel records (the host's runtime calls and copies at undisturbed speed).
if(TARGET CUDA::cupti)
  add_library(kestrel_kernel_trace SHARED ${CMAKE_SOURCE_DIR}/tools/kernel_trace/kernel_trace.cpp)
  target_link_libraries(kestrel_kernel_trace PRIVATE CUDA::cupti)
  add_library(kestrel_api_trace SHARED ${CMAKE_SOURCE_DIR}/tools/kernel_trace/kernel_trace.cpp)
  target_link_libraries(kestrel_api_trace PRIVATE CUDA::cupti)
  target_compile_definitions(kestrel_api_trace PRIVATE KERNEL_TRACE_KERNELS=0)
endif()
