// The CUDA backend's mixture-of-experts FFN (ForwardOps::moe_ffn; kernels and flow in moe_ops.h):
// the experts' weights uploaded as one bf16 array per projection, and per pass the router's f32
// logits, routing, rows sorted by expert, one grouped GEMM launch for every expert's gate|up
// (SwiGLU) and one for down, the shared expert through the dense projections, and the combine.
#include <algorithm>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_model_runner.h"
#include "backend/cuda/moe_ops.h"
#include "core/error.h"

namespace kestrel::cuda_runner {

namespace {

cuda::MoeRouteArgs route_args(const MoeRouting& r) {
  cuda::MoeRouteArgs a;
  a.n_expert = r.n_expert;
  a.top_k = r.n_expert_used;
  a.group_limited = r.select == MoeRouting::Select::GroupLimited;
  a.n_group = r.n_group;
  a.topk_group = r.topk_group;
  a.norm_topk = r.norm_topk;
  a.routed_scale = r.routed_scale;
  return a;
}

}  // namespace

// Layer l's routed experts as ExpGate = [E, 2 f, d] (expert e's gate rows, then its up rows: one
// GEMM gives [gate | up] as the dense GateUp does) and ExpDown = [E, d, f]; the router as Router =
// [E, d], with the shared-expert gate row appended ([E + 1, d]) when the model gates its shared
// expert, so one f32 projection gives both. DeviceWeight::n_in / n_out hold one expert's gate (f
// rows of d) and down (d rows of f) shapes.
void CudaModelRunner::upload_moe(int32_t l, Layer& dl, cuda::WeightUploader& up,
                                 std::array<bool, kWeightRoleCount>& done) {
  const ModelWeights& W = model_.weights();
  const MoeHparams& moe = hp_.moe;
  const int64_t n_exp = moe.routing.n_expert, d = hp_.n_embd, f = moe.n_ff_expert;
  const std::string where = "CUDA backend: layer " + std::to_string(l) + " mixture of experts: ";
  if (n_exp > cuda::kMoeMaxExperts || moe.routing.n_expert_used > cuda::kMoeMaxTopK)
    throw Error(where + std::to_string(n_exp) + " experts, " + std::to_string(moe.routing.n_expert_used) +
                " per token (the kernels take at most " + std::to_string(cuda::kMoeMaxExperts) + " and " +
                std::to_string(cuda::kMoeMaxTopK) + ")");
  if (d % 8 != 0 || f % 8 != 0 || moe.n_ff_shared % 8 != 0)
    throw Error(where + "n_embd " + std::to_string(d) + ", expert width " + std::to_string(f) + " and shared width " +
                std::to_string(moe.n_ff_shared) + " must be multiples of 8");
  const LayerTensor& gate = W.at({l, WeightRole::ExpGate});
  const LayerTensor& upt = W.at({l, WeightRole::ExpUp});
  const LayerTensor& down = W.at({l, WeightRole::ExpDown});
  for (const LayerTensor* t : {&gate, &upt, &down})
    if (static_cast<int64_t>(t->experts.size()) != n_exp)
      throw Error(where + std::to_string(t->experts.size()) + " expert matrices for " + std::to_string(n_exp) +
                  " experts");
  std::vector<const WeightView*> views;
  for (int64_t e = 0; e < n_exp; ++e) {
    const WeightView& g = gate.experts[static_cast<size_t>(e)];
    const WeightView& u = upt.experts[static_cast<size_t>(e)];
    const WeightView& dn = down.experts[static_cast<size_t>(e)];
    if (g.n_out != f || g.n_in != d || u.n_out != f || u.n_in != d || dn.n_out != d || dn.n_in != f)
      throw Error(where + "expert " + std::to_string(e) + " is not [" + std::to_string(f) + ", " + std::to_string(d) +
                  "] (gate, up) and [" + std::to_string(d) + ", " + std::to_string(f) + "] (down)");
    views.push_back(&g);
    views.push_back(&u);
  }
  DeviceWeight& gu = dl[WeightRole::ExpGate];
  gu.w = up.matrices(views);
  gu.n_in = d;
  gu.n_out = f;
  views.clear();
  for (const WeightView& dn : down.experts) views.push_back(&dn);
  DeviceWeight& dw = dl[WeightRole::ExpDown];
  dw.w = up.matrices(views);
  dw.n_in = f;
  dw.n_out = d;

  views = {&W.at({l, WeightRole::Router}).matrix};
  if (moe.shared_gate) views.push_back(&W.at({l, WeightRole::ShRouter}).matrix);
  DeviceWeight& rw = dl[WeightRole::Router];
  rw.w = up.matrices(views);
  rw.n_in = d;
  rw.n_out = 0;
  for (const WeightView* v : views) rw.n_out += v->n_out;
  if (rw.n_out != n_exp + (moe.shared_gate ? 1 : 0))
    throw Error(where + "the router has " + std::to_string(rw.n_out) + " rows for " + std::to_string(n_exp) + " experts");
  for (WeightRole r : {WeightRole::Router, WeightRole::ShRouter, WeightRole::ExpGate, WeightRole::ExpUp,
                       WeightRole::ExpDown})
    done[static_cast<size_t>(r)] = true;
  if (moe_counts_.bytes() == 0) {
    const std::vector<unsigned long long> zeros(static_cast<size_t>(hp_.n_layer * n_exp), 0);
    moe_counts_ = cuda::upload(zeros.data(), zeros.size() * sizeof(unsigned long long));
  }
}

bool CudaModelRunner::reserve_moe(int64_t n) {
  if (!hp_.moe.enabled()) return false;
  const MoeHparams& moe = hp_.moe;
  const int64_t n_exp = moe.routing.n_expert, k = moe.routing.n_expert_used, d = hp_.n_embd;
  const int64_t f = moe.n_ff_expert, s = moe.n_ff_shared;
  const cuda::MoePlan plan = cuda::moe_plan(n, static_cast<int32_t>(n_exp), static_cast<int32_t>(k));
  bool grew = false;
  auto grow = [&](DevMem& m, int64_t bytes) {
    if (static_cast<size_t>(bytes) <= m.bytes()) return;
    m.reserve(static_cast<size_t>(bytes));
    grew = true;
  };
  grow(moe_logits_, n * (n_exp + 1) * 4);
  grow(moe_ids_, n * k * 4);
  grow(moe_weights_, n * k * 4);
  grow(moe_tiles_, plan.max_tiles * 4);
  grow(moe_perm_, plan.padded_rows() * 4);
  grow(moe_act_, plan.padded_rows() * f * 2);
  grow(moe_y_, n * k * d * 2);
  if (s > 0) {
    grow(moe_sh_gate_up_, n * 2 * s * 2);
    grow(moe_sh_y_, n * d * 2);
    grow(side_act_, n * s * 2);  // project()'s SwiGLU input on the side stream's cuBLASLt path
    grow(act_, n * s * 2);       // and on stream_'s (under the per-op profiler)
  }
  return grew;
}

void CudaModelRunner::moe_ffn(int32_t layer, Act in, Act out) {
  const Layer& L = layers_[static_cast<size_t>(layer)];
  const MoeHparams& moe = hp_.moe;
  const int64_t n = pass_.n_tokens, d = hp_.n_embd, f = moe.n_ff_expert, s = moe.n_ff_shared;
  const int32_t n_exp = moe.routing.n_expert, k = moe.routing.n_expert_used;
  const bf16* x = act(in);
  bf16* y = act(out);
  KESTREL_ASSERT(x != nullptr && y != nullptr && x != y, "CUDA moe_ffn: in and out are different activations");
  const DeviceWeight& R = L[WeightRole::Router];
  // The shared experts on the side stream, from the same input, beside the routed ones (not while
  // the per-op profiler times the ops on stream_ one by one).
  const bool side = s > 0 && prof_ == nullptr;
  if (side) {
    if (side_stream_ == nullptr) {
      KESTREL_CUDA_CHECK(cudaStreamCreateWithFlags(&side_stream_, cudaStreamNonBlocking));
      KESTREL_CUDA_CHECK(cudaEventCreateWithFlags(&moe_fork_, cudaEventDisableTiming));
      KESTREL_CUDA_CHECK(cudaEventCreateWithFlags(&moe_join_, cudaEventDisableTiming));
      side_gemm_ = std::make_unique<cuda::Gemm>();
    }
    KESTREL_CUDA_CHECK(cudaEventRecord(moe_fork_, stream_));
    KESTREL_CUDA_CHECK(cudaStreamWaitEvent(side_stream_, moe_fork_, 0));
    shared_expert(L, x, n, side_stream_);
    KESTREL_CUDA_CHECK(cudaEventRecord(moe_join_, side_stream_));
  }
  float* logits = moe_logits_.as<float>();
  project(x, R.w.as<bf16>(), logits, true, n, d, R.n_out);
  mark("gemm router");
  int32_t* ids = moe_ids_.as<int32_t>();
  float* weights = moe_weights_.as<float>();
  const cuda::MoePlan plan = cuda::moe_plan(n, n_exp, k);
  cuda::moe_route_sort(logits, R.n_out, pass_arrays_->slots, n, route_args(moe.routing), plan, ids, weights,
                       moe_tiles_.as<int32_t>(), moe_perm_.as<int32_t>(),
                       moe_counts_.as<unsigned long long>() + static_cast<int64_t>(layer) * n_exp, stream_);
  mark("moe route");
  cuda::MoeGemmArgs g;
  g.x = x;
  g.w = L[WeightRole::ExpGate].w.as<bf16>();
  g.y = moe_act_.as<bf16>();
  g.tile_expert = moe_tiles_.as<int32_t>();
  g.perm = moe_perm_.as<int32_t>();
  g.n_in = d;
  g.n_out = f;
  g.top_k = k;
  g.n_tokens = n;
  g.swiglu = true;
  cuda::moe_gemm(g, plan, stream_);
  mark("moe gemm gate_up");
  g.x = moe_act_.as<bf16>();
  g.w = L[WeightRole::ExpDown].w.as<bf16>();
  g.y = moe_y_.as<bf16>();
  g.n_in = f;
  g.n_out = d;
  g.swiglu = false;
  cuda::moe_gemm(g, plan, stream_);
  mark("moe gemm down");
  const bf16* shared = nullptr;
  if (s > 0) {
    if (side) {
      KESTREL_CUDA_CHECK(cudaStreamWaitEvent(stream_, moe_join_, 0));
    } else {
      shared_expert(L, x, n, stream_);
      mark("gemm shared expert");
    }
    shared = moe_sh_y_.as<bf16>();
  }
  cuda::moe_combine(moe_y_.as<bf16>(), ids, weights, shared, moe.shared_gate ? logits + n_exp : nullptr, R.n_out, n,
                    k, d, y, stream_);
  mark("moe combine");
}

// moe_sh_y_ [n, d] = the shared experts' SwiGLU FFN of x, enqueued on `stream`.
void CudaModelRunner::shared_expert(const Layer& L, const bf16* x, int64_t n, cudaStream_t stream) {
  const int64_t d = hp_.n_embd, s = hp_.moe.n_ff_shared;
  project(x, L[WeightRole::ShGateUp].w.as<bf16>(), moe_sh_gate_up_.as<bf16>(), false, n, d, 2 * s, false, stream);
  project(moe_sh_gate_up_.as<bf16>(), L[WeightRole::ShDown].w.as<bf16>(), moe_sh_y_.as<bf16>(), false, n, s, d,
          /*swiglu=*/true, stream);
}

std::vector<uint64_t> CudaModelRunner::expert_token_counts() const {
  use_device();
  if (moe_counts_.bytes() == 0) return {};
  std::vector<unsigned long long> c(moe_counts_.bytes() / sizeof(unsigned long long));
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream_));
  KESTREL_CUDA_CHECK(cudaMemcpy(c.data(), moe_counts_.as<void>(), c.size() * sizeof(c[0]), cudaMemcpyDeviceToHost));
  return std::vector<uint64_t>(c.begin(), c.end());
}

}  // namespace kestrel::cuda_runner
