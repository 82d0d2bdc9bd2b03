// The sampler's random number generator: our own xoshiro256** so that a seed gives the same draws
// on every platform and standard library (std::uniform_real_distribution's output is
// implementation-defined, so we never use it).
#pragma once

#include <array>
#include <cstdint>

namespace kestrel {

// xoshiro256** 1.0 from D. Blackman and S. Vigna, "Scrambled Linear Pseudorandom Number
// Generators", ACM Transactions on Mathematical Software 47(4), 2021 (arXiv:1805.01407).
// 256 bits of state, period 2^256 - 1, passes BigCrush; the state is seeded by expanding one
// 64-bit seed with SplitMix64 (G. Steele, D. Lea, C. Flood, "Fast Splittable Pseudorandom Number
// Generators", OOPSLA 2014), as the paper recommends, so that no seed yields the all-zero state.
class Rng {
 public:
  explicit Rng(uint64_t seed);
  // Uses the given state as is (for tests against hand-computed values). Must not be all zero.
  static Rng from_state(const std::array<uint64_t, 4>& state);

  // The next 64 random bits.
  uint64_t next_u64();
  // Uniform in [0, 1): the top 53 bits scaled by 2^-53, so every value is a multiple of 2^-53.
  double next_double();

  const std::array<uint64_t, 4>& state() const { return s_; }

 private:
  Rng() = default;
  std::array<uint64_t, 4> s_{};
};

// One SplitMix64 step: advances *state by the golden-ratio increment and returns the mixed value.
uint64_t splitmix64_next(uint64_t* state);

}  // namespace kestrel
