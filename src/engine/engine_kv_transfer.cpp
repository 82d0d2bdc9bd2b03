// Disaggregated prefill in the engine (vLLM's prefill/decode disaggregation, pull model as its
// NIXL connector): a producer engine keeps a finished prefill's K/V blocks held until another
// engine has pulled them; a consumer engine starts a sequence from the pulled bytes and computes
// only the rest of its prompt. The transport between the two is the server's
// (tools/kestrel/server/kv_transfer.*).
#include <algorithm>
#include <chrono>
#include <string>

#include "backend/kv_geometry.h"
#include "core/error.h"
#include "engine/engine.h"
#include "engine/engine_impl.h"

namespace kestrel {

void check_kv_transfer_format(const KvTransferFormat& local, const KvTransferFormat& remote) {
  const auto differ = [](const char* field, const std::string& ours, const std::string& theirs) {
    throw Error(std::string("KV transfer: the remote KV cache's ") + field + " is " + theirs + ", this engine's " +
                ours + " (both sides must run the same model, --block-size, --kv-cache-dtype and "
                "--tensor-parallel-size)");
  };
  const auto n = [](int64_t v) { return std::to_string(v); };
  if (remote.block_size != local.block_size) differ("block_size", n(local.block_size), n(remote.block_size));
  if (remote.kv_dtype != local.kv_dtype)
    differ("kv_dtype", std::string(kv_dtype_name(local.kv_dtype)), std::string(kv_dtype_name(remote.kv_dtype)));
  if (remote.n_layer != local.n_layer) differ("n_layer", n(local.n_layer), n(remote.n_layer));
  if (remote.n_head_kv != local.n_head_kv) differ("n_head_kv", n(local.n_head_kv), n(remote.n_head_kv));
  if (remote.head_dim != local.head_dim) differ("head_dim", n(local.head_dim), n(remote.head_dim));
  if (remote.tensor_parallel_size != local.tensor_parallel_size)
    differ("tensor_parallel_size", n(local.tensor_parallel_size), n(remote.tensor_parallel_size));
  if (remote.bytes_per_token != local.bytes_per_token)
    differ("bytes_per_token", n(local.bytes_per_token), n(remote.bytes_per_token));
}

KvTransferFormat Engine::Impl::kv_format() const {
  const KvGeometry g = kv_geometry(model.hparams());
  KvTransferFormat f;
  f.block_size = runner->block_size();
  f.kv_dtype = runner->kv_dtype();
  f.bytes_per_token = runner->kv_bytes_per_token();
  f.n_layer = g.n_layer;
  f.n_head_kv = g.is_mla() ? 1 : g.n_head_kv;
  f.head_dim = g.is_mla() ? g.kv_lora_rank + g.rope_dim : g.head_dim;
  f.tensor_parallel_size = config.tensor_parallel_size;
  return f;
}

void Engine::Impl::hold_kv(RequestState& r, RequestOutput& o) {
  Sequence& s = r.seq;
  if (s.status != SeqStatus::Running || !manager.has(s.id) || s.n_computed <= 0) return;
  HeldKv h;
  h.seq = r.id | kHeldSeqBit;
  h.tokens.assign(s.tokens.begin(), s.tokens.begin() + s.n_computed);
  // The held sequence shares every block; it lists only the computed tokens' blocks.
  manager.fork(s.id, h.seq);
  manager.truncate(h.seq, s.n_computed);
  o.kv_held_blocks = manager.block_table(h.seq);
  o.kv_held_tokens = s.n_computed;
  held_kv[r.id] = std::move(h);
}

void Engine::Impl::check_import(const Request& req, int64_t n_prompt) const {
  const KvImport& im = *req.kv_import;
  check_kv_transfer_format(kv_format(), im.format);
  if (im.n_tokens < 1 || im.n_tokens > n_prompt)
    throw Error("kv_transfer_params: " + std::to_string(im.n_tokens) + " transferred tokens for a prompt of " +
                std::to_string(n_prompt) + " (must be in [1, n_prompt])");
  const int64_t bs = im.format.block_size;
  const int64_t n_blocks = (im.n_tokens + bs - 1) / bs;
  if (im.ipc) {
    if (static_cast<int64_t>(im.ipc_blocks.size()) != n_blocks)
      throw Error("kv_transfer_params: " + std::to_string(im.ipc_blocks.size()) + " remote blocks for " +
                  std::to_string(im.n_tokens) + " tokens, expected " + std::to_string(n_blocks));
    int64_t record = 0;
    for (const int64_t b : im.ipc->block_bytes) record += b;
    if (record != im.format.bytes_per_block())
      throw Error("kv_transfer_params: the producer's KV cache tensors hold " + std::to_string(record) +
                  " bytes per block, its format " + std::to_string(im.format.bytes_per_block()));
  } else if (static_cast<int64_t>(im.bytes.size()) != n_blocks * im.format.bytes_per_block()) {
    throw Error("kv_transfer_params: " + std::to_string(im.bytes.size()) + " bytes of K/V for " +
                std::to_string(im.n_tokens) + " tokens, expected " +
                std::to_string(n_blocks * im.format.bytes_per_block()));
  }
  if (req.prompt_logprobs >= 0 || req.prompt_logits || req.beam.enabled())
    throw Error("kv_transfer_params: a request with transferred K/V takes no prompt_logprobs, prompt_logits or beam search");
}

void Engine::Impl::write_import(const SchedulerOutput::Import& im) {
  const auto it = requests.find(im.seq->id);
  KESTREL_ASSERT(it != requests.end() && it->second->req.kv_import, "engine: an import without its bytes");
  RequestState& r = *it->second;
  const std::vector<int32_t>& table = manager.block_table(r.seq.id);
  const KvImport& kv = *r.req.kv_import;
  const size_t block_bytes = static_cast<size_t>(kv.format.bytes_per_block());
  const auto start = std::chrono::steady_clock::now();
  int64_t n_written = 0;
  if (kv.ipc) {
    std::vector<int32_t> src, dst;
    for (int64_t b = im.first_block; b < im.first_block + im.n_blocks; ++b) {
      const int32_t block = table[static_cast<size_t>(b)], from = kv.ipc_blocks[static_cast<size_t>(b)];
      if (block == KvManager::kNoBlock || from == KvManager::kNoBlock) continue;  // before a sliding window
      src.push_back(from);
      dst.push_back(block);
    }
    try {
      runner->copy_kv_blocks_ipc(*kv.ipc, src, dst);
    } catch (const Error& e) {  // the producer's memory cannot be mapped (any more): this request's failure
      r.import_error = e.what();
      r.req.kv_import.reset();
      return;
    }
    n_written = static_cast<int64_t>(dst.size());
  } else {
    const std::span<const std::byte> all(kv.bytes);
    for (int64_t b = im.first_block; b < im.first_block + im.n_blocks; ++b) {
      const int32_t block = table[static_cast<size_t>(b)];
      if (block == KvManager::kNoBlock) continue;  // before a sliding window: never read
      runner->write_kv_blocks(std::span<const int32_t>(&block, 1),
                              all.subspan(static_cast<size_t>(b) * block_bytes, block_bytes));
      ++n_written;
    }
  }
  const size_t t = kv.ipc ? 1 : 0;
  stats.kv_imports[t] += 1;
  stats.kv_import_bytes[t] += n_written * static_cast<int64_t>(block_bytes);
  stats.kv_import_seconds[t] += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // Written: the bytes are not needed again (a recompute computes them), and a producer's blocks
  // may go (remote_hold's deleter, once the last copy of the import goes).
  r.req.kv_import.reset();
}

void Engine::Impl::expire_imports(std::vector<RequestOutput>& outputs) {
  if (ipc_imports.empty()) return;
  const auto now = std::chrono::steady_clock::now();
  std::erase_if(ipc_imports, [&](RequestId id) {
    const auto it = requests.find(id);
    if (it == requests.end() || !it->second->req.kv_import) return true;  // ended, or written
    RequestState& r = *it->second;
    if (r.seq.status != SeqStatus::Waiting || now < r.req.kv_import->ipc_valid_until) return false;
    RequestOutput o;
    o.id = id;
    o.error = "KV transfer: the producer's hold on the K/V ended before this request was admitted "
              "(raise abort_request_timeout in --kv-transfer-config)";
    finish(r, "error", outputs, &o);
    return true;
  });
}

KvTransferFormat Engine::kv_transfer_format() const { return impl_->kv_format(); }

const Engine::Impl::HeldKv& Engine::Impl::held_export(RequestId id, std::vector<int32_t>* tokens,
                                                      KvImport& out) const {
  const auto it = held_kv.find(id);
  if (it == held_kv.end()) throw Error("KV transfer: request " + std::to_string(id) + " holds no K/V");
  out.format = kv_format();
  out.n_tokens = static_cast<int64_t>(it->second.tokens.size());
  if (tokens != nullptr) *tokens = it->second.tokens;
  return it->second;
}

KvImport Engine::export_held_kv(RequestId id, std::vector<int32_t>* tokens) const {
  Impl& m = *impl_;
  // The runner reads blocks with no pass in flight; the drained passes' outputs come with the
  // next step.
  m.drain(m.pending);
  KvImport out;
  const Impl::HeldKv& held = m.held_export(id, tokens, out);
  const std::vector<int32_t>& table = m.manager.block_table(held.seq);
  const size_t block_bytes = static_cast<size_t>(out.format.bytes_per_block());
  out.bytes.assign(table.size() * block_bytes, std::byte{0});
  for (size_t b = 0; b < table.size(); ++b)  // blocks before a sliding window stay zero: never read
    if (table[b] != KvManager::kNoBlock)
      m.runner->read_kv_blocks(std::span<const int32_t>(&table[b], 1),
                               std::span<std::byte>(out.bytes).subspan(b * block_bytes, block_bytes));
  return out;
}

KvImport Engine::export_held_kv_ipc(RequestId id, std::vector<int32_t>* tokens) const {
  const Impl& m = *impl_;
  KvImport out;
  const Impl::HeldKv& held = m.held_export(id, tokens, out);
  out.ipc = m.runner->export_kv_ipc();
  out.ipc_blocks = m.manager.block_table(held.seq);
  return out;
}

std::vector<int32_t> Engine::held_kv_blocks(RequestId id) const {
  const auto it = impl_->held_kv.find(id);
  if (it == impl_->held_kv.end()) return {};
  return impl_->manager.block_table(it->second.seq);
}

void Engine::release_held_kv(RequestId id) {
  Impl& m = *impl_;
  const auto it = m.held_kv.find(id);
  if (it == m.held_kv.end()) return;
  const std::vector<int32_t>& t = it->second.tokens;
  m.manager.free(it->second.seq, t, static_cast<int64_t>(t.size()));
  m.held_kv.erase(it);
  m.refresh_kv_stats();
}

size_t Engine::n_held_kv() const { return impl_->held_kv.size(); }

}  // namespace kestrel
