// LlamaModel::load_dummy: a model with generated weights in the shapes of a Hugging Face
// config.json, tensor by tensor as the architecture lists them (Architecture::tensors), as
// load_hf_dir reads a checkpoint's.
#include "model/dummy_weights.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>

#include "core/dtype.h"
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

uint32_t* GeneratedWeights::hold_words(size_t n) {
  held_.push_back(std::make_unique_for_overwrite<uint32_t[]>(std::max<size_t>(n, 1)));
  return held_.back().get();
}

namespace {

// A dense projection a GPTQ checkpoint quantizes (the experts, router, embeddings and head stay
// bf16 in generated models).
bool generated_gptq_role(WeightRole r) {
  switch (r) {
    case WeightRole::Q: case WeightRole::K: case WeightRole::V: case WeightRole::AttnOut:
    case WeightRole::Gate: case WeightRole::Up: case WeightRole::Down: return true;
    default: return false;
  }
}

// The generated GPTQ v1 4-bit matrix `name` [n_out, n_in] (dummy_weights.h), its tensors in g.
QuantizedMatrix generated_gptq4(const std::string& name, int64_t n_in, int64_t n_out, int64_t group_size,
                                GeneratedWeights& g, ThreadPool& pool) {
  const int64_t G = group_size == -1 ? n_in : group_size;
  if (G <= 0 || n_in % G != 0 || n_in % 8 != 0 || n_out % 8 != 0)
    throw Error(name + ": --load-format dummy cannot make a GPTQ 4-bit matrix of " + std::to_string(n_out) + " x " +
                std::to_string(n_in) + " with group size " + std::to_string(group_size) +
                " (n_in and n_out multiples of 8, n_in of the group size)");
  QuantizedMatrix m;
  m.format = QuantFormat::GptqV1;
  m.name = name;
  m.n_in = n_in, m.n_out = n_out, m.bits = 4, m.group_size = G, m.n_groups = n_in / G;
  m.scale_type = GgmlType::F16;
  const uint64_t key = random_fill_key(kDummyWeightSeed, name.data(), name.size());
  const int64_t n_words = n_in / 8 * n_out;
  uint32_t* qw = g.hold_words(static_cast<size_t>(n_words));
  pool.parallel_for(n_words, int64_t{1} << 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) qw[i] = static_cast<uint32_t>(random_fill_group(key, static_cast<uint64_t>(i)));
  });
  const int64_t n_zero_words = m.n_groups * n_out / 8;
  uint32_t* qz = g.hold_words(static_cast<size_t>(n_zero_words));
  std::fill(qz, qz + n_zero_words, 0x77777777u);  // zero 8, stored minus one
  const int64_t n_scales = m.n_groups * n_out;
  auto* sc = reinterpret_cast<uint16_t*>(g.hold_words(static_cast<size_t>((n_scales + 1) / 2)));
  const double base = 1.0 / (4.6 * std::sqrt(static_cast<double>(n_in)));
  const uint64_t skey = splitmix64_mix(key ^ 0x5ca1e5ull);
  for (int64_t i = 0; i < n_scales; ++i) {
    const double u = static_cast<double>(random_fill_group(skey, static_cast<uint64_t>(i)) >> 11) * 0x1.0p-53;
    sc[i] = fp32_to_fp16(static_cast<float>(base * (0.75 + 0.5 * u)));
  }
  m.qweight = reinterpret_cast<const uint8_t*>(qw);
  m.qzeros = reinterpret_cast<const uint8_t*>(qz);
  m.scales = reinterpret_cast<const uint8_t*>(sc);
  return m;
}

}  // namespace

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
  // GPTQ 4-bit configs: the dense projections in the GPTQ layout (dummy_weights.h); other
  // quantization_configs are not generated (bf16 weights, as before).
  const QuantConfig& qc = cfg.quant;
  const bool gptq4 = qc.method == QuantMethod::Gptq && qc.bits == 4;
  auto gptq_matrix = [&](const TensorSpec& spec) {
    return gptq4 && spec.n_expert == 0 && spec.n_in > 0 && generated_gptq_role(spec.role) && !qc.is_not_converted(spec.hf);
  };

  std::vector<GeneratedWeights::Matrix> planned;
  for (int32_t l = -1; l < static_cast<int32_t>(hp.n_layer); ++l)
    for (const TensorSpec& spec : arch.tensors(hp, l)) {
      if (tied(spec) || spec.n_in == 0 || gptq_matrix(spec)) continue;
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
  std::unique_ptr<ThreadPool> pool;
  if (gptq4) {
    m->quantized_ = std::make_unique<QuantizedWeights>();
    m->quant_method_ = QuantMethod::Gptq;
    pool = std::make_unique<ThreadPool>(0);
  }
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
      } else if (gptq_matrix(spec)) {
        lt.matrix = m->quantized_->add(generated_gptq4(spec.hf, spec.n_in, spec.n_out, qc.group_size, g, *pool));
        const QuantizedMatrix& qm = *lt.matrix.quant;
        m->weight_bytes_ += static_cast<uint64_t>(spec.n_in * spec.n_out / 2 + qm.n_groups * spec.n_out * 5 / 2);
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
