// A linear layer over 16-bit weights (fp16 or bf16) with fp32 inputs, outputs and arithmetic, for CPUs
// with AVX2, FMA and F16C, whose output rows do not depend on the batch: a row gets the same bits in a
// one-token step, in a verification forward and in a prefill chunk, whatever the other rows are.
//
// y [M, N] = x [M, K] @ W^T (+ bias [N]) with W packed once at load time (`pack_linear` in
// magicdec.kernels): [N / 16, K, 16], i.e. for each group of 16 output columns and each input, the 16
// columns' weights side by side. A task owns a group of columns and runs every input row against it,
// kRows rows at a time: for each input k it widens the group's 16 weights to fp32 once (a shift for bf16,
// vcvtph2ps for fp16) and adds x[i, k] times them to the rows' accumulators. Every output element is the
// same sequence of fp32 operations over K whatever M is and however groups are shared among threads.
#include <immintrin.h>

#include "avx2.h"
#include "common.h"
#include "layer.h"
#include "sampler.h"

namespace {

using magicdec::Bf16;
using magicdec::Fp16;

constexpr int64_t kGroup = 16;  // output columns per packed group: 2 ymm of fp32 accumulators per row
constexpr int kRows = 6;        // input rows per block: 6 x 2 accumulators, 2 weight vectors, 1 broadcast

// `rows` input rows x [rows, K] against one packed group `w` [K, 16]; writes the group's `cols` valid
// columns of y (row stride ldy).
template <class S, int rows>
inline void block(const float* x, const uint16_t* w, int64_t K, const float* bias, float* y, int64_t ldy,
                  int64_t cols) {
  __m256 acc[rows][2];
  for (int i = 0; i < rows; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = S::load8(w + k * kGroup), w1 = S::load8(w + k * kGroup + 8);
    for (int i = 0; i < rows; ++i) {
      const __m256 xv = _mm256_broadcast_ss(x + i * K + k);
      acc[i][0] = _mm256_fmadd_ps(xv, w0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(xv, w1, acc[i][1]);
    }
  }
  for (int j = 0; j < 2; ++j) {
    const int64_t c = std::min<int64_t>(8, cols - 8 * j);
    if (c <= 0) break;
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(c)),
                                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256 b = bias != nullptr ? _mm256_maskload_ps(bias + 8 * j, mask) : _mm256_setzero_ps();
    for (int i = 0; i < rows; ++i) _mm256_maskstore_ps(y + i * ldy + 8 * j, mask, _mm256_add_ps(acc[i][j], b));
  }
}

template <class S>
void run(const float* xp, const uint16_t* wp, const float* bp, float* yp, int64_t M, int64_t K, int64_t N) {
  at::parallel_for(0, (N + kGroup - 1) / kGroup, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n = g * kGroup, cols = std::min(kGroup, N - n);
      const uint16_t* wg = wp + g * K * kGroup;
      const float* bg = bp != nullptr ? bp + n : nullptr;
      magicdec::for_each_row_block<kRows>(M, [&](int64_t i, auto r) {
        block<S, decltype(r)::value>(xp + i * K, wg, K, bg, yp + i * N + n, N, cols);
      });
    }
  });
}

}  // namespace

// (fp32: the output is fp32 whatever it says, this path's compute dtype; the argument keeps the paths' signatures alike)
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, const std::optional<at::Tensor>& bias,
                  bool /*fp32*/) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "linear: x [M, K] fp32");
  const int64_t M = x.size(0), K = x.size(1), groups = (N + kGroup - 1) / kGroup;
  const auto type = packed.scalar_type();
  TORCH_CHECK((type == at::kHalf || type == at::kBFloat16) && packed.is_contiguous() &&
              packed.numel() == groups * K * kGroup, "linear: fp16 or bf16 weights packed for K = ", K, " and N = ", N);
  at::Tensor b;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "linear: bias [N] expected");
    b = bias->to(at::kFloat).contiguous();
  }
  auto y = at::empty({M, N}, x.options());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  (type == at::kHalf ? run<Fp16> : run<Bf16>)(x.data_ptr<float>(), wp, bp, y.data_ptr<float>(), M, K, N);
  return y;
}

// linear with magicdec::layer::LinearFn's signature (no tiles on this path)
at::Tensor linear_on(const at::Tensor& x, const at::Tensor& packed, int64_t N, const std::optional<at::Tensor>& bias,
                     bool fp32, bool /*tiles*/) {
  return linear(x, packed, N, bias, fp32);
}

// fp32 linear layer over packed fp16 or bf16 weights (AVX2, FMA, F16C), the same bits for a row in any batch
TORCH_LIBRARY_FRAGMENT(magicdec_avx2, m) {
  m.def("linear(Tensor x, Tensor packed, int N, Tensor? bias, bool fp32) -> Tensor", &linear);
  MAGICDEC_REGISTER_LAYER_OPS(m, float, linear_on);
  MAGICDEC_REGISTER_SAMPLER(m);
}
