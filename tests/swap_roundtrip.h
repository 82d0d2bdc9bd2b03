// A backend's swap copies checked through its own forward pass: a prompt's K/V written into
// device blocks 0 and 1, swapped out to host blocks 1 and 2 (listed last first: a descending run,
// which CUDA copies as one), the device blocks overwritten by another prompt, swapped back in to
// device blocks 5 and 3, and the next token's logits read
// through the table [5, 3]; the reference is a fresh runner of the same options that decodes the
// same token straight after the same prompt in blocks [0, 1]. The two decode passes have the same
// shape, so the same kernels run on K/V that must be equal: the logits must be bitwise equal.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <vector>

#include "backend/model_runner.h"
#include "core/error.h"

namespace kestrel::test {

// One sequence's pass: tokens at positions [pos0, pos0 + tokens.size()) through `table`, logits
// of the last token.
inline std::vector<float> run_one(ModelRunner& r, const std::vector<int32_t>& tokens, int32_t pos0,
                                  const std::vector<int32_t>& table) {
  const int32_t bs = r.block_size();
  std::vector<int32_t> positions, query_start = {0, static_cast<int32_t>(tokens.size())};
  std::vector<int64_t> slots;
  for (size_t i = 0; i < tokens.size(); ++i) {
    const int32_t p = pos0 + static_cast<int32_t>(i);
    positions.push_back(p);
    slots.push_back(int64_t{table[static_cast<size_t>(p / bs)]} * bs + p % bs);
  }
  const std::vector<int32_t> context = {pos0 + static_cast<int32_t>(tokens.size())};
  const std::vector<int32_t> logits_at = {static_cast<int32_t>(tokens.size()) - 1};
  ForwardBatch b;
  b.token_ids = tokens;
  b.positions = positions;
  b.slot_mapping = slots;
  b.query_start = query_start;
  b.context_lens = context;
  b.block_tables = table;
  b.max_blocks_per_seq = static_cast<int32_t>(table.size());
  b.logits_indices = logits_at;
  const std::span<const float> logits = r.forward(b);
  return {logits.begin(), logits.end()};
}

// make_runner: a runner with block_size 16 and at least 6 KV blocks.
inline void expect_swap_roundtrip_keeps_logits(const std::function<std::unique_ptr<ModelRunner>()>& make_runner,
                                               int32_t n_vocab) {
  std::vector<int32_t> prompt, other;
  for (int32_t i = 0; i < 20; ++i) {
    prompt.push_back(1 + (i * 37) % (n_vocab - 1));
    other.push_back(1 + (i * 53 + 11) % (n_vocab - 1));
  }
  const std::vector<int32_t> next = {7 % n_vocab};
  const auto reference = make_runner();
  ASSERT_EQ(reference->block_size(), 16);
  run_one(*reference, prompt, 0, {0, 1});
  const std::vector<float> want = run_one(*reference, next, 20, {0, 1});

  const auto r = make_runner();
  r->allocate_swap_space(3);
  run_one(*r, prompt, 0, {0, 1});
  const std::vector<BlockSwap> out = {{1, 2}, {0, 1}};
  r->swap_out(out);
  run_one(*r, other, 0, {0, 1});  // overwrites both device blocks
  const std::vector<BlockSwap> in = {{5, 1}, {3, 2}};
  r->swap_in(in);
  const std::vector<float> got = run_one(*r, next, 20, {5, 3});
  // Two whole blocks of every layer came in.
  EXPECT_EQ(r->host_to_device_totals().bytes, 2 * r->kv_bytes_per_token() * r->block_size());
  ASSERT_EQ(got.size(), want.size());
  EXPECT_EQ(got, want);
  // The overwritten blocks read instead give other logits, so the comparison can fail.
  const std::vector<float> stale = run_one(*r, next, 20, {0, 1});
  EXPECT_NE(stale, want);
}

// The host tier's exchange (ModelRunner::swap_out_in), checked the same way: a prompt's K/V in
// device blocks [0, 1] swapped out to host blocks [1, 2], a second prompt's K/V written over both
// device blocks, then one call copies the second prompt's blocks out (to host blocks [3, 0]) and
// the first prompt's back into the same device blocks, crossed (table [1, 0]). The first prompt's
// next token through [1, 0] must give the reference logits (the copies in landed), and the second
// prompt's blocks, swapped in from host [3, 0] to device [2, 3], the logits of a fresh runner that
// ran it in [0, 1] (each copy out read its block before the copy in overwrote it).
// make_runner: a runner with block_size 16 and at least 4 KV blocks.
inline void expect_swap_out_in_orders_each_block(const std::function<std::unique_ptr<ModelRunner>()>& make_runner,
                                                 int32_t n_vocab) {
  std::vector<int32_t> prompt, other;
  for (int32_t i = 0; i < 20; ++i) {
    prompt.push_back(1 + (i * 37) % (n_vocab - 1));
    other.push_back(1 + (i * 53 + 11) % (n_vocab - 1));
  }
  const std::vector<int32_t> next = {7 % n_vocab};
  std::vector<float> want_prompt, want_other;
  {
    const auto reference = make_runner();
    ASSERT_EQ(reference->block_size(), 16);
    run_one(*reference, prompt, 0, {0, 1});
    want_prompt = run_one(*reference, next, 20, {0, 1});
    run_one(*reference, other, 0, {2, 3});
    want_other = run_one(*reference, next, 20, {2, 3});
  }
  ASSERT_NE(want_prompt, want_other);  // the two prompts are told apart by their logits

  const auto r = make_runner();
  r->allocate_swap_space(4);
  run_one(*r, prompt, 0, {0, 1});
  r->swap_out(std::vector<BlockSwap>{{0, 1}, {1, 2}});
  run_one(*r, other, 0, {0, 1});  // overwrites both device blocks
  const std::vector<BlockSwap> out = {{0, 3}, {1, 0}};
  const std::vector<BlockSwap> in = {{1, 1}, {0, 2}};
  r->swap_out_in(out, in);
  EXPECT_EQ(run_one(*r, next, 20, {1, 0}), want_prompt);
  EXPECT_EQ(r->host_to_device_totals().bytes, 2 * r->kv_bytes_per_token() * r->block_size());
  r->swap_in(std::vector<BlockSwap>{{2, 3}, {3, 0}});
  EXPECT_EQ(run_one(*r, next, 20, {2, 3}), want_other);
}

// Disaggregated prefill's block transfer checked the same way: a prompt's K/V read from blocks
// [0, 1] of one runner (read_kv_blocks), written into blocks [5, 3] of another one
// (write_kv_blocks) that never ran the prompt, and the next token's logits read there through
// [5, 3] must equal those of the runner that ran it. make_runner as above.
inline void expect_kv_transfer_keeps_logits(const std::function<std::unique_ptr<ModelRunner>()>& make_runner,
                                            int32_t n_vocab) {
  std::vector<int32_t> prompt;
  for (int32_t i = 0; i < 20; ++i) prompt.push_back(1 + (i * 37) % (n_vocab - 1));
  const std::vector<int32_t> next = {7 % n_vocab};
  const auto producer = make_runner();
  run_one(*producer, prompt, 0, {0, 1});
  const std::vector<int32_t> held = {0, 1};
  std::vector<std::byte> bytes(2 * static_cast<size_t>(producer->block_size()) *
                               static_cast<size_t>(producer->kv_bytes_per_token()));
  producer->read_kv_blocks(held, bytes);
  const std::vector<float> want = run_one(*producer, next, 20, {0, 1});

  const auto consumer = make_runner();
  const std::vector<int32_t> fresh = {5, 3};
  consumer->write_kv_blocks(fresh, bytes);
  EXPECT_EQ(run_one(*consumer, next, 20, {5, 3}), want);
  // Blocks that received nothing give other logits, so the comparison can fail.
  EXPECT_NE(run_one(*consumer, next, 20, {0, 1}), want);
  // A buffer of the wrong size is an error, not a partial copy.
  bytes.pop_back();
  EXPECT_THROW(consumer->write_kv_blocks(fresh, bytes), Error);
}

}  // namespace kestrel::test
