#include "sampling/rng.h"

#include "core/error.h"

namespace kestrel {
namespace {

constexpr uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

}  // namespace

uint64_t splitmix64_next(uint64_t* state) {
  *state += 0x9e3779b97f4a7c15ULL;
  uint64_t z = *state;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

Rng::Rng(uint64_t seed) {
  for (uint64_t& word : s_) word = splitmix64_next(&seed);
}

Rng Rng::from_state(const std::array<uint64_t, 4>& state) {
  KESTREL_ASSERT(state[0] | state[1] | state[2] | state[3], "xoshiro256** state must not be zero");
  Rng rng;
  rng.s_ = state;
  return rng;
}

uint64_t Rng::next_u64() {
  // The "**" scrambler (multiply, rotate, multiply) on s1, then the xoshiro linear step.
  const uint64_t result = rotl(s_[1] * 5, 7) * 9;
  const uint64_t t = s_[1] << 17;
  s_[2] ^= s_[0];
  s_[3] ^= s_[1];
  s_[1] ^= s_[2];
  s_[0] ^= s_[3];
  s_[2] ^= t;
  s_[3] = rotl(s_[3], 45);
  return result;
}

double Rng::next_double() {
  // The upper bits of xoshiro output are the strongest; 53 of them fill a double's mantissa.
  return static_cast<double>(next_u64() >> 11) * 0x1.0p-53;
}

}  // namespace kestrel
