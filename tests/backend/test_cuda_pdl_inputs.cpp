// The decode GEMVs (stream_gemv in each input mode, skinny_gemm) read inputs that the kernel just
// before them wrote. Every launch asks for programmatic dependent launch, so a GEMV starts while
// that kernel still runs and must read its input only after griddepcontrol.wait, with loads that
// see the new data (ld_dependent16 in device_common.cuh). Here each input is poisoned, then written
// by a gather_rows kernel from a staging copy immediately before the GEMV, in three rounds with
// fresh data; the output must be bit-identical to the same GEMV run on the same input uploaded
// with cudaMemcpy after the device went idle (the kernels are deterministic, so any difference is
// a read of old or poisoned data). On the H200, stream_gemv's one-token kernels failed this before
// their inputs were read with coherent loads: the one-token fused-norm test and a teacher-forced
// decode check (scripts/device/e2e_check.py --prefill-chunk 1) were off by a relative L2 of ~0.5-1.
#include "cuda_test_util.h"

namespace kestrel::test {
namespace {

// dst = src, by a kernel (gather_rows over rows 0 .. n_rows - 1 of `identity`) launched last
// before the caller's kernel, once the device is idle. Both hold n_rows x width 16-bit elements;
// f32 data goes through as pairs.
void write_by_kernel(const DeviceBuffer<int32_t>& identity, const void* src, void* dst, int64_t n_rows,
                     int64_t width) {
  sync_device();  // only gather_rows may still run when the GEMV starts
  cuda::gather_rows(static_cast<const cuda::bf16*>(src), identity.get(), n_rows, width, static_cast<cuda::bf16*>(dst),
                    nullptr);
}

enum class Mode { kPlain, kF32Out, kSwiGLU, kFusedNorm, kSkinny };

const char* mode_name(Mode m) {
  switch (m) {
    case Mode::kPlain: return "stream_gemv bf16";
    case Mode::kF32Out: return "stream_gemv f32";
    case Mode::kSwiGLU: return "stream_gemv swiglu";
    case Mode::kFusedNorm: return "stream_gemv fused norm";
    case Mode::kSkinny: return "skinny_gemm";
  }
  return "?";
}

TEST(CudaPdlInputs, GemvReadsWhatThePrecedingKernelWrote) {
  KESTREL_REQUIRE_CUDA();
  std::mt19937 rng(31);
  struct Shape {
    int64_t n_tokens, n_in, n_out;
  };
  // The 8B's qkv (4096 -> 6144) and down (14336 -> 4096) at one and two tokens; small ones on
  // the emulation.
  std::vector<Shape> shapes = {{1, 2048, 9}, {2, 4096, 5}};
  if (!kCudaEmulated) shapes = {{1, 4096, 6144}, {2, 4096, 6144}, {1, 14336, 4096}, {2, 14336, 4096}};
  for (const Shape& c : shapes) {
    for (const Mode mode : {Mode::kPlain, Mode::kF32Out, Mode::kSwiGLU, Mode::kFusedNorm, Mode::kSkinny}) {
      SCOPED_TRACE(std::string(mode_name(mode)) + " tokens " + std::to_string(c.n_tokens) + " n_in " +
                   std::to_string(c.n_in) + " n_out " + std::to_string(c.n_out));
      const bool swiglu = mode == Mode::kSwiGLU, norm = mode == Mode::kFusedNorm, f32 = mode == Mode::kF32Out;
      const int64_t x_width = swiglu ? 2 * c.n_in : c.n_in;  // bf16 elements per token
      const size_t n_x = static_cast<size_t>(c.n_tokens * x_width);
      const size_t n_y = static_cast<size_t>(c.n_tokens * c.n_out);
      const auto w = random_bf16(static_cast<size_t>(c.n_out * c.n_in), rng);
      const auto norm_w = random_bf16(static_cast<size_t>(c.n_in), rng, 0.5f, 1.5f);
      DeviceBuffer<uint16_t> d_w(w), d_norm(norm_w);
      // Inputs: x (bf16), or for the fused norm the residual (f32) and the add (bf16).
      DeviceBuffer<uint16_t> d_x(n_x), d_x_stage(n_x), d_add(n_x), d_add_stage(n_x);
      DeviceBuffer<float> d_res(n_x), d_res_stage(n_x), d_res_out(n_x);
      const DeviceBuffer<int32_t> identity(std::vector<int32_t>{0, 1});
      auto run = [&](void* y) {
        if (mode == Mode::kSkinny) {
          cuda::SkinnyGemmArgs a{};
          a.x = d_x.bf16();
          a.x_stride = c.n_in;
          a.w = d_w.bf16();
          a.y = y;
          a.n_tokens = c.n_tokens;
          a.n_in = c.n_in;
          a.n_out = c.n_out;
          cuda::skinny_gemm(a, nullptr);
          return;
        }
        cuda::StreamGemvArgs a{};
        a.x = norm ? nullptr : d_x.bf16();
        a.x_stride = x_width;
        a.w = d_w.bf16();
        a.y = y;
        a.n_tokens = c.n_tokens;
        a.n_in = c.n_in;
        a.n_out = c.n_out;
        a.swiglu = swiglu;
        a.f32_out = f32;
        if (norm) {
          a.norm_residual_in = d_res.get();
          a.norm_add = d_add.bf16();
          a.norm_weight = d_norm.bf16();
          a.norm_residual_out = d_res_out.get();
          a.norm_eps = 1e-5f;
        }
        cuda::stream_gemv(a, nullptr);
      };
      for (int round = 0; round < 3; ++round) {
        SCOPED_TRACE("round " + std::to_string(round));
        const auto x = random_bf16(n_x, rng, -3.0f, 3.0f);
        const auto add = random_bf16(n_x, rng, -2.0f, 2.0f);
        const auto res = random_f32(n_x, rng, -3.0f, 3.0f);
        // Reference: the inputs uploaded, the device idle, then the GEMV.
        d_x.upload(x);
        d_add.upload(add);
        d_res.upload(res);
        sync_device();
        const auto want = run_to_f32(n_y, f32, run);
        // The same inputs written by the kernel right before the GEMV, over poison.
        d_x_stage.upload(x);
        d_add_stage.upload(add);
        d_res_stage.upload(res);
        d_x.poison();
        d_add.poison();
        d_res.poison();
        const auto got = run_to_f32(n_y, f32, [&](void* y) {
          if (norm) {
            write_by_kernel(identity, d_add_stage.get(), d_add.get(), c.n_tokens, c.n_in);
            write_by_kernel(identity, d_res_stage.get(), d_res.get(), c.n_tokens, 2 * c.n_in);  // f32 as bf16 pairs
          } else {
            write_by_kernel(identity, d_x_stage.get(), d_x.get(), c.n_tokens, x_width);
          }
          run(y);
        });
        ASSERT_EQ(got, want);
      }
    }
  }
}

}  // namespace
}  // namespace kestrel::test
