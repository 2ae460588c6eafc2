// A bf16 linear layer on CPUs with AVX512-BF16 whose output rows do not depend on the batch: a row
// gets the same bits in a one-token step, in a verification forward and in a prefill chunk, whatever
// the other rows are. torch's bf16 matmul (oneDNN) rounds a row differently at different row counts and
// reads the weights at about half the memory bandwidth at one row.
//
// y [M, N] = x [M, K] @ W^T (+ bias [N]) with W packed once at load time (`pack` in magicdec.kernels):
// [N / 64, K / 2, 64, 2], i.e. for each group of 64 output columns and each pair of inputs, the 64
// columns' two weights side by side, so that one `vdpbf16ps` with a broadcast input pair advances 16
// output columns by two products. A task owns a group of columns and runs every input row against it,
// kRows rows at a time, reading each weight once per call. Every output element is the same sequence
// of fp32 operations over K whatever M is and however groups are shared among threads.
#include <immintrin.h>

#include "common.h"

namespace {

constexpr int64_t kGroup = 64;  // output columns per packed group: 4 zmm of fp32 accumulators per row
constexpr int kVecs = kGroup / 16;
constexpr int kRows = 6;  // input rows per block: 6 x 4 accumulators, 4 weight vectors, 1 broadcast

// `rows` input rows x [rows, K] against one packed group `w` [K / 2, 64, 2]; writes the group's `cols`
// valid columns of y (row stride ldy).
template <int rows>
inline void block(const uint16_t* x, const uint16_t* w, int64_t K, const float* bias,
                  uint16_t* y, int64_t ldy, int64_t cols) {
  __m512 acc[rows][kVecs];
  for (int i = 0; i < rows; ++i)
    for (int j = 0; j < kVecs; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2) {
    const uint16_t* wk = w + k * kGroup;
    __m512bh wv[kVecs];
    for (int j = 0; j < kVecs; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(wk + 32 * j);
    for (int i = 0; i < rows; ++i) {
      int32_t pair;
      __builtin_memcpy(&pair, x + i * K + k, 4);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < kVecs; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
  for (int j = 0; j < kVecs; ++j) {
    const int64_t c = cols - 16 * j;
    if (c <= 0) break;
    const __mmask16 m = c >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << c) - 1);
    const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(m, bias + 16 * j) : _mm512_setzero_ps();
    for (int i = 0; i < rows; ++i) {
      const __m256i out = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[i][j], b));  // round to nearest even
      _mm256_mask_storeu_epi16(y + i * ldy + 16 * j, m, out);
    }
  }
}

}  // namespace

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                     const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "linear: x [M, K] bf16");
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t groups = (N + kGroup - 1) / kGroup;
  TORCH_CHECK(K % 2 == 0 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
              packed.numel() == groups * K * kGroup, "linear: weights packed for K = ", K, " and N = ", N);
  at::Tensor b;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "linear: bias [N] expected");
    b = bias->to(at::kFloat).contiguous();
  }
  auto y = at::empty({M, N}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n = g * kGroup, cols = std::min(kGroup, N - n);
      const uint16_t* wg = wp + g * K * kGroup;
      const float* bg = bp != nullptr ? bp + n : nullptr;
      magicdec::for_each_row_block<kRows>(M, [&](int64_t i, auto r) {
        block<decltype(r)::value>(xp + i * K, wg, K, bg, yp + i * N + n, N, cols);
      });
    }
  });
  return y;
}

// bf16 linear layer over packed weights (AVX512-BF16), the same bits for a row in any batch
TORCH_LIBRARY_FRAGMENT(magicdec_avx512bf16, m) {
  m.def("linear(Tensor x, Tensor packed, int N, Tensor? bias) -> Tensor", &linear);
}
