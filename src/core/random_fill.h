// Deterministic pseudo-random bf16 values for generated weights (--load-format dummy): element i
// of a tensor is a pure function of the tensor's key and i, computed the same way on the host and
// in a CUDA kernel (this header is included by both; in a CUDA build the functions are
// __host__ __device__), so a model's CPU and GPU copies of a generated tensor are equal bit for bit.
//
// The stream is splitmix64 (Steele, Lea & Flood 2014) with the key as its seed: its (g + 1)-th
// output gives elements 4g .. 4g + 3, 16 bits each (element i: bits 16 (i mod 4) and up), an
// integer m uniform in [-2^15, 2^15); the value is m * step (one exactly rounded f32 product, so
// no FMA contraction can change it), rounded to bf16 to nearest even. With step = a / 2^15 the
// values are uniform in [-a, a) on 2^16 levels, finer than bf16's 8-bit mantissa.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define KESTREL_HOST_DEVICE __host__ __device__
#else
#define KESTREL_HOST_DEVICE
#endif

namespace kestrel {

// How one generated tensor's elements are made.
struct RandomFill {
  uint64_t key = 0;  // the tensor's stream (random_fill_key of the seed and the tensor's name)
  float step = 0;    // value = m * step, m an integer in [-2^15, 2^15)
};

// 2^15: step = a / kRandomFillLevels gives values in [-a, a).
inline constexpr float kRandomFillLevels = 32768.0f;

KESTREL_HOST_DEVICE inline uint64_t splitmix64_mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// The key of a tensor named `name` (e.g. "model.layers.3.mlp.experts.5.gate_proj") under `seed`:
// FNV-1a of the name, mixed with the seed.
inline uint64_t random_fill_key(uint64_t seed, const char* name, size_t len) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < len; ++i) h = (h ^ static_cast<unsigned char>(name[i])) * 0x100000001b3ull;
  return splitmix64_mix(h ^ splitmix64_mix(seed + 0x9e3779b97f4a7c15ull));
}

// The 64 random bits of elements 4g .. 4g + 3.
KESTREL_HOST_DEVICE inline uint64_t random_fill_group(uint64_t key, uint64_t g) {
  return splitmix64_mix(key + (g + 1) * 0x9e3779b97f4a7c15ull);
}

// The integer m in [-2^15, 2^15) at lane j (0..3) of a group's bits.
KESTREL_HOST_DEVICE inline int32_t random_fill_lane(uint64_t z, unsigned j) {
  return static_cast<int32_t>((z >> (16 * j)) & 0xffffu) - 32768;
}

// m * step rounded to bf16 bits, to nearest even (the values are finite).
KESTREL_HOST_DEVICE inline uint16_t random_fill_round(int32_t m, float step) {
  const float v = static_cast<float>(m) * step;
  uint32_t x;
  std::memcpy(&x, &v, sizeof x);
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

// Element i as f32 (before rounding to bf16): m * step.
KESTREL_HOST_DEVICE inline float random_fill_f32(const RandomFill& f, uint64_t i) {
  return static_cast<float>(random_fill_lane(random_fill_group(f.key, i / 4), static_cast<unsigned>(i % 4))) * f.step;
}

// Element i as bf16 bits: random_fill_f32 rounded to nearest even.
KESTREL_HOST_DEVICE inline uint16_t random_fill_bf16(const RandomFill& f, uint64_t i) {
  return random_fill_round(random_fill_lane(random_fill_group(f.key, i / 4), static_cast<unsigned>(i % 4)), f.step);
}

}  // namespace kestrel
