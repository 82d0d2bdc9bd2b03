#include "model/quantized_matrix.h"

#include <cmath>
#include <cstring>
#include <new>

#include "core/error.h"
#include "core/fp8.h"
#include "core/thread_pool.h"
#include "io/quoted.h"
#include "io/safetensors_checkpoint.h"
#include "model/quant_config.h"

namespace kestrel {
namespace {

uint32_t word(const uint8_t* base, int64_t i) {
  uint32_t w;
  std::memcpy(&w, base + 4 * i, 4);
  return w;
}


int32_t group_of(const QuantizedMatrix& m, int64_t k) {
  if (m.g_idx == nullptr) return static_cast<int32_t>(k / m.group_size);
  return static_cast<int32_t>(word(m.g_idx, k));
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// Finds and checks the tensors of one module.
class Reader {
 public:
  Reader(const SafetensorsCheckpoint& ckpt, std::vector<std::string>& used, uint64_t& bytes)
      : ckpt_(ckpt), used_(used), bytes_(bytes) {}

  const SafetensorsTensor& require(const std::string& name, const std::string& what) {
    const SafetensorsTensor* t = ckpt_.find(name);
    if (t == nullptr) throw Error(ckpt_.dir() + ": missing tensor " + quoted_name(name) + " (" + what + ")");
    used_.push_back(name);
    bytes_ += t->n_bytes();
    return *t;
  }
  [[noreturn]] void fail(const SafetensorsTensor& t, const std::string& problem) const {
    throw Error(ckpt_.file_of(t.name) + ": tensor " + quoted_name(t.name) + " " + problem);
  }
  void expect_shape(const SafetensorsTensor& t, const std::vector<int64_t>& want, const std::string& why) const {
    if (t.shape != want) fail(t, "has shape " + shape_text(t.shape) + ", expected " + shape_text(want) + " (" + why + ")");
  }
  void expect_dtype(const SafetensorsTensor& t, SafetensorsDtype want, const std::string& why) const {
    if (t.dtype != want)
      fail(t, "has dtype " + std::string(safetensors_dtype_name(t.dtype)) + ", expected " +
                  std::string(safetensors_dtype_name(want)) + " (" + why + ")");
    aligned(t);
  }
  GgmlType scale_type(const SafetensorsTensor& t) const {
    const auto type = to_ggml_type(t.dtype);
    if (!type) fail(t, "has dtype " + std::string(safetensors_dtype_name(t.dtype)) + ", expected F32, F16 or BF16 scales");
    aligned(t);
    return *type;
  }

 private:
  void aligned(const SafetensorsTensor& t) const {
    const size_t align = safetensors_dtype_size(t.dtype);
    if (reinterpret_cast<uintptr_t>(t.data) % align != 0)
      fail(t, "data at byte " + std::to_string(t.begin) + " of the data section is not aligned to its " +
                  std::to_string(align) + "-byte elements");
  }
  const SafetensorsCheckpoint& ckpt_;
  std::vector<std::string>& used_;
  uint64_t& bytes_;
};

// GPTQ v1 and AWQ GEMM: integer weights with a scale and a zero per group of inputs.
QuantizedMatrix read_int_groups(Reader& rd, const std::string& prefix, const QuantConfig& cfg, int64_t K, int64_t N) {
  QuantizedMatrix m;
  const bool gptq = cfg.method == QuantMethod::Gptq;
  m.format = gptq ? QuantFormat::GptqV1 : QuantFormat::AwqGemm;
  m.name = prefix;
  m.n_in = K, m.n_out = N;
  m.bits = cfg.bits;
  m.group_size = cfg.group_size == -1 ? K : cfg.group_size;
  const int64_t P = 32 / m.bits;
  const std::string fmt = gptq ? "GPTQ" : "AWQ GEMM";
  const SafetensorsTensor& qw = rd.require(prefix + ".qweight", fmt + " packed weights");
  rd.expect_dtype(qw, SafetensorsDtype::I32, "packed int32 words");
  if ((gptq ? K : N) % P != 0)
    rd.fail(qw, std::string(gptq ? "packs in_features " + std::to_string(K) : "packs out_features " + std::to_string(N)) +
                    ", which is not a multiple of the " + std::to_string(P) + " values per int32 word");
  rd.expect_shape(qw, gptq ? std::vector<int64_t>{K / P, N} : std::vector<int64_t>{K, N / P},
                  gptq ? "[in_features / " + std::to_string(P) + ", out_features]"
                       : "[in_features, out_features / " + std::to_string(P) + "]");
  m.qweight = qw.data;
  // AutoGPTQ sizes its groups ceil(K / G); AWQ needs whole groups.
  m.n_groups = gptq ? (K + m.group_size - 1) / m.group_size : K / m.group_size;
  const SafetensorsTensor& sc = rd.require(prefix + ".scales", fmt + " group scales");
  if (!gptq && K % m.group_size != 0)
    rd.fail(sc, "belongs to in_features " + std::to_string(K) + ", which is not a multiple of group_size " +
                    std::to_string(m.group_size));
  m.scale_type = rd.scale_type(sc);
  rd.expect_shape(sc, {m.n_groups, N}, "one row per group of " + std::to_string(m.group_size) + " inputs");
  m.scales = sc.data;
  const SafetensorsTensor& qz = rd.require(prefix + ".qzeros", fmt + " packed zero points");
  rd.expect_dtype(qz, SafetensorsDtype::I32, "packed int32 words");
  if (N % P != 0)
    rd.fail(qz, "packs out_features " + std::to_string(N) + ", which is not a multiple of " + std::to_string(P));
  rd.expect_shape(qz, {m.n_groups, N / P}, "one row per group, " + std::to_string(P) + " zeros per int32 word");
  m.qzeros = qz.data;
  if (!gptq) return m;
  const SafetensorsTensor& gi = rd.require(prefix + ".g_idx", "GPTQ group index of each input");
  rd.expect_dtype(gi, SafetensorsDtype::I32, "int32 group indices");
  rd.expect_shape(gi, {K}, "one group index per input");
  for (int64_t k = 0; k < K; ++k) {
    const auto g = static_cast<int32_t>(word(gi.data, k));
    if (g < 0 || g >= m.n_groups)
      rd.fail(gi, "holds group " + std::to_string(g) + " at input " + std::to_string(k) + ", outside [0, " +
                      std::to_string(m.n_groups) + ")");
    if (!cfg.desc_act && g != k / m.group_size)
      rd.fail(gi, "holds group " + std::to_string(g) + " at input " + std::to_string(k) + ", but desc_act is false (groups of " +
                      std::to_string(m.group_size) + " consecutive inputs: " + std::to_string(k / m.group_size) + ")");
  }
  m.g_idx = gi.data;
  return m;
}

QuantizedMatrix read_fp8(Reader& rd, const std::string& prefix, const QuantConfig& cfg, int64_t K, int64_t N) {
  QuantizedMatrix m;
  m.format = QuantFormat::Fp8;
  m.name = prefix;
  m.n_in = K, m.n_out = N;
  const SafetensorsTensor& w = rd.require(prefix + ".weight", "FP8 weights");
  if (w.dtype != SafetensorsDtype::F8_E4M3)
    rd.fail(w, "has dtype " + std::string(safetensors_dtype_name(w.dtype)) +
                   ", expected F8_E4M3 (float8_e4m3fn weights of an fp8 checkpoint)");
  rd.expect_shape(w, {N, K}, "[out_features, in_features]");
  m.weight = w.data;
  const std::string scale_name = prefix + (cfg.block_scale_inv ? ".weight_scale_inv" : ".weight_scale");
  const SafetensorsTensor& sc = rd.require(scale_name, "FP8 weight scales");
  m.scale_type = rd.scale_type(sc);
  m.scales = sc.data;
  if (cfg.block_n > 0) {
    m.block_n = cfg.block_n, m.block_k = cfg.block_k;
    rd.expect_shape(sc, {(N + m.block_n - 1) / m.block_n, (K + m.block_k - 1) / m.block_k},
                    "one scale per " + std::to_string(m.block_n) + " x " + std::to_string(m.block_k) + " block");
  } else if (sc.n_elements() == 1 && sc.shape.size() <= 2) {  // per tensor: [], [1] or [1, 1]
    m.block_n = N, m.block_k = K;
  } else if (sc.shape == std::vector<int64_t>{N, 1} || sc.shape == std::vector<int64_t>{N}) {
    m.block_n = 1, m.block_k = K;  // per output channel
  } else {
    rd.fail(sc, "has shape " + shape_text(sc.shape) + ", expected [1] (per tensor) or [" + std::to_string(N) +
                    ", 1] (per output channel)");
  }
  return m;
}

}  // namespace


float scale_at(const QuantizedMatrix& m, int64_t i) {
  if (m.scale_type == GgmlType::F32) {
    float f;
    std::memcpy(&f, m.scales + 4 * i, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, m.scales + 2 * i, 2);
  return m.scale_type == GgmlType::F16 ? fp16_to_fp32(h) : bf16_to_fp32(h);
}

void dequantize_rows(const QuantizedMatrix& m, int64_t row0, int64_t n_rows, float* out) {
  const int64_t K = m.n_in, N = m.n_out;
  if (m.format == QuantFormat::Fp8) {
    const int64_t cols = m.scale_cols();
    for (int64_t r = 0; r < n_rows; ++r) {
      const int64_t n = row0 + r;
      const uint8_t* w = m.weight + n * K;
      float* o = out + r * K;
      for (int64_t k = 0; k < K; ++k) o[k] = e4m3_to_float(w[k]) * scale_at(m, (n / m.block_n) * cols + k / m.block_k);
    }
    return;
  }
  const int64_t P = 32 / m.bits;
  const uint32_t mask = (1u << m.bits) - 1;
  static constexpr int kAwqReverse[8] = {0, 4, 1, 5, 2, 6, 3, 7};
  for (int64_t r = 0; r < n_rows; ++r) {
    const int64_t n = row0 + r;
    float* o = out + r * K;
    if (m.format == QuantFormat::GptqV1) {
      const int zshift = m.bits * static_cast<int>(n % P);
      for (int64_t k = 0; k < K; ++k) {
        const int32_t g = group_of(m, k);
        const auto q = static_cast<int32_t>((word(m.qweight, (k / P) * N + n) >> (m.bits * (k % P))) & mask);
        const auto zero = static_cast<int32_t>((word(m.qzeros, g * (N / P) + n / P) >> zshift) & mask) + 1;
        o[k] = scale_at(m, g * N + n) * static_cast<float>(q - zero);
      }
    } else {  // AWQ GEMM
      const int shift = 4 * kAwqReverse[n % 8];
      for (int64_t k = 0; k < K; ++k) {
        const int64_t g = k / m.group_size;
        const auto q = static_cast<int32_t>((word(m.qweight, k * (N / 8) + n / 8) >> shift) & 0xF);
        const auto zero = static_cast<int32_t>((word(m.qzeros, g * (N / 8) + n / 8) >> shift) & 0xF);
        o[k] = static_cast<float>(q - zero) * scale_at(m, g * N + n);
      }
    }
  }
}

QuantizedMatrix read_quantized_matrix(const SafetensorsCheckpoint& ckpt, const std::string& prefix, const QuantConfig& cfg,
                                      int64_t n_in, int64_t n_out, std::vector<std::string>& used, uint64_t& bytes) {
  KESTREL_ASSERT(cfg.quantized(), "read_quantized_matrix of a quantized checkpoint");
  Reader rd(ckpt, used, bytes);
  return cfg.method == QuantMethod::Fp8 ? read_fp8(rd, prefix, cfg, n_in, n_out)
                                        : read_int_groups(rd, prefix, cfg, n_in, n_out);
}

WeightView QuantizedWeights::add(QuantizedMatrix m) {
  auto e = std::make_unique<Entry>();
  e->m = std::move(m);
  // Default-initialised: the pages are not touched until make_host() writes them.
  const size_t n = static_cast<size_t>(e->m.n_in * e->m.n_out);
  try {
    e->host.reset(new float[n]);
  } catch (const std::bad_alloc&) {
    throw Error(e->m.name + ": cannot reserve " + std::to_string((n * sizeof(float)) >> 20) +
                " MiB of address space for the matrix's f32 host copy");
  }
  WeightView v{GgmlType::F32, e->m.n_in, e->m.n_out, reinterpret_cast<const uint8_t*>(e->host.get())};
  v.quant = &e->m;
  m_.push_back(std::move(e));
  return v;
}

uint8_t* QuantizedWeights::hold(size_t bytes) {
  held_.push_back(std::make_unique<uint64_t[]>((bytes + 7) / 8));
  return reinterpret_cast<uint8_t*>(held_.back().get());
}

void QuantizedWeights::make_host() {
  std::lock_guard<std::mutex> lock(mu_);
  if (on_host_) return;
  // Chunks of 16 rows, so the threads share a few large matrices evenly.
  struct Chunk {
    const Entry* e;
    int64_t row0, n_rows;
  };
  std::vector<Chunk> chunks;
  for (const auto& e : m_)
    for (int64_t r = 0; r < e->m.n_out; r += 16) chunks.push_back({e.get(), r, std::min<int64_t>(16, e->m.n_out - r)});
  ThreadPool pool(0);
  pool.parallel_for(static_cast<int64_t>(chunks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const Chunk& k = chunks[static_cast<size_t>(c)];
      dequantize_rows(k.e->m, k.row0, k.n_rows, k.e->host.get() + k.row0 * k.e->m.n_in);
    }
  });
  on_host_ = true;
}

}  // namespace kestrel
