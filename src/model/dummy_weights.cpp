// LlamaModel::load_dummy: a model with generated weights in the shapes of a Hugging Face
// config.json, tensor by tensor as the architecture lists them (Architecture::tensors), as
// load_hf_dir reads a checkpoint's.
#include "model/dummy_weights.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>

#include "core/error.h"
#include "core/thread_pool.h"
#include "model/forward_ops.h"
#include "model/hf_config.h"
#include "model/llama_weights.h"
#include "model/quantized_matrix.h"

namespace kestrel {

namespace {

namespace fs = std::filesystem;

constexpr float kVectorScale = 1.0f / 16;

uint64_t key_of(const std::string& name) { return random_fill_key(kDummyWeightSeed, name.data(), name.size()); }

size_t page_size() {
  const long p = ::sysconf(_SC_PAGESIZE);
  return p > 0 ? static_cast<size_t>(p) : 4096;
}

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

std::string gib(size_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f GiB", static_cast<double>(bytes) / (1u << 30));
  return buf;
}

}  // namespace

RandomFill matrix_fill(const std::string& name, int64_t n_in) {
  return RandomFill{key_of(name), static_cast<float>(1.0 / std::sqrt(static_cast<double>(n_in))) / kRandomFillLevels};
}

std::vector<float> generated_vector(const std::string& name, int64_t n, bool norm) {
  const RandomFill f{key_of(name), kVectorScale / kRandomFillLevels};
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = (norm ? 1.0f : 0.0f) + random_fill_f32(f, static_cast<uint64_t>(i));
  return v;
}

void fill_random_bf16_host(const RandomFill& f, uint16_t* out, int64_t begin, int64_t end) {
  int64_t i = begin;
  for (; i < end && i % 4 != 0; ++i) out[i - begin] = random_fill_bf16(f, static_cast<uint64_t>(i));
  for (; i + 4 <= end; i += 4) {  // one hash per four elements
    const uint64_t z = random_fill_group(f.key, static_cast<uint64_t>(i / 4));
    for (unsigned j = 0; j < 4; ++j) out[i - begin + j] = random_fill_round(random_fill_lane(z, j), f.step);
  }
  for (; i < end; ++i) out[i - begin] = random_fill_bf16(f, static_cast<uint64_t>(i));
}

GeneratedWeights::GeneratedWeights(std::vector<Matrix> matrices) : m_(std::move(matrices)) {
  const size_t page = page_size();
  for (Matrix& m : m_) {
    m.offset = bytes_;
    bytes_ = round_up(bytes_ + static_cast<size_t>(m.n_in * m.n_out) * 2, page);
  }
  if (bytes_ == 0) bytes_ = page;
  // Address space only: no memory is committed until a range is made readable and written.
  void* p = ::mmap(nullptr, bytes_, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED)
    throw Error("cannot reserve " + gib(bytes_) + " of address space for the generated weights: " +
                std::strerror(errno));
  base_ = static_cast<uint8_t*>(p);
}

GeneratedWeights::~GeneratedWeights() {
  if (base_ != nullptr) ::munmap(base_, bytes_);
}

void GeneratedWeights::protect_rw(size_t offset, size_t bytes) {
  if (::mprotect(base_ + offset, round_up(bytes, page_size()), PROT_READ | PROT_WRITE) != 0)
    throw Error("cannot make " + gib(bytes) + " of host memory for the generated weights: " + std::strerror(errno));
}

void GeneratedWeights::make_host(size_t i) {
  std::lock_guard<std::mutex> lock(mu_);
  Matrix& m = m_[i];
  if (m.on_host) return;
  protect_rw(m.offset, static_cast<size_t>(m.n_in * m.n_out) * 2);
  fill_random_bf16_host(m.fill, reinterpret_cast<uint16_t*>(base_ + m.offset), 0, m.n_in * m.n_out);
  m.on_host = true;
}

void GeneratedWeights::make_all_host() {
  std::lock_guard<std::mutex> lock(mu_);
  if (all_on_host_) return;
  protect_rw(0, bytes_);
  // Huge pages where the kernel has them: a 512th of the page faults of the first touch (best
  // effort; without them the fill is the same, slower).
  ::madvise(base_, bytes_, MADV_HUGEPAGE);
  // Chunks of about a million elements, so the threads share a few large matrices evenly.
  struct Chunk {
    size_t matrix;
    int64_t begin, end;
  };
  constexpr int64_t kChunk = int64_t{1} << 20;
  std::vector<Chunk> chunks;
  for (size_t i = 0; i < m_.size(); ++i) {
    if (m_[i].on_host) continue;
    const int64_t n = m_[i].n_in * m_[i].n_out;
    for (int64_t b = 0; b < n; b += kChunk) chunks.push_back({i, b, std::min(n, b + kChunk)});
  }
  ThreadPool pool(0);
  pool.parallel_for(static_cast<int64_t>(chunks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const Chunk& k = chunks[static_cast<size_t>(c)];
      const Matrix& m = m_[k.matrix];
      fill_random_bf16_host(m.fill, reinterpret_cast<uint16_t*>(base_ + m.offset) + k.begin, k.begin, k.end);
    }
  });
  for (Matrix& m : m_) m.on_host = true;
  all_on_host_ = true;
}

void LlamaModel::ensure_host_weights() const {
  if (generated_ != nullptr) generated_->make_all_host();
  if (quantized_ != nullptr) quantized_->make_host();
}

std::unique_ptr<LlamaModel> LlamaModel::load_dummy(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    if (!fs::exists(dir, ec)) throw Error(dir + ": no such folder");
    throw Error(dir + ": --load-format dummy needs a Hugging Face model folder holding a config.json, "
                      "whose shapes the random weights take (a GGUF or other file is not read for them)");
  }
  const fs::path root(dir);
  const fs::path cfg_path = root / "config.json";
  if (!fs::exists(cfg_path, ec))
    throw Error(dir + ": no config.json (--load-format dummy makes random weights in the shapes a Hugging "
                      "Face config.json describes)");
  const HfModelConfig cfg = HfModelConfig::from_file(cfg_path.string());
  std::unique_ptr<LlamaModel> m(new LlamaModel());
  m->format_ = ModelFormat::HfFolder;
  m->path_ = dir;
  m->hparams_ = cfg.hparams;
  ModelHparams& hp = m->hparams_;
  const fs::path abs = fs::absolute(root).lexically_normal();
  hp.name = abs.has_filename() ? abs.filename().string() : abs.parent_path().filename().string();
  m->chat_template_ = hf_chat_template(dir);
  const Architecture& arch = architecture(hp.arch);

  // Every tensor's name once, as the HF loader would read it (experts expanded).
  auto expert_name = [](const TensorSpec& spec, int64_t e) {
    std::string name = spec.hf;
    const size_t at = name.find("{e}");
    KESTREL_ASSERT(at != std::string::npos, "an expert tensor's HF name has an {e} placeholder");
    name.replace(at, 3, std::to_string(e));
    return name + ".weight";
  };
  auto tied = [&](const TensorSpec& spec) { return spec.role == WeightRole::Output && cfg.tie_word_embeddings; };

  std::vector<GeneratedWeights::Matrix> planned;
  for (int32_t l = -1; l < static_cast<int32_t>(hp.n_layer); ++l)
    for (const TensorSpec& spec : arch.tensors(hp, l)) {
      if (tied(spec) || spec.n_in == 0) continue;
      for (int64_t e = 0; e < std::max<int64_t>(spec.n_expert, 1); ++e) {
        const std::string name = spec.n_expert > 0 ? expert_name(spec, e) : spec.hf + ".weight";
        planned.push_back({name, spec.n_in, spec.n_out, matrix_fill(name, spec.n_in), 0, false});
      }
    }
  m->generated_ = std::make_unique<GeneratedWeights>(std::move(planned));
  GeneratedWeights& g = *m->generated_;

  ModelWeights& w = m->weights_;
  w.resize(hp.n_layer);
  size_t next = 0;
  auto view = [&](const TensorSpec& spec) {
    const GeneratedWeights::Matrix& pm = g.matrix(next);
    KESTREL_ASSERT(pm.n_in == spec.n_in && pm.n_out == spec.n_out, "generated matrices in the planned order");
    WeightView v{GgmlType::BF16, spec.n_in, spec.n_out, g.data(next)};
    v.random = g.fill(next);
    // The CUDA backend splits MLA's KvB into W_UK^T and W_UV on the host while it starts
    // (cuda_mla.cpp), so KvB is made on the host at once (per layer H (nope + v) x r values).
    if (spec.role == WeightRole::KvB) g.make_host(next);
    ++next;
    m->weight_bytes_ += static_cast<uint64_t>(spec.n_in * spec.n_out) * 2;
    return v;
  };
  for (int32_t l = -1; l < static_cast<int32_t>(hp.n_layer); ++l)
    for (const TensorSpec& spec : arch.tensors(hp, l)) {
      if (tied(spec)) {
        w.put({l, spec.role}, LayerTensor{w.at({-1, WeightRole::TokenEmbd}).matrix, {}, {}, {}});
        w.tied_output = true;
        continue;
      }
      LayerTensor lt;
      if (spec.n_expert > 0) {
        for (int64_t e = 0; e < spec.n_expert; ++e) lt.experts.push_back(view(spec));
      } else if (spec.n_in == 0) {
        lt.vector = generated_vector(spec.hf + ".weight", spec.n_out, /*norm=*/true);
        m->weight_bytes_ += static_cast<uint64_t>(spec.n_out) * 2;
      } else {
        lt.matrix = view(spec);
      }
      if (spec.may_have_bias && cfg.has_bias(spec.role)) {
        lt.bias = generated_vector(spec.hf + ".bias", spec.n_out, /*norm=*/false);
        m->weight_bytes_ += static_cast<uint64_t>(spec.n_out) * 2;
      }
      w.put({l, spec.role}, std::move(lt));
    }
  KESTREL_ASSERT(next == g.size(), "every generated matrix has a view");
  w.rope_freq_factors = cfg.rope_freq_factors;
  return m;
}

}  // namespace kestrel
