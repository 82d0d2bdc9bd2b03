// The decode GEMVs (stream_gemv in each input mode, skinny_gemm) read inputs that the kernel just
// before them wrote. Every launch asks for programmatic dependent launch, so a GEMV starts while
// that kernel still runs and must read its input only after griddepcontrol.wait (device_common.cuh:
// ld_dependent16). Here each input is poisoned, then written by delayed_copy, a kernel that lets
// the GEMV launch at once and sleeps 20 us before it copies; the GEMV is launched right after it.
// The output (and the fused norm's summed residual) must be bit-identical to the same GEMV run on
// the same input uploaded with cudaMemcpy after the device went idle (the kernels are
// deterministic, so any difference is a read of poisoned or old data). Three rounds with fresh
// data; for the fused norm the residual and the add take turns as the input written last.
// History: before ld_dependent16, ptxas placed one of the one-token stream_gemv's read-only loads
// of x above the wait (SASS); on the H200 its fused-norm test's unfused reference (a GEMV right
// after add_rms_norm) was off by a relative 0.90-1.03, and a teacher-forced decode check by 0.46.
#include "cuda_test_util.h"

namespace kestrel::test {
namespace {

constexpr unsigned kDelayNs = 20000;

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
    if (!cuda::stream_gemv_supports(c.n_tokens, c.n_in, c.n_out)) {
      ADD_FAILURE() << "stream_gemv does not take " << c.n_tokens << " x " << c.n_in << " -> " << c.n_out
                    << " on this device";
      continue;
    }
    const auto w = random_bf16(static_cast<size_t>(c.n_out * c.n_in), rng);
    const auto norm_w = random_bf16(static_cast<size_t>(c.n_in), rng, 0.5f, 1.5f);
    DeviceBuffer<uint16_t> d_w(w), d_norm(norm_w);
    for (const Mode mode : {Mode::kPlain, Mode::kF32Out, Mode::kSwiGLU, Mode::kFusedNorm, Mode::kSkinny}) {
      SCOPED_TRACE(std::string(mode_name(mode)) + " tokens " + std::to_string(c.n_tokens) + " n_in " +
                   std::to_string(c.n_in) + " n_out " + std::to_string(c.n_out));
      const bool swiglu = mode == Mode::kSwiGLU, norm = mode == Mode::kFusedNorm, f32 = mode == Mode::kF32Out;
      const int64_t x_width = swiglu ? 2 * c.n_in : c.n_in;  // bf16 elements per token
      const size_t n_x = static_cast<size_t>(c.n_tokens * x_width);
      const size_t n_y = static_cast<size_t>(c.n_tokens * c.n_out);
      // Inputs: x (bf16), or for the fused norm the residual (f32) and the add (bf16).
      DeviceBuffer<uint16_t> d_x(n_x), d_x_stage(n_x), d_add(n_x), d_add_stage(n_x);
      DeviceBuffer<float> d_res(n_x), d_res_stage(n_x), d_res_out(n_x);
      auto run = [&](void* y) {
        // x is unread in the fused-norm mode.
        const cuda::ProjectionOperands ops{norm ? nullptr : d_x.bf16(), x_width, d_w.bf16(), y, c.n_tokens, c.n_in,
                                           c.n_out, swiglu, f32};
        if (mode == Mode::kSkinny) {
          cuda::skinny_gemm(cuda::SkinnyGemmArgs{ops}, nullptr);
          return;
        }
        cuda::StreamGemvArgs a{ops};
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
        d_res_out.poison();
        sync_device();
        const auto want = run_to_f32(n_y, f32, run);
        const auto want_res = d_res_out.download();
        // The same inputs written over poison by the kernel launched right before the GEMV.
        d_x_stage.upload(x);
        d_add_stage.upload(add);
        d_res_stage.upload(res);
        d_x.poison();
        d_add.poison();
        d_res.poison();
        d_res_out.poison();
        sync_device();
        const auto got = run_to_f32(n_y, f32, [&](void* y) {
          if (norm) {
            // Both inputs by kernels; the one written last alternates by round.
            const bool res_last = round % 2 == 0;
            const auto copy_add = [&] { cuda::delayed_copy(d_add_stage.get(), d_add.get(), n_x * 2, kDelayNs, nullptr); };
            const auto copy_res = [&] { cuda::delayed_copy(d_res_stage.get(), d_res.get(), n_x * 4, kDelayNs, nullptr); };
            res_last ? copy_add() : copy_res();
            res_last ? copy_res() : copy_add();
          } else {
            cuda::delayed_copy(d_x_stage.get(), d_x.get(), n_x * 2, kDelayNs, nullptr);
          }
          run(y);
        });
        ASSERT_EQ(got, want);
        if (norm) ASSERT_EQ(d_res_out.download(), want_res);
      }
    }
  }
}

}  // namespace
}  // namespace kestrel::test
