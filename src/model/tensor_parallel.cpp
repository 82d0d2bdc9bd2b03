// Tensor-parallel shards of a loaded model: views of row slices, owned copies of column slices.
#include "model/tensor_parallel.h"

#include <cstring>
#include <string>

#include "core/error.h"
#include "model/llama_weights.h"

namespace kestrel {

void validate_tensor_parallel(const ModelHparams& hp, int size) {
  const std::string flag = "--tensor-parallel-size " + std::to_string(size);
  if (size < 1) throw Error("--tensor-parallel-size must be at least 1, got " + std::to_string(size));
  if (size == 1) return;
  const bool llama_family = hp.arch == "llama" || hp.arch == "qwen2" || hp.arch == "mistral";
  if (!llama_family || hp.moe.enabled() || hp.mla.enabled())
    throw Error("architecture '" + hp.arch + "'" + (hp.moe.enabled() ? " with mixture-of-experts layers" : "") +
                " is not supported with tensor parallelism (" + flag + "); Llama, Qwen2 and Mistral are");
  auto divides = [&](int64_t n, const char* what) {
    if (n % size != 0)
      throw Error(flag + " does not divide the model's " + what + " (" + std::to_string(n) + ")");
  };
  divides(hp.n_head, "attention heads");
  divides(hp.n_ff, "FFN width");
  divides(hp.n_vocab, "vocabulary");
  if (hp.n_head_kv >= size) divides(hp.n_head_kv, "KV heads");
  else if (size % hp.n_head_kv != 0)
    throw Error(flag + ": with fewer KV heads (" + std::to_string(hp.n_head_kv) +
                ") than ranks, the KV heads must divide the ranks to be replicated evenly");
}

TensorParallelSlice tensor_parallel_slice(const ModelHparams& hp, int rank, int size) {
  TensorParallelSlice s;
  s.n_head = hp.n_head / size;
  s.head_begin = s.n_head * rank;
  if (hp.n_head_kv >= size) {
    s.n_head_kv = hp.n_head_kv / size;
    s.kv_head_begin = s.n_head_kv * rank;
  } else {
    s.n_head_kv = 1;
    s.kv_head_begin = rank / (size / hp.n_head_kv);  // the KV head of this rank's query heads
  }
  s.n_ff = hp.n_ff / size;
  s.ff_begin = s.n_ff * rank;
  s.n_vocab = hp.n_vocab / size;
  s.vocab_begin = s.n_vocab * rank;
  return s;
}

namespace {

WeightView plain(WeightView w) {
  // After ensure_host_weights every matrix's values are at `data` in `type`; a slice is read there.
  w.random = nullptr;
  w.quant = nullptr;
  return w;
}

LayerTensor row_slice(const LayerTensor& t, int64_t begin, int64_t count) {
  LayerTensor s;
  s.matrix = plain(t.matrix);
  s.matrix.data = t.matrix.row(begin);
  s.matrix.n_out = count;
  if (!t.bias.empty()) s.bias.assign(t.bias.begin() + begin, t.bias.begin() + begin + count);
  return s;
}

}  // namespace

std::unique_ptr<LlamaModel> LlamaModel::tensor_parallel_shard(int rank, int size) const {
  validate_tensor_parallel(hparams_, size);
  if (rank < 0 || rank >= size)
    throw Error("tensor-parallel rank " + std::to_string(rank) + " outside [0, " + std::to_string(size) + ")");
  ensure_host_weights();
  const TensorParallelSlice sl = tensor_parallel_slice(hparams_, rank, size);
  std::unique_ptr<LlamaModel> m(new LlamaModel());
  m->format_ = format_;
  m->path_ = path_;
  m->chat_template_ = chat_template_;
  m->hparams_ = hparams_;
  m->hparams_.n_head = sl.n_head;
  m->hparams_.n_head_kv = sl.n_head_kv;
  m->hparams_.n_ff = sl.n_ff;
  m->quant_method_ = quant_method_;
  m->weights_.resize(hparams_.n_layer);
  m->weights_.rope_freq_factors = weights_.rope_freq_factors;
  const int64_t hd = hparams_.head_dim;

  auto column_slice = [&](const LayerTensor& t, int64_t begin, int64_t count, const std::string& what) {
    const WeightView& w = t.matrix;
    if (begin % w.type.block_size != 0 || count % w.type.block_size != 0)
      throw Error(path_ + ": " + what + " (" + std::string(type_name(w.type.storage)) + ", blocks of " +
                  std::to_string(w.type.block_size) + ") cannot be split into " + std::to_string(size) +
                  " column slices of " + std::to_string(count) + " without splitting a block");
    const size_t off = row_bytes(w.type.storage, begin), bytes = row_bytes(w.type.storage, count);
    std::vector<uint8_t>& buf = m->shard_columns_.emplace_back(bytes * static_cast<size_t>(w.n_out));
    for (int64_t r = 0; r < w.n_out; ++r) std::memcpy(buf.data() + r * bytes, w.row(r) + off, bytes);
    LayerTensor s;
    s.matrix = plain(w);
    s.matrix.data = buf.data();
    s.matrix.n_in = count;
    if (rank == 0) s.bias = t.bias;  // added once, to the sum
    return s;
  };

  for (int32_t l = -1; l < static_cast<int32_t>(hparams_.n_layer); ++l)
    for (size_t ri = 0; ri < kWeightRoleCount; ++ri) {
      const WeightRole role = static_cast<WeightRole>(ri);
      const LayerTensor* t = weights_.find({l, role});
      if (t == nullptr) continue;
      const std::string what = "tensor '" + std::string(weight_role_name(role)) + "' of layer " + std::to_string(l);
      switch (role) {
        case WeightRole::Q: m->weights_.put({l, role}, row_slice(*t, sl.head_begin * hd, sl.n_head * hd)); break;
        case WeightRole::K:
        case WeightRole::V:
          m->weights_.put({l, role}, row_slice(*t, sl.kv_head_begin * hd, sl.n_head_kv * hd));
          break;
        case WeightRole::Gate:
        case WeightRole::Up: m->weights_.put({l, role}, row_slice(*t, sl.ff_begin, sl.n_ff)); break;
        case WeightRole::AttnOut:
          m->weights_.put({l, role}, column_slice(*t, sl.head_begin * hd, sl.n_head * hd, what));
          break;
        case WeightRole::Down: m->weights_.put({l, role}, column_slice(*t, sl.ff_begin, sl.n_ff, what)); break;
        case WeightRole::Output: m->weights_.put({l, role}, row_slice(*t, sl.vocab_begin, sl.n_vocab)); break;
        case WeightRole::TokenEmbd:
          m->weights_.put({l, role}, row_slice(*t, sl.vocab_begin, sl.n_vocab));
          break;
        default: m->weights_.put({l, role}, *t); break;  // norm vectors, replicated
      }
    }
  m->weights_.tied_output = weights_.tied_output;
  m->weights_.vocab_begin = sl.vocab_begin;
  return m;
}

}  // namespace kestrel
