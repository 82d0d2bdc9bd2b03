#include "engine/perplexity.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"

namespace kestrel {

namespace {
constexpr int64_t kHeaderBytes = 8 + 4 + 4 + 4 * 8;
// Dimensions a base file may claim: enough for any vocabulary and context, small enough that the
// byte counts below cannot overflow.
constexpr int64_t kMaxDim = int64_t{1} << 31;

bool write_all(std::FILE* f, const void* p, size_t n) { return n == 0 || std::fwrite(p, 1, n, f) == n; }
bool read_all(std::FILE* f, void* p, size_t n) { return n == 0 || std::fread(p, 1, n, f) == n; }

int64_t row_count(const KldBaseHeader& h) { return h.n_chunks * (h.n_ctx - 1 - h.first); }

// Mean and its standard error of values with the given sum and sum of squares.
void mean_unc(double sum, double sum2, int64_t n, double& mean, double& unc) {
  mean = sum / static_cast<double>(n);
  const double var = std::max(0.0, sum2 / static_cast<double>(n) - mean * mean);
  unc = n > 1 ? std::sqrt(var / static_cast<double>(n - 1)) : 0.0;
}
}  // namespace

int64_t kld_first_scored(int64_t n_ctx) { return n_ctx < 64 ? n_ctx / 2 : 32; }
int64_t kld_scored_per_chunk(int64_t n_ctx) { return n_ctx - 1 - kld_first_scored(n_ctx); }

std::vector<int32_t> perplexity_chunks(std::span<const int32_t> text_ids, int64_t n_ctx, int32_t bos, int64_t max_chunks) {
  if (n_ctx < 4) throw Error("a context (-c) of " + std::to_string(n_ctx) + " tokens is too short to score (at least 4)");
  const int64_t per = bos >= 0 ? n_ctx - 1 : n_ctx;
  int64_t n = static_cast<int64_t>(text_ids.size()) / per;
  if (max_chunks > 0) n = std::min(n, max_chunks);
  if (n == 0)
    throw Error("the text has " + std::to_string(text_ids.size()) + " tokens; one chunk of -c " + std::to_string(n_ctx) +
                " needs " + std::to_string(per) + " (use a longer text or a smaller -c)");
  std::vector<int32_t> out;
  out.reserve(static_cast<size_t>(n * n_ctx));
  for (int64_t c = 0; c < n; ++c) {
    if (bos >= 0) out.push_back(bos);
    out.insert(out.end(), text_ids.begin() + c * per, text_ids.begin() + (c + 1) * per);
  }
  return out;
}

KldBaseWriter::KldBaseWriter(const std::string& path, const KldBaseHeader& h, std::span<const int32_t> tokens)
    : path_(path), h_(h) {
  KESTREL_ASSERT(static_cast<int64_t>(tokens.size()) == h.n_chunks * h.n_ctx, "KL base tokens match the header");
  f_ = std::fopen(path.c_str(), "wb");
  if (f_ == nullptr) throw Error(path + ": cannot open the KL divergence base file for writing");
  const uint32_t version = kKldVersion, type = 0;
  const int64_t dims[4] = {h.n_vocab, h.n_ctx, h.first, h.n_chunks};
  if (!write_all(f_, kKldMagic, 8) || !write_all(f_, &version, 4) || !write_all(f_, &type, 4) ||
      !write_all(f_, dims, sizeof dims) || !write_all(f_, tokens.data(), tokens.size_bytes()))
    throw Error(path + ": writing the KL divergence base file failed");
}

KldBaseWriter::~KldBaseWriter() {
  if (f_ != nullptr) std::fclose(f_);
}

void KldBaseWriter::write_chunk(std::span<const float> logprobs) {
  KESTREL_ASSERT(static_cast<int64_t>(logprobs.size()) == (h_.n_ctx - 1 - h_.first) * h_.n_vocab, "KL base chunk size");
  KESTREL_ASSERT(written_ < h_.n_chunks, "KL base chunk count");
  if (!write_all(f_, logprobs.data(), logprobs.size_bytes()))
    throw Error(path_ + ": writing the KL divergence base file failed (disk full?)");
  ++written_;
}

void KldBaseWriter::finish() {
  if (written_ != h_.n_chunks)
    throw Error(path_ + ": " + std::to_string(written_) + " of " + std::to_string(h_.n_chunks) + " chunks written");
  const bool ok = std::fclose(f_) == 0;
  f_ = nullptr;
  if (!ok) throw Error(path_ + ": writing the KL divergence base file failed");
}

KldBaseReader::KldBaseReader(const std::string& path) : path_(path) {
  f_ = std::fopen(path.c_str(), "rb");
  if (f_ == nullptr) throw Error(path + ": cannot open the KL divergence base file");
  char magic[8];
  uint32_t version = 0, type = 0;
  int64_t dims[4] = {};
  if (!read_all(f_, magic, 8) || std::memcmp(magic, kKldMagic, 8) != 0)
    throw Error(path + ": not a kestrel KL divergence base file (made by --kl-divergence-base; magic differs)");
  if (!read_all(f_, &version, 4) || !read_all(f_, &type, 4) || !read_all(f_, dims, sizeof dims))
    throw Error(path + ": KL divergence base file truncated in its header");
  if (version != kKldVersion)
    throw Error(path + ": KL divergence base file version " + std::to_string(version) + " (this kestrel reads " +
                std::to_string(kKldVersion) + ")");
  if (type != 0) throw Error(path + ": KL divergence base file value type " + std::to_string(type) + " (0, f32, expected)");
  h_ = {dims[0], dims[1], dims[2], dims[3]};
  if (h_.n_vocab < 1 || h_.n_vocab > kMaxDim || h_.n_ctx < 4 || h_.n_ctx > kMaxDim || h_.n_chunks < 1 ||
      h_.n_chunks > kMaxDim || h_.first != kld_first_scored(h_.n_ctx))
    throw Error(path + ": KL divergence base file header is inconsistent (vocab " + std::to_string(h_.n_vocab) +
                ", ctx " + std::to_string(h_.n_ctx) + ", first scored " + std::to_string(h_.first) + ", chunks " +
                std::to_string(h_.n_chunks) + ")");
  const int64_t n_tokens = h_.n_chunks * h_.n_ctx;
  // Row counts and vocabularies below 2^31 each: the products fit int64 only when checked in double.
  const double want = static_cast<double>(kHeaderBytes) + 4.0 * static_cast<double>(n_tokens) +
                      4.0 * static_cast<double>(row_count(h_)) * static_cast<double>(h_.n_vocab);
  if (std::fseek(f_, 0, SEEK_END) != 0) throw Error(path + ": cannot seek in the KL divergence base file");
  const double have = static_cast<double>(std::ftell(f_));
  if (have != want)
    throw Error(path + ": KL divergence base file has " + std::to_string(static_cast<int64_t>(have)) +
                " bytes, its header says " + std::to_string(static_cast<int64_t>(want)) +
                (have < want ? " (truncated)" : " (trailing bytes)"));
  std::fseek(f_, kHeaderBytes, SEEK_SET);
  tokens_.resize(static_cast<size_t>(n_tokens));
  if (!read_all(f_, tokens_.data(), tokens_.size() * 4)) throw Error(path + ": reading the KL divergence base file failed");
  for (size_t i = 0; i < tokens_.size(); ++i)
    if (tokens_[i] < 0 || tokens_[i] >= h_.n_vocab)
      throw Error(path + ": KL divergence base file token " + std::to_string(i) + " is " + std::to_string(tokens_[i]) +
                  ", outside the vocabulary of " + std::to_string(h_.n_vocab));
  data_offset_ = kHeaderBytes + 4 * n_tokens;
}

KldBaseReader::~KldBaseReader() {
  if (f_ != nullptr) std::fclose(f_);
}

std::vector<float> KldBaseReader::read_chunk(int64_t c) {
  KESTREL_ASSERT(c >= 0 && c < h_.n_chunks, "KL base chunk index");
  const int64_t n = kld_scored_per_chunk(h_.n_ctx) * h_.n_vocab;
  std::vector<float> out(static_cast<size_t>(n));
  if (std::fseek(f_, static_cast<long>(data_offset_ + 4 * c * n), SEEK_SET) != 0 || !read_all(f_, out.data(), out.size() * 4))
    throw Error(path_ + ": reading chunk " + std::to_string(c) + " of the KL divergence base file failed");
  return out;
}

double log_softmax_row(const float* logits, int64_t n_vocab, float* out) {
  double mx = -INFINITY;
  for (int64_t v = 0; v < n_vocab; ++v) mx = std::max(mx, static_cast<double>(logits[v]));
  double sum = 0;
  for (int64_t v = 0; v < n_vocab; ++v) sum += std::exp(static_cast<double>(logits[v]) - mx);
  const double lse = mx + std::log(sum);
  for (int64_t v = 0; v < n_vocab; ++v) out[v] = static_cast<float>(static_cast<double>(logits[v]) - lse);
  return lse;
}

int64_t check_kld_base(const KldBaseReader& base, int64_t n_vocab, int64_t n_ctx, std::span<const int32_t> chunks,
                       int64_t max_chunks) {
  const KldBaseHeader& h = base.header();
  if (h.n_vocab != n_vocab)
    throw Error("--kl-divergence-base: the base file's vocabulary has " + std::to_string(h.n_vocab) +
                " tokens, this model's " + std::to_string(n_vocab) + " (a base from another model?)");
  if (h.n_ctx != n_ctx)
    throw Error("--kl-divergence-base: the base file was made with -c " + std::to_string(h.n_ctx) + ", this run has -c " +
                std::to_string(n_ctx));
  const int64_t n = max_chunks > 0 ? std::min(max_chunks, h.n_chunks) : h.n_chunks;
  if (!chunks.empty()) {
    const int64_t m = std::min<int64_t>(n * n_ctx, static_cast<int64_t>(chunks.size()));
    for (int64_t i = 0; i < m; ++i)
      if (chunks[static_cast<size_t>(i)] != base.tokens()[static_cast<size_t>(i)])
        throw Error("--kl-divergence-base: the text's tokens differ from the base file's at chunk " +
                    std::to_string(i / n_ctx) + ", position " + std::to_string(i % n_ctx) + " (" +
                    std::to_string(chunks[static_cast<size_t>(i)]) + " here, " +
                    std::to_string(base.tokens()[static_cast<size_t>(i)]) +
                    " in the file): another text, tokenizer or BOS setting");
    if (static_cast<int64_t>(chunks.size()) < n * n_ctx)
      throw Error("--kl-divergence-base: the text gives " + std::to_string(chunks.size() / n_ctx) +
                  " chunks, the base file has " + std::to_string(n) + " (use --chunks or the base's text)");
  }
  return n;
}

PerplexityResult evaluate_perplexity(std::span<const int32_t> chunks, int64_t n_ctx, int64_t n_vocab,
                                     const ChunkLogits& logits_of, KldBaseWriter* save, KldBaseReader* base,
                                     const std::function<void(int64_t)>& progress) {
  PerplexityResult r;
  r.n_ctx = n_ctx;
  r.first = kld_first_scored(n_ctx);
  r.n_chunks = static_cast<int64_t>(chunks.size()) / n_ctx;
  r.has_kl = base != nullptr;
  const int64_t rows = kld_scored_per_chunk(n_ctx);
  double nll = 0, nll2 = 0, bnll = 0, bnll2 = 0, kl_sum = 0, kl_sum2 = 0;
  int64_t same_top = 0;
  std::vector<double> kls;
  std::vector<float> lp(static_cast<size_t>(rows * n_vocab));
  for (int64_t c = 0; c < r.n_chunks; ++c) {
    const std::span<const int32_t> chunk = chunks.subspan(static_cast<size_t>(c * n_ctx), static_cast<size_t>(n_ctx));
    const std::vector<float> logits = logits_of(chunk);
    if (static_cast<int64_t>(logits.size()) != n_ctx * n_vocab)
      throw Error("perplexity: the engine returned " + std::to_string(logits.size()) + " logits for a chunk of " +
                  std::to_string(n_ctx) + " x " + std::to_string(n_vocab));
    std::vector<float> b;
    if (base != nullptr) b = base->read_chunk(c);
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t p = r.first + i;
      float* q = lp.data() + i * n_vocab;
      const float* x = logits.data() + p * n_vocab;
      const double lse = log_softmax_row(x, n_vocab, q);
      if (!std::isfinite(lse))
        throw Error("perplexity: non-finite logits at chunk " + std::to_string(c) + ", position " + std::to_string(p));
      const int32_t t = chunk[static_cast<size_t>(p + 1)];
      const double l = -static_cast<double>(q[t]);
      nll += l;
      nll2 += l * l;
      if (base == nullptr) continue;
      const float* bp = b.data() + i * n_vocab;
      double kl = 0;
      for (int64_t v = 0; v < n_vocab; ++v) {
        const double bv = bp[v];
        kl += std::exp(bv) * (bv - static_cast<double>(q[v]));
      }
      kls.push_back(kl);
      kl_sum += kl;
      kl_sum2 += kl * kl;
      same_top += (std::max_element(bp, bp + n_vocab) - bp) == (std::max_element(q, q + n_vocab) - q);
      const double bl = -static_cast<double>(bp[t]);
      bnll += bl;
      bnll2 += bl * bl;
    }
    if (save != nullptr) save->write_chunk(lp);
    if (progress) progress(c + 1);
  }
  r.n_scored = r.n_chunks * rows;
  double mean = 0, unc = 0;
  mean_unc(nll, nll2, r.n_scored, mean, unc);
  r.ppl = std::exp(mean);
  r.ppl_unc = r.ppl * unc;
  if (base != nullptr) {
    mean_unc(bnll, bnll2, r.n_scored, mean, unc);
    r.base_ppl = std::exp(mean);
    r.base_ppl_unc = r.base_ppl * unc;
    mean_unc(kl_sum, kl_sum2, r.n_scored, r.kl_mean, r.kl_mean_unc);
    std::sort(kls.begin(), kls.end());
    const auto rank = [&](double q) {
      const int64_t k = static_cast<int64_t>(std::ceil(q * static_cast<double>(kls.size())));
      return kls[static_cast<size_t>(std::clamp<int64_t>(k - 1, 0, static_cast<int64_t>(kls.size()) - 1))];
    };
    r.kl_median = rank(0.5);
    r.kl_p99 = rank(0.99);
    r.kl_max = kls.back();
    const double n = static_cast<double>(r.n_scored);
    r.top1 = static_cast<double>(same_top) / n;
    r.top1_unc = r.n_scored > 1 ? std::sqrt(r.top1 * (1 - r.top1) / (n - 1)) : 0.0;
  }
  return r;
}

}  // namespace kestrel
