// 16-bit storage types of the AVX2 kernels: eight values widened to an fp32 ymm (needs AVX2 and F16C).
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace magicdec {

struct Bf16 {  // bf16 is the top half of an fp32: widening is a shift
  static constexpr uint16_t kNegInfBits = 0xFF80;
  static __m256 load8(const uint16_t* p) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16));
  }
};

struct Fp16 {  // widened by F16C's vcvtph2ps
  static constexpr uint16_t kNegInfBits = 0xFC00;
  static __m256 load8(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
};

}  // namespace magicdec
