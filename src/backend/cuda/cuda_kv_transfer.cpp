// The CUDA backend's part of disaggregated prefill: the K/V of whole blocks to and from host
// memory (ModelRunner::read_kv_blocks / write_kv_blocks), each block one record of every cache
// tensor's block bytes; and, between two processes on one GPU, device to device through CUDA IPC
// (export_kv_ipc / open_kv_ipc / copy_kv_blocks_ipc; CUDA Runtime API, "Interprocess
// Communication": a cudaMalloc allocation's handle, opened in another process as a pointer to the
// same memory). The copies run on stream_ after the passes that wrote the K/V, and the host waits
// for them (a transfer is a rare, whole-prompt event; the server's pull waits on it anyway).
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_model_runner.h"
#include "core/error.h"

namespace kestrel::cuda_runner {

std::vector<CudaModelRunner::CacheTensor> CudaModelRunner::cache_tensors() const {
  std::vector<CacheTensor> t;
  for (size_t l = 0; l < k_cache_.size(); ++l) {
    t.push_back({k_cache_[l].as<std::byte>(), static_cast<size_t>(cache_block_bytes_)});
    if (l < v_cache_.size()) t.push_back({v_cache_[l].as<std::byte>(), static_cast<size_t>(cache_block_bytes_)});
  }
  for (size_t l = 0; l < k_scale_.size(); ++l) {
    t.push_back({k_scale_[l].as<std::byte>(), static_cast<size_t>(scale_block_bytes_)});
    t.push_back({v_scale_[l].as<std::byte>(), static_cast<size_t>(scale_block_bytes_)});
  }
  return t;
}

void CudaModelRunner::kv_transfer_copy(std::span<const int32_t> blocks, std::byte* host, size_t host_bytes,
                                       bool to_host) const {
  use_device();
  const std::vector<CacheTensor> tensors = cache_tensors();
  size_t record = 0;
  for (const CacheTensor& t : tensors) record += t.bytes;
  if (host_bytes != blocks.size() * record)
    throw Error("CUDA KV transfer: " + std::to_string(host_bytes) + " bytes for " + std::to_string(blocks.size()) +
                " blocks of " + std::to_string(record) + " bytes");
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (blocks[i] < 0 || blocks[i] >= n_blocks_)
      throw Error("CUDA KV transfer: block " + std::to_string(blocks[i]) + " is outside the pool");
    std::byte* h = host + i * record;
    for (const CacheTensor& t : tensors) {
      std::byte* d = t.device + static_cast<size_t>(blocks[i]) * t.bytes;
      if (to_host) {
        KESTREL_CUDA_CHECK(cudaMemcpyAsync(h, d, t.bytes, cudaMemcpyDeviceToHost, stream_));
      } else {
        KESTREL_CUDA_CHECK(cudaMemcpyAsync(d, h, t.bytes, cudaMemcpyHostToDevice, stream_));
      }
      h += t.bytes;
    }
  }
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void CudaModelRunner::read_kv_blocks(std::span<const int32_t> blocks, std::span<std::byte> out) const {
  kv_transfer_copy(blocks, out.data(), out.size(), true);
}

void CudaModelRunner::write_kv_blocks(std::span<const int32_t> blocks, std::span<const std::byte> in) {
  kv_transfer_copy(blocks, const_cast<std::byte*>(in.data()), in.size(), false);
}

std::string uuid_text(const cudaUUID_t& uuid) {
  std::string s = "GPU-";
  char hex[3];
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) s += '-';
    std::snprintf(hex, sizeof hex, "%02x", static_cast<unsigned>(static_cast<unsigned char>(uuid.bytes[i])));
    s += hex;
  }
  return s;
}

std::vector<std::byte*> CudaModelRunner::cache_tensor_bases() const {
  std::vector<std::byte*> bases;
  for (const CacheTensor& t : cache_tensors()) bases.push_back(t.device);
  return bases;
}

KvIpcMemory CudaModelRunner::export_kv_ipc() const {
  use_device();
  std::lock_guard lock(ipc_mutex_);
  if (ipc_export_ == nullptr) {
    auto m = std::make_unique<KvIpcMemory>();
    m->device_uuid = device_uuid_;
    m->n_blocks = n_blocks_;
    for (const CacheTensor& t : cache_tensors()) {
      cudaIpcMemHandle_t h{};
      const cudaError_t err = cudaIpcGetMemHandle(&h, t.device);
      if (err != cudaSuccess) {
        cudaGetLastError();
        throw Error(std::string("CUDA IPC: cudaIpcGetMemHandle of the KV cache failed: ") + cudaGetErrorString(err));
      }
      m->handles.emplace_back(reinterpret_cast<const char*>(&h), sizeof h);
      m->block_bytes.push_back(static_cast<int64_t>(t.bytes));
    }
    ipc_export_ = std::move(m);
  }
  return *ipc_export_;
}

void CudaModelRunner::open_kv_ipc(const KvIpcMemory& peer) const {
  use_device();
  const std::vector<CacheTensor> tensors = cache_tensors();
  if (peer.handles.size() != tensors.size() || peer.block_bytes.size() != tensors.size())
    throw Error("CUDA IPC: the producer's KV cache has " + std::to_string(peer.handles.size()) +
                " tensors, this one " + std::to_string(tensors.size()));
  for (size_t t = 0; t < tensors.size(); ++t) {
    if (peer.block_bytes[t] != static_cast<int64_t>(tensors[t].bytes))
      throw Error("CUDA IPC: the producer's KV cache tensor " + std::to_string(t) + " has " +
                  std::to_string(peer.block_bytes[t]) + " bytes per block, this one " + std::to_string(tensors[t].bytes));
    if (peer.handles[t].size() != sizeof(cudaIpcMemHandle_t))
      throw Error("CUDA IPC: a handle of " + std::to_string(peer.handles[t].size()) + " bytes (want " +
                  std::to_string(sizeof(cudaIpcMemHandle_t)) + ")");
  }
  if (peer.n_blocks <= 0) throw Error("CUDA IPC: the producer's pool has no blocks");
  if (peer.device_uuid != device_uuid_)
    throw Error("CUDA IPC: the producer runs on " + peer.device_uuid + ", this process on " + device_uuid_);
  std::lock_guard lock(ipc_mutex_);
  if (ipc_peers_.count(peer.handles) != 0) return;
  // Another thread than the engine's may map: the calling thread's current device must be ours.
  KESTREL_CUDA_CHECK(cudaSetDevice(0));
  std::vector<std::byte*> bases;
  for (const std::string& text : peer.handles) {
    cudaIpcMemHandle_t h{};
    std::memcpy(&h, text.data(), sizeof h);
    void* p = nullptr;
    const cudaError_t err = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
    if (err != cudaSuccess) {
      cudaGetLastError();
      for (std::byte* b : bases) cudaIpcCloseMemHandle(b);
      throw Error(std::string("CUDA IPC: cudaIpcOpenMemHandle of the producer's KV cache failed: ") +
                  cudaGetErrorString(err));
    }
    bases.push_back(static_cast<std::byte*>(p));
  }
  ipc_peers_.emplace(peer.handles, std::move(bases));
}

void CudaModelRunner::close_kv_ipc() {
  std::lock_guard lock(ipc_mutex_);
  for (auto& [handles, bases] : ipc_peers_)
    for (std::byte* b : bases) cudaIpcCloseMemHandle(b);
  ipc_peers_.clear();
}

void CudaModelRunner::copy_kv_blocks_ipc(const KvIpcMemory& peer, std::span<const int32_t> src,
                                         std::span<const int32_t> dst) {
  open_kv_ipc(peer);
  std::vector<std::byte*> bases;
  {
    std::lock_guard lock(ipc_mutex_);
    bases = ipc_peers_.at(peer.handles);
  }
  copy_kv_blocks_from(bases, peer.n_blocks, src, dst);
}

void CudaModelRunner::copy_kv_blocks_from(std::span<std::byte* const> peer_bases, int32_t peer_blocks,
                                          std::span<const int32_t> src, std::span<const int32_t> dst) {
  use_device();
  const std::vector<CacheTensor> tensors = cache_tensors();
  if (peer_bases.size() != tensors.size())
    throw Error("CUDA KV copy: " + std::to_string(peer_bases.size()) + " peer tensors for " +
                std::to_string(tensors.size()));
  if (src.size() != dst.size())
    throw Error("CUDA KV copy: " + std::to_string(src.size()) + " source blocks for " + std::to_string(dst.size()));
  for (size_t i = 0; i < src.size(); ++i) {
    if (src[i] < 0 || src[i] >= peer_blocks)
      throw Error("CUDA KV copy: block " + std::to_string(src[i]) + " is outside the producer's pool");
    if (dst[i] < 0 || dst[i] >= n_blocks_)
      throw Error("CUDA KV copy: block " + std::to_string(dst[i]) + " is outside the pool");
  }
  // Runs of blocks consecutive on both sides: one copy per run and tensor.
  for (size_t i = 0; i < src.size();) {
    size_t n = 1;
    while (i + n < src.size() && src[i + n] == src[i] + static_cast<int32_t>(n) &&
           dst[i + n] == dst[i] + static_cast<int32_t>(n))
      ++n;
    for (size_t t = 0; t < tensors.size(); ++t) {
      const size_t b = tensors[t].bytes;
      KESTREL_CUDA_CHECK(cudaMemcpyAsync(tensors[t].device + static_cast<size_t>(dst[i]) * b,
                                         peer_bases[t] + static_cast<size_t>(src[i]) * b, n * b,
                                         cudaMemcpyDeviceToDevice, stream_));
    }
    i += n;
  }
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

}  // namespace kestrel::cuda_runner
