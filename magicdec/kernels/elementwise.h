// Branch-free float functions for the loops of the layer operators and the sampler, written so that the compiler
// vectorizes them under each path's flags. They sit inside the same optimize pragma as those loops: a function compiled
// with other optimization options (std::max, std::floor, a helper outside the pragma) is not inlined into them, and
// the loop is then not vectorized.
#pragma once
#include <cstdint>
#include <cstring>

#include "common.h"

#pragma GCC push_options
#pragma GCC optimize("no-trapping-math", "fp-contract=off")

namespace magicdec {
namespace elementwise {

// exp(x) (Cephes expf, as the attention kernels take it: range reduction by ln 2, a degree-6 polynomial): 0 below -87
// (and for -inf and NaN), +inf above 88.
inline float exp(float x) {
  const bool zero = !(x >= -87.0f), huge = x > 88.0f;
  x = x > -87.0f ? x : -87.0f;
  x = x < 88.0f ? x : 88.0f;
  const float n = __builtin_floorf(x * kLog2e + 0.5f);
  float r = x - n * kLn2Hi;
  r = r - n * kLn2Lo;
  float p = kExpPoly[0];
  for (int i = 1; i < 6; ++i) p = p * r + kExpPoly[i];
  p = p * r * r + (r + 1.0f);
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  const float y = p * scale;
  return zero ? 0.0f : (huge ? __builtin_inff() : y);
}

// SiLU, x sigmoid(x), as torch computes it: x / (1 + exp(-x)).
inline float silu(float x) { return x / (1.0f + exp(-x)); }

// GELU's tanh approximation, 0.5 x (1 + tanh(y)) with y = sqrt(2 / pi) (x + 0.044715 x^3), as x / (1 + exp(-2y)):
// the same function, without the cancellation of 1 + tanh(y) where y is very negative.
inline float gelu_tanh(float x) {
  const float y = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  return x / (1.0f + exp(-2.0f * y));
}

}  // namespace elementwise
}  // namespace magicdec

#pragma GCC pop_options
