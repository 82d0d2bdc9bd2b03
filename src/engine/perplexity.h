// Perplexity of a text and the KL divergence of a model's next-token distributions from a base
// run's, over fixed chunks of the text: the measurements of llama.cpp's llama-perplexity
// (perplexity, --kl-divergence-base, --kl-divergence), computed here from the logits of the
// engine's prefill.
//
// Chunks: the text's tokens (without special tokens) are cut into consecutive pieces; with a
// tokenizer that adds BOS each chunk is BOS followed by n_ctx - 1 text tokens, otherwise n_ctx text
// tokens. A chunk is one sequence run from an empty KV cache. Logits row p of a chunk predicts
// token p + 1; rows p in [first, n_ctx - 1) are scored, first = kld_first_scored(n_ctx) (32, or
// n_ctx / 2 below a context of 64), so every scored token has at least `first` tokens of context.
//
// Per scored row, with logits x (f32) over the vocabulary V: lse = log sum_v exp(x_v) and
// log p_v = x_v - lse, in float64; the log-probabilities kept (base file) and compared are those
// values rounded to f32 (relative error 2^-24, so the rounding moves a mean KL by less than
// 2^-24 x (entropy + mean |log p - log q|), about 1e-7 on real text: negligible beside the goals).
//  - NLL of the row = -log p_t (the f32 value, as the base file keeps it), t the next token;
//    PPL = exp(mean NLL), and its uncertainty by the delta method, PPL x sd(NLL) / sqrt(N - 1)
//    (llama.cpp's).
//  - KL(base || run) = sum_v exp(b_v) (b_v - q_v) over the f32 log-probabilities b (base) and q
//    (this run), accumulated in float64: exactly 0 when both runs give the same logits. Mean with
//    sd / sqrt(N - 1); median, 99th percentile and maximum (nearest rank).
//  - top-1 agreement ("Same top p" in llama.cpp): the share of rows whose first maximum of b and
//    q is the same token, with sqrt(p (1 - p) / (N - 1)).
//
// Base file (--kl-divergence-base), little-endian:
//   char[8]  magic "KSTRLKLD"
//   uint32   version (1)
//   uint32   value type (0: f32 log-probabilities; f32 rather than f16: f16's relative 2^-11
//            would move a mean KL by up to 2^-11 x entropy, ~1.5e-3 nats at 3 nats of entropy,
//            too much beside a goal of 0.01)
//   int64    n_vocab, n_ctx, first, n_chunks
//   int32    tokens[n_chunks x n_ctx]                      (each chunk as run, BOS included)
//   float32  logprobs[n_chunks x (n_ctx - 1 - first) x n_vocab]  (scored rows, chunk-major)
// and nothing after: the size is checked exactly.
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace kestrel {

inline constexpr char kKldMagic[8] = {'K', 'S', 'T', 'R', 'L', 'K', 'L', 'D'};
inline constexpr uint32_t kKldVersion = 1;

// The first scored row of a chunk of n_ctx tokens (see above).
int64_t kld_first_scored(int64_t n_ctx);
// Scored rows per chunk: n_ctx - 1 - kld_first_scored(n_ctx).
int64_t kld_scored_per_chunk(int64_t n_ctx);

// The chunks of `text_ids` (tokens of the text, no special tokens) as run, concatenated:
// [n_chunks x n_ctx], each BOS first when bos >= 0. max_chunks 0 = as many whole chunks as the text
// holds. Throws kestrel::Error when n_ctx < 4 or the text holds no whole chunk (naming both counts).
std::vector<int32_t> perplexity_chunks(std::span<const int32_t> text_ids, int64_t n_ctx, int32_t bos, int64_t max_chunks);

struct KldBaseHeader {
  int64_t n_vocab = 0, n_ctx = 0, first = 0, n_chunks = 0;
};

// Writes a base file as chunks are scored. Throws kestrel::Error naming the path when it cannot be
// written.
class KldBaseWriter {
 public:
  KldBaseWriter(const std::string& path, const KldBaseHeader& h, std::span<const int32_t> tokens);
  ~KldBaseWriter();
  // One chunk's scored rows, [kld_scored_per_chunk(n_ctx) x n_vocab].
  void write_chunk(std::span<const float> logprobs);
  // Flushes and closes; throws when a write failed or fewer chunks than the header's were written.
  void finish();

 private:
  std::string path_;
  std::FILE* f_ = nullptr;
  KldBaseHeader h_;
  int64_t written_ = 0;
};

// Reads a base file. The constructor checks the header, the exact size and the token ids (each in
// [0, n_vocab)); throws kestrel::Error naming the path and what is wrong (not a base file, an
// unsupported version or value type, impossible dimensions, truncated or trailing bytes, a bad id).
class KldBaseReader {
 public:
  explicit KldBaseReader(const std::string& path);
  ~KldBaseReader();
  const KldBaseHeader& header() const { return h_; }
  const std::vector<int32_t>& tokens() const { return tokens_; }
  // Chunk c's rows, [kld_scored_per_chunk(n_ctx) x n_vocab].
  std::vector<float> read_chunk(int64_t c);

 private:
  std::string path_;
  std::FILE* f_ = nullptr;
  KldBaseHeader h_;
  std::vector<int32_t> tokens_;
  int64_t data_offset_ = 0;
};

struct PerplexityResult {
  int64_t n_ctx = 0, first = 0, n_chunks = 0, n_scored = 0;
  double ppl = 0, ppl_unc = 0;  // this run
  bool has_kl = false;          // the fields below: with a base file
  double base_ppl = 0, base_ppl_unc = 0;
  double kl_mean = 0, kl_mean_unc = 0, kl_median = 0, kl_p99 = 0, kl_max = 0;
  double top1 = 0, top1_unc = 0;  // fraction in [0, 1]
};

// log-probabilities of one logits row as described above: out[v] = float(x_v - lse); returns lse
// (float64).
double log_softmax_row(const float* logits, int64_t n_vocab, float* out);

// Runs every chunk of `chunks` ([n_chunks x n_ctx]) through `logits_of` (returns the chunk's
// logits, [n_ctx x n_vocab] f32) and scores it. With `save` the scored rows' log-probabilities go
// to the base file; with `base` they are compared with the base file's (whose header and tokens
// the caller has checked against `chunks`). `progress` (may be empty) is called after each chunk
// with the chunks done. Throws kestrel::Error when logits_of returns the wrong size or a row is
// not finite.
using ChunkLogits = std::function<std::vector<float>(std::span<const int32_t> chunk)>;
PerplexityResult evaluate_perplexity(std::span<const int32_t> chunks, int64_t n_ctx, int64_t n_vocab,
                                     const ChunkLogits& logits_of, KldBaseWriter* save, KldBaseReader* base,
                                     const std::function<void(int64_t)>& progress = {});

// Checks a base file against this run: the model's vocabulary, the context, and (when `chunks` is
// not empty) the tokens of the first min(file, run) chunks. Returns the chunks to compare: the
// file's, at most max_chunks (0 = all). Throws kestrel::Error naming the mismatch (the first chunk
// and position whose token differs).
int64_t check_kld_base(const KldBaseReader& base, int64_t n_vocab, int64_t n_ctx, std::span<const int32_t> chunks,
                       int64_t max_chunks);

}  // namespace kestrel
